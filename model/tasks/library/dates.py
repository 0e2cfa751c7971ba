"""Calendar helpers on plain integers: leap years, month lengths, weekdays, clock times and durations."""

from .mathx import clamp
from .text import pad_left


def is_leap(year):
    """Whether `year` is a leap year of the Gregorian calendar."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    """The number of days of `month` (1-12) in `year`."""
    if month == 2:
        return 29 if is_leap(year) else 28
    if month in (4, 6, 9, 11):
        return 30
    return 31


def day_of_year(year, month, day):
    """The day's number in its year, 1 for January 1st."""
    total = day
    for m in range(1, month):
        total += days_in_month(year, m)
    return total


def weekday(year, month, day):
    """The day of the week, 0 for Monday to 6 for Sunday (Zeller's congruence)."""
    if month < 3:
        month += 12
        year -= 1
    k, j = year % 100, year // 100
    h = (day + 13 * (month + 1) // 5 + k + k // 4 + j // 4 + 5 * j) % 7
    return (h + 5) % 7


def iso_date(year, month, day):
    """The date as 'YYYY-MM-DD', the day limited to the month's length."""
    day = clamp(day, 1, days_in_month(year, month))
    return pad_left(str(year), 4, "0") + "-" + pad_left(str(month), 2, "0") + "-" + pad_left(str(day), 2, "0")


def clock(minutes):
    """Minutes after midnight as 'HH:MM' on a 24-hour clock (wrapping past midnight)."""
    minutes = minutes % (24 * 60)
    return pad_left(str(minutes // 60), 2, "0") + ":" + pad_left(str(minutes % 60), 2, "0")


def minutes_of(text):
    """The minutes after midnight of an 'HH:MM' time."""
    hours, _, mins = text.partition(":")
    return int(hours) * 60 + int(mins)


def minutes_between(start, end):
    """The minutes from the 'HH:MM' time `start` to `end`, through midnight when `end` is earlier."""
    gap = minutes_of(end) - minutes_of(start)
    if gap < 0:
        gap += 24 * 60
    return gap


def duration(seconds):
    """A number of seconds as a short text such as '1h 02m 05s' (hours only when there are some)."""
    hours, rest = divmod(seconds, 3600)
    mins, secs = divmod(rest, 60)
    text = pad_left(str(mins), 2, "0") + "m " + pad_left(str(secs), 2, "0") + "s"
    if hours > 0:
        text = str(hours) + "h " + text
    return text
