"""Seeded changes to one function of a Python module: the bugs of tasks made from real code.

- Owns: `KINDS` (the changes), `sites` (every place in a module's functions where a kind applies, found with
  `ast`), `apply_site` (the module's text with one site changed) and `mutations` (a seeded, deterministic
  stream of distinct changed modules, spread over functions and kinds).
- Guarantee: a change edits only the source text of the node it changes, and is kept only when the edited
  text parses to exactly the tree with that one node changed.
- Does not: decide whether a change is a bug (running the tests does: ops/tasks_make.py), or word tasks
  (model/tasks/make.py).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

KINDS: Final = ("compare", "arith", "off_by_one", "variable", "condition", "statement", "constant", "arguments",
                "return", "deletion")
"""`compare` (a comparison operator swapped: < and <=, == and !=, in and not in, ...), `arith` (an arithmetic
operator swapped, also in `+=`), `off_by_one` (a bound of `range(...)`, a slice or an index moved by one),
`variable` (a local name read in place of another), `condition` (one operand of `and`/`or` dropped, or an `if`
without `else` whose body now always runs), `statement` (a statement dropped), `constant` (a number changed, a
boolean flipped), `arguments` (two positional arguments of a call swapped), `return` (a return value replaced by
None), `deletion` (the function's body removed, its docstring kept: to be implemented again)."""
_COMPARE: Final[dict[type, tuple[type, str, str]]] = {      # op -> (swapped op, token pattern, new token)
    ast.Lt: (ast.LtE, r"<(?![<=])", "<="), ast.LtE: (ast.Lt, r"<=", "<"),
    ast.Gt: (ast.GtE, r"(?<![-=>])>(?![=>])", ">="), ast.GtE: (ast.Gt, r">=", ">"),
    ast.Eq: (ast.NotEq, r"==", "!="), ast.NotEq: (ast.Eq, r"!=", "=="),
    ast.In: (ast.NotIn, r"\bin\b", "not in"), ast.NotIn: (ast.In, r"\bnot\s+in\b", "in"),
    ast.Is: (ast.IsNot, r"\bis\b", "is not"), ast.IsNot: (ast.Is, r"\bis\s+not\b", "is"),
}
_ARITH: Final[dict[type, tuple[type, str, str]]] = {        # op -> (swapped op, token pattern, new token)
    ast.Add: (ast.Sub, r"\+", "-"), ast.Sub: (ast.Add, r"-", "+"), ast.Mult: (ast.FloorDiv, r"(?<!\*)\*(?!\*)", "//"),
    ast.Div: (ast.Mult, r"(?<!/)/(?!/)", "*"), ast.FloorDiv: (ast.Div, r"//", "/"), ast.Mod: (ast.FloorDiv, r"%", "//"),
    ast.Pow: (ast.Mult, r"\*\*", "*"), ast.LShift: (ast.RShift, r"<<", ">>"), ast.RShift: (ast.LShift, r">>", "<<"),
    ast.BitAnd: (ast.BitOr, r"&", "|"), ast.BitOr: (ast.BitAnd, r"\|", "&"), ast.BitXor: (ast.BitAnd, r"\^", "&"),
}
_OP_TOKENS: Final[dict[type, str]] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
                                     ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&",
                                     ast.BitOr: "|", ast.BitXor: "^"}
_SYMMETRIC_CALLS: Final = frozenset({"max", "min", "print", "hypot", "gcd", "lcm"})
_BOUND_NAMES: Final = frozenset({"self", "cls"})

Path = tuple[tuple[str, int | None], ...]
"""Where a node is in a module's tree: (field, index or None) steps from the module."""


@dataclass(frozen=True, slots=True)
class Site:
    """One place a kind applies: the node (`path`), the function it is in, and what to do there (`detail`)."""

    kind: str
    function: str
    path: Path
    detail: Any = None


@dataclass(frozen=True, slots=True)
class Mutation:
    """A module with one site changed: `text` is the whole new file; `line` (1-based) and `change` say where
    and what, for the record (a task's instruction never says either)."""

    path: str
    function: str
    kind: str
    line: int
    change: str
    text: str


# ---- finding sites -----------------------------------------------------------------------------------------
def _children(node: ast.AST, path: Path) -> Iterator[tuple[Path, ast.AST]]:
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield (*path, (field, i)), item
        elif isinstance(value, ast.AST):
            yield (*path, (field, None)), value


def _walk(node: ast.AST, path: Path) -> Iterator[tuple[Path, ast.AST]]:
    """Every node below `node` (itself excluded), with its path, in source order; f-strings not entered."""
    for child_path, child in _children(node, path):
        yield child_path, child
        if not isinstance(child, ast.JoinedStr):
            yield from _walk(child, child_path)


def resolve(tree: ast.AST, path: Path) -> ast.AST:
    node: Any = tree
    for field, index in path:
        node = getattr(node, field)
        if index is not None:
            node = node[index]
    return node


def functions(tree: ast.Module) -> list[tuple[str, Path, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The module's functions and its classes' methods (classes nested in classes too): (qualified name, path,
    node). Functions nested in a function belong to it."""
    out: list[tuple[str, Path, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(body: list[ast.stmt], path: Path, prefix: str) -> None:
        for i, node in enumerate(body):
            here = (*path, ("body", i))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((prefix + node.name, here, node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, here, f"{prefix}{node.name}.")

    visit(tree.body, (), "")
    return out


def _docstring(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = fn.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _is_stub(body: Sequence[ast.stmt]) -> bool:
    """A body that does nothing to take away: empty, `pass`, `...` or a bare raise."""
    return all(isinstance(s, ast.Pass | ast.Raise) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
               for s in body)


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameters and names the function assigns, sorted; `self` and `cls` left out."""
    names = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(names - _BOUND_NAMES)


def _int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _stringy(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes))


def sites(tree: ast.Module, kinds: Sequence[str] = KINDS) -> list[Site]:
    """Every site of `kinds` in the functions of `tree`, in source order."""
    out: list[Site] = []
    for name, fn_path, fn in functions(tree):
        skip_doc = 1 if _docstring(fn) else 0
        if "deletion" in kinds and not _is_stub(fn.body[skip_doc:]):
            out.append(Site("deletion", name, fn_path))
        local = _locals(fn)
        for path, node in (pair for i, stmt in enumerate(fn.body[skip_doc:], skip_doc)
                           for pair in [((*fn_path, ("body", i)), stmt), *_walk(stmt, (*fn_path, ("body", i)))]):
            out += [Site(k, name, path, d) for k, d in _node_sites(node, local, kinds)]
    return out


def _node_sites(node: ast.AST, local: list[str], kinds: Sequence[str]) -> Iterator[tuple[str, Any]]:
    if "compare" in kinds and isinstance(node, ast.Compare):
        yield from (("compare", i) for i, op in enumerate(node.ops) if type(op) in _COMPARE)
    if "arith" in kinds and isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        if not (_stringy(node.left) or _stringy(node.right)):
            yield "arith", None
    if "arith" in kinds and isinstance(node, ast.AugAssign) and type(node.op) in _ARITH and not _stringy(node.value):
        yield "arith", None
    if "off_by_one" in kinds:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            yield from (("off_by_one", (f"args.{i}", d)) for i, a in enumerate(node.args[:2])
                        if not isinstance(a, ast.Starred) for d in (1, -1))
        if isinstance(node, ast.Slice):
            yield from (("off_by_one", (f, d)) for f in ("lower", "upper") if getattr(node, f) is not None
                        for d in (1, -1))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name | ast.BinOp) and isinstance(
                node.ctx, ast.Load):
            yield from (("off_by_one", ("slice", d)) for d in (1, -1))
    if "variable" in kinds and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in local:
        yield from (("variable", other) for other in local if other != node.id)
    if "condition" in kinds:
        if isinstance(node, ast.BoolOp):
            yield from (("condition", j) for j in range(len(node.values)))
        if isinstance(node, ast.If) and not node.orelse:
            yield "condition", "guard"
    if "statement" in kinds and isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Expr | ast.If
                                           | ast.For | ast.While | ast.Raise | ast.With | ast.Try):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            yield "statement", None
    if "constant" in kinds and isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        yield "constant", None
    if "arguments" in kinds and isinstance(node, ast.Call) and len(node.args) >= 2:
        callee = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(
            node.func, ast.Attribute) else ""
        if callee not in _SYMMETRIC_CALLS:
            yield from (("arguments", i) for i in range(len(node.args) - 1)
                        if not any(isinstance(a, ast.Starred) for a in node.args[i:i + 2])
                        and ast.dump(node.args[i]) != ast.dump(node.args[i + 1]))
    if "return" in kinds and isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        yield "return", None


# ---- changing one site -------------------------------------------------------------------------------------
class _Text:
    """A module's text with byte offsets from `ast` positions (line 1-based, column in UTF-8 bytes)."""

    def __init__(self, source: str) -> None:
        self.data = source.encode()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined,arg-type]

    def get(self, a: int, b: int) -> str:
        return self.data[a:b].decode()

    def lines(self, first: int, last: int) -> tuple[int, int]:
        """Byte span of whole lines first..last (1-based, inclusive)."""
        return self.starts[first - 1], self.starts[min(last, len(self.starts) - 1)]

    def owns_lines(self, node: ast.AST) -> bool:
        """Whether `node` alone fills its lines (only blanks before it, only blanks or a comment after)."""
        a, b = self.span(node)
        head = self.data[self.starts[node.lineno - 1]:a]                                    # type: ignore[attr-defined]
        tail = self.data[b:self.starts[min(node.end_lineno, len(self.starts) - 1)]]        # type: ignore[attr-defined]
        return not head.strip() and (not tail.strip() or tail.strip().startswith(b"#"))


Edit = list[tuple[int, int, str]]
"""Byte spans of the original text and their replacements (non-overlapping)."""


def _indent(text: _Text, node: ast.AST) -> str:
    start = text.starts[node.lineno - 1]                                                     # type: ignore[attr-defined]
    return text.data[start:start + node.col_offset].decode()                                 # type: ignore[attr-defined]


def _token_edit(text: _Text, a: int, b: int, pattern: str, new: str) -> Edit | None:
    """Replace the one operator token in the gap a..b."""
    gap = text.get(a, b)
    found = list(re.finditer(pattern, gap))
    if len(found) != 1:
        return None
    m = found[0]
    return [(a + m.start(), a + m.end(), new)]


def _moved(node: ast.expr, delta: int) -> ast.expr:
    if _int(node):
        return ast.Constant(node.value + delta)                                             # type: ignore[attr-defined]
    return ast.BinOp(node, ast.Add() if delta > 0 else ast.Sub(), ast.Constant(1))


def _change(tree: ast.Module, text: _Text, site: Site) -> tuple[Edit | list[Edit], str] | None:
    """Change the site's node in `tree` (in place) and return the text edit(s) to try and a note of the change."""
    node = resolve(tree, site.path)
    match site.kind:
        case "compare":
            assert isinstance(node, ast.Compare)
            i = site.detail
            new_op, pattern, token = _COMPARE[type(node.ops[i])]
            left = node.left if i == 0 else node.comparators[i - 1]
            edit = _token_edit(text, text.span(left)[1], text.span(node.comparators[i])[0], pattern, token)
            old = ast.unparse(ast.Compare(ast.Name("a"), [node.ops[i]], [ast.Name("b")]))[2:-2]
            node.ops[i] = new_op()
            return (edit, f"`{old}` became `{token}`") if edit else None
        case "arith":
            assert isinstance(node, ast.BinOp | ast.AugAssign)
            new_op, pattern, token = _ARITH[type(node.op)]
            left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            edit = _token_edit(text, text.span(left)[1], text.span(right)[0], pattern, token)
            old = _OP_TOKENS[type(node.op)]
            node.op = new_op()
            return (edit, f"`{old}` became `{token}`") if edit else None
        case "off_by_one":
            field, delta = site.detail
            name, _, index = field.partition(".")
            holder = getattr(node, name)
            bound = holder[int(index)] if index else holder
            seg = text.get(*text.span(bound))
            moved = _moved(bound, delta)
            if index:
                holder[int(index)] = moved
            else:
                setattr(node, name, moved)
            a, b = text.span(bound)
            sign = "+" if delta > 0 else "-"
            plain = str(moved.value) if isinstance(moved, ast.Constant) else f"{seg} {sign} 1"  # type: ignore[attr-defined]
            return [[(a, b, plain)], [(a, b, f"({seg}) {sign} 1")]], f"`{seg}` became `{plain}`"
        case "variable":
            assert isinstance(node, ast.Name)
            old, node.id = node.id, site.detail
            a, b = text.span(node)
            return [(a, b, site.detail)], f"`{old}` became `{site.detail}`"
        case "condition" if site.detail == "guard":
            assert isinstance(node, ast.If)
            parent, field, index = _parent(tree, site.path)
            block = getattr(parent, field)
            block[index:index + 1] = node.body
            if not text.owns_lines(node) or not all(text.owns_lines(s) for s in node.body) \
                    or node.body[0].lineno <= node.test.end_lineno:                             # type: ignore[operator]
                return None
            shift = len(_indent(text, node.body[0])) - len(_indent(text, node))
            first, last = text.lines(node.body[0].lineno, node.end_lineno)                       # type: ignore[arg-type]
            body = [line[shift:] if line.strip() else line
                    for line in text.get(first, last).splitlines(keepends=True)]
            a, b = text.lines(node.lineno, node.end_lineno)                                      # type: ignore[arg-type]
            return [(a, b, "".join(body))], f"the guard `if {ast.unparse(node.test)}` was dropped"
        case "condition":
            assert isinstance(node, ast.BoolOp)
            j = site.detail
            kept = [v for k, v in enumerate(node.values) if k != j]
            spans = [text.span(v) for v in kept]
            a, b = text.span(node)
            joiner = " and " if isinstance(node.op, ast.And) else " or "
            plain = joiner.join(text.get(*s) for s in spans)
            dropped = ast.unparse(node.values[j])
            parent, field, index = _parent(tree, site.path)
            new: ast.expr = kept[0] if len(kept) == 1 else ast.BoolOp(node.op, kept)
            _replace(parent, field, index, new)
            return [[(a, b, plain)], [(a, b, f"({plain})")]], f"the operand `{dropped}` was dropped"
        case "statement":
            assert isinstance(node, ast.stmt)
            parent, field, index = _parent(tree, site.path)
            block = getattr(parent, field)
            if not text.owns_lines(node) or (index > 0 and block[index - 1].end_lineno == node.lineno):
                return None
            del block[index]
            a, b = text.lines(node.lineno, node.end_lineno)                                      # type: ignore[arg-type]
            if not block:
                block.append(ast.Pass())
                return [(a, b, f"{_indent(text, node)}pass\n")], f"`{_first_line(node)}` was dropped"
            return [(a, b, "")], f"`{_first_line(node)}` was dropped"
        case "constant":
            assert isinstance(node, ast.Constant)
            value = node.value
            new_value = (not value if isinstance(value, bool) else value + 1 if isinstance(value, int)
                         else value * 2 if value else 1.0)
            node.value = new_value
            a, b = text.span(node)
            return [(a, b, repr(new_value))], f"`{text.get(a, b)}` became `{new_value!r}`"
        case "arguments":
            assert isinstance(node, ast.Call)
            i = site.detail
            first, second = node.args[i], node.args[i + 1]
            (a1, b1), (a2, b2) = text.span(first), text.span(second)
            node.args[i], node.args[i + 1] = second, first
            return ([(a1, b1, text.get(a2, b2)), (a2, b2, text.get(a1, b1))],
                    f"arguments `{ast.unparse(first)}` and `{ast.unparse(second)}` were swapped")
        case "return":
            assert isinstance(node, ast.Return) and node.value is not None
            a, b = text.span(node.value)
            old = text.get(a, b)
            node.value = ast.Constant(None)
            return [(a, b, "None")], f"`return {old}` became `return None`"
        case "deletion":
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            keep = 1 if _docstring(node) else 0
            first = node.body[keep]
            if first.lineno == node.lineno or not text.owns_lines(first):
                return None
            a, b = text.lines(first.lineno, node.end_lineno)                                     # type: ignore[arg-type]
            raise_stmt = ast.Raise(ast.Name("NotImplementedError", ast.Load()))
            node.body[keep:] = [raise_stmt]
            return [(a, b, f"{_indent(text, first)}raise NotImplementedError\n")], "the body was removed"
    return None


def _parent(tree: ast.Module, path: Path) -> tuple[Any, str, int | None]:
    *head, (field, index) = path
    return resolve(tree, tuple(head)), field, index


def _replace(parent: Any, field: str, index: int | None, new: ast.AST) -> None:
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _first_line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


def _apply(text: _Text, edit: Edit) -> str:
    data = text.data
    for a, b, new in sorted(edit, reverse=True):
        data = data[:a] + new.encode() + data[b:]
    return data.decode()


def apply_site(source: str, site: Site) -> tuple[str, str] | None:
    """(new text, note of the change) with `site` changed, or None when no text edit yields exactly the tree
    with that one node changed (the site is then skipped).

    A change edits only the source text of the node it changes (an operator token, an expression, whole
    statement lines), so the rest of the file, comments included, stays as it was; the edited text is parsed
    again and kept only when its tree is exactly the tree with that one node changed.
    """
    expected = ast.parse(source)
    text = _Text(source)
    changed = _change(expected, text, site)
    if changed is None:
        return None
    edits, note = changed
    want = ast.dump(ast.fix_missing_locations(expected))
    options = edits if edits and isinstance(edits[0], list) else [edits]
    for edit in options:
        new = _apply(text, edit)                                                              # type: ignore[arg-type]
        try:
            if ast.dump(ast.parse(new)) == want and new != source:
                return new, note
        except (SyntaxError, ValueError):
            continue
    return None


# ---- the seeded stream -------------------------------------------------------------------------------------
def mutations(files: Mapping[str, str], seed: int, kinds: Sequence[str] = KINDS) -> Iterator[Mutation]:
    """Distinct changed modules of `files` (path -> Python source; files that do not parse are skipped),
    deterministic for a seed: functions are taken in a seeded order, round after round, each giving one change
    of the kind used least so far among those it has (ties drawn), until every site is spent.

    :raises ValueError: a kind not in `KINDS`.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown mutation kind {unknown[0]!r}; the kinds are {', '.join(KINDS)}")
    rng = random.Random(seed)
    pools: list[tuple[str, str, dict[str, list[Site]]]] = []          # (path, function, kind -> sites left)
    for path in sorted(files):
        try:
            tree = ast.parse(files[path])
        except (SyntaxError, ValueError):
            continue
        by_function: dict[str, dict[str, list[Site]]] = {}
        for site in sites(tree, kinds):
            by_function.setdefault(site.function, {}).setdefault(site.kind, []).append(site)
        for function, by_kind in by_function.items():
            for left in by_kind.values():
                rng.shuffle(left)
            pools.append((path, function, by_kind))
    rng.shuffle(pools)
    used = dict.fromkeys(kinds, 0)
    seen: set[str] = set()
    while pools:
        for path, function, by_kind in list(pools):
            while by_kind:
                least = min(used[k] for k in by_kind)
                kind = rng.choice(sorted(k for k in by_kind if used[k] == least))
                site = by_kind[kind].pop()
                if not by_kind[kind]:
                    del by_kind[kind]
                done = apply_site(files[path], site)
                if done is None:
                    continue
                new, note = done
                digest = hashlib.sha256(f"{path}\0{new}".encode()).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                used[kind] += 1
                node = resolve(ast.parse(files[path]), site.path)
                yield Mutation(path, function, kind, getattr(node, "lineno", 0), note, new)
                break
        pools = [pool for pool in pools if pool[2]]


__all__ = ["KINDS", "Mutation", "Site", "apply_site", "functions", "mutations", "resolve", "sites"]
