"""`rlbus replay FILE inspect|export|publish [filters]` and `rlbus replay FILE train`, and the Python API
`rlbus.ops.recording.replay.open(path)`.

Owns: the command line (filters shared by the three actions, their parsing), the inspect table, and
`open()`: `for rollout in open("run.rlrec", versions=(3, 5)).rollouts(): ...` iterates typed Rollouts.
The typed reading and filter semantics are ops/recording/playback.py, the file format ops/recording/format.py, the
publishing ops/recording/republish.py, `train` (a fresh trainer reproducing every recorded version digest)
ops/recording/retrain.py. `publish` also feeds a recording to a new run's live trainer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.ops.target import add_target_options

if TYPE_CHECKING:
    from rlbus.ops.recording.playback import Filters, Playback

KINDS = ("rollout", "train_step", "weight_manifest", "checkpoint_mark", "eval_report", "event")


def open(path: str | os.PathLike[str], **filters: Any) -> Playback:
    """Open a recording for typed reading. Filters: kinds, versions=(lo, hi), rewards=(lo, hi), regions,
    task_ids, since, until (unix s). Iterate it for messages, or call `.rollouts()` for typed Rollouts."""
    from rlbus.ops.recording.playback import open_playback

    return open_playback(path, **filters)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay", help="inspect, export (JSONL) or publish back a recording, with filters",
        description="Read a recording made by `rlbus record`. Filters (all optional, all must hold) select "
                    "messages by kind, policy-version range, reward range, region, task id and recorded time. "
                    "A filter on a field a kind lacks excludes that kind (e.g. --task keeps only rollouts).")
    p.add_argument("file", type=Path, metavar="FILE", help="recording file (.rlrec)")
    filters = argparse.ArgumentParser(add_help=False)
    g = filters.add_argument_group("filters")
    g.add_argument("--kind", action="append", default=None, help=f"message kinds, repeatable or comma separated: "
                                                                  f"{', '.join(KINDS)}")
    g.add_argument("--versions", default=None, metavar="LO:HI",
                   help="policy versions, inclusive (3:5, 3:, :5 or 4); a rollout matches when its tokens' "
                        "version span overlaps")
    g.add_argument("--rewards", default=None, metavar="LO:HI", help="rollout reward range, inclusive (0.5: or :0)")
    g.add_argument("--region", action="append", default=None, help="region (repeatable)")
    g.add_argument("--task", action="append", default=None, help="task id (repeatable)")
    g.add_argument("--since", default=None,
                   help="recorded at or after: ISO time, unix seconds, or +DURATION after the first message")
    g.add_argument("--until", default=None, help="recorded at or before (same forms as --since)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = actions.add_parser("inspect", parents=[filters], help="summary: counts per kind and region, rewards, "
                                                              "versions, time range")
    a.add_argument("--json", action="store_true", help="print the summary as JSON")
    a.set_defaults(handler=_inspect)
    e = actions.add_parser("export", parents=[filters], help="one JSON object per message")
    e.add_argument("--jsonl", required=True, metavar="OUT", help="output file ('-': stdout)")
    e.add_argument("--tensors", choices=["lists", "base64"], default="lists",
                   help="per-token arrays as JSON lists (default) or base64 bytes")
    e.set_defaults(handler=_export)
    b = actions.add_parser("publish", parents=[filters],
                           help="publish back onto a bus under a run (default: rollouts only; feeds a fresh trainer)")
    add_target_options(b, run_positional=False, role="admin")
    b.add_argument("--speed", type=float, default=0.0,
                   help="X times the recorded pace (2: twice as fast); 0 (default): as fast as possible")
    b.add_argument("--to-region", default=None,
                   help="publish every rollout to this region (default: its recorded region if the target has it, "
                        "else the hub)")
    b.add_argument("--provision", action="store_true",
                   help="create the target run's streams first (needs the admin role)")
    b.set_defaults(handler=_publish)
    t = actions.add_parser("train", help="feed the whole recording to a fresh trainer and check that it reproduces "
                                         "every recorded WeightManifest digest (exit 1 names the first that differs)",
                           description="Replay the TrainSteps of the final checkpoint lineage (and any abandoned "
                                       "branch) on a fresh trainer built like the live one, with each step's "
                                       "rollouts in the order the trainer used them, and compare the digest of "
                                       "every version with the recorded manifest. Exit 0: all reproduced; 1: a "
                                       "mismatch; 2: the recording lacks what is needed.")
    _add_train_arguments(t)
    t.set_defaults(handler=_train)


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pretrained", type=Path, default=None,
                   help="the run's pretrained checkpoint (<state-dir>/pretrained/pretrain.pt); default: the path "
                        "the trainer recorded in its started event")
    p.add_argument("--topology", type=Path, default=None,
                   help="topology file whose [trainer] settings to use; default: the settings the trainer recorded")
    p.add_argument("--seed", type=int, default=None, help="trainer seed (default: the run's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the trainer's; another count may change floating-point sums)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first mismatching version")
    p.add_argument("--json", action="store_true",
                   help="print {versions, matched, mismatched, first_mismatch, ...} as JSON instead of lines")


def _train(args: argparse.Namespace) -> int:
    from rlbus.ops.recording.retrain import handle

    return handle(args)


# ---- filters ----------------------------------------------------------------------------------------
def _range(text: str | None, cast: type, what: str) -> tuple[Any, Any] | None:
    from rlbus.messages.errors import RlbusError

    if text is None:
        return None
    try:
        if ":" not in text:
            value = cast(text)
            return value, value
        lo, hi = text.split(":", 1)
        return (cast(lo) if lo.strip() else None), (cast(hi) if hi.strip() else None)
    except ValueError:
        raise RlbusError(f"{what} {text!r}: expected LO:HI (either side may be empty) or one value") from None


def _when(text: str | None, first: float | None) -> float | None:
    from rlbus.messages.errors import RlbusError
    from rlbus.ops.target import parse_duration

    if text is None:
        return None
    if text.startswith("+"):
        if first is None:
            return None
        return first + parse_duration(text[1:])
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise RlbusError(f"time {text!r}: expected ISO 8601 (2026-01-31T12:00:00), unix seconds, or +DURATION") from None
    return when.timestamp()


def filters_from(args: argparse.Namespace, playback: Playback, *, default_kinds: frozenset[str] | None = None
                 ) -> Filters:
    """The Filters the options ask for (times relative to the recording's first message need its index)."""
    from rlbus.messages.errors import RlbusError
    from rlbus.ops.recording.playback import Filters

    kinds = None
    if args.kind:
        kinds = frozenset(k.strip() for item in args.kind for k in item.split(",") if k.strip())
        if unknown := sorted(kinds - set(KINDS)):
            raise RlbusError(f"--kind: unknown {unknown}; kinds are {', '.join(KINDS)}")
    segments = playback.reader.segments
    first = min((s.min_time for s in segments), default=None)
    return Filters(kinds=kinds or default_kinds, versions=_range(args.versions, int, "--versions"),
                   rewards=_range(args.rewards, float, "--rewards"),
                   regions=frozenset(args.region) if args.region else None,
                   task_ids=frozenset(args.task) if args.task else None,
                   since=_when(args.since, first), until=_when(args.until, first))


# ---- actions ----------------------------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    from rlbus.ops.recording.playback import open_playback, summarize

    with open_playback(args.file) as pb:
        f = filters_from(args, pb)
        summary = summarize(pb.entries(**_kw(f)))
        summary["file"] = str(args.file)
        summary["run"] = pb.run
        summary["complete"] = pb.reader.complete
        summary["undecodable"] = pb.undecodable
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _kw(f: Filters) -> dict[str, Any]:
    return {k: getattr(f, k) for k in f.__dataclass_fields__ if getattr(f, k) is not None}


def _print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t0, t1 = s["time"]
    span = "-" if t0 is None else (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))} … "
                                   f"{time.strftime('%H:%M:%S', time.localtime(t1))} ({t1 - t0:.1f} s)")
    console.print(f"{s['file']}: run {s['run']!r}, {s['messages']} messages, {span}"
                  + ("" if s["complete"] else "  (no index: interrupted recording, scanned)"))
    kinds = sorted(s["per_kind"])
    table = Table(title="messages per region and kind", title_justify="left")
    table.add_column("region")
    for k in kinds:
        table.add_column(k, justify="right")
    for region, counts in sorted(s["per_region"].items()):
        table.add_row(region, *[str(counts.get(k, 0)) for k in kinds])
    table.add_row("all", *[str(s["per_kind"][k]) for k in kinds], style="bold")
    console.print(table)
    r = s["reward"]
    if r["n"]:
        console.print(f"rollouts {r['n']}: reward mean {r['mean']:.4f} std {r['std']:.4f} min {r['min']:.4g} "
                      f"max {r['max']:.4g}; {s['tasks']} tasks; {s['completion_tokens']} completion tokens"
                      + (f"; pass rate {s['pass_rate']:.3f} of {s['graded']} graded" if s["pass_rate"] is not None else ""))
    vmin, vmax = s["versions"]
    console.print(f"policy versions: {'-' if vmin is None else f'{vmin} … {vmax}'}")
    if s["events"]:
        console.print("events: " + ", ".join(f"{k} {v}" for k, v in sorted(s["events"].items())))


def _export(args: argparse.Namespace) -> int:
    from rlbus.ops.recording.playback import export_jsonl, open_playback

    with open_playback(args.file) as pb:
        entries = pb.entries(**_kw(filters_from(args, pb)))
        if args.jsonl == "-":
            n = export_jsonl(entries, sys.stdout, tensors=args.tensors)
        else:
            with Path(args.jsonl).open("w") as out:
                n = export_jsonl(entries, out, tensors=args.tensors)
    print(f"rlbus replay: exported {n} messages to {args.jsonl}", file=sys.stderr)
    return 0


def _publish(args: argparse.Namespace) -> int:
    import dataclasses

    import anyio

    from rlbus.messages.errors import RlbusError
    from rlbus.ops.recording.playback import open_playback
    from rlbus.ops.recording.republish import DEFAULT_KINDS
    from rlbus.ops.target import resolve

    if not args.run_opt:
        raise RlbusError("publish needs the target run: --run NEWRUN")
    if args.speed < 0:
        raise RlbusError(f"--speed {args.speed}: expected 0 (as fast as possible) or a positive factor")
    located = argparse.Namespace(**{**vars(args), "run": None, "run_opt": args.run_opt if args.url else None})
    target = dataclasses.replace(resolve(located), run=args.run_opt)
    with open_playback(args.file) as pb:
        f = filters_from(args, pb, default_kinds=DEFAULT_KINDS)
        return int(anyio.run(_publish_async, pb, f, target, args, backend="asyncio"))


async def _publish_async(pb: Playback, f: Filters, target: Any, args: argparse.Namespace) -> int:
    from rlbus.messages.streams import StreamSettings, provision_run
    from rlbus.ops.recording.republish import republish

    def show(result: Any) -> None:
        print(f"rlbus replay: published {result.published} ({result.duplicates} duplicates)", file=sys.stderr,
              flush=True)

    async with await target.connect(name="rlbus-replay") as bus:
        if args.provision:
            await provision_run(bus.nc, bus.subjects, hub=target.hub, domains=target.domains,
                                settings=StreamSettings())
        result = await republish(pb.entries(**_kw(f)), bus, speed=args.speed, regions=set(target.urls),
                                 hub=target.hub, region=args.to_region, on_progress=show)
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items()))
    print(f"rlbus replay: published {result.published} messages to run {target.run!r} in {result.seconds:.1f} s "
          f"({result.duplicates} already there)" + (f"; skipped {skipped}" if skipped else "")
          + (f"; regions remapped {result.remapped}" if result.remapped else ""))
    return 0
