"""Sequence helpers: chunks, windows, running totals, searching and merging."""


def chunk(xs, size):
    """`xs` cut into lists of `size` items (the last one may be shorter)."""
    return [xs[i:i + size] for i in range(0, len(xs), size)]


def flatten(rows):
    """The items of a list of lists, in order."""
    out = []
    for row in rows:
        for item in row:
            out.append(item)
    return out


def running_total(xs):
    """The running totals of `xs`: element i is the sum of xs[0..i]."""
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def dedupe(xs):
    """`xs` with later repeats of an item removed, first occurrences kept in order."""
    seen, out = [], []
    for x in xs:
        if x not in seen:
            seen.append(x)
            out.append(x)
    return out


def rotate(xs, k):
    """`xs` rotated left by `k` places (a negative `k` rotates right)."""
    if not xs:
        return []
    k = k % len(xs)
    return xs[k:] + xs[:k]


def argmax(xs):
    """The index of the largest item of a non-empty list (the first one on ties)."""
    best = 0
    for i in range(1, len(xs)):
        if xs[i] > xs[best]:
            best = i
    return best


def window_sums(xs, width):
    """The sums of every run of `width` consecutive items of `xs`, left to right."""
    if width <= 0 or width > len(xs):
        return []
    total = sum(xs[:width])
    out = [total]
    for i in range(width, len(xs)):
        total += xs[i] - xs[i - width]
        out.append(total)
    return out


def interleave(xs, ys):
    """Items of `xs` and `ys` taken alternately, starting with `xs`; what is left of the longer one at the end."""
    out = []
    n = min(len(xs), len(ys))
    for i in range(n):
        out.append(xs[i])
        out.append(ys[i])
    return out + xs[n:] + ys[n:]


def differences(xs):
    """The differences between consecutive items: xs[i + 1] - xs[i]."""
    return [xs[i + 1] - xs[i] for i in range(len(xs) - 1)]


def top_k(xs, k):
    """The `k` largest items of `xs`, largest first."""
    return sorted(xs, reverse=True)[:k]


def merge_sorted(xs, ys):
    """One sorted list of the items of two sorted lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        if xs[i] <= ys[j]:
            out.append(xs[i])
            i += 1
        else:
            out.append(ys[j])
            j += 1
    return out + xs[i:] + ys[j:]


def find_sorted(xs, target):
    """The index of `target` in the sorted list `xs` by binary search, or -1 when it is absent."""
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def runs_of(xs):
    """The lengths of the runs of equal consecutive items of `xs`."""
    out = []
    for i, x in enumerate(xs):
        if i > 0 and x == xs[i - 1]:
            out[-1] += 1
        else:
            out.append(1)
    return out
