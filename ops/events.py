"""`rlbus events [RUN] --since 10m --kind crashed`: browse a run's lifecycle events and incidents.

Owns: the command line and the output (one line per event, or one JSON object per line with --json).
Events are read from the hub's EVENTS stream from a start time through an ephemeral consumer
(messages/history.py), filtered by event kind, actor, region and actor kind; --follow keeps printing
new ones until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from rlbus.ops.target import add_target_options, on_signal

if TYPE_CHECKING:
    from rlbus.messages.bus import Bus
    from rlbus.messages.schemas import Event


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "events", help="browse lifecycle events (started, stopped, crashed, restarted, dead letters, ...)",
        description="List the events of a run from the hub's EVENTS stream, oldest first, from --since ago "
                    "(e.g. 10m, 2h, 1d). Filter by event kind, actor, region or actor kind; --follow keeps "
                    "printing new events until Ctrl-C. A run that has stopped is opened read-only: its stored "
                    "servers are started again (no actor) while the events are read, then stopped.")
    add_target_options(p)
    p.add_argument("--since", default="1h", help="how far back to start: 90s, 10m, 2h, 1d, or 'all' (default 1h)")
    p.add_argument("--kind", action="append", default=None, metavar="EVENT",
                   help="only these event kinds (repeatable or comma separated: crashed,restarted)")
    p.add_argument("--actor", action="append", default=None, help="only events of this actor id (repeatable)")
    p.add_argument("--region", action="append", default=None, help="only events from this region (repeatable)")
    p.add_argument("--actor-kind", action="append", default=None, help="only events of this actor kind")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON object per line: {time, seq, subject, event...}")
    p.set_defaults(handler=_handler)


def _split(values: list[str] | None) -> set[str] | None:
    if not values:
        return None
    return {v.strip() for item in values for v in item.split(",") if v.strip()}


def _handler(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.target import parse_duration, resolve

    target = resolve(args)
    since = None if args.since == "all" else time.time() - parse_duration(args.since)
    return int(anyio.run(_run, target, since, args, backend="asyncio"))


async def _run(target: Any, since: float | None, args: argparse.Namespace) -> int:
    import anyio

    from rlbus.ops.target import opened

    kinds, actors, regions, akinds = _split(args.kind), _split(args.actor), _split(args.region), _split(args.actor_kind)
    shown = 0
    refuse = ("--follow waits for events a stopped run never sends: drop it to list what it stored"
              if args.follow else None)
    async with (opened(target, args, command="rlbus events", refuse=refuse) as reached,
                await reached.connect(name="rlbus-events") as bus, anyio.create_task_group() as tg):
        if args.follow:
            tg.start_soon(on_signal, tg.cancel_scope.cancel)
        async for at, seq, subject, event in read_events(bus, since=since, follow=args.follow):
            if ((kinds and event.event not in kinds) or (actors and event.actor_id not in actors)
                    or (regions and event.region not in regions) or (akinds and event.actor_kind not in akinds)):
                continue
            shown += 1
            print(_json_line(at, seq, subject, event) if args.json else _text_line(at, event), flush=args.follow)
        tg.cancel_scope.cancel()
    if not args.json and not shown:
        print("rlbus events: no matching events", file=sys.stderr)
    return 0


async def read_events(bus: Bus, *, since: float | None, follow: bool = False
                      ) -> AsyncIterator[tuple[float, int, str, Event]]:
    """(stored at, stream seq, subject, Event) from the hub's EVENTS stream, from `since` (None: all)."""
    from rlbus.messages import codec
    from rlbus.messages.errors import BadMessage
    from rlbus.messages.history import Start, read_stream, stored_at
    from rlbus.messages.schemas import Event

    start = Start() if since is None else Start.since(since)
    subjects = bus.subjects
    async for msg in read_stream(bus.js, subjects.events_stream(), subject=subjects.all_events(), start=start,
                                 follow=follow):
        try:
            event = codec.decode_as(msg.data, msg.headers, Event)
        except BadMessage:
            continue
        yield stored_at(msg), int(msg.metadata.sequence.stream), msg.subject, event


def _text_line(at: float, event: Event) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"
    data = " ".join(f"{k}={v}" for k, v in sorted(event.data.items()))
    parts = [stamp, event.region or "-", event.actor_kind or "-", event.actor_id or "-", event.event,
             event.detail, data]
    return "  ".join(p for p in parts if p)


def _json_line(at: float, seq: int, subject: str, event: Event) -> str:
    import msgspec

    return json.dumps({"time": at, "seq": seq, "subject": subject, **msgspec.to_builtins(event)})

