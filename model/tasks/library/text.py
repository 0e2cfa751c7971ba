"""Text helpers: slugs, padding, truncation, simple encodings."""

from .seqs import chunk, rotate


def slugify(title):
    """Lower-case words of `title` joined by '-'; characters other than letters and digits separate words."""
    words, current = [], ""
    for ch in title.lower():
        if ch.isalnum():
            current += ch
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    return "-".join(words)


def pad_left(text, width, fill):
    """`text` with `fill` characters added on its left until it is `width` long (longer text is kept whole)."""
    missing = width - len(text)
    if missing <= 0:
        return text
    return fill * missing + text


def truncate(text, limit, marker):
    """`text` cut to at most `limit` characters, ending with `marker` when something was cut."""
    if len(text) <= limit:
        return text
    keep = limit - len(marker)
    if keep < 0:
        return marker[:limit]
    return text[:keep] + marker


def count_words(text):
    """The number of whitespace-separated words in `text`."""
    count, inside = 0, False
    for ch in text:
        if ch.isspace():
            inside = False
        elif not inside:
            inside = True
            count += 1
    return count


def is_palindrome(text):
    """Whether the letters and digits of `text`, lower-cased, read the same both ways."""
    kept = [ch.lower() for ch in text if ch.isalnum()]
    i, j = 0, len(kept) - 1
    while i < j:
        if kept[i] != kept[j]:
            return False
        i += 1
        j -= 1
    return True


def caesar(text, shift):
    """`text` with every ASCII letter moved `shift` places along the alphabet (wrapping), case kept."""
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - ord("A") + shift) % 26 + ord("A")))
        else:
            out.append(ch)
    return "".join(out)


def run_length(text):
    """Run-length encoding of `text` as a list of [character, count] pairs."""
    runs = []
    for ch in text:
        if runs and runs[-1][0] == ch:
            runs[-1][1] += 1
        else:
            runs.append([ch, 1])
    return runs


def expand_runs(runs):
    """The text a run-length encoding (a list of [character, count] pairs) stands for."""
    return "".join(ch * count for ch, count in runs)


def common_prefix(words):
    """The longest prefix shared by every string of `words` ('' for no words)."""
    if not words:
        return ""
    prefix = words[0]
    for word in words[1:]:
        n = 0
        while n < len(prefix) and n < len(word) and prefix[n] == word[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def snake_case(name):
    """A camelCase or PascalCase `name` in snake_case."""
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i > 0:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def wrap(text, width):
    """The words of `text` packed greedily into lines of at most `width` characters (a longer word alone)."""
    lines, line = [], ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def rotate_word(word, k):
    """`word` with its letters rotated left by `k` places."""
    return "".join(rotate(list(word), k))


def groups_of(text, size):
    """`text` in groups of `size` characters separated by spaces (the last group may be shorter)."""
    return " ".join("".join(part) for part in chunk(list(text), size))
