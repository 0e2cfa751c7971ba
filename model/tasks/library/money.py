"""Money in integer cents: prices, discounts, taxes, splitting a bill and invoice lines."""

from .dates import days_in_month, minutes_between
from .mathx import clamp, percent
from .seqs import running_total, top_k, window_sums
from .text import pad_left, truncate


def to_cents(text):
    """A price written as '12.5' or '12.50' (or '12') in cents."""
    whole, _, frac = text.partition(".")
    frac = (frac + "00")[:2]
    return int(whole) * 100 + int(frac)


def format_cents(cents):
    """Cents written as a price with two decimals, such as '12.05' or '-0.40'."""
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return sign + str(cents // 100) + "." + pad_left(str(cents % 100), 2, "0")


def discounted(cents, rate):
    """A price after a discount of `rate` percent (limited to 0..100), rounded down to a cent."""
    rate = clamp(rate, 0, 100)
    return cents * (100 - rate) // 100


def with_tax(cents, rate):
    """A price with `rate` percent of tax added, rounded to the nearest cent (halves up)."""
    return (cents * (100 + rate) + 50) // 100


def order_total(items):
    """The total of a list of (unit price in cents, quantity) pairs."""
    total = 0
    for price, quantity in items:
        total += price * quantity
    return total


def split_bill(cents, people):
    """`cents` shared by `people` as evenly as can be: the first ones pay the left-over cents."""
    share, left = divmod(cents, people)
    return [share + 1 if i < left else share for i in range(people)]


def share_of(part, whole):
    """`part` of `whole` as a percentage with one decimal."""
    return percent(part, whole, 1)


def balances(payments):
    """The balance after each payment of a list of amounts in cents."""
    return running_total(payments)


def invoice_line(name, cents, width):
    """One invoice line: `name` cut to fit, then the price right-aligned, `width` characters in all."""
    price = format_cents(cents)
    label = truncate(name, width - len(price) - 1, "~")
    return label + pad_left(price, width - len(label), " ")


def invoice(items, width):
    """The lines of an invoice for (name, unit price in cents, quantity) rows, then a 'total' line."""
    lines = []
    total = 0
    for name, price, quantity in items:
        cost = price * quantity
        total += cost
        lines.append(invoice_line(name, cost, width))
    lines.append(invoice_line("total", total, width))
    return lines


def prorated(cents, year, month, days):
    """The part of a monthly price `cents` due for `days` days of that month, rounded down to a cent."""
    return cents * days // days_in_month(year, month)


def parking_fee(start, end, rate):
    """The fee in cents for parking from the 'HH:MM' time `start` to `end` at `rate` cents an hour or part of one."""
    hours = (minutes_between(start, end) + 59) // 60
    return hours * rate


def best_run(sales, days):
    """The largest total of `days` consecutive daily sales (0 when there are fewer days of sales)."""
    sums = window_sums(sales, days)
    return max(sums) if sums else 0


def priciest(prices, k):
    """The `k` highest prices written as text, highest first."""
    return [format_cents(c) for c in top_k(prices, k)]
