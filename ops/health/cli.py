"""`rlbus health [RUN]`: every actor in every region, problems first, plus each region's bus.

Owns: the command line (target options, thresholds, --once/--json/--prometheus) and the loop that
refreshes the view. The model is ops/health/model.py, the bus reading ops/health/watch.py, the table,
JSON and metrics ops/health/view.py. Exit codes: 0, or 1 with --once when an actor is dead or a region's
bus is down; 2 for errors (no such run, bus unreachable).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rlbus.ops.target import add_target_options, on_signal


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "health", help="live table of every actor and region bus, problems first (--once --json for scripts)",
        description="Show every actor of a run in every region, problems first: dead (no heartbeat past its "
                    "deadline), failed, stalled (alive but no counter changed), lagging (too many policy versions "
                    "behind), restarting; then each region's bus (server ping, JetStream, TASKS backlog, own "
                    "ROLLOUTS) and the hub's trainer backlog and dead letters. Reads the HEALTH stream's history, "
                    "so an actor that died before this command started is still seen dead. With --once, a run "
                    "that has stopped is opened read-only (its stored servers started again, no actor, then "
                    "stopped) and shows how it ended.")
    add_target_options(p)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (1 when something is dead)")
    p.add_argument("--json", action="store_true", help="JSON: one object with --once, else one object per refresh")
    p.add_argument("--prometheus", type=int, default=None, metavar="PORT",
                   help="serve the same as Prometheus metrics on PORT (0: any free port, printed)")
    p.add_argument("--bind", default="0.0.0.0", help="address of the metrics endpoint (default 0.0.0.0)")
    p.add_argument("--refresh-s", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--settle-s", type=float, default=0.5,
                   help="with --once: listen to live heartbeats this long before judging (default 0.5)")
    t = p.add_argument_group("thresholds")
    t.add_argument("--deadline-factor", type=float, default=3.0,
                   help="dead after this many heartbeat intervals without a heartbeat (default 3)")
    t.add_argument("--min-deadline-s", type=float, default=3.0, help="the deadline is at least this (default 3 s)")
    t.add_argument("--interval-s", type=float, default=2.0,
                   help="heartbeat interval assumed until two heartbeats were seen (default 2 s)")
    t.add_argument("--stall-s", type=float, default=60.0,
                   help="stalled when no counter changed for this long (default 60 s; 0 disables)")
    t.add_argument("--lag-versions", type=int, default=2, help="lagging when more versions behind (default 2)")
    t.add_argument("--restart-window-s", type=float, default=300.0,
                   help="restarting when it restarted within this window (default 300 s)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.health.model import HealthRules
    from rlbus.ops.target import resolve

    target = resolve(args)
    rules = HealthRules(deadline_factor=args.deadline_factor, min_deadline_s=args.min_deadline_s,
                        default_interval_s=args.interval_s, stall_s=args.stall_s, lag_versions=args.lag_versions,
                        restart_window_s=args.restart_window_s)
    return int(anyio.run(_run, target, rules, args, backend="asyncio"))


async def _run(target: Any, rules: Any, args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.health.view import registry_for, serve_metrics, to_json
    from rlbus.ops.health.watch import HealthWatch
    from rlbus.ops.target import opened

    refuse = None if args.once else ("the live view waits for heartbeats a stopped run never sends: "
                                     "`rlbus health --once` shows how it ended")
    async with (opened(target, args, command="rlbus health", refuse=refuse) as reached,
                await reached.connect(name="rlbus-health") as bus):
        watch = HealthWatch(reached, bus, rules)
        try:
            await watch.load()
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch.follow)
                if args.once:
                    await anyio.sleep(args.settle_s)
                    await watch.probe()
                    snap = watch.snapshot()
                    tg.cancel_scope.cancel()
                else:
                    latest: list[Any] = [None]
                    if args.prometheus is not None:
                        port = await tg.start(lambda task_status: serve_metrics(
                            registry_for(lambda: latest[0]), args.prometheus, host=args.bind,
                            task_status=task_status))
                        print(f"rlbus health: Prometheus metrics on http://{args.bind}:{port}/metrics",
                              file=sys.stderr, flush=True)
                    tg.start_soon(on_signal, tg.cancel_scope.cancel)
                    await _refresh_loop(watch, latest, args)
        finally:
            await watch.aclose()
    if not args.once:
        return 0
    if args.json:
        print(json.dumps(to_json(snap), indent=2))
    else:
        _print_table(snap)
    return 1 if snap.anything_dead else 0


async def _refresh_loop(watch: Any, latest: list[Any], args: argparse.Namespace) -> None:
    import anyio
    from rich.console import Console
    from rich.live import Live

    from rlbus.ops.health.view import render_table, to_json

    console = Console()
    quiet = args.prometheus is not None and not console.is_terminal and not args.json
    if console.is_terminal and not args.json:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                await watch.probe()
                latest[0] = watch.snapshot()
                live.update(render_table(latest[0]), refresh=True)
                await anyio.sleep(args.refresh_s)
    while True:
        await watch.probe()
        latest[0] = watch.snapshot()
        if args.json:
            print(json.dumps(to_json(latest[0])), flush=True)
        elif not quiet:
            console.print(render_table(latest[0]))
        await anyio.sleep(args.refresh_s)


def _print_table(snap: Any) -> None:
    from rich.console import Console

    from rlbus.ops.health.view import render_table

    Console(width=max(Console().width, 140)).print(render_table(snap))

