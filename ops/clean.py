"""`rlbus clean RUN`: delete a run's state directory (server stores, checkpoints, logs, recordings).

Owns: the `clean` subcommand. Refuses to delete anything that does not look like an rlbus state dir,
or one that a live `rlbus up` holds (ops/up.py `hold_state_dir`). Removes the network namespaces and links a
killed run on that directory left (topology/network/links.py `clean_leftovers`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("clean", help="delete a run's state directory",
                       description="Delete ./.rlbus/RUN (or --state-dir): every server store, checkpoint, log and "
                                   "recording of that run. Stop the run first.")
    p.add_argument("run", help="run name")
    p.add_argument("--state-dir", type=Path, default=None, help="state directory (default ./.rlbus/RUN)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    path = args.state_dir or Path(".rlbus") / args.run
    if not path.exists():
        print(f"rlbus clean: nothing at {path}", file=sys.stderr)
        return 0
    if not (path / "nats").exists() and not (path / "logs").exists():
        print(f"rlbus clean: {path} does not look like an rlbus state directory (no nats/ or logs/); "
              f"not deleting it", file=sys.stderr)
        return 2
    from rlbus.ops.up import hold_state_dir
    from rlbus.topology.network.links import clean_leftovers

    lock = hold_state_dir(path)            # refuses (exit 2, naming the pid) while an `rlbus up` holds it
    try:
        if removed := clean_leftovers(path / "nats"):
            print(f"rlbus clean: removed {len(removed)} link(s) and namespace(s) a killed run left: "
                  f"{', '.join(removed)}")
        shutil.rmtree(path)
    finally:
        lock.close()
    print(f"rlbus clean: deleted {path}")
    return 0
