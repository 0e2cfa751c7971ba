"""The trainer actor: consumes the hub's ROLLOUTS, trains the policy, announces every version, and makes each
rollout enter exactly one optimizer step across crashes.

- Owns: `Trainer`, the consume → plan → step → log → announce loop; acks; state uploads; resume.
- Guarantee: a rollout is acked only once a CheckpointMark of this trainer's own lineage covers its step
  (actors/trainer/exactly_once.py keeps the books); at most `max_ack_pending` rollouts in memory.
- Does not: do the math (actors/trainer/core.py), make checkpoints durable (actors/checkpointer.py) or encode
  versions for generators (actors/publisher/).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
import torch
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.actors.common.ledger import reason_category
from rlbus.actors.trainer.config import WORLD_ENV, TrainerConfig, TrainerLaunch, settings_record
from rlbus.actors.trainer.core import (
    Core,
    Objective,
    Plan,
    StepStats,
    TrainerCore,
    build_core,
    mtp_distill_problem,
    plan_step,
    versions_behind,
)
from rlbus.actors.trainer.exactly_once import RolloutBook, Seen
from rlbus.actors.trainer.resume import Resume, resume_point
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus, Delivery
from rlbus.messages.errors import BadMessage, RlbusError, TopologyError
from rlbus.messages.history import last_message
from rlbus.messages.objects import delete_object
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import (
    CheckpointMark,
    DroppedRollout,
    Message,
    Rollout,
    StateUploaded,
    TrainStep,
    VersionReady,
)
from rlbus.messages.subjects import Subjects

log = structlog.get_logger()

T = TypeVar("T")
SETTINGS_KEY = "trainer_settings"
"""Key of the trainer's `started` event data holding its `settings_record` as JSON (read by ops/recording/retrain.py)."""
THREADS_KEY = "torch_threads"
_PUBLISH_ERRORS = (nats.errors.Error, TimeoutError)
MARK_WATCH_BACKOFF_S = (0.2, 5.0)
"""The mark watcher's retry delay after losing CHECKPOINTS: from the first to the cap, doubling, jittered."""
MARK_WATCH_GIVE_UP_S = GIVE_UP_S
"""The mark watcher fails the trainer (its supervisor restarts it) after this long without reaching the hub."""


def objective(config: TrainerConfig, launch: TrainerLaunch | None = None) -> Objective:
    """The loss terms of `config` at the launch's sampling temperature and gradient clip (default launch)."""
    launch = launch or TrainerLaunch()
    return Objective(kl_coef=config.kl_coef, is_cap=config.is_cap, length_penalty=config.length_penalty,
                     grad_clip=launch.grad_clip, temperature=launch.sampling_temperature,
                     aggregation=config.aggregation, scale_by_std=config.scale_by_std,
                     mtp_distill=config.mtp_distill)


def build_trainer(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                  launch: TrainerLaunch | None = None) -> Trainer:
    """The trainer of a `[trainer]` section (plain values) — called by actors/kinds.py.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Trainer(ident, bus, decode_config("trainer", settings, TrainerConfig), limits, launch)


def trainer_threads() -> int:
    """Torch threads of a trainer: `RLBUS_TORCH_THREADS` (the launcher sets the instance's `torch_threads`), else 1."""
    return max(1, int(os.environ.get("RLBUS_TORCH_THREADS", "1") or 1))


def rank_spec(config: TrainerConfig, env: Mapping[str, str] | None = None) -> Any:
    """This process's place in a multi-rank trainer (`actors/trainer/ranks.py` `RankSpec`, from the launcher's
    environment), or None for a one-rank trainer.

    :raises RlbusError: `[trainer] world_size` > 1 without the launcher's rank environment, or the two disagree.
    """
    if config.world_size == 1 and WORLD_ENV not in (env if env is not None else os.environ):
        return None
    from rlbus.actors.trainer.ranks import RankSpec

    spec = RankSpec.from_env(env if env is not None else os.environ)
    world = 1 if spec is None else spec.world_size
    if world != config.world_size:
        raise RlbusError(f"[trainer] world_size = {config.world_size} but this process was launched as one of "
                         f"{world} ranks (RLBUS_WORLD_SIZE); start trainers through `rlbus up`")
    return spec


def load_into(core: Core, state: Mapping[str, bytes]) -> dict[str, Any]:
    """Load a checkpoint's objects (name -> bytes) into `core`, whatever world size saved them (`Core.load`).
    Returns the state's `meta`."""
    return core.load(state)


def build_trainer_core(config: TrainerConfig, *, threads: int, pretrained: str = "",
                       device: str = "cpu") -> TrainerCore:
    """Set torch's thread count and build the core of `config` from `pretrained` (`TrainerLaunch.pretrained`;
    empty: a fresh tiny model) on `device` (`TrainerLaunch.device`): the trainer's setup and `rlbus replay FILE
    train` (ops/recording/retrain.py) both start here, so a replay cannot drift from the live trainer.

    :raises TopologyError: `[trainer] mtp_distill` > 0 for a policy whose heads it cannot train.
    """
    torch.set_num_threads(threads)
    core = build_core(pretrained, lr=config.lr, seed=config.seed, device=device, reference=config.reference_dtype,
                      precision=config.precision, precision_scope=config.precision_scope,
                      router_replay_threshold=config.router_replay_threshold)
    if config.mtp_distill > 0 and (why := mtp_distill_problem(core.policy)) is not None:
        raise TopologyError(f"trainer.mtp_distill = {config.mtp_distill:g}: {why}")
    return core


class Trainer(Actor):
    """Trains on the hub's ROLLOUTS (durable `trainer`); the guarantees are in the module docstring.

    Order per step: TrainStep on TRAINLOG → bf16 version to CKPT + VersionReady → (every N steps) full state
    to CKPT + StateUploaded; so a TrainStep is stored before any mark can cover its rollouts. At most the
    consumer's `max_ack_pending` rollouts are held in memory (`Trainer._relieve`).
    """

    kind = "trainer"

    def __init__(self, ident: ActorId, bus: Bus, config: TrainerConfig | None = None,
                 limits: ActorLimits | None = None, launch: TrainerLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config or TrainerConfig()
        self.launch = launch or TrainerLaunch()
        self.subjects: Subjects = bus.subjects
        self.incarnation = uuid.uuid4().hex[:8]
        self.core: Core | None = None
        self.step = 0
        self.version = 0
        self.announced: int | None = None
        self._files_uploaded = False
        self.resumed = False
        self.resume_source = ""
        """Where the state came from: "ckpt" (the mark's object), "disk" (the durable copy) or "fresh"."""
        self.book: RolloutBook[Delivery[Rollout]] = RolloutBook()
        """Consumed ids, deliveries held for a mark, uploads awaiting one (actors/trainer/exactly_once.py)."""
        self.pending: dict[str, dict[str, Delivery[Rollout]]] = {}
        """Task id → rollout id → delivery, for groups not yet in a step (arrival order)."""
        self.to_drop: dict[str, tuple[Delivery[Rollout], str]] = {}
        """Rollout id → (delivery, reason) of dropped rollouts waiting for the next TrainStep to record them."""
        self.parent_checkpoint: int | None = None
        self.last_upload_step = 0
        self.unlogged: list[TrainStep] = []
        self.world_size = 1
        self.keepalive_s = 1.0
        self.max_buffered = 50_000
        """Rollouts the trainer may hold unacked (its consumer's `max_ack_pending`): JetStream delivers no
        more past it, so held + pending + to_drop never exceed it; `_relieve` keeps it from deadlocking."""
        self._checked: dict[str, str | None] = {}
        """Rollout id → why the model cannot train on it (None: it can), computed once per pending rollout."""

    # ---- lifecycle ------------------------------------------------------------------------------
    async def setup(self) -> None:
        info = await self.bus.js.consumer_info(self.subjects.hub_rollouts_stream(), self.subjects.durable("trainer"))
        ack_wait = float(info.config.ack_wait or 30.0)
        self.keepalive_s = min(30.0, max(0.2, ack_wait / 4))
        if info.config.max_ack_pending and info.config.max_ack_pending > 0:
            self.max_buffered = int(info.config.max_ack_pending)
        self.gauges["buffer_bound"] = float(self.max_buffered)
        cfg, threads, pretrained, device = self.config, trainer_threads(), self.launch.pretrained, self.launch.device
        spec = rank_spec(cfg)

        def build() -> Core:
            core = build_trainer_core(cfg, threads=threads, pretrained=pretrained, device=device)
            if spec is None:
                return core
            from rlbus.actors.trainer.ranks import ShardedCore, join

            join(spec, core.policy.device)        # waits for every rank (the rendezvous timeout names the missing)
            return ShardedCore(core, spec)

        self.core = await anyio.to_thread.run_sync(build)
        self.world_size = 1 if spec is None else spec.world_size
        self.gauges["world_size"] = float(self.world_size)
        log.info("trainer_model_ready", pretrained=pretrained or None, incarnation=self.incarnation,
                 policy=self.core.policy.describe(), world_size=self.world_size)

    async def run(self) -> None:
        core = self._core()
        point = await resume_point(self.bus, state_dir=self.launch.state_dir, wait_s=self.launch.resume_wait_s,
                                   gauges=self.gauges)
        await self._resume(core, point)
        await self._announce()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_marks, point.next_mark_seq)
            tg.start_soon(self._keepalive)
            if self.world_size > 1:
                tg.start_soon(self._ping_ranks)
            await self._consume()

    async def drain(self) -> None:
        """Log what is unlogged, announce the held version, checkpoint now and wait briefly for the mark."""
        if not self.resumed:
            return
        await self._flush()
        await self._announce()
        if self.step > self.last_upload_step:
            await self._checkpoint()
        if self.book.uploads:
            with anyio.move_on_after(self.launch.mark_wait_s):
                while self.book.uploads:
                    s = self.subjects
                    mark = await last_message(self.bus.js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
                    if mark is not None:
                        await self._on_mark(mark)
                    if self.book.uploads:
                        await anyio.sleep(0.1)
        if self.core is not None:
            await anyio.to_thread.run_sync(self.core.stop)      # the other ranks return (one process: nothing)
        await self.bus.nc.flush(timeout=2)
        log.info("trainer_drained", step=self.step, version=self.version, held=len(self.book.held),
                 pending=sum(map(len, self.pending.values())))

    def started_data(self) -> dict[str, str]:
        """The settings and thread count in the `started` event, so a recording can be replayed
        (`rlbus replay FILE train`) without the topology file."""
        record = settings_record(self.config, self.launch)
        return {SETTINGS_KEY: msgspec.json.encode(record).decode(), THREADS_KEY: str(trainer_threads())}

    # ---- resume ---------------------------------------------------------------------------------
    def _core(self) -> Core:
        if self.core is None:
            raise RlbusError("trainer used before setup()")
        return self.core

    async def _resume(self, core: Core, point: Resume) -> None:
        if point.state is not None and point.mark is not None:
            meta = await anyio.to_thread.run_sync(core.load, point.state)
            self.step = self.last_upload_step = int(meta["step"])
            self.parent_checkpoint = self.step
            self.book.resume(self.step, meta["consumed"])
            log.info("trainer_resumed", step=self.step, mark_version=point.mark.policy_version,
                     consumed=len(self.book.consumed), source=point.source)
        self.version = point.next_version
        self.policy_version = self.version
        self.resume_source = point.source
        self.resumed = True
        self.gauges.update(step=float(self.step), version=float(self.version))

    # ---- consuming and stepping -----------------------------------------------------------------
    async def _consume(self) -> None:
        stream, durable = self.subjects.hub_rollouts_stream(), self.subjects.durable("trainer")
        async for delivery in self.bus.consume(stream, durable, Rollout, batch=32, fetch_timeout_s=0.5):
            await self._accept(delivery)
            plan = self._plan()
            for task_id, reason in plan.drop:
                for d in self.pending.pop(task_id).values():
                    self._checked.pop(d.message.rollout_id, None)
                    self.to_drop[d.message.rollout_id] = (d, reason)
                    self.count("dropped")
            if plan.train:
                with self.busy():
                    await self._step(plan)
            elif self._buffered() >= max(1, int(self.max_buffered * 0.9)):
                with self.busy():
                    await self._relieve()
            self.gauges.update(pending=float(sum(map(len, self.pending.values()))), held=float(len(self.book.held)),
                               buffered=float(self._buffered()))

    def _buffered(self) -> int:
        """Deliveries held in memory, not yet acked: held for a mark, pending in groups, waiting to be dropped."""
        return len(self.book.held) + sum(map(len, self.pending.values())) + len(self.to_drop)

    async def _relieve(self) -> None:
        """The buffer is nearly at `max_buffered` (JetStream will deliver nothing more) and no batch is ready:
        train the ready groups there are, else drop the oldest incomplete groups, and record the drops in a
        TrainStep of their own (no optimizer step, same policy version) — so rollouts that can never train
        (incomplete, stale) cannot wedge the trainer. Checkpoints come early too (`_maybe_checkpoint`)."""
        plan = plan_step({t: [d.message for d in m.values()] for t, m in self.pending.items()},
                         version=self.version, staleness_versions=self.config.staleness_versions,
                         batch_rollouts=1, check=self._check, drop_flat=self.config.drop_flat_groups)
        if plan.train:
            await self._step(plan)
            return
        target = max(1, self.max_buffered // 8)
        evicted = 0
        for task_id in list(self.pending):
            if evicted >= target:
                break
            members = self.pending.pop(task_id)
            size = next(iter(members.values())).message.group_size if members else 0
            for d in members.values():
                self._checked.pop(d.message.rollout_id, None)
                why = f"incomplete: {len(members)} of a group of {size} with the trainer's buffer full"
                self.to_drop[d.message.rollout_id] = (d, f"{why} ({self.max_buffered})")
                self.count("dropped")
            evicted += len(members)
        if self.to_drop:
            await self._record_drops()

    async def _accept(self, delivery: Delivery[Rollout]) -> None:
        rollout = delivery.message
        rid = rollout.rollout_id
        seen = self.book.seen(rid, delivery)
        if seen is not Seen.NEW:                     # redelivered: trained or dropped already
            self.count("redelivered_consumed")
            if seen is Seen.ACK:
                await delivery.ack()                 # a mark covers it: the earlier ack was lost
            return                                   # else the book holds it until its step's mark arrives
        if rid in self.to_drop:                      # redelivered while its drop waits for the next step
            self.to_drop[rid] = (delivery, self.to_drop[rid][1])
            return
        group = self.pending.setdefault(rollout.task_id, {})
        if rid in group:
            self.count("redelivered_pending")
        group[rid] = delivery
        self.count("received")

    def _plan(self) -> Plan:
        groups = {task: [d.message for d in members.values()] for task, members in self.pending.items()}
        return plan_step(groups, version=self.version, staleness_versions=self.config.staleness_versions,
                         batch_rollouts=self.config.batch_rollouts, check=self._check,
                         drop_flat=self.config.drop_flat_groups)

    def _check(self, rollout: Rollout) -> str | None:
        rid = rollout.rollout_id
        if rid not in self._checked:
            self._checked[rid] = self._core().check(rollout)
        return self._checked[rid]

    async def _step(self, plan: Plan) -> None:
        core = self._core()
        used = [d for task in plan.train for d in self.pending.pop(task).values()]
        dropped, self.to_drop = list(self.to_drop.values()), {}
        rollouts = [d.message for d in used]
        staleness = Counter(str(versions_behind(r, self.version)) for r in rollouts)
        with anyio.CancelScope(shield=True):         # a step is applied and recorded together, or not at all
            lr = self.config.lr_at(self.step + 1)
            began = time.perf_counter()
            stats: StepStats = await anyio.to_thread.run_sync(
                functools.partial(core.train_step, rollouts, objective(self.config, self.launch), lr=lr))
            self.gauges["lr"] = lr
            self.gauges["step_s"] = time.perf_counter() - began
            if stats.mtp_distill_loss is not None:
                self.gauges["mtp_distill_loss"] = stats.mtp_distill_loss
            self.step += 1
            self.version += 1
            self.policy_version = self.version
            consumed = [*used, *(d for d, _ in dropped)]
            self.book.consume(self.step, ((d.message.rollout_id, d) for d in consumed))
            for d in consumed:
                self._checked.pop(d.message.rollout_id, None)
            self.unlogged.append(TrainStep(
                step=self.step, policy_version=self.version, parent_checkpoint=self.parent_checkpoint,
                rollout_ids=[r.rollout_id for r in rollouts],
                dropped=[DroppedRollout(rollout_id=d.message.rollout_id, reason=why) for d, why in dropped],
                loss=stats.loss, kl=stats.kl, reward_mean=stats.reward_mean, reward_std=stats.reward_std,
                staleness=dict(staleness), world_size=self.world_size, replaced_experts=stats.replaced_experts))
        self.count("steps")
        self.count("trained", len(rollouts))
        if not stats.applied:
            self.count("nonfinite_steps")
        self.gauges.update(step=float(self.step), version=float(self.version), loss=stats.loss, kl=stats.kl,
                           reward_mean=stats.reward_mean, grad_norm=stats.grad_norm,
                           staleness_mean=sum(int(k) * n for k, n in staleness.items()) / max(1, len(rollouts)))
        log.info("trainer_step", step=self.step, version=self.version, rollouts=len(rollouts), dropped=len(dropped),
                 loss=round(stats.loss, 5), kl=round(stats.kl, 5), reward_mean=round(stats.reward_mean, 4),
                 grad_norm=round(stats.grad_norm, 4), tokens=stats.tokens, replayed=stats.replayed,
                 replaced_experts=stats.replaced_experts, applied=stats.applied)
        await self._flush()
        if dropped:
            reasons = Counter(reason_category(why) for _, why in dropped)
            await self.emit("stale_dropped" if set(reasons) == {"stale"} else "incident",
                            detail=f"step {self.step} dropped {len(dropped)} rollouts",
                            step=str(self.step), **{f"dropped_{k}": str(n) for k, n in reasons.items()})
        await self._announce()
        await self._maybe_checkpoint()

    async def _record_drops(self) -> None:
        """A TRAINLOG record of dropped rollouts alone (no optimizer step: the policy version stays), so that
        they can be acked once a mark covers it; for when rollouts pile up that nothing will train."""
        dropped, self.to_drop = list(self.to_drop.values()), {}
        self.step += 1                    # no await until the record is queued: applied together or not at all
        self.book.consume(self.step, ((d.message.rollout_id, d) for d, _ in dropped))
        self.unlogged.append(TrainStep(
            step=self.step, policy_version=self.version, parent_checkpoint=self.parent_checkpoint,
            dropped=[DroppedRollout(rollout_id=d.message.rollout_id, reason=why) for d, why in dropped]))
        self.count("drop_records")
        reasons = Counter(reason_category(why) for _, why in dropped)
        log.warning("trainer_drops_recorded", step=self.step, dropped=len(dropped), reasons=dict(reasons))
        await self._flush()
        await self.emit("incident", detail=f"step {self.step} records {len(dropped)} dropped rollouts without "
                        f"training", step=str(self.step), **{f"dropped_{k}": str(n) for k, n in reasons.items()})
        await self._maybe_checkpoint()

    async def _maybe_checkpoint(self) -> None:
        """Every `checkpoint_interval` steps, and early when the rollouts held for a mark reach half the buffer
        bound (otherwise the unacked ones could fill `max_ack_pending` before the next checkpoint is due)."""
        if self.step % self.launch.checkpoint_interval == 0 or (
                len(self.book.held) >= self.max_buffered // 2 and not self.book.uploads):
            await self._checkpoint()

    # ---- publishing -----------------------------------------------------------------------------
    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run an idempotent bus operation, retrying transient failures for up to a minute."""
        retry = retry_policy("trainer_bus_retry", on=_PUBLISH_ERRORS, initial_s=0.2, max_s=5.0, give_up_after_s=60,
                             what=what)
        async for attempt in retry:
            with attempt:
                return await call()
        raise AssertionError("unreachable")

    async def _publish(self, subject: str, message: Message, msg_id: str) -> None:
        """Publish with `msg_id` dedupe (a retried publish is stored once)."""
        await self._retrying(msg_id, lambda: self.bus.publish(subject, message, msg_id=msg_id))

    async def _put(self, name: str, blob: bytes, *, keep_same: bool = False) -> str:
        """Upload to CKPT (a retry overwrites the same name); returns the digest. `keep_same`: a content-addressed
        name, left as it is when already stored (a reader in the middle of it is not cut off)."""
        return await self._retrying(name, lambda: self.bus.put_object(self.subjects.checkpoint_bucket(), name, blob,
                                                                      keep_same=keep_same))

    async def _flush(self) -> None:
        """Store every TrainStep not yet on TRAINLOG, in order."""
        while self.unlogged:
            record = self.unlogged[0]
            await self._publish(self.subjects.trainlog(), record, msg_id=f"step-{record.step}-{self.incarnation}")
            self.unlogged.pop(0)

    async def _announce(self) -> None:
        """Upload the bf16 cast of the held version to CKPT and publish its VersionReady (once per version)."""
        if self.announced == self.version or self.unlogged:
            return
        core = self._core()
        version, step = self.version, self.step

        blob, version_digest, raw = await anyio.to_thread.run_sync(core.published_version)
        await self._upload_policy_files(core)
        name = Subjects.version_object(version)
        bucket = self.subjects.checkpoint_bucket()
        digest = await self._put(name, blob)
        await self._publish(self.subjects.version_ready(), VersionReady(
            version=version, step=step, object=name, digest=digest, version_digest=version_digest, raw_bytes=raw,
            model_config=core.model_config_dict()), msg_id=f"version-{version}")
        self.announced = version
        self.count("versions")
        old = version - self.launch.keep_version_objects
        if old >= 0:
            await delete_object(self.bus.js, bucket, Subjects.version_object(old))

    async def _upload_policy_files(self, core: Core) -> None:
        """Put the files the policy's spec lists (a Hugging Face config and tokenizer) in CKPT, by content, once
        per incarnation: the publisher copies them to every region beside the version objects."""
        if self._files_uploaded:
            return
        for data in core.policy_files().values():
            await self._put(Subjects.policy_file_object(hashlib.sha256(data).hexdigest()), data, keep_same=True)
        self._files_uploaded = True

    async def _checkpoint(self) -> None:
        """Upload the full state of this step to CKPT and announce it to the checkpointer."""
        if self.unlogged:
            log.warning("trainer_checkpoint_skipped", reason="train steps not yet on TRAINLOG", step=self.step)
            return
        core = self._core()
        step = self.step
        consumed = self.book.consumed_by(step)
        meta = {"step": step, "version": self.version, "consumed": consumed, "incarnation": self.incarnation,
                "parent_step": self.parent_checkpoint, "saved_at": time.time()}
        sharded = core.world_size > 1

        def upload(filename: str, data: bytes) -> tuple[str, str]:
            """A shard by content (every rank uploads its own), a one-process state by step and incarnation."""
            name = (Subjects.shard_object(hashlib.sha256(data).hexdigest(), filename) if sharded
                    else Subjects.state_object(step, self.incarnation))
            return name, anyio.from_thread.run(self._put, name, data)

        objects, digests = await anyio.to_thread.run_sync(core.save, meta, upload)
        self.book.uploaded(step, objects[0])
        await self._publish(self.subjects.state_uploads(), StateUploaded(
            step=step, policy_version=self.version, objects=list(objects), digests=list(digests),
            consumed_rollout_ids=consumed, parent_step=self.parent_checkpoint),
            msg_id=f"upload-{step}-{self.incarnation}")
        self.last_upload_step = step
        self.count("state_uploads")
        log.info("trainer_state_uploaded", step=step, version=self.version, objects=len(objects), first=objects[0])

    # ---- marks and acks -------------------------------------------------------------------------
    async def _watch_marks(self, start_seq: int) -> None:
        """Follow CHECKPOINTS from `start_seq` and act on this trainer's marks, through hub restarts: when the
        ephemeral consumer or the server goes away (no responders, consumer gone, timeouts), follow again from
        the first mark not yet seen, after a doubling, jittered backoff capped at MARK_WATCH_BACKOFF_S[1] and a
        `trainer_mark_watch_retry` warning; only after MARK_WATCH_GIVE_UP_S without reaching the hub does the
        error fail the trainer. Marks seen twice are harmless (`_on_mark` ignores old steps)."""
        self._mark_seq, self._mark_ok_at = start_seq, time.monotonic()
        first, cap = MARK_WATCH_BACKOFF_S
        retry = retry_policy("trainer_mark_watch_retry", on=(nats.errors.Error, TimeoutError, OSError),
                             initial_s=first, max_s=cap, give_up_after_s=MARK_WATCH_GIVE_UP_S,
                             since=lambda: self._mark_ok_at, next_seq=lambda: self._mark_seq)
        try:
            async for attempt in retry:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.count("mark_watch_retries")
                    await self._follow_marks()
        except (nats.errors.Error, TimeoutError, OSError) as err:
            log.error("trainer_mark_watch_gave_up", error=repr(err), next_seq=self._mark_seq)
            raise

    async def _follow_marks(self) -> None:
        """One ephemeral consumer from `self._mark_seq` on; returns only by raising. `self._mark_ok_at` notes
        the last time the hub answered (consumer created, a fetch delivered, or an idle check found it)."""
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=self._mark_seq, inactive_threshold=30.0, mem_storage=True,
                                num_replicas=1)
        s = self.subjects
        psub = await self.bus.js.pull_subscribe(s.checkpoints(), stream=s.checkpoints_stream(), config=config)
        self._mark_ok_at = time.monotonic()
        idle = 0
        try:
            while True:
                try:
                    msgs = await psub.fetch(16, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    idle += 1
                    if idle % 5 == 0:               # a consumer lost with its server answers nothing: ask
                        await psub.consumer_info()
                        self._mark_ok_at = time.monotonic()
                    continue
                idle, self._mark_ok_at = 0, time.monotonic()
                for msg in msgs:
                    try:
                        mark = codec.decode_as(msg.data, msg.headers, CheckpointMark)
                        checks.check(mark)
                    except BadMessage as err:      # a copy to the DLQ (once, however many trainers read it)
                        await self.bus.dead_letter(msg, reason=str(err), source=s.checkpoints_stream(), settle=False)
                    else:
                        await self._on_mark(mark)
                    self._mark_seq = int(msg.metadata.sequence.stream) + 1
        finally:
            with anyio.move_on_after(1.0, shield=True):
                try:
                    await psub.unsubscribe()
                except (nats.errors.Error, TimeoutError) as err:
                    log.debug("trainer_mark_unsubscribe_failed", error=repr(err))

    async def _on_mark(self, mark: CheckpointMark) -> None:
        """A mark of one of this incarnation's uploads: ack every held rollout its step covers."""
        covered = self.book.cover(mark.step, mark.objects)
        if covered is None:
            return
        self.parent_checkpoint = mark.step
        for delivery in covered:
            await delivery.ack()
        self.count("marks")
        self.count("acked", len(covered))
        self.gauges["marked_step"] = float(mark.step)
        log.info("trainer_mark_covered", step=mark.step, acked=len(covered), held=len(self.book.held))

    async def _ping_ranks(self) -> None:
        """While the trainer waits for rollouts, ping the other ranks now and then: a dead one breaks the ping's
        collective (the trainer fails, the launcher restarts the group) and the live ones' waits never time out."""
        core = self._core()
        every = max(0.5, min(5.0, self.config.collective_timeout_s / 4))
        while True:
            await anyio.sleep(every)
            await anyio.to_thread.run_sync(core.ping)

    async def _keepalive(self) -> None:
        """Reset the ack wait of every rollout held or buffered, so none is redelivered while we keep it."""
        while True:
            await anyio.sleep(self.keepalive_s)
            deliveries = [*self.book.held.values(), *(d for g in self.pending.values() for d in g.values()),
                          *(d for d, _ in self.to_drop.values())]
            try:
                for delivery in deliveries:
                    await delivery.in_progress()
            except _PUBLISH_ERRORS as err:
                log.warning("trainer_keepalive_failed", error=repr(err), deliveries=len(deliveries))
