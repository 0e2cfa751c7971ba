"""One problem found in a topology file: where (file, key path), what, and how bad.

Owns: the `Problem` record shared by the key walker (topology/file/_walk.py), the cross-field rules and
`validate()` (topology/file/load.py) and `rlbus validate` (ops/validate.py). Does not: find problems.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Severity = Literal["error", "warning"]


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """A problem at a key path like `regions[1].actors[0].kind`; `str()` gives `FILE: KEY: MESSAGE`."""

    key: str
    """Key path in the file (`trainer.lr`, `regions[0].actors[2].count`); empty for the file as a whole."""
    message: str
    """What was expected and what was found, and what to do."""
    severity: Severity = "error"
    """'error' makes the file unusable; 'warning' is reported but the topology still loads."""
    file: str = ""
    """The topology file; empty when checking a Topology that did not come from a file."""

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.key) if p]
        if self.severity == "warning":
            parts.append("warning")
        return ": ".join([*parts, self.message])
