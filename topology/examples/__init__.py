"""The example topology files shipped with rlbus, found by name.

Owns: `example_path(name)` and `example_names()`. The files: `single` (one hub region; the default
of `rlbus up`), `three_regions` (hub plus two leaves), `ray` (Ray backend), `tiny` (small settings
for tests), `hf` (a Hugging Face policy), `agentic` (agentic coding on the built-in repository tasks), `ranks` (the tiny run with a
trainer of two ranks). Does not: read or validate them (topology/file/load.py).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from rlbus.messages.errors import TopologyError

__all__ = ["example_names", "example_path"]


def example_names() -> list[str]:
    """Names of the shipped examples, sorted, without the `.toml` suffix."""
    root = resources.files(__name__)
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def example_path(name: str) -> Path:
    """Path of the example `name` ('single', 'three_regions.toml', ...).

    :raises TopologyError: if there is no such example (the message lists the ones there are).
    """
    stem = name.removesuffix(".toml")
    target = resources.files(__name__).joinpath(f"{stem}.toml")
    if not target.is_file():
        raise TopologyError(f"no example topology {name!r}; examples are: {', '.join(example_names())}")
    return Path(str(target))
