"""Process entry of one actor instance: `python -m rlbus.ops.actor --kind K --run R ...`.

Owns: turning command-line arguments (written by a launcher in topology/) into a connected, hosted
actor, with logging configured once. Exit code 0 when the actor stopped, 1 when it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlbus.ops.actor", description="Run one rlbus actor.")
    p.add_argument("--kind", required=True, help="actor kind")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--region", required=True, help="region name")
    p.add_argument("--id", required=True, dest="actor_id", help="actor id")
    p.add_argument("--url", required=True, action="append", help="NATS server URL (repeatable)")
    p.add_argument("--domain", default=None, help="JetStream domain of the region")
    p.add_argument("--role", default=None, help="role whose credentials to use")
    p.add_argument("--credentials", type=Path, default=None, help="credentials.json of the embedded servers")
    p.add_argument("--settings", default="{}", help="JSON object of kind settings")
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--drain-s", type=float, default=10.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import anyio

    from rlbus.actors.base import ActorId, ActorLimits
    from rlbus.actors.host import Endpoint, credentials_from_file, host, open_bus
    from rlbus.actors.kinds import build_actor
    from rlbus.messages.bus import Identity
    from rlbus.messages.errors import RlbusError
    from rlbus.ops.logging import configure_logging

    configure_logging(json=True)
    user = password = None
    if args.credentials is not None:
        user, password = credentials_from_file(args.credentials, args.role or args.kind)
    elif os.environ.get("RLBUS_NATS_USER"):
        user, password = os.environ["RLBUS_NATS_USER"], os.environ.get("RLBUS_NATS_PASSWORD", "")
    ident = ActorId(run=args.run, region=args.region, kind=args.kind, actor_id=args.actor_id)
    limits = ActorLimits(heartbeat_interval_s=args.heartbeat_s, drain_timeout_s=args.drain_s)

    async def _main() -> None:
        endpoint = Endpoint(urls=tuple(args.url), domain=args.domain, user=user, password=password)
        bus = await open_bus(endpoint, run=args.run,
                             identity=Identity(actor_id=args.actor_id, kind=args.kind, region=args.region))
        try:
            actor = build_actor(args.kind, ident, bus, json.loads(args.settings), limits)
            await host(actor)
        finally:
            await bus.close()

    try:
        anyio.run(_main, backend="asyncio")
    except RlbusError as err:
        print(f"rlbus actor {args.kind}/{args.actor_id}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
