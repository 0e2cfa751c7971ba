"""`rlbus up [FILE]`: launch a topology on this machine and show its progress until Ctrl-C.

Owns: the command line of `up` (topology file, state dir, --fresh, backend, --for), the live progress
view (from the actors' heartbeats on the hub's health subject) and the closing summary. The work of
starting servers, streams and actors is topology/launch.py's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_TOPOLOGY = "demo"
"""The embedded default of `rlbus up`: the 3-region bus demo until the RL actors land."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "up", help="launch a topology (default: the embedded 3-region demo) and show progress",
        description="Start the embedded NATS servers (one per region, unless the topology names nats_urls), "
                    "provision the streams, launch every actor through the local or Ray backend, and show a live "
                    "table of their heartbeats. Ctrl-C drains the actors, stops the servers and leaves no process "
                    "behind. A second `rlbus up` on the same state directory resumes the run.")
    p.add_argument("topology", nargs="?", default=DEFAULT_TOPOLOGY,
                   help=f"topology file, or the name of a shipped example (default: {DEFAULT_TOPOLOGY})")
    p.add_argument("--state-dir", type=Path, default=None, help="run state directory (default ./.rlbus/<run>)")
    p.add_argument("--fresh", action="store_true", help="delete the run's state directory first and start over")
    p.add_argument("--backend", choices=["local", "ray"], default=None, help="override the topology's launch backend")
    p.add_argument("--for", dest="duration", type=float, default=None, metavar="SECONDS",
                   help="stop by itself after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="actor heartbeat interval (default 1 s)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.topology.examples import example_path
    from rlbus.topology.load import load

    path = Path(args.topology)
    if not path.exists() and "/" not in args.topology:
        path = example_path(args.topology)
    topology = load(path)
    return int(anyio.run(_up, topology, args, backend="asyncio"))


async def _up(topology: Any, args: argparse.Namespace) -> int:
    import anyio

    import functools

    from rlbus.ops.logging import configure_logging
    from rlbus.topology.launch import Launch

    view = _ProgressView(sys.stdout.isatty())
    started = time.monotonic()
    print(f"rlbus up: run {topology.run!r}, {len(topology.regions)} region(s), "
          f"{len(topology.instances())} actor(s), backend {args.backend or topology.launch.backend}", flush=True)
    async with Launch.open(topology, state_dir=args.state_dir, fresh=args.fresh) as launch:
        where = ", ".join(f"{r}={u[0]}" for r, u in launch.endpoints.urls.items())
        print(f"rlbus up: bus ready ({where}); state in {launch.state_dir}", flush=True)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(lambda task_status: launch.run_actors(
                    backend=args.backend, heartbeat_s=args.heartbeat_s, task_status=task_status,
                    worker_setup=functools.partial(configure_logging, json=True)))
                tg.start_soon(view.watch, launch.admin)
                tg.start_soon(_cancel_on_signal, tg.cancel_scope)
                if args.duration is not None:
                    await anyio.sleep(args.duration)
                    tg.cancel_scope.cancel()
        except KeyboardInterrupt:
            pass
        print(f"rlbus up: stopping: actors drained, servers stopping ({time.monotonic() - started:.0f}s)", flush=True)
        summary = view.summary(launch)
    print(summary, flush=True)
    return 0


async def _cancel_on_signal(scope: Any) -> None:
    """Ctrl-C (SIGINT) or SIGTERM: cancel, which drains the actors and stops the servers."""
    import signal

    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"rlbus up: {signal.Signals(signum).name}: draining", flush=True)
            scope.cancel()
            return


class _ProgressView:
    """Latest heartbeat per actor, printed as a table every few seconds (live-updating on a terminal)."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.latest: dict[str, Any] = {}

    async def watch(self, bus: Any) -> None:
        import anyio

        from rlbus.messages import codec
        from rlbus.messages.errors import BadMessage
        from rlbus.messages.schemas import Heartbeat

        sub = await bus.nc.subscribe(bus.subjects.all_health())
        last = 0.0
        try:
            async for msg in sub.messages:
                try:
                    hb = codec.decode_as(msg.data, msg.headers, Heartbeat)
                except BadMessage:
                    continue
                self.latest[hb.actor_id] = hb
                if time.monotonic() - last > (1.0 if self.tty else 5.0):
                    last = time.monotonic()
                    print(self.render(), flush=True)
        finally:
            with anyio.move_on_after(1, shield=True):
                await sub.unsubscribe()

    def render(self) -> str:
        now = time.time()
        rows = [("actor", "region", "kind", "state", "age", "counters")]
        for hb in sorted(self.latest.values(), key=lambda h: (h.region, h.actor_kind, h.actor_id)):
            counters = " ".join(f"{k}={v}" for k, v in sorted(hb.counters.items()))
            rows.append((hb.actor_id, hb.region, hb.actor_kind, hb.state, f"{now - hb.sent_at:.0f}s", counters))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join([time.strftime("%H:%M:%S"), *lines, ""])

    def summary(self, launch: Any) -> str:
        lines = ["rlbus up: summary"]
        totals: dict[str, int] = {}
        for hb in self.latest.values():
            for k, v in hb.counters.items():
                totals[f"{hb.actor_kind}.{k}"] = totals.get(f"{hb.actor_kind}.{k}", 0) + v
        for key in sorted(totals):
            lines.append(f"  {key} = {totals[key]}")
        sup = launch.supervisor
        if sup is not None:
            for actor_id, entry in sorted(sup.actors.items()):
                lines.append(f"  {actor_id}: {entry.state}, restarts {entry.restarts}")
        return "\n".join(lines)
