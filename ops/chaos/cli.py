"""`rlbus chaos [FILE]`: run the 3-region RL topology under a seeded storm of faults, then prove the ledger.

Owns: the command line of `chaos` (window length, kills, server kills, partitions, pauses and their
lengths, seed, state dir, --agentic, --json) and the process-level flow: pretrain once, run (ops/chaos/run.py),
print the report (ops/chaos/report.py), write `<state>/chaos.json`, exit 1 when anything was lost or
trained twice. Does not: schedule or inject faults itself (ops/chaos/plan.py, ops/chaos/run.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chaos", help="run the 3-region RL topology while killing actors, servers and links; print the ledger",
        description="Launch the embedded 3-region topology (default: three_regions with tiny settings; FILE "
                    "overrides) with the local backend, wait for the first optimizer step, then for --minutes: "
                    "SIGKILL random actors of every kind (the supervisor restarts them), SIGKILL a leaf region's "
                    "nats-server and restart it on its store dir after --outage-s, cut a leaf's link to the hub for "
                    "--outage-s, and SIGSTOP/SIGCONT actors. Then the feeder is stopped and the trainer catches up "
                    "(up to --settle-s), the actors drain, and the ledger is printed: rollouts produced, trained, "
                    "lost, trained twice, dropped (with reasons), pending, restarts and recovery times. Exit 1 when "
                    "a rollout was lost or trained twice. Wall time: about warm-up + minutes + catch-up + drain. "
                    "The run's state directory is cleared first (a pretrained policy there is kept).")
    p.add_argument("topology", nargs="?", default=None,
                   help="topology file or shipped example name (default: the chaos-sized three_regions)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the fault window (default 10)")
    p.add_argument("--kills", type=int, default=50,
                   help="SIGKILLs in all, actor processes plus leaf servers (default 50)")
    p.add_argument("--server-kills", type=int, default=None, metavar="N",
                   help="how many of the kills hit a leaf nats-server (default: one per 3 minutes, at least 1)")
    p.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="leaf-to-hub link cuts (default: one per 3 minutes, at least 1)")
    p.add_argument("--links", default=None, metavar="RATE/LATENCY",
                   help="put every leaf behind a shaped link, like 100mbit/30ms (one way; needs root, ip, tc and nft), "
                        "as a [regions.link] in each leaf would; with links, partitions take turns dropping every "
                        "packet, taking the link down and closing the relay")
    p.add_argument("--degrades", type=int, default=None, metavar="N",
                   help="link degradations, loss and a latency spike for --outage-s (default with links: one per 3 "
                        "minutes; without: 0)")
    p.add_argument("--degrade-loss", type=float, default=0.05, metavar="FRACTION",
                   help="packets a degraded link drops (default 0.05)")
    p.add_argument("--degrade-spike-ms", type=float, default=200.0, metavar="MS",
                   help="delay a degraded link adds each way (default 200)")
    p.add_argument("--pauses", type=int, default=None, metavar="N",
                   help="actor SIGSTOP/SIGCONT pauses (default: kills / 5, at least 1)")
    p.add_argument("--outage-s", type=float, default=30.0,
                   help="how long a killed leaf server stays down and a partition lasts (default 30)")
    p.add_argument("--pause-s", type=float, default=5.0, help="how long a paused actor stays stopped (default 5)")
    p.add_argument("--settle-s", type=float, default=300.0,
                   help="longest quiet period for the trainer to catch up before the drain (default 300)")
    p.add_argument("--warmup-s", type=float, default=300.0,
                   help="longest wait for the first optimizer step before the faults start (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    p.add_argument("--state-dir", type=Path, default=None, help="run state directory (default ./.rlbus/<run>)")
    p.add_argument("--agentic", action="store_true",
                   help="agentic episodes (repository tasks, tool calls, sandbox sessions; default topology: the "
                        "agentic example on a hub and a leaf, scripted turns): kills hit generators, sandbox "
                        "supervisors and the trainer mid-episode, and the report adds the sessions left open, the "
                        "restored workspaces equal to their snapshot, sandbox_error drops and unplanned restarts "
                        "(exit 1 unless all clean). A FILE fed repository tasks is run this way too")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.messages.errors import TopologyError
    from rlbus.ops.chaos.agentic import AGENTIC_KILL_KINDS, agentic_chaos_topology, is_agentic, kill_kinds
    from rlbus.ops.chaos.plan import ChaosSettings
    from rlbus.ops.chaos.report import exit_code, table
    from rlbus.ops.chaos.run import RESULT_NAME, chaos_topology, ensure_pretrained, prepare_state_dir
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.load import load

    if args.topology is None:
        topology = agentic_chaos_topology() if args.agentic else chaos_topology()
    else:
        path = Path(args.topology)
        topology = load(path if path.exists() or "/" in args.topology else example_path(args.topology))
    agentic = args.agentic or is_agentic(topology)
    kinds = kill_kinds(topology, AGENTIC_KILL_KINDS) if agentic else None
    if not all(r.embedded for r in topology.regions):
        raise TopologyError("rlbus chaos kills and partitions servers it starts itself: use a topology without "
                            "nats_urls")
    if args.links is not None:
        topology = with_links(topology, args.links)
    from rlbus.topology.network.links import namespaces_unavailable

    links = bool(topology.link_shapes()) and namespaces_unavailable() is None
    per_3min = max(1, round(args.minutes / 3))
    settings = ChaosSettings(
        duration_s=args.minutes * 60, kills=args.kills,
        server_kills=per_3min if args.server_kills is None else args.server_kills,
        partitions=per_3min if args.partitions is None else args.partitions,
        pauses=max(1, args.kills // 5) if args.pauses is None else args.pauses,
        outage_s=args.outage_s, pause_s=args.pause_s, seed=args.seed, links=links,
        degrades=(per_3min if links else 0) if args.degrades is None else args.degrades,
        degrade_loss=args.degrade_loss, degrade_spike_s=args.degrade_spike_ms / 1e3)
    if problems := settings.check():
        raise TopologyError("rlbus chaos: " + "; ".join(problems))
    stream = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    state = (args.state_dir or topology.state_path).resolve()
    prepare_state_dir(state)
    ensure_pretrained(topology, state, say)
    say(f"chaos: run {topology.run!r}, {len(topology.regions)} regions, {len(topology.instances())} actors; "
        f"{settings.kills} kills ({settings.server_kills} leaf servers), {settings.partitions} partitions, "
        f"{settings.pauses} pauses over {settings.duration_s:.0f}s, seed {settings.seed}"
        + (f"; leaves behind shaped links, {settings.degrades} link degradations" if links else "")
        + (f"; agentic episodes, kills hit {', '.join(kinds or [])}" if agentic else ""))
    result: dict[str, Any] | None = anyio.run(_main, topology, state, settings, args, say, kinds, agentic,
                                              backend="asyncio")
    if result is None:
        say("rlbus chaos: interrupted; actors drained and servers stopped, no ledger")
        return 130
    (state / RESULT_NAME).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(table(result), flush=True)
    return exit_code(result)


def with_links(topology: Any, spec: str) -> Any:
    """`topology` with every leaf behind a link of `spec` ('RATE/LATENCY', like '100mbit/30ms').

    :raises TopologyError: `spec` is not of that form (the text says what was expected)."""
    import msgspec

    from rlbus.messages.errors import TopologyError
    from rlbus.topology.file.schema import LinkSettings
    from rlbus.topology.network.links import parse_rate, parse_time

    rate, _, latency = spec.partition("/")
    try:
        parse_rate(rate)
        parse_time(latency)
    except ValueError as err:
        raise TopologyError(f"rlbus chaos --links {spec!r}: {err}; expected RATE/LATENCY like 100mbit/30ms") from None
    link = LinkSettings(bandwidth=rate, latency=latency)
    return msgspec.structs.replace(topology, regions=[
        msgspec.structs.replace(r, link=link) if r.role != "hub" else r for r in topology.regions])


async def _main(topology: Any, state: Path, settings: Any, args: argparse.Namespace, say: Any,
                kinds: list[str] | None, agentic: bool) -> dict[str, Any] | None:
    import signal

    import anyio

    from rlbus.ops.chaos.run import ChaosRun

    chaos = ChaosRun(topology, state, settings, settle_s=args.settle_s, warmup_s=args.warmup_s, say=say,
                     kill_kinds=kinds, agentic=agentic)
    result: dict[str, Any] | None = None
    async with anyio.create_task_group() as tg:
        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    say(f"rlbus chaos: {signal.Signals(signum).name}: stopping")
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch_signals)
        result = await chaos.run()
        tg.cancel_scope.cancel()
    return result
