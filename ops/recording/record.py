"""`rlbus record [RUN] -o FILE [--follow | --for SECONDS]`: write a run's streams into one recording file.

Owns: the command line, progress output (stderr) and the closing summary. What is recorded and how is
ops/recording/recorder.py; the file format is ops/recording/format.py (see docs/recording.md; readable with plain
msgpack + zstandard). Ctrl-C during --follow stops reading and still writes a complete file. A stopped run is
read through its stored servers, started for the command (ops/target.py `opened`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rlbus.ops.target import add_target_options, on_signal

STREAM_LABELS = ("ROLLOUTS", "TRAINLOG", "WEIGHTS", "CHECKPOINTS", "EVALS", "EVENTS")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "record", help="record a run's rollouts, TRAINLOG, weight manifests, checkpoints, evals and events to a file",
        description="Write the run's hub streams (the aggregated ROLLOUTS of every region, TRAINLOG, WEIGHTS "
                    "manifests, CHECKPOINTS marks, EVALS reports, EVENTS) into one self-describing file: "
                    "zstd-compressed MessagePack segments with an index, readable with plain msgpack + zstandard. "
                    "By default everything stored so far is recorded and the command exits; --follow keeps "
                    "recording new messages until Ctrl-C, --for SECONDS for that long. A run that has stopped is opened "
                    "read-only: its stored servers are started again (no actor) for as long as the recording "
                    "takes, then stopped.")
    add_target_options(p)
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="recording file (default <state-dir>/recordings/<run>-<time>.rlrec)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="keep recording new messages until Ctrl-C")
    mode.add_argument("--for", dest="duration", type=float, default=None, metavar="SECONDS",
                      help="keep recording new messages for this many seconds")
    p.add_argument("--streams", default=None,
                   help=f"comma-separated subset of {','.join(STREAM_LABELS)} (default: all)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    p.set_defaults(handler=_handler)


def default_output(args: argparse.Namespace, run: str) -> Path:
    """`<state-dir>/recordings/<run>-<YYYYmmdd-HHMMSS>.rlrec`, or in the working directory with --url."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.url:
        return Path(f"{run}-{stamp}.rlrec")
    state = args.state_dir or Path(".rlbus") / run
    return state / "recordings" / f"{run}-{stamp}.rlrec"


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.messages.errors import RlbusError
    from rlbus.ops.target import resolve

    target = resolve(args)
    labels = None
    if args.streams:
        labels = [s.strip().upper() for s in args.streams.split(",") if s.strip()]
        if unknown := sorted(set(labels) - set(STREAM_LABELS)):
            raise RlbusError(f"--streams: unknown {unknown}; choose from {', '.join(STREAM_LABELS)}")
    output = args.output or default_output(args, target.run)
    output.parent.mkdir(parents=True, exist_ok=True)
    return int(anyio.run(_run, target, output, labels, args, backend="asyncio"))


async def _run(target: Any, output: Path, labels: list[str] | None, args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.recording.recorder import record
    from rlbus.ops.target import opened

    tty = sys.stderr.isatty()
    started = time.monotonic()

    def show(progress: Any) -> None:
        if args.quiet:
            return
        if tty:
            print(f"\r{progress.line()}", end="", file=sys.stderr, flush=True)
        elif time.monotonic() - started > 1.5:
            print(f"rlbus record: {progress.line()}", file=sys.stderr, flush=True)

    stop = anyio.Event()
    follow = args.follow or args.duration is not None
    refuse = ("--follow and --for wait for messages a stopped run never sends: drop them to record what it stored"
              if follow else None)
    async with (opened(target, args, command="rlbus record", refuse=refuse) as reached,
                await reached.connect(name="rlbus-record") as bus, anyio.create_task_group() as tg):
        tg.start_soon(on_signal, stop.set)
        progress = await record(bus, output, follow=follow, duration_s=args.duration, labels=labels, stop=stop,
                                on_progress=show)
        tg.cancel_scope.cancel()
    if tty and not args.quiet:
        print(file=sys.stderr)
    size = output.stat().st_size  # noqa: ASYNC240 - one stat of a closed file, after the recording
    counts = ", ".join(f"{k} {v}" for k, v in sorted(progress.counts.items()))
    print(f"rlbus record: wrote {output}: {progress.total} messages ({counts}); {size / 1e6:.2f} MB on disk, "
          f"{progress.bytes_in / 1e6:.2f} MB of messages")
    if progress.missing:
        print(f"rlbus record: streams not found (not recorded): {', '.join(progress.missing)}", file=sys.stderr)
    return 0

