"""`rlbus plot FILE|RUN -o DIR`: PNGs of reward, pass rate, KL, staleness and throughput per version, and of
held-out accuracy against cost per evaluated version.

Owns: the command line. A FILE is a recording (`rlbus record`); a RUN is recorded first (a snapshot of
its streams, into a temporary file) and then plotted. The series and drawing are ops/recording/plotting.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlbus.ops.target import add_target_options


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plot", help="PNGs of reward, pass rate, KL, staleness and throughput per policy version, and accuracy "
                     "against cost",
        description="Draw reward, pass rate, KL, staleness and throughput per policy version from a recording "
                    "(or from a live run, recorded first) into PNG files, and accuracy_cost.png: for each "
                    "evaluated version, the held-out pass rate of agentic episodes against the policy tokens "
                    "spent per task (greedy pass@1, and pass@k at k sampled episodes' tokens), and pass_at_k.png: "
                    "greedy pass@1, mean@K and pass@k with their intervals per evaluated version. A plot whose "
                    "data the recording lacks says so in its PNG.")
    p.add_argument("source", metavar="FILE|RUN", help="a recording file, or a run id (read from its bus)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="output directory (default: <file>-plots next to FILE, or <state-dir>/plots for RUN)")
    add_target_options(p, run_positional=False)
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    source = Path(args.source)
    if source.is_file():
        out = args.output or source.with_name(source.stem + "-plots")
        return _plot_file(source, out)
    import anyio

    from rlbus.ops.target import resolve

    args.run = args.source
    target = resolve(args)
    out = args.output or ((args.state_dir or Path(".rlbus") / target.run) / "plots")
    with tempfile.TemporaryDirectory(prefix="rlbus-plot-") as tmp:
        path = Path(tmp) / f"{target.run}.rlrec"
        anyio.run(_record, target, path, backend="asyncio")
        return _plot_file(path, out)


async def _record(target: Any, path: Path) -> None:
    from rlbus.ops.recording.recorder import record

    async with await target.connect(name="rlbus-plot") as bus:
        await record(bus, path)


def _plot_file(path: Path, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from rlbus.ops.recording.playback import open_playback
    from rlbus.ops.recording.plotting import collect, render_all

    with open_playback(path) as pb:
        data = collect(pb.entries(), run=pb.run)
    paths = render_all(data, out)
    print(f"rlbus plot: {len(data.rollouts)} rollouts, {len(data.steps)} train steps, {len(data.evals)} eval "
          f"reports, {len(data.manifests)} weight manifests", file=sys.stderr)
    for p in paths:
        print(p)
    return 0
