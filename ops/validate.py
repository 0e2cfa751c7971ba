"""`rlbus validate FILE [--json] [--reference]`: check a topology file and report every problem at once.

Owns: the command line and output format (`FILE: KEY: MESSAGE` per problem, warnings marked, or
`OK: FILE: run R, N regions, M actors`; exit 2 on any error, 0 otherwise; never a traceback for bad
input). Does not: decide what is a problem (topology/file/load.py, topology/file/rules.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate` subcommand to the `rlbus` parser."""
    p = sub.add_parser(
        "validate",
        help="check a topology file and report every problem with its key path",
        description="Check a topology TOML file: unknown or misspelled keys, wrong types, out-of-range values, "
                    "and rules across keys (one hub, one trainer in the hub, unique names, counts that fit). "
                    "Prints every problem as FILE: KEY: MESSAGE; exit code 2 if any is an error.",
    )
    p.add_argument("file", nargs="?", metavar="FILE",
                   help="topology file, or the name of a shipped example (single, three_regions, ray, tiny)")
    p.add_argument("--json", action="store_true", help="print one JSON object (ok, run, counts, problems)")
    p.add_argument("--reference", action="store_true",
                   help="print the Markdown reference of every topology key (type, default, meaning) and exit")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from rlbus.topology.file.load import validate

    if args.reference:
        from rlbus.topology.file.reference import reference_markdown

        print(reference_markdown())
        return 0
    if args.file is None:
        print("rlbus validate: expected a topology FILE (or --reference)", file=sys.stderr)
        return 2
    path = _resolve(Path(args.file))
    topology, problems = validate(path)
    errors = [p for p in problems if p.severity == "error"]
    if args.json:
        report: dict[str, Any] = {
            "file": str(path),
            "ok": not errors,
            "run": topology.run if topology is not None else None,
            "regions": len(topology.regions) if topology is not None else None,
            "actors": len(topology.instances()) if topology is not None else None,
            "errors": len(errors),
            "warnings": len(problems) - len(errors),
            "problems": [{"file": p.file, "key": p.key, "severity": p.severity, "message": p.message}
                         for p in problems],
        }
        print(json.dumps(report, indent=2))
        return 2 if errors else 0
    for problem in problems:
        print(problem)
    if topology is None:
        n = len(errors)
        print(f"FAILED: {path}: {n} error{'s' if n != 1 else ''}, {len(problems) - n} warning"
              f"{'s' if len(problems) - n != 1 else ''}", file=sys.stderr)
        return 2
    print(f"OK: {path}: run {topology.run}, {len(topology.regions)} region{'s' if len(topology.regions) != 1 else ''}, "
          f"{len(topology.instances())} actors")
    return 0


def _resolve(path: Path) -> Path:
    """A path as given if it exists (or looks like a path), else the shipped example of that name."""
    if path.exists() or len(path.parts) > 1 or path.suffix:
        return path
    from rlbus.messages.errors import TopologyError
    from rlbus.topology.examples import example_path

    try:
        return example_path(str(path))
    except TopologyError:
        return path
