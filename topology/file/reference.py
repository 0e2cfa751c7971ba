"""The topology key reference (key, type, default, meaning), generated from topology/file/schema.py.

Owns: `field_docs(cls)` (the string literal under each field, read from the class source with `ast`)
and `reference_markdown()` (one Markdown table per TOML table, walked from `Topology`): the text of
docs/topology.md (`rlbus validate --reference > docs/topology.md`; tests/meta/test_meta_readme.py keeps
the file equal to it), so the reference cannot drift from the schema. Does not: validate anything.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi

from rlbus.topology.file import schema
from rlbus.topology.file._walk import expectation
from rlbus.topology.file.schema import Topology

__all__ = ["field_docs", "reference_markdown", "struct_tables"]


def field_docs(cls: type[msgspec.Struct]) -> dict[str, str]:
    """{field name: the docstring line(s) written right under it} for one schema Struct."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def struct_tables() -> Iterator[tuple[str, mi.StructType]]:
    """(TOML table header, struct type) for every table of the schema, depth first from the top level."""
    top = mi.type_info(Topology)
    assert isinstance(top, mi.StructType)
    yield from _tables("", top)


def _unwrap(t: mi.Type) -> mi.Type:
    if isinstance(t, mi.Metadata):
        return _unwrap(t.type)
    if isinstance(t, mi.UnionType):
        others = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return _unwrap(others[0]) if len(others) == 1 else t
    return t


def _tables(header: str, t: mi.StructType) -> Iterator[tuple[str, mi.StructType]]:
    yield header, t
    for field in t.fields:
        inner = _unwrap(field.type)
        name = f"{header.strip('[]')}.{field.encode_name}" if header else field.encode_name
        if isinstance(inner, mi.StructType):
            yield from _tables(f"[{name}]", inner)
        elif isinstance(inner, mi.ListType) and isinstance(item := _unwrap(inner.item_type), mi.StructType):
            yield from _tables(f"[[{name}]]", item)


def _type_text(t: mi.Type) -> str:
    inner = _unwrap(t)
    optional = isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types)
    if isinstance(inner, mi.StructType):
        text = "table"
    elif isinstance(inner, mi.ListType) and isinstance(_unwrap(inner.item_type), mi.StructType):
        text = "array of tables"
    else:
        text = expectation(t if not optional else inner)
    return f"{text} (optional)" if optional else text


def _default_text(field: mi.Field) -> str:
    if field.required:
        return "required"
    if isinstance(_unwrap(field.type), mi.StructType):
        return "(table)"
    value: Any = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if value is None:
        return "none"
    return "`" + msgspec.json.encode(value).decode() + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """The whole key reference as Markdown: per table a header line and a key | type | default | meaning table."""
    intro = ("Generated from the field docstrings of `topology/file/schema.py` by "
             "`rlbus validate --reference > docs/topology.md` (a test keeps this file equal to it): every key, "
             "its type, its default and what it means. Start from a shipped example "
             "(`topology/examples/`); a key left out takes its default.")
    lines = ["# Topology file reference", "", intro, ""]
    for header, t in struct_tables():
        docs = field_docs(t.cls)
        title = f"`{header}`" if header else "top level"
        lines += [f"## {title}", "", " ".join((t.cls.__doc__ or "").split()), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for field in t.fields:
            lines.append(f"| `{field.encode_name}` | {_cell(_type_text(field.type))} | {_cell(_default_text(field))} "
                         f"| {_cell(docs.get(field.name, ''))} |")
        lines.append("")
    return "\n".join(lines)


def _schema_structs() -> list[type[msgspec.Struct]]:
    """Every Struct class of the topology file: those defined in topology/file/schema.py and the actors' Configs it
    composes (used by tests to demand a docstring per field)."""
    own = [obj for obj in vars(schema).values()
           if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == schema.__name__]
    return list(dict.fromkeys([*own, *(t.cls for _, t in struct_tables())]))
