"""The `rlbus` command: one argparse parser with a subcommand per job, heavy imports inside each.

Owns: `main(argv)`: parse, configure logging, run the subcommand, map `RlbusError` to exit code 2
with a one-line message. Each subcommand's module (below) exposes `register(sub)`; a family of
subcommands shares a subpackage (`ops/bench/`, `ops/health/`, `ops/chaos/`, `ops/recording/`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Final

from rlbus.messages.errors import RlbusError
from rlbus.ops.logging import configure_logging

SUBCOMMANDS: Final = {
    "up": "rlbus.ops.up",
    "validate": "rlbus.ops.validate",
    "clean": "rlbus.ops.clean",
    "pretrain": "rlbus.ops.pretrain",
    "sft": "rlbus.ops.sft",
    "eval": "rlbus.ops.eval",
    "export": "rlbus.ops.export",
    "tasks": "rlbus.ops.tasks",
    "bench": "rlbus.ops.bench.cli",
    "health": "rlbus.ops.health.cli",
    "events": "rlbus.ops.events",
    "record": "rlbus.ops.recording.record",
    "replay": "rlbus.ops.recording.replay",
    "plot": "rlbus.ops.recording.plot",
    "chaos": "rlbus.ops.chaos.cli",
}
"""Subcommand → the module that registers it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlbus",
        description="Asynchronous RL for language-model coding agents over NATS JetStream. "
                    "Run `rlbus up` for the main job on the embedded default topology.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-json", action="store_true", help="JSON logs even on a terminal")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json=True if args.log_json else None,
                      level=logging.DEBUG if args.verbose else logging.WARNING if args.command in
                      ("validate", "health", "events", "replay", "bench", "record", "plot", "eval",
                                            "tasks") else logging.INFO)
    try:
        return int(args.handler(args) or 0)
    except RlbusError as err:
        print(f"rlbus {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rlbus {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                # `rlbus ... | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
