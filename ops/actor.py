"""Process entry of one actor instance: `python -m rlbus.ops.actor --kind K --run R ...`.

Owns: configuring logging once and mapping the outcome to an exit code (0 stopped, 1 failed or
refused). The work is in actors/process.py, shared with the Ray backend.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from rlbus.actors.process import run_actor
    from rlbus.messages.errors import RlbusError
    from rlbus.ops.logging import configure_logging

    configure_logging(json=True)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        run_actor(args)
    except RlbusError as err:
        print(f"rlbus actor: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
