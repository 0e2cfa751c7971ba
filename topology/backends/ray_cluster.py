"""The `ray` launch backend: one Ray actor per actor instance, placed by `region:<name>` resources.

- Owns: `RayBackend` (joining or starting a Ray cluster, one Ray actor per `ProcessSpec`, Ray's restarts made
  visible as events, restart groups, a graceful stop) and `RayActorHost` (the rlbus actor on the Ray actor's
  event loop).
- Guarantee: `import ray` happens inside functions only (it is heavy).
- Does not: decide which actors exist (`rlbus up`) or talk to actors (they use the bus).
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import redirect_stderr
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any, Final

import anyio
import structlog

from rlbus.actors.base import State
from rlbus.actors.process import build_parser, serve_actor
from rlbus.messages.errors import ActorFailed, TopologyError
from rlbus.topology.backends.local import (
    RENDEZVOUS_ENV,
    EventSink,
    ProcessSpec,
    RestartPolicy,
    free_rendezvous,
    send_event,
)

log = structlog.get_logger()

RAY_ENV: Final = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
"""Set (unless already set) for the driver and so for every Ray process it starts."""
MIN_OBJECT_STORE_BYTES: Final = 75 * 2**20
"""Ray refuses a smaller object store."""
REGION_CAPACITY: Final = 100.0
"""Units of each `region:<name>` resource a locally started cluster declares."""
ACTOR_SHARE: Final = 0.001
"""Units of its region resource one actor asks for: placement only, never a limit."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one incarnation of a Ray actor runs, as the actor itself reports it."""

    pid: int
    node_id: str
    node_ip: str
    incarnation: str
    """Random per incarnation: a restarted Ray actor reports a new one."""


class RayActorHost:
    """The body of one Ray actor: hosts one rlbus actor on the Ray actor's (asyncio) event loop.

    Ray runs async actor methods on a thread that is not the main one, so OS signals cannot reach the
    actor: `stop()` cancels it instead, which is the same drain as SIGTERM in the local backend.
    """

    def __init__(self, env: Mapping[str, str], worker_setup: Callable[[], None] | None = None) -> None:
        os.environ.update(env)
        if worker_setup is not None:
            worker_setup()
        self.incarnation = uuid.uuid4().hex
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._final: State | None = None
        self._stop_requested = False

    async def describe(self) -> Placement:
        """Pid, Ray node and incarnation of this Ray actor."""
        import ray

        return Placement(pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(),
                         node_ip=ray.util.get_node_ip_address(), incarnation=self.incarnation)

    async def rendezvous(self) -> str:
        """`host:port` on this actor's node with a port free now: where its group meets (rank 0's host)."""
        import ray

        return free_rendezvous(ray.util.get_node_ip_address())

    async def serve(self, argv: Sequence[str], restarts: int, env: Mapping[str, str] | None = None) -> str:
        """Run the actor of `argv` (`actors/process.py` arguments) until it ends or `stop()`; returns
        its final state's value. A later call in the same incarnation waits for the first one. `env` is set
        first (a group's rendezvous)."""
        os.environ.update(env or {})
        if self._done is not None:
            await self._done.wait()
            return (self._final or State.FAILED).value
        if self._stop_requested:
            return State.STOPPED.value
        self._done = anyio.Event()
        self._scope = anyio.CancelScope()
        os.environ["RLBUS_RESTARTS"] = str(restarts)
        try:
            self._final = await serve_until_cancelled(build_parser().parse_args(list(argv)), self._scope)
        except Exception as err:   # connecting or building failed: report, let the driver restart us
            log.error("ray_actor_serve_failed", error=repr(err))
            self._final = State.FAILED
        finally:
            self._done.set()
        return self._final.value

    async def stop(self) -> str | None:
        """Cancel the actor (it drains and sends its final heartbeat); returns its final state's value."""
        self._stop_requested = True
        if self._scope is None or self._done is None:
            return None
        self._scope.cancel()
        await self._done.wait()
        return self._final.value if self._final is not None else None


async def serve_until_cancelled(args: argparse.Namespace, scope: anyio.CancelScope) -> State:
    """Serve the actor (actors/process.py, without OS signal handlers: Ray runs this off the main
    thread) until it ends or `scope` is cancelled; a cancelled actor drains and sends its final heartbeat."""
    with scope:
        try:
            return await serve_actor(args, signals=False)
        except ActorFailed as err:       # the actor already reported it (failed heartbeat, crashed event)
            log.error("actor_crashed", error=repr(err))
            return State.FAILED
        except Exception as err:         # connecting or building it failed (bad settings): report as failed
            log.error("actor_not_started", error=repr(err))
            return State.FAILED
    return State.STOPPED


@dataclass(slots=True)
class RayEntry:
    """The live record of one Ray actor."""

    spec: ProcessSpec
    handle: Any = None
    placement: Placement | None = None
    restarts: int = 0
    state: str = "starting"
    """starting | running | restarting | failed | stopped | exited"""


class RayBackend:
    """Runs one Ray actor per spec and follows Ray's restarts until cancelled; then stops them all.

    It joins a Ray cluster (`address`) or starts a local one with one custom resource per region, creates one
    Ray actor per `ProcessSpec` (`resources={spec.resource: 0.001}`, `num_cpus=0`, Ray's `max_restarts` from
    the restart policy), hosting the rlbus actor on the Ray actor's event loop, makes Ray's restarts visible
    (`crashed`, then `restarted` once the new incarnation answers, or `failed` when Ray gives up), and stops
    gracefully: the Ray actor's `stop()` cancels the actor, which drains and sends its final heartbeat, then
    the Ray actor is killed. A restart group (a trainer's ranks, `ProcessSpec.group`) is placed by one
    placement group (a bundle per rank, `region:` resources, spread over nodes), meets at a fresh rendezvous
    on rank 0's node for every start, and lives and dies together: one member ending kills the others, and
    all restart.
    """

    def __init__(self, specs: Sequence[ProcessSpec], *, policy: RestartPolicy, address: str | None = None,
                 num_cpus: int | None = None, on_event: EventSink | None = None, drain_timeout_s: float = 15.0,
                 object_store_bytes: int = 128 * 2**20, temp_dir: Path | None = None,
                 node_ip_address: str | None = None, worker_setup: Callable[[], None] | None = None) -> None:
        """`address`: the cluster to join (`"auto"`, `"host:port"`, `"ray://..."`); None starts a local
        cluster with `num_cpus` CPUs and `REGION_CAPACITY` of every spec's region resource, unless this
        process is already connected to Ray (then that connection is used and left open).
        `node_ip_address`: this machine's address as the cluster knows it (a node on 127.0.0.x).
        `worker_setup`: called in every Ray actor before the rlbus actor starts (e.g. logging setup);
        it must pickle (a module-level function or a `functools.partial` of one).

        :raises TopologyError: a spec's arguments do not parse or it has no Ray resource.
        """
        for spec in specs:
            _check_spec(spec)
        self.actors = {spec.actor_id: RayEntry(spec) for spec in specs}
        self.policy = policy
        self.address = address
        self.num_cpus = num_cpus
        self.on_event = on_event
        self.drain_timeout_s = drain_timeout_s
        self.object_store_bytes = max(MIN_OBJECT_STORE_BYTES, object_store_bytes)
        self.temp_dir = temp_dir
        self.node_ip_address = node_ip_address
        self.worker_setup = worker_setup
        self._owns_ray = False
        self._stopping = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every Ray actor, follow them until cancelled, then stop all of them (shielded, bounded)."""
        try:
            # ray's first import parses Python (ast.parse): do it on this (the event loop's) thread, not in the
            # worker that connects (CPython 3.11 keeps the parser's recursion depth in process-global state,
            # gh-106905; two threads parsing at once fail with "AST constructor recursion depth mismatch").
            import ray  # noqa: F401

            await anyio.to_thread.run_sync(self._connect)
            actor_class = _actor_class()
            async with anyio.create_task_group() as tg:
                for entry in self.actors.values():
                    if not entry.spec.group:
                        self._create(entry, actor_class)
                task_status.started()
                for entry in self.actors.values():
                    if not entry.spec.group:
                        tg.start_soon(self._supervise, entry)
                groups: dict[str, list[RayEntry]] = {}
                for entry in self.actors.values():
                    if entry.spec.group:
                        groups.setdefault(entry.spec.group, []).append(entry)
                for members in groups.values():
                    tg.start_soon(self._supervise_group, members, actor_class)
        finally:
            with anyio.CancelScope(shield=True):
                await self.stop()

    def _connect(self) -> None:
        import ray

        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        if ray.is_initialized():
            log.info("ray_connection_reused")
            return
        common: dict[str, Any] = {"log_to_driver": False}
        if self.node_ip_address is not None:
            common["_node_ip_address"] = self.node_ip_address
        try:
            if self.address is not None:
                ray.init(address=self.address, **common)
            else:
                regions = sorted({e.spec.resource for e in self.actors.values()})
                ray.init(num_cpus=self.num_cpus, include_dashboard=False,
                         object_store_memory=self.object_store_bytes, resources=dict.fromkeys(regions, REGION_CAPACITY),
                         _temp_dir=str(self.temp_dir) if self.temp_dir is not None else None, **common)
        except Exception as err:   # Ray raises ConnectionError, RuntimeError, ValueError, ...
            where = f"join the Ray cluster at {self.address!r} ([launch] ray_address)" if self.address is not None \
                else "start a local Ray cluster"
            raise TopologyError(f"ray backend: cannot {where}: {err}") from err
        self._owns_ray = True
        have = ray.cluster_resources()
        for resource in sorted({e.spec.resource for e in self.actors.values()} - set(have)):
            log.warning("ray_resource_missing", resource=resource,
                        hint="no node declares it yet; its actors wait until one does")
        log.info("ray_connected", address=self.address or "local", resources=sorted(have))

    def _create(self, entry: RayEntry, actor_class: Any, placement: Any = None) -> None:
        spec = entry.spec
        entry.handle = actor_class.options(
            num_cpus=0, resources={spec.resource: ACTOR_SHARE}, max_restarts=self.policy.max_restarts,
            max_task_retries=0, max_concurrency=8, scheduling_strategy=placement,
        ).remote(dict(spec.env), self.worker_setup)
        entry.state = "running"
        log.info("ray_actor_created", actor=spec.actor_id, kind=spec.kind, resource=spec.resource)

    async def _supervise(self, entry: RayEntry) -> None:
        import ray

        placement = await self._placement(entry)
        if placement is None:
            await self._fail(entry, "the Ray actor died before it started")
            return
        await self._emit("started", entry, _where(placement))
        restarted = ""   # the detail of a restart to announce once the new incarnation serves
        while True:
            ref = entry.handle.serve.remote(list(entry.spec.args), entry.restarts)
            if restarted:
                await self._emit("restarted", entry, restarted)
                restarted = ""
            try:
                final = await ref
            except ray.exceptions.RayActorError as err:
                how = f"Ray actor died ({type(err).__name__})"
            else:
                if self._stopping:
                    return
                if final != State.FAILED.value:
                    entry.state = "exited"
                    log.info("ray_actor_exited", actor=entry.spec.actor_id, state=final)
                    return
                how = "the actor failed"
                ray.kill(entry.handle, no_restart=False)   # a fresh worker, counted by Ray's max_restarts
            if self._stopping:
                return
            log.warning("ray_actor_crashed", actor=entry.spec.actor_id, how=how)
            await self._emit("crashed", entry, how)
            entry.state = "restarting"
            old = entry.placement
            placement = await self._placement(entry)
            if placement is None:
                await self._fail(entry, f"{how}; Ray gave up after {entry.restarts} restarts "
                                        f"(max_restarts {self.policy.max_restarts})")
                return
            if old is not None and placement.incarnation == old.incarnation:
                log.warning("ray_actor_unreachable_but_alive", actor=entry.spec.actor_id)
                entry.state = "running"
                continue   # serve() joins the one still running
            entry.restarts += 1
            await anyio.sleep(self.policy.delay(entry.restarts))
            if self._stopping:
                return
            entry.state = "running"
            restarted = f"{how}; restart {entry.restarts}, {_where(placement)}"
            log.info("ray_actor_restarted", actor=entry.spec.actor_id, restarts=entry.restarts,
                     pid=placement.pid, node_ip=placement.node_ip)

    async def _supervise_group(self, members: list[RayEntry], actor_class: Any) -> None:
        """Place a restart group with one placement group, start it on a fresh rendezvous, and when any member
        ends, kill the rest and start them all again (Ray restarts each; the count is the first member's)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lead = members[0]
        group = placement_group([{m.spec.resource: ACTOR_SHARE} for m in members], strategy="SPREAD",
                                name=f"rlbus-{lead.spec.group}-{uuid.uuid4().hex[:6]}")
        await group.ready()
        for k, entry in enumerate(members):
            self._create(entry, actor_class, PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=k))
        for entry in members:
            placement = await self._placement(entry)
            if placement is None:
                await self._fail(entry, "the Ray actor died before it started")
                return
            await self._emit("started", entry, _where(placement))
        restarted = ""
        while True:
            rendezvous = await lead.handle.rendezvous.remote()
            refs = [m.handle.serve.remote(list(m.spec.args), m.restarts, {RENDEZVOUS_ENV: rendezvous})
                    for m in members]
            if restarted:
                for entry in members:
                    await self._emit("restarted", entry, restarted)
            ended, how = await _first_to_end(members, refs)
            if self._stopping:
                return
            if ended is lead and how == "":
                for entry in members:
                    entry.state = "exited"
                log.info("ray_group_exited", group=lead.spec.group)
                return
            how = how or "the actor ended"
            log.warning("ray_actor_crashed", actor=ended.spec.actor_id, how=how, group=lead.spec.group)
            await self._emit("crashed", ended, how)
            for entry in members:                 # a fresh worker each, counted by Ray's max_restarts
                entry.state = "restarting"
                try:
                    ray.kill(entry.handle, no_restart=False)
                except Exception as err:          # already dead: Ray restarts it anyway
                    log.info("ray_actor_kill_skipped", actor=entry.spec.actor_id, error=repr(err))
            for entry in members:
                old = entry.placement
                placement = await self._placement(entry)
                if placement is None:
                    for member in members:
                        await self._fail(member, f"{how} in group {lead.spec.group}; Ray gave up after "
                                                 f"{entry.restarts} restarts (max_restarts {self.policy.max_restarts})")
                    return
                for _ in range(150):               # not restarted yet (ray.kill is asynchronous): wait for it
                    if placement is None or old is None or placement.incarnation != old.incarnation:
                        break
                    await anyio.sleep(0.2)
                    placement = await self._placement(entry)
                entry.restarts += 1
            await anyio.sleep(self.policy.delay(lead.restarts))
            if self._stopping:
                return
            for entry in members:
                entry.state = "running"
            restarted = f"{how} ({ended.spec.actor_id}); group restart {lead.restarts}"

    async def _placement(self, entry: RayEntry) -> Placement | None:
        """The placement of the live incarnation, waiting while Ray (re)creates it; None once it is dead."""
        import ray

        while True:
            try:
                with anyio.fail_after(30):
                    placement: Placement = await entry.handle.describe.remote()
            except ray.exceptions.ActorDiedError:
                return None
            except (ray.exceptions.RayActorError, TimeoutError) as err:   # restarting or unreachable
                log.info("ray_actor_waiting", actor=entry.spec.actor_id, why=type(err).__name__)
                await anyio.sleep(0.5)
                continue
            entry.placement = placement
            return placement

    async def _fail(self, entry: RayEntry, detail: str) -> None:
        entry.state = "failed"
        log.error("ray_actor_failed", actor=entry.spec.actor_id, detail=detail)
        await self._emit("failed", entry, detail)

    async def _emit(self, kind: str, entry: RayEntry, detail: str) -> None:
        await send_event(self.on_event, kind, entry.spec, detail)

    async def stop(self) -> None:
        """Ask every Ray actor to stop (drain, final heartbeat) within the drain timeout, kill them all,
        and shut down the local Ray cluster if this backend started it."""
        self._stopping = True
        live = [e for e in self.actors.values() if e.handle is not None and e.state not in ("failed", "stopped")]

        async def stop_one(entry: RayEntry) -> None:
            try:
                await entry.handle.stop.remote()
            except Exception as err:   # dead or restarting: it is killed below either way
                log.info("ray_actor_stop_skipped", actor=entry.spec.actor_id, error=type(err).__name__)

        with anyio.move_on_after(self.drain_timeout_s) as scope:
            async with anyio.create_task_group() as tg:
                for entry in live:
                    tg.start_soon(stop_one, entry)
        if scope.cancelled_caught:
            log.warning("ray_actor_drain_timeout", actors=[e.spec.actor_id for e in live])
        await anyio.to_thread.run_sync(self._kill_all)

    def _kill_all(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for entry in self.actors.values():
            if entry.handle is not None:
                try:
                    ray.kill(entry.handle, no_restart=True)
                except Exception as err:   # already dead
                    log.info("ray_actor_kill_skipped", actor=entry.spec.actor_id, error=repr(err))
            if entry.state not in ("failed", "exited"):
                entry.state = "stopped"
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def placements(self) -> dict[str, Placement]:
        """The last known placement of every started Ray actor, by actor id."""
        return {a: e.placement for a, e in self.actors.items() if e.placement is not None}


async def _first_to_end(members: list[RayEntry], refs: list[Any]) -> tuple[RayEntry, str]:
    """The first member whose `serve` call returned or raised, with how it ended ("" for a clean stop)."""
    import ray

    done: list[tuple[RayEntry, str]] = []
    finished = anyio.Event()

    async def wait(entry: RayEntry, ref: Any) -> None:
        try:
            final = await ref
            how = "" if final != State.FAILED.value else "the actor failed"
        except ray.exceptions.RayActorError as err:
            how = f"Ray actor died ({type(err).__name__})"
        done.append((entry, how))
        finished.set()

    async with anyio.create_task_group() as tg:
        for entry, ref in zip(members, refs, strict=True):
            tg.start_soon(wait, entry, ref)
        await finished.wait()
        tg.cancel_scope.cancel()
    return done[0]


def _check_spec(spec: ProcessSpec) -> None:
    if not spec.resource:
        raise TopologyError(f"actor {spec.actor_id}: the ray backend needs a Ray resource (region:<name>)")
    errors = StringIO()
    try:
        with redirect_stderr(errors):
            build_parser().parse_args(list(spec.args))
    except SystemExit:
        raise TopologyError(f"actor {spec.actor_id}: bad actor arguments {list(spec.args)}: "
                            f"{errors.getvalue().strip()}") from None


def _where(placement: Placement) -> str:
    return f"pid {placement.pid} on {placement.node_ip} (node {placement.node_id[:12]})"


def _actor_class() -> Any:
    import ray

    return ray.remote(RayActorHost)
