"""Running a chaos run: a whole embedded topology under a seeded schedule of faults, then its accounting.

- Owns: `chaos_topology()` (the default topology), `prepare_state_dir`, and `ChaosRun`: launch, inject the
  planned faults (ops/chaos/plan.py), a quiet period, a graceful drain, and the result (the ledger,
  restarts, recovery times; with `agentic` the sessions and restored workspaces, ops/chaos/agentic.py).
- Does not: print tables (ops/chaos/report.py) or parse the command line (ops/chaos/cli.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, Final

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlbus.actors.common.ledger import Ledger, final_lineage, read_all, read_ledger
from rlbus.messages.bus import Bus
from rlbus.messages.errors import RlbusError
from rlbus.messages.schemas import Event, Heartbeat, Rollout, TrainStep
from rlbus.ops.chaos.agentic import (
    SESSION_LEASE_S,
    agentic_verdict,
    open_sessions,
    restore_checks,
    session_roots_left,
)
from rlbus.ops.chaos.plan import (
    ChaosSettings,
    Fault,
    FaultRecord,
    pick_victim,
    plan_faults,
    recovery_after,
    summarize,
)
from rlbus.topology.backends.launch import PRETRAINED_DIR, Launch, read_fed_tasks
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load
from rlbus.topology.file.schema import RestartSettings, Topology

log = structlog.get_logger()

Say = Callable[[str], None]
RUN_STATE: Final = ("nats", "checkpoints", "logs", "plots", "run.json", "chaos.json")
"""What a chaos run clears from its state directory before it starts (the pretrained policy stays)."""
RESULT_NAME: Final = "chaos.json"
_API_ERRORS: Final = (nats.errors.Error, nats.js.errors.Error, TimeoutError)
_CUT_MODES: Final = {"partition": "close", "link_drop": "drop", "link_down": "down"}
"""How each partition kind cuts (topology/network/regions.py `RegionSet.cut`)."""
_CUT_WORDS: Final = {"close": "relay connections closed", "drop": "every packet dropped", "down": "link down"}


CHAOS_REDELIVER_AFTER: Final = "20s"
"""`[durability] redeliver_after` of the default chaos topology: longer than a leaf server's outage plus a
holder's renewal interval (8 s + 20/3 s by default), so a live holder keeps its work; short enough that the
quiet period after the last kill is not a minute of waiting."""


def chaos_topology() -> Topology:
    """The default of `rlbus chaos`: `three_regions` (hub + eu + us, every actor kind) with `tiny`'s small
    batches and limits (staleness bound 4 versions), a 10-step tiny pretraining, rare evaluations, and room for
    10 restarts a minute; what a killed actor held comes back after `CHAOS_REDELIVER_AFTER`."""
    three, tiny = load(example_path("three_regions")), load(example_path("tiny"))
    replace = msgspec.structs.replace
    return replace(
        three, run="chaos", feeder=replace(three.feeder, backlog_per_region=8), generator=tiny.generator,
        trainer=replace(tiny.trainer, staleness_versions=4), checkpoint=tiny.checkpoint, sandbox=tiny.sandbox, weights=tiny.weights,
        evaluator=replace(tiny.evaluator, every_versions=20), pretrain=replace(tiny.pretrain, steps=10, eval_n=4),
        restart=RestartSettings(max_restarts=10, window_s=60.0, backoff_initial_s=0.2, backoff_max_s=2.0),
        durability=replace(three.durability, redeliver_after=CHAOS_REDELIVER_AFTER))


def prepare_state_dir(state: Path) -> None:
    """Clear a previous run's servers, checkpoints and logs from `state` (keeping `pretrained/`)."""
    for name in RUN_STATE:
        path = state / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    state.mkdir(parents=True, exist_ok=True)


def ensure_pretrained(topology: Topology, state: Path, say: Say) -> None:
    """Pretrain into `<state>/pretrained/` with the topology's `[pretrain]` unless a policy is there."""
    from rlbus.model.training.pretrain import PretrainConfig, pretrain

    out = state / PRETRAINED_DIR
    if (out / "pretrain.pt").exists():
        return
    settings = topology.pretrain
    overrides = {"eval_n": settings.eval_n} if settings.eval_n is not None else {}
    config = PretrainConfig.preset(settings.preset, **overrides)
    if settings.max_seq_len is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=settings.max_seq_len))
    say(f"chaos: pretraining the policy ({settings.preset}, {settings.steps or config.steps} steps) into {out}")
    result = pretrain(config, settings.steps, settings.seed, out, settings.threads)
    say(f"chaos: pretrained in {result.wall_s:.0f}s")


class ChaosRun:
    """One chaos run of `topology` in `state`; `await run()` returns the result dict (ops/chaos/report.py).

    Launch (local backend, leaves behind cuttable relays), watch heartbeats and the hub's rollout arrivals,
    wait for the first optimizer step, inject the planned faults (ops/chaos/plan.py) — SIGKILL actors,
    SIGKILL a leaf nats-server then restart it on its store dir, cut a leaf's link (behind shaped links also
    by dropping all its packets or taking it down, and degrade it), SIGSTOP/SIGCONT actors (of `kill_kinds`,
    or of every kind) — then the quiet period (the feeder is stopped; wait until every task is done, every
    rollout has reached the hub and the trainer has consumed what it can; with `agentic`, also until the
    sandboxes' sessions are closed), a graceful drain, and the result: the ledger, restarts, recovery times;
    with `agentic` the sessions and restored workspaces too (ops/chaos/agentic.py).
    """

    def __init__(self, topology: Topology, state: Path, settings: ChaosSettings, *, settle_s: float = 300.0,
                 warmup_s: float = 300.0, say: Say = lambda _: None, kill_kinds: Sequence[str] | None = None,
                 agentic: bool = False) -> None:
        self.topology = topology
        self.kill_kinds = None if kill_kinds is None else sorted(kill_kinds)
        """Actor kinds the kills and pauses hit (None: every kind the topology runs)."""
        self.agentic = agentic
        """Account for sandbox sessions and restored workspaces too (ops/chaos/agentic.py)."""
        self.gauges: dict[str, dict[str, float]] = {}
        """Actor id → the gauges of its last heartbeat."""
        self.kinds: dict[str, str] = {}
        """Actor id → its kind, from its heartbeats."""
        self._beat = anyio.Event()
        """Set by the next heartbeat."""
        self.opened: dict[tuple[str, int], int] = {}
        """(sandbox actor id, pid) → sessions that process opened, by its last heartbeat."""
        self.state = state
        self.settings = settings
        self.settle_s = settle_s
        self.warmup_s = warmup_s
        self.say = say
        self.beats: dict[str, list[tuple[float, int]]] = defaultdict(list)
        """Actor id → (monotonic arrival, pid) of every heartbeat seen at the hub."""
        self.flow: dict[str, list[float]] = defaultdict(list)
        """Region → monotonic arrival of each of its rollouts in the hub's ROLLOUTS."""
        self.trainer_steps = 0
        self.records: list[FaultRecord] = []
        self.skipped: list[str] = []
        self.down: set[str] = set()
        """Regions whose server is killed or whose link is cut right now (their actors are not hit)."""
        self.paused: set[str] = set()
        self.t0 = 0.0
        self.timeline: dict[str, float] = {}
        self._trainers = {i.actor_id for i in topology.instances() if i.kind == "trainer"}
        self._generating = {i.region for i in topology.instances() if i.kind == "generator"}
        self.warm = anyio.Event()

    # ---- the whole run ----------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        started = time.monotonic()
        leaves = [r.name for r in self.topology.regions if r.role == "leaf"]
        kinds = self.kill_kinds or sorted({i.kind for i in self.topology.instances()} |
                                          ({"trainer_rank"} if self.topology.trainer.world_size > 1 else set()))
        plan = plan_faults(self.settings, kinds, leaves)
        async with Launch.open(self.topology, state_dir=self.state, relay=True) as launch:
            self.say(f"chaos: bus ready ({', '.join(f'{r}={u[0]}' for r, u in launch.endpoints.urls.items())}); "
                     f"state in {launch.state_dir}")
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_beats, launch.admin)
                tg.start_soon(self._watch_flow, launch.admin)
                actors = anyio.CancelScope()
                drained = anyio.Event()
                await tg.start(self._run_actors, launch, actors, drained)
                caught_up = False
                try:
                    await self._warm_up()
                    await self._inject(launch, plan)
                    caught_up = await self._settle(launch)
                    if self.agentic:
                        await self._sessions_closed()
                finally:
                    actors.cancel()                      # SIGTERM every actor: a graceful drain
                    with anyio.CancelScope(shield=True), anyio.move_on_after(60):
                        await drained.wait()
                self.timeline["drained"] = time.monotonic() - started
                self.say(f"chaos: actors drained ({self.timeline['drained']:.0f}s); reading the ledger")
                result = await self._account(launch, caught_up)
                tg.cancel_scope.cancel()
        result["wall_s"] = round(time.monotonic() - started, 1)
        return result

    async def _run_actors(self, launch: Launch, scope: anyio.CancelScope, drained: anyio.Event, *,
                          task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await launch.run_actors(backend="local", heartbeat_s=1.0, task_status=task_status)
        finally:
            drained.set()

    # ---- watching ---------------------------------------------------------------------------------
    async def _watch_beats(self, bus: Bus) -> None:
        """Record every heartbeat's arrival and pid; follow the trainer's step counter."""
        async with aclosing(bus.follow(bus.subjects.all_health(), Heartbeat)) as beats:
            async for hb in beats:
                self.beats[hb.actor_id].append((time.monotonic(), hb.pid))
                self.gauges[hb.actor_id] = hb.gauges
                if "sessions_opened" in hb.gauges:
                    self.opened[(hb.actor_id, hb.pid)] = int(hb.gauges["sessions_opened"])
                self.kinds[hb.actor_id] = hb.actor_kind
                self._beat.set()
                self._beat = anyio.Event()
                if hb.actor_kind == "trainer":
                    self.trainer_steps = max(self.trainer_steps, hb.counters.get("steps", 0))
                    self._check_warm()

    async def _watch_flow(self, bus: Bus) -> None:
        """Record when each region's rollouts arrive in the hub's ROLLOUTS (headers only, no acks)."""
        s = bus.subjects
        by_subject = {s.rollouts(r.name): r.name for r in self.topology.regions}
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.NEW, headers_only=True,
                                inactive_threshold=60.0, mem_storage=True, num_replicas=1)
        while True:
            try:
                psub = await bus.js.pull_subscribe(s.all_rollouts(), stream=s.hub_rollouts_stream(), config=config)
            except _API_ERRORS as err:
                log.warning("chaos_flow_watch_retry", error=repr(err))
                await anyio.sleep(1.0)
                continue
            try:
                while True:
                    try:
                        msgs = await psub.fetch(256, timeout=1.0)
                    except (nats.errors.TimeoutError, TimeoutError):
                        continue
                    now = time.monotonic()
                    for msg in msgs:
                        if (region := by_subject.get(msg.subject)) is not None:
                            self.flow[region].append(now)
                    self._check_warm()
            except _API_ERRORS as err:
                log.warning("chaos_flow_watch_retry", error=repr(err))
                await anyio.sleep(1.0)
            finally:
                with anyio.move_on_after(1, shield=True):
                    await psub.unsubscribe()

    def _check_warm(self) -> None:
        """Set `warm` once the trainer has taken a step and every generating region's rollouts have arrived."""
        if self.trainer_steps >= 1 and self._generating <= {r for r, arrivals in self.flow.items() if arrivals}:
            self.warm.set()

    async def _warm_up(self) -> None:
        """Wait (bounded by `warmup_s`) until the run is warm: faults on a run that never started prove nothing."""
        began = time.monotonic()
        with anyio.move_on_after(self.warmup_s):
            await self.warm.wait()
        self.timeline["warm_up_s"] = round(time.monotonic() - began, 1)
        self.say(f"chaos: warm after {self.timeline['warm_up_s']:.0f}s (trainer step {self.trainer_steps}); "
                 f"faults for {self.settings.duration_s:.0f}s")

    # ---- faults -----------------------------------------------------------------------------------
    async def _inject(self, launch: Launch, plan: list[Fault]) -> None:
        self.t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for fault in plan:
                await anyio.sleep(max(0.0, self.t0 + fault.at_s - time.monotonic()))
                tg.start_soon(self._fault, launch, fault)
            await anyio.sleep(max(0.0, self.t0 + self.settings.duration_s - time.monotonic()))
        self.say(f"chaos: fault window over (+{self._now():.0f}s)")

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def _fault(self, launch: Launch, fault: Fault) -> None:
        match fault.kind:
            case "actor_kill" | "pause":
                await self._actor_fault(launch, fault)
            case "server_kill" | "partition" | "link_drop" | "link_down" | "link_degrade":
                await self._region_fault(launch, fault)

    async def _actor_fault(self, launch: Launch, fault: Fault) -> None:
        sup = launch.supervisor
        pids: dict[str, int] = sup.pids()
        live = {a: (e.spec.kind, e.spec.region) for a, e in sup.actors.items() if a in pids}
        victim = pick_victim(fault, live, exclude_regions=self.down, busy=self.paused)
        if victim is None:
            self.skipped.append(f"{fault.kind} of a {fault.target} at +{fault.at_s:.0f}s: no live actor to hit")
            return
        pid = pids[victim]
        record = FaultRecord(kind=fault.kind, target=victim, at_s=self._now(), pid=pid)
        if fault.kind == "actor_kill":
            if not _signal(pid, signal.SIGKILL):
                self.skipped.append(f"SIGKILL {victim}: pid {pid} already gone")
                return
            self.records.append(record)
            self.say(f"chaos +{record.at_s:5.0f}s  SIGKILL {victim} (pid {pid})")
            return
        if not _signal(pid, signal.SIGSTOP):
            return
        self.paused.add(victim)
        self.records.append(record)
        self.say(f"chaos +{record.at_s:5.0f}s  SIGSTOP {victim} (pid {pid}) for {fault.length_s:.0f}s")
        try:
            await anyio.sleep(fault.length_s)
        finally:
            _signal(pid, signal.SIGCONT)
            record.restored_s = self._now()
            self.paused.discard(victim)

    async def _region_fault(self, launch: Launch, fault: Fault) -> None:
        regions = launch.regions
        assert regions is not None  # the chaos run starts embedded servers
        region = fault.target
        degrade = fault.kind == "link_degrade"
        if not degrade:                 # a degraded region's actors may still be hit
            self.down.add(region)
        record = FaultRecord(kind=fault.kind, target=region, at_s=self._now())
        s = self.settings
        try:
            if fault.kind == "server_kill":
                pid = regions.servers[region].pid or 0
                await anyio.to_thread.run_sync(regions.kill, region)
                record.pid = pid
                self.say(f"chaos +{record.at_s:5.0f}s  SIGKILL nats-server of {region} (pid {pid}) for "
                         f"{fault.length_s:.0f}s")
            elif degrade:
                await anyio.to_thread.run_sync(lambda: regions.degrade(region, loss=s.degrade_loss,
                                                                       extra_latency_s=s.degrade_spike_s))
                self.say(f"chaos +{record.at_s:5.0f}s  degrade {region}'s link ({s.degrade_loss:.0%} loss, "
                         f"+{s.degrade_spike_s * 1e3:.0f} ms each way) for {fault.length_s:.0f}s")
            else:
                mode = _CUT_MODES[fault.kind]
                await anyio.to_thread.run_sync(lambda: regions.cut(region, mode))
                self.say(f"chaos +{record.at_s:5.0f}s  cut {region} from the hub ({_CUT_WORDS[mode]}) for "
                         f"{fault.length_s:.0f}s")
            self.records.append(record)
            await anyio.sleep(fault.length_s)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    if fault.kind == "server_kill":
                        await anyio.to_thread.run_sync(lambda: regions.restart(region, timeout_s=60.0))
                    elif degrade:
                        await anyio.to_thread.run_sync(lambda: regions.degrade(region))
                    else:
                        await anyio.to_thread.run_sync(lambda: regions.heal(region, timeout_s=60.0))
                    record.restored_s = self._now()
                    done = {"server_kill": "restarted on its store", "link_degrade": "link restored"}
                    self.say(f"chaos +{record.restored_s:5.0f}s  {region} {done.get(fault.kind, 'healed')}")
                except Exception as err:
                    record.note = f"not restored: {err!r}"[:300]
                    log.error("chaos_restore_failed", region=region, fault=fault.kind, error=repr(err))
                self.down.discard(region)

    # ---- the quiet period ---------------------------------------------------------------------------
    async def _settle(self, launch: Launch) -> bool:
        """Stop the feeder, then wait until every task is done, every rollout is at the hub and the trainer
        has consumed all but less than one batch (or `settle_s` passed). True when caught up."""
        sup = launch.supervisor
        for actor_id, pid in sup.pids().items():
            if sup.actors[actor_id].spec.kind == "feeder":
                _signal(pid, signal.SIGTERM)            # exits 0: the supervisor does not restart it
                self.say(f"chaos +{self._now():5.0f}s  feeder {actor_id} stopped: quiet period (up to "
                         f"{self.settle_s:.0f}s) while the trainer catches up")
        began = time.monotonic()
        last_note = 0.0
        batch = self.topology.trainer.batch_rollouts
        s = launch.admin.subjects
        ack_wait = float((await launch.admin.js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer")))
                         .config.ack_wait or 60.0)
        seen: tuple[int, ...] = ()
        since = time.monotonic()
        with anyio.move_on_after(self.settle_s):
            while True:
                try:
                    state = await self._backlog(launch)
                    if state["tasks"] == 0 and state["unsourced"] <= 0 and state["undelivered"] == 0:
                        book = await read_ledger(launch.admin)
                        state["untrained"] = len(book.pending) + len(book.lost)
                        progress = (book.trained, sum(book.dropped.values()), state["untrained"])
                        if progress != seen:
                            seen, since = progress, time.monotonic()
                        # what a dead trainer held comes back after the ack wait; past that, a standstill is the end
                        # (e.g. dropped rollouts that the trainer records with its next step, which never comes)
                        still = time.monotonic() - max(since, self._trainer_started() + ack_wait)
                        if state["untrained"] < batch or still > 10.0:
                            self.timeline["settle_s"] = round(time.monotonic() - began, 1)
                            self.say(f"chaos: caught up after {self.timeline['settle_s']:.0f}s of quiet "
                                     f"({state['untrained']} rollouts not in a step)")
                            return True
                except _API_ERRORS as err:
                    state = {"error": repr(err)}
                if time.monotonic() - last_note > 15:
                    last_note = time.monotonic()
                    self.say("chaos: settling: " + ", ".join(f"{k} {v}" for k, v in state.items()))
                await anyio.sleep(2.0)
        self.timeline["settle_s"] = round(time.monotonic() - began, 1)
        self.say(f"chaos: not caught up within {self.settle_s:.0f}s of quiet; draining anyway")
        return False

    async def _sessions_closed(self) -> None:
        """Wait (bounded: a session lease and a bit) until the sandbox supervisors' heartbeats say no session is open:
        every group is published by now, so what is still open was held by a killed generator and ends with its
        lease."""
        lease = self.topology.generator.session_lease_s or SESSION_LEASE_S
        began = time.monotonic()
        with anyio.move_on_after(lease + 15.0):
            while open_sessions(self.gauges, self._sandboxes()):
                await self._beat.wait()
        self.timeline["sessions_closed_s"] = round(time.monotonic() - began, 1)
        self.say(f"chaos: {open_sessions(self.gauges, self._sandboxes())} sandbox sessions open after "
                 f"{self.timeline['sessions_closed_s']:.0f}s")

    def _sandboxes(self) -> list[str]:
        return sorted(a for a, kind in self.kinds.items() if kind == "sandbox")

    def _trainer_started(self) -> float:
        """When the newest trainer process first heartbeat (monotonic; 0 when none was seen)."""
        starts = [0.0]
        for actor, beats in self.beats.items():
            if beats and actor in self._trainers:
                newest = beats[-1][1]
                starts.append(next(t for t, pid in beats if pid == newest))
        return max(starts)

    async def _backlog(self, launch: Launch) -> dict[str, int]:
        """Tasks not done (all regions), rollouts not yet at the hub, rollouts not yet delivered to the trainer."""
        admin = launch.admin
        s = admin.subjects
        tasks = regional = 0
        for region in self.topology.regions:
            js = admin.jetstream(launch.endpoints.domains[region.name])
            info = await js.consumer_info(s.tasks_stream(region.name), s.durable("generator", region.name))
            tasks += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
            regional += int((await js.stream_info(s.rollouts_stream(region.name))).state.messages)
        hub = int((await admin.js.stream_info(s.hub_rollouts_stream())).state.messages)
        trainer = await admin.js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))
        return {"tasks": tasks, "unsourced": regional - hub, "undelivered": int(trainer.num_pending or 0)}

    # ---- the result ---------------------------------------------------------------------------------
    async def _account(self, launch: Launch, caught_up: bool) -> dict[str, Any]:
        admin = launch.admin
        s = admin.subjects
        book: Ledger = await read_ledger(admin)
        try:
            tasks = await read_fed_tasks(self.topology, admin)
        except (*_API_ERRORS, RlbusError) as err:     # the rollout ledger still decides; say why tasks were not
            tasks = None
            self.skipped.append(f"task account not read: {err!r}")
        steps = await read_all(admin.js, s.trainlog_stream(), s.trainlog(), TrainStep)
        reasons = Counter(d.reason for step in final_lineage(steps) for d in step.dropped)
        hub_ids = {r.rollout_id for r in await read_all(admin.js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout)}
        stranded: list[str] = []
        produced_by_region: dict[str, int] = {}
        for region in self.topology.regions:
            js = admin.jetstream(launch.endpoints.domains[region.name])
            ids = {r.rollout_id for r in await read_all(js, s.rollouts_stream(region.name), s.rollouts(region.name),
                                                         Rollout)}
            produced_by_region[region.name] = len(ids)
            stranded += sorted(ids - hub_ids)
        self._recoveries()
        sup = launch.supervisor
        kills = [r for r in self.records if r.kind in ("actor_kill", "server_kill")]
        killed = Counter(r.target for r in self.records if r.kind == "actor_kill")
        unplanned = {a: e.restarts - killed[a] for a, e in sorted(sup.actors.items()) if e.restarts > killed[a]}
        agentic = await self._agentic(launch, book.dropped, sum(unplanned.values())) if self.agentic else None
        return {
            "agentic": agentic,
            "run": self.topology.run, "state_dir": str(self.state), "seed": self.settings.seed,
            "window_s": self.settings.duration_s, "outage_s": self.settings.outage_s,
            "pause_s": self.settings.pause_s,
            "kills": len(kills), "kills_requested": self.settings.kills,
            "actor_kills": sum(r.kind == "actor_kill" for r in self.records),
            "server_kills": sum(r.kind == "server_kill" for r in self.records),
            "partitions": sum(r.kind == "partition" for r in self.records),
            "links": self.settings.links,
            "link_cuts": sum(r.kind in ("link_drop", "link_down") for r in self.records),
            "link_degrades": sum(r.kind == "link_degrade" for r in self.records),
            "link_bytes": launch.regions.link_counters() if launch.regions is not None else {},
            "pauses": sum(r.kind == "pause" for r in self.records),
            "killed_kinds": dict(Counter(sup.actors[r.target].spec.kind for r in self.records
                                         if r.kind == "actor_kill")),
            "produced": book.produced, "produced_by_region": produced_by_region, "trained": book.trained,
            "lost": len(book.lost), "duplicated": len(book.trained_twice), "dropped": book.dropped,
            "drop_reasons": dict(reasons.most_common(8)), "pending": len(book.pending), "stranded": len(stranded),
            "steps": len(book.lineage), "abandoned_steps": book.abandoned_steps,
            "restarts": sum(e.restarts for e in sup.actors.values()),
            "restarts_by_actor": {a: e.restarts for a, e in sorted(sup.actors.items()) if e.restarts},
            "unplanned_restarts": unplanned,
            "failed_actors": sorted(a for a, e in sup.actors.items() if e.state == "failed"),
            "recovery": {k: v.as_dict() for k, v in summarize(self.records).items()},
            "faults": [r.as_dict() for r in self.records], "skipped": self.skipped,
            "caught_up": caught_up, "timeline_s": self.timeline,
            "lost_ids": book.lost[:50], "duplicated_ids": book.trained_twice[:50], "pending_ids": book.pending[:50],
            "stranded_ids": stranded[:50],
            "tasks_fed": tasks.fed if tasks else 0, "tasks_rolled_out": tasks.rolled_out if tasks else 0,
            "tasks_dead_lettered": tasks.dead_lettered if tasks else 0, "tasks_pending": tasks.pending if tasks else 0,
            "tasks_lost": len(tasks.lost) if tasks else 0, "tasks_lost_ids": tasks.lost[:50] if tasks else [],
            "clean": book.clean and (tasks is None or tasks.clean),
        }

    async def _agentic(self, launch: Launch, dropped: dict[str, int], unplanned: int) -> dict[str, Any]:
        """The agentic figures (ops/chaos/agentic.py): sessions open at the end, session roots left on disk by the
        run's sandbox processes, restored workspaces checked and equal (the generators' events), sandbox_error
        drops, unplanned restarts, and what is wrong with them."""
        s = launch.admin.subjects
        try:
            checked, equal = restore_checks(await read_all(launch.admin.js, s.events_stream(), s.all_events(), Event))
        except _API_ERRORS as err:
            checked = equal = 0
            self.skipped.append(f"restore events not read: {err!r}")
        pids = {pid for actor in self._sandboxes() for _, pid in self.beats.get(actor, [])}
        figures: dict[str, Any] = {
            "sessions_open": open_sessions(self.gauges, self._sandboxes()),
            "sessions_opened": sum(self.opened.values()),
            "session_roots_left": session_roots_left(pids),
            "restores_checked": checked, "restores_equal": equal,
            "sandbox_errors": int(dropped.get("sandbox_error", 0)), "unplanned_restarts": unplanned,
        }
        figures["wrong"] = agentic_verdict(figures)
        return figures

    def _recoveries(self) -> None:
        """Fill each record's recovery time from the heartbeats and arrivals seen (relative to the fault)."""
        for record in self.records:
            start = self.t0 + record.at_s
            seen: float | None = None
            match record.kind:
                case "actor_kill":
                    seen = recovery_after(self.beats.get(record.target, []), start, lambda pid, old=record.pid: pid != old)
                case "pause":
                    after = self.t0 + (record.restored_s if record.restored_s is not None else record.at_s)
                    seen = recovery_after(self.beats.get(record.target, []), after, lambda _pid: True)
                case "server_kill" | "partition" | "link_drop" | "link_down" | "link_degrade":
                    if record.restored_s is not None:
                        arrivals = [(t, 0) for t in self.flow.get(record.target, [])]
                        seen = recovery_after(arrivals, self.t0 + record.restored_s, lambda _v: True)
            record.recovery_s = None if seen is None else seen - start


def _signal(pid: int, signum: signal.Signals) -> bool:
    """Send `signum` to `pid`; False when the process is already gone."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True
