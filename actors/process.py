"""Running one actor instance from command-line style arguments: the body of every actor process.

Owns: `build_parser()` and `run_actor(argv)`: parse, read the role's credentials, connect, build the
actor of the requested kind, host it until it stops. Used by the `python -m rlbus.ops.actor` entry
(local backend) and by the Ray backend's actor wrapper. Does not: configure logging (the entry does).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from rlbus.actors.base import ActorId, ActorLimits, State
from rlbus.actors.host import Endpoint, credentials_from_file, host, open_bus
from rlbus.actors.kinds import build_actor
from rlbus.messages.bus import Identity
from rlbus.messages.errors import TopologyError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlbus.ops.actor", description="Run one rlbus actor.")
    p.add_argument("--kind", required=True, help="actor kind")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--region", required=True, help="region name")
    p.add_argument("--id", required=True, dest="actor_id", help="actor id")
    p.add_argument("--url", required=True, action="append", help="NATS server URL (repeatable)")
    p.add_argument("--domain", default=None, help="JetStream domain of the region")
    p.add_argument("--role", default=None, help="role whose credentials to use (default: the kind)")
    p.add_argument("--credentials", type=Path, default=None,
                   help="credentials.json of the embedded servers (else RLBUS_NATS_USER/RLBUS_NATS_PASSWORD)")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM file of the CA to trust: connect over TLS (topology [tls])")
    p.add_argument("--settings", default="{}", help="JSON object of the kind's topology section")
    p.add_argument("--launch", default=None,
                   help="JSON object of what the launcher passes beside the settings (the kind's *Launch)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval")
    p.add_argument("--drain-s", type=float, default=10.0, help="drain time limit after SIGTERM")
    return p


def parse_settings(text: str, what: str = "settings") -> dict[str, Any]:
    """The `--settings` (or `--launch`) JSON object; `TopologyError` naming the problem otherwise."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise TopologyError(f"actor {what} are not JSON ({err}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise TopologyError(f"actor {what} must be a JSON object, got {text[:200]!r}")
    return value


async def serve_actor(args: argparse.Namespace, *, signals: bool = True) -> State:
    """Connect as the role and host the actor until it stops; returns its final state.
    `signals=False`: no OS signal handlers (off the main thread); cancel the caller's scope to stop.

    :raises ActorFailed: when the actor failed.
    """
    user = password = None
    if args.credentials is not None:
        user, password = credentials_from_file(args.credentials, args.role or args.kind)
    elif os.environ.get("RLBUS_NATS_USER"):
        user, password = os.environ["RLBUS_NATS_USER"], os.environ.get("RLBUS_NATS_PASSWORD", "")
    ident = ActorId(run=args.run, region=args.region, kind=args.kind, actor_id=args.actor_id)
    limits = ActorLimits(heartbeat_interval_s=args.heartbeat_s, drain_timeout_s=args.drain_s)
    endpoint = Endpoint(urls=tuple(args.url), domain=args.domain, user=user, password=password,
                        role=args.role, tls_ca=args.tls_ca)     # no --role: the inbox is named after the user
    bus = await open_bus(endpoint, run=args.run,
                         identity=Identity(actor_id=args.actor_id, kind=args.kind, region=args.region))
    try:
        launch = None if args.launch is None else parse_settings(args.launch, "launch values")
        actor = build_actor(args.kind, ident, bus, parse_settings(args.settings), limits, launch)
        return await host(actor, signals=signals)
    finally:
        await bus.close()


def run_actor(argv: Sequence[str]) -> State:
    """Parse `argv` and run the actor to completion on a fresh event loop (blocking)."""
    args = build_parser().parse_args(list(argv))
    return anyio.run(serve_actor, args, backend="asyncio")
