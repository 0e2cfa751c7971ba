"""Walks a parsed TOML dict against the schema Structs and collects every key/type/range problem.

Owns: the per-key checks msgspec would do, but without stopping at the first one (msgspec raises on
the first error; `rlbus validate` must report all of them), with difflib suggestions for misspelled
keys and choices, and a cleaned copy of the input (bad optional values dropped so their defaults
apply) that the cross-field rules can still run on. Does not: read files or run cross-field rules.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from datetime import date, datetime, time
from typing import Any, Final

import msgspec.inspect as mi

from rlbus.topology.file.problem import Problem
from rlbus.topology.file.schema import PATTERN_WORDS

PathPart = str | int

_MISSING: Final = object()


def key_path(parts: Sequence[PathPart]) -> str:
    """['regions', 1, 'actors', 0, 'kind'] -> 'regions[1].actors[0].kind'."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def describe_value(value: object) -> str:
    """How a TOML value is named in a message: "the string 'x'", 'the integer 3', 'a table', ..."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, datetime | date | time):
        return f"the date/time {value.isoformat()}"
    return f"a {type(value).__name__}"


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    parts = [f"{op} {v}" for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
    return " " + " and ".join(parts) if parts else ""


def expectation(t: mi.Type) -> str:
    """What a value of schema type `t` must look like, in words."""
    match t:
        case mi.Metadata(type=inner, extra_json_schema=extra):
            described = (extra or {}).get("description")
            return str(described) if described else expectation(inner)
        case mi.IntType():
            return f"an integer{_bounds(t)}"
        case mi.FloatType():
            return f"a number{_bounds(t)}"
        case mi.BoolType():
            return "true or false"
        case mi.StrType(min_length=min_length, max_length=max_length, pattern=pattern):
            if pattern in PATTERN_WORDS:
                text = PATTERN_WORDS[pattern]
            else:
                text = "a non-empty string" if min_length else "a string"
                text = f"{text} matching {pattern}" if pattern else text
            return f"{text}, at most {max_length} characters" if max_length else text
        case mi.LiteralType(values=values):
            return "one of " + ", ".join(repr(v) for v in values)
        case mi.ListType(item_type=mi.StructType(), min_length=min_length):
            return f"{'a non-empty' if min_length else 'an'} array of tables"
        case mi.ListType(item_type=item, min_length=min_length):
            lead = "a non-empty array" if min_length else "an array"
            return f"{lead}, each item {expectation(item)}"
        case mi.DictType(value_type=value):
            return f"a table, each value {expectation(value)}"
        case mi.StructType():
            return "a table"
        case mi.UnionType(types=types):
            return " or ".join(expectation(x) for x in types if not isinstance(x, mi.NoneType))
    return str(t)


class Walker:
    """One walk over one parsed file; `problems` collects every problem found, in file order."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def _add(self, path: Sequence[PathPart], message: str) -> None:
        self.problems.append(Problem(key=key_path(path), message=message))

    def _wrong(self, path: Sequence[PathPart], t: mi.Type, value: object, extra: str = "") -> None:
        want = expectation(t)
        header = re.sub(r"\[\d+\]", "", key_path(path))
        if isinstance(t, mi.StructType) and header:
            want += f" [{header}]"
        elif isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
            want += f" [[{header}]]"
        self._add(path, f"expected {want}, found {describe_value(value)}{extra}")

    def walk(self, value: Any, t: mi.Type, path: list[PathPart]) -> tuple[bool, Any]:
        """Check `value` against `t` at `path`; returns (usable, cleaned value)."""
        match t:
            case mi.Metadata(type=inner):
                return self.walk(value, inner, path)
            case mi.StructType():
                return self._struct(value, t, path)
            case mi.ListType() | mi.DictType():
                return self._container(value, t, path)
            case mi.UnionType(types=types):
                return self._union(value, [x for x in types if not isinstance(x, mi.NoneType)], t, path)
            case mi.LiteralType(values=values):
                if value in values and type(value) in {type(v) for v in values}:
                    return True, value
                hint = ""
                if isinstance(value, str):
                    close = difflib.get_close_matches(value, [str(v) for v in values], n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                self._wrong(path, t, value, hint)
                return False, None
            case mi.IntType():
                if not isinstance(value, int) or isinstance(value, bool):
                    self._wrong(path, t, value)
                    return False, None
                return self._range(value, t, path)
            case mi.FloatType():
                if not isinstance(value, int | float) or isinstance(value, bool):
                    self._wrong(path, t, value)
                    return False, None
                if not math.isfinite(value):
                    self._wrong(path, t, value, " (must be finite)")
                    return False, None
                return self._range(value, t, path)
            case mi.BoolType():
                if not isinstance(value, bool):
                    self._wrong(path, t, value)
                    return False, None
                return True, value
            case mi.StrType():
                return self._str(value, t, path)
        raise TypeError(f"topology walker has no rule for schema type {t!r} at {key_path(path)}")

    def _range(self, value: float, t: mi.IntType | mi.FloatType, path: list[PathPart]) -> tuple[bool, Any]:
        bad = ((t.ge is not None and value < t.ge) or (t.gt is not None and value <= t.gt)
               or (t.le is not None and value > t.le) or (t.lt is not None and value >= t.lt))
        if bad:
            self._wrong(path, t, value)
            return False, None
        return True, value

    def _str(self, value: Any, t: mi.StrType, path: list[PathPart]) -> tuple[bool, Any]:
        if not isinstance(value, str):
            self._wrong(path, t, value)
            return False, None
        if (
            (t.min_length is not None and len(value) < t.min_length)
            or (t.max_length is not None and len(value) > t.max_length)
            or (t.pattern is not None and re.search(t.pattern, value) is None)
        ):
            self._wrong(path, t, value)
            return False, None
        return True, value

    def _union(self, value: Any, types: list[mi.Type], t: mi.Type, path: list[PathPart]) -> tuple[bool, Any]:
        if len(types) == 1:
            return self.walk(value, types[0], path)
        for option in types:
            trial = Walker()
            ok, cleaned = trial.walk(value, option, path)
            if ok and not trial.problems:
                return True, cleaned
        self._wrong(path, t, value)
        return False, None

    def _container(self, value: Any, t: mi.ListType | mi.DictType, path: list[PathPart]) -> tuple[bool, Any]:
        if not isinstance(value, list if isinstance(t, mi.ListType) else dict):
            self._wrong(path, t, value)
            return False, None
        ok = True
        if (t.min_length is not None and len(value) < t.min_length) or (
            t.max_length is not None and len(value) > t.max_length
        ):
            self._wrong(path, t, value)
            ok = False
        if isinstance(t, mi.ListType):
            items = [self.walk(item, t.item_type, [*path, i]) for i, item in enumerate(value)]
            return ok and all(good for good, _ in items), [cleaned for _, cleaned in items]
        out: dict[str, Any] = {}
        assert isinstance(value, dict)
        for key, item in value.items():
            key_ok, _ = self.walk(key, t.key_type, [*path, key])
            item_ok, cleaned = self.walk(item, t.value_type, [*path, key])
            ok = ok and key_ok and item_ok
            out[key] = cleaned
        return ok, out

    def _struct(self, value: Any, t: mi.StructType, path: list[PathPart]) -> tuple[bool, Any]:
        if not isinstance(value, dict):
            self._wrong(path, t, value)
            return False, None
        fields = {f.encode_name: f for f in t.fields}
        ok = True
        cleaned: dict[str, Any] = {}
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else "valid keys here: " + ", ".join(fields)
                self._add([*path, key], f"unknown key {key!r}; {hint}")
                continue
            item_ok, item_clean = self.walk(item, field.type, [*path, key])
            if item_ok:
                cleaned[key] = item_clean
            elif field.required or _is_composite(field.type):
                ok = False  # a broken table or array would make the cross-field rules report nonsense
        for name, field in fields.items():
            if field.required and name not in value:
                self._add([*path, name], f"missing; expected {expectation(field.type)}")
                ok = False
        return ok, cleaned


def _is_composite(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _is_composite(t.type)
    if isinstance(t, mi.UnionType):
        return any(_is_composite(x) for x in t.types)
    return isinstance(t, mi.StructType | mi.ListType | mi.DictType)
