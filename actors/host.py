"""Hosting an actor in a process: SIGTERM/SIGINT become cancellation, which becomes a bounded drain.

Owns: `host(actor)` (signal → cancel → drain → final heartbeat) and `open_bus(...)` for an actor's
connection with its role's credentials. Does not: choose which actor to build (actors/kinds.py) or
supervise restarts (topology/).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from rlbus.actors.base import Actor, State
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.errors import ActorFailed, RlbusError

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How an actor reaches its region's bus."""

    urls: tuple[str, ...]
    domain: str | None = None
    user: str | None = None
    password: str | None = None
    role: str | None = None
    """The role connected as (names the connection's private reply inbox, `_INBOX.<role>.<random>`)."""
    tls_ca: Path | None = None
    """CA to trust for TLS (topology `[tls]`); None: plaintext unless a URL is `tls://`."""


def credentials_from_file(path: Path, role: str) -> tuple[str, str]:
    """Read (user, password) of `role` from a credentials.json written by topology/network/servers.py."""
    try:
        table = json.loads(path.read_text())
        entry = table[role]
        return str(entry["user"]), str(entry["password"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RlbusError(f"{path}: no usable credentials for role {role!r} ({err!r}); "
                         f"expected {{\"{role}\": {{\"user\": ..., \"password\": ...}}}}") from None


async def open_bus(endpoint: Endpoint, *, run: str, identity: Identity) -> Bus:
    """Connect an actor to its region's server as its role."""
    options = ConnectOptions(user=endpoint.user, password=endpoint.password, role=endpoint.role,
                             tls_ca_file=None if endpoint.tls_ca is None else str(endpoint.tls_ca))
    return await Bus.connect(list(endpoint.urls), run=run, identity=identity, domain=endpoint.domain,
                             options=options)


async def host(actor: Actor, *, signals: bool = True) -> State:
    """Serve `actor` until it returns, fails, is cancelled, or (with `signals`) the process gets
    SIGTERM/SIGINT; returns the final state. `signals=False` where signal handlers cannot be installed
    (off the main thread, e.g. inside a Ray actor): cancel the caller's scope instead.

    :raises ActorFailed: when the actor ended in the FAILED state.
    """
    async with anyio.create_task_group() as tg:
        if signals:
            tg.start_soon(_cancel_on_signal, tg.cancel_scope)
        try:
            await actor.serve()
        except* Exception as group:
            log.error("actor_crashed", errors=[repr(e) for e in group.exceptions])
        tg.cancel_scope.cancel()
    if actor.state is State.FAILED:
        raise ActorFailed(f"{actor.ident.kind} {actor.ident.actor_id} failed: {actor.last_error}")
    return actor.state


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal_received", signal=signal.Signals(signum).name, pid=os.getpid())
            scope.cancel()
            return
