"""The actor base: lifecycle states, readiness, heartbeats, events, service discovery and bounded drain.

Owns: `Actor.serve()` — connect-free lifecycle around a concrete actor's `setup()`, `run()` and
`drain()`: starting → ready → busy ⇄ ready → draining → stopped (or failed), a heartbeat every
`heartbeat_interval_s` on the actor's health subject, `started`/`stopped`/`crashed` events, the final
heartbeat, and NATS service discovery (`$SRV.PING/INFO/STATS`) through nats-py's micro framework.
Does not: open the bus connection (the host does) or handle signals (actors/host.py).
"""

from __future__ import annotations

import abc
import enum
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import anyio
import nats.errors
import nats.micro
import structlog
from anyio.abc import TaskStatus
from nats.micro.request import Request

from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Event, EventKind, Heartbeat
from rlbus.messages.subjects import token

log = structlog.get_logger()

SERVICE_VERSION: Final = "0.1.0"


class State(enum.Enum):
    """Lifecycle states of an actor (docs/design.md, "Actors")."""

    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ActorId:
    """Where an actor sits: run, region, kind and its own id (all subject tokens)."""

    run: str
    region: str
    kind: str
    actor_id: str

    def __post_init__(self) -> None:
        for what in ("run", "region", "kind", "actor_id"):
            token(getattr(self, what), what)

    def log_fields(self) -> dict[str, str]:
        return {"run": self.run, "region": self.region, "kind": self.kind, "actor": self.actor_id}


@dataclass(frozen=True, slots=True)
class ActorLimits:
    """Timing of the lifecycle; tests use the small values, a real run the defaults."""

    heartbeat_interval_s: float = 2.0
    drain_timeout_s: float = 10.0


class Actor(abc.ABC):
    """Base of every actor. Subclasses set `kind` and implement `setup`, `run` and maybe `drain`."""

    kind: ClassVar[str]

    def __init__(self, ident: ActorId, bus: Bus, limits: ActorLimits | None = None) -> None:
        self.ident = ident
        self.bus = bus
        self.limits = limits or ActorLimits()
        self.state = State.STARTING
        self.counters: dict[str, int] = {}
        self.gauges: dict[str, float] = {}
        self.policy_version: int | None = None
        self.last_error = ""
        self.restarts = int(os.environ.get("RLBUS_RESTARTS", "0") or 0)

    # ---- what a concrete actor implements -------------------------------------------------------
    @abc.abstractmethod
    async def setup(self) -> None:
        """Prepare (bind consumers, load weights). Raising here means the actor never becomes ready."""

    @abc.abstractmethod
    async def run(self) -> None:
        """The actor's work; returns when done, is cancelled on shutdown."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Finish or hand back in-flight work (nak, flush). Runs shielded, bounded by `drain_timeout_s`."""

    def started_data(self) -> dict[str, str]:
        """Extra `data` of this actor's `started` event (the trainer records its settings there for replay)."""
        return {}

    # ---- helpers for subclasses -----------------------------------------------------------------
    def count(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the actor busy for the duration of one unit of work."""
        if self.state is State.READY:
            self.state = State.BUSY
        try:
            yield
        finally:
            if self.state is State.BUSY:
                self.state = State.READY

    async def emit(self, event: EventKind, detail: str = "", **data: str) -> None:
        """Publish an Event stamped with this actor's identity."""
        await self.bus.event(Event(event=event, actor_id=self.ident.actor_id, actor_kind=self.ident.kind,
                                   region=self.ident.region, detail=detail, data=data))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(actor_id=self.ident.actor_id, actor_kind=self.ident.kind, region=self.ident.region,
                         state=self.state.value, run=self.ident.run, policy_version=self.policy_version,
                         counters=dict(self.counters), gauges=dict(self.gauges), restarts=self.restarts,
                         last_error=self.last_error, pid=os.getpid())

    # ---- lifecycle ------------------------------------------------------------------------------
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the whole lifecycle. Reports readiness through `task_status` once `setup()` succeeded."""
        with structlog.contextvars.bound_contextvars(**self.ident.log_fields()):
            async with anyio.create_task_group() as tg:
                try:
                    await self.setup()
                except BaseException as err:
                    self.state = State.FAILED
                    self.last_error = repr(err)[:500]
                    with anyio.move_on_after(2.0, shield=True):
                        await self._publish_heartbeat()
                        await self.emit("crashed", detail=f"setup failed: {self.last_error}")
                    raise
                service = await self._start_service()
                tg.start_soon(self._heartbeat_loop)
                self.state = State.READY
                log.info("actor_ready")
                task_status.started()
                await self.emit("started", **{**self.started_data(), "pid": str(os.getpid())})
                try:
                    await self.run()
                except anyio.get_cancelled_exc_class():
                    raise
                except BaseException as err:
                    self.state = State.FAILED
                    self.last_error = repr(err)[:500]
                    log.exception("actor_failed")
                    raise
                finally:
                    await self._finish(service)
                    tg.cancel_scope.cancel()

    async def _finish(self, service: nats.micro.service.Service | None) -> None:
        if self.state is not State.FAILED:
            self.state = State.DRAINING
            with anyio.move_on_after(1.0, shield=True):
                await self._publish_heartbeat()
            with anyio.move_on_after(self.limits.drain_timeout_s, shield=True):
                try:
                    await self.drain()
                except Exception as err:
                    self.state = State.FAILED
                    self.last_error = f"drain: {err!r}"[:500]
                    log.exception("actor_drain_failed")
            if self.state is State.DRAINING:
                self.state = State.STOPPED
        with anyio.move_on_after(2.0, shield=True):
            await self._publish_heartbeat()
            if self.state is State.FAILED:
                await self.emit("crashed", detail=self.last_error)
            else:
                await self.emit("stopped")
            if service is not None:
                await service.stop()
        log.info("actor_finished", state=self.state.value)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._publish_heartbeat()
            await anyio.sleep(self.limits.heartbeat_interval_s)

    async def _publish_heartbeat(self) -> None:
        subject = self.bus.subjects.health(self.ident.region, self.ident.kind, self.ident.actor_id)
        try:
            await self.bus.publish_core(subject, self.heartbeat())
        except (nats.errors.Error, OSError) as err:
            log.warning("heartbeat_not_sent", error=repr(err))

    async def _start_service(self) -> nats.micro.service.Service | None:
        """Answer `$SRV.PING/INFO/STATS` as `rlbus-<kind>`, plus a `status` endpoint with the heartbeat."""

        async def status(request: Request) -> None:
            await request.respond(json.dumps(_builtins(self.heartbeat())).encode())

        try:
            service = await nats.micro.add_service(
                self.bus.nc, name=f"rlbus-{self.ident.kind}", version=SERVICE_VERSION,
                description=f"rlbus {self.ident.kind} actor",
                metadata={**self.ident.log_fields(), "pid": str(os.getpid())},
            )
            await service.add_endpoint(name="status", handler=status,
                                       subject=self.bus.subjects.service_status(self.ident.kind, self.ident.actor_id))
        except (nats.errors.Error, ValueError) as err:
            log.warning("service_discovery_unavailable", error=repr(err))
            return None
        return service


def _builtins(heartbeat: Heartbeat) -> Any:
    import msgspec

    return msgspec.to_builtins(heartbeat)


