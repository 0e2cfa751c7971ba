"""Seeded changes to one function of a module (model/tasks/mutators.py): each kind edits the one node it names
and nothing else of the file, the stream is deterministic for a seed, distinct, and spread over kinds."""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import textwrap

import pytest

from rlbus.model.tasks.mutators import KINDS, Site, apply_site, functions, mutations, sites

SOURCE = '''\
"""A module to change."""

LIMIT = 10  # module level: never changed


def clamp(values, low, high):
    """Keep each value within [low, high]."""
    out = []
    for i in range(len(values)):
        v = values[i]   # the value
        if v < low or v > high:
            v = min(max(v, low), high)
        out.append(v)
    return out


def stub():
    """Nothing to take away."""
    raise NotImplementedError


class Box:
    def scaled(self, factor):
        if factor == 0:
            return None
        return divmod(self.size * factor, 2)
'''


def _changed(kind: str, detail: object = None, function: str | None = None) -> list[tuple[str, str]]:
    """(new text, note) of every site of `kind` (with `detail`, if given) in SOURCE."""
    out = []
    for site in sites(ast.parse(SOURCE), [kind]):
        if (detail is None or site.detail == detail) and (function is None or site.function == function):
            done = apply_site(SOURCE, site)
            if done is not None:
                out.append(done)
    return out


def _diff(new: str) -> list[str]:
    return [line for line in difflib.unified_diff(SOURCE.splitlines(), new.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_each_kind_edits_only_its_node_and_keeps_comments() -> None:
    """Every kind has sites in SOURCE; each change parses to another tree, and the lines it changes all lie in the
    function the site is in (the module-level constant, its comment and the other functions stay as they were)."""
    tree = ast.parse(SOURCE)
    spans = {name: (fn.lineno, fn.end_lineno) for name, _, fn in functions(tree)}
    old = SOURCE.splitlines()
    for kind in KINDS:
        found = [(site, apply_site(SOURCE, site)) for site in sites(tree, [kind])]
        assert any(done is not None for _, done in found), kind
        for site, done in found:
            if done is None:
                continue
            new, note = done
            assert ast.dump(ast.parse(new)) != ast.dump(tree)
            first, last = spans[site.function]
            blocks = difflib.SequenceMatcher(None, old, new.splitlines(), autojunk=False).get_opcodes()
            touched = [(i1 + 1, i2) for tag, i1, i2, _, _ in blocks if tag != "equal"]
            assert touched and all(first <= a and b <= last for a, b in touched), (kind, note, touched)
            assert "LIMIT = 10  # module level: never changed" in new


def test_operator_and_constant_changes_are_one_token() -> None:
    compare = dict((note, _diff(new)) for new, note in _changed("compare"))
    assert compare["`<` became `<=`"] == ["-        if v < low or v > high:", "+        if v <= low or v > high:"]
    assert compare["`==` became `!=`"] == ["-        if factor == 0:", "+        if factor != 0:"]
    arith = [_diff(new) for new, note in _changed("arith") if note == "`*` became `//`"]
    assert arith == [["-        return divmod(self.size * factor, 2)", "+        return divmod(self.size // factor, 2)"]]
    constants = {note for _, note in _changed("constant")}
    assert constants == {"`0` became `1`", "`2` became `3`"}          # LIMIT is outside any function


def test_structural_changes() -> None:
    """A dropped statement leaves `pass` where its block would be empty; a dropped guard un-indents its body; a
    dropped operand keeps the other; swapped arguments; a return of None; off by one in range and index."""
    dropped = {note: _diff(new) for new, note in _changed("statement")}
    assert dropped["`out.append(v)` was dropped"] == ["-        out.append(v)"]
    guard = [_diff(new) for new, note in _changed("condition", "guard", "clamp")]
    assert guard == [["-        if v < low or v > high:", "-            v = min(max(v, low), high)",
                      "+        v = min(max(v, low), high)"]]
    operand = {note for _, note in _changed("condition", 0)}
    assert "the operand `v < low` was dropped" in operand
    swapped = {note for _, note in _changed("arguments")}
    assert "arguments `self.size * factor` and `2` were swapped" in swapped
    assert not any("max" in note or "min" in note for note in swapped)            # symmetric calls left alone
    returns = {note for _, note in _changed("return")}
    assert returns == {"`return out` became `return None`",
                       "`return divmod(self.size * factor, 2)` became `return None`"}
    moved = {note for _, note in _changed("off_by_one")}
    assert {"`len(values)` became `len(values) + 1`", "`i` became `i - 1`"} <= moved


def test_variable_reads_another_local_and_never_self() -> None:
    notes = {note for _, note in _changed("variable")}
    assert "`low` became `high`" in notes
    assert not any("self" in note for note in notes)


def test_deletion_keeps_the_docstring_and_raises() -> None:
    """The body goes, the docstring stays, `raise NotImplementedError` in its place; a stub has nothing to delete."""
    done = {s.function: apply_site(SOURCE, s) for s in sites(ast.parse(SOURCE), ["deletion"])}
    assert set(done) == {"clamp", "Box.scaled"}                                   # not stub
    new, note = done["clamp"]                                                     # type: ignore[misc]
    assert note == "the body was removed"
    namespace: dict[str, object] = {}
    exec(compile(new, "m.py", "exec"), namespace)
    clamp = namespace["clamp"]
    assert clamp.__doc__ == "Keep each value within [low, high]."                # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError):
        clamp([1], 0, 2)                                                          # type: ignore[operator]


def test_an_edit_whose_tree_is_not_exact_is_skipped() -> None:
    """A comparison whose operator token appears twice in the gap (inside a comment) cannot be edited exactly by
    text; apply_site gives None instead of a wrong file."""
    source = "def f(a, b):\n    return (a  # < here\n            < b)\n"
    (site,) = [s for s in sites(ast.parse(source), ["compare"])]
    assert apply_site(source, site) is None
    assert apply_site(source, Site("compare", "f", site.path, 0)) is None


def test_the_stream_is_seeded_distinct_and_spread_over_kinds() -> None:
    """The same seed gives the same changes; another seed another order; no two changed files are equal; the
    first changes of a real module use many kinds (the least used kind goes first)."""
    files = {"textwrap.py": inspect.getsource(textwrap)}
    first = [(m.function, m.kind, m.line, m.change) for m in itertools.islice(mutations(files, 7), 30)]
    again = [(m.function, m.kind, m.line, m.change) for m in itertools.islice(mutations(files, 7), 30)]
    other = [(m.function, m.kind, m.line, m.change) for m in itertools.islice(mutations(files, 8), 30)]
    assert first == again and first != other
    texts = [m.text for m in itertools.islice(mutations(files, 7), 60)]
    assert len(set(texts)) == len(texts)
    assert len({kind for _, kind, _, _ in first}) >= 8
    small = list(mutations({"m.py": SOURCE}, 1))
    assert len({m.text for m in small}) == len(small) and {m.kind for m in small} == set(KINDS)
    assert all(m.path == "m.py" and m.function in ("clamp", "stub", "Box.scaled") for m in small)


def test_unknown_kind_and_unparsable_files() -> None:
    with pytest.raises(ValueError, match="unknown mutation kind 'typo'"):
        next(mutations({"m.py": SOURCE}, 1, ["typo"]))
    assert list(mutations({"bad.py": "def f(:\n"}, 1)) == []
