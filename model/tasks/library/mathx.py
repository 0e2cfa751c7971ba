"""Number helpers: bounds, divisors, primes, rounding and small statistics."""


def clamp(x, lo, hi):
    """`x` limited to the range lo..hi."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def gcd(a, b):
    """The greatest common divisor of two non-negative integers (Euclid's algorithm)."""
    while b:
        a, b = b, a % b
    return a


def lcm(a, b):
    """The least common multiple of two positive integers."""
    return a // gcd(a, b) * b


def is_prime(n):
    """Whether the integer `n` is prime."""
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def primes_below(n):
    """Every prime smaller than `n`, in increasing order."""
    return [k for k in range(2, n) if is_prime(k)]


def digit_sum(n):
    """The sum of the decimal digits of the integer `n` (its sign ignored)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total


def mean(xs):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(xs) / len(xs)


def median(xs):
    """The median of a non-empty list of numbers (the mean of the two middle ones for an even count)."""
    ordered = sorted(xs)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(xs):
    """The population variance of a non-empty list of numbers."""
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def percent(part, whole, places):
    """`part` as a percentage of `whole`, rounded to `places` decimals (0.0 when `whole` is 0)."""
    if whole == 0:
        return 0.0
    return round(100 * part / whole, places)


def factorial(n):
    """n! for a non-negative integer n."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result


def binomial(n, k):
    """The number of ways to choose `k` items of `n` (0 when k is out of 0..n)."""
    if k < 0 or k > n:
        return 0
    return factorial(n) // (factorial(k) * factorial(n - k))


def fibonacci(n):
    """The first `n` Fibonacci numbers, starting 0, 1."""
    out, a, b = [], 0, 1
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out
