"""The task feeder: puts coding tasks on every region's TASKS work queue, each backlog bounded yet full
(and, with `max_rollouts_ahead`, the work ahead of the trainer bounded too).

- Owns: `Feeder` (kind "feeder"; settings: actors/common/config.py `FeederConfig`): the task sequence walked,
  each task to its region, per-region cursors saved in the hub's PARTIALS KV, the lockstep schedule, and the
  curriculum's reward watch (which rollouts pass, per level; the selection itself: actors/common/curriculum.py).
- Guarantee: a task goes to its region only; a restarted feeder repeats nothing and skips nothing.
- Does not: define task sources, the verifier spec or the saved position (actors/common/feed.py), generate
  or grade (actors/generator/actor.py), provision streams (messages/streams.py) or account for fed tasks
  (actors/common/ledger.py `read_task_ledger`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import (
    REPO_LEVELS,
    FeederConfig,
    FeederLaunch,
    decode_config,
    feed_weights,
    names_task_file,
)
from rlbus.actors.common.curriculum import CurriculumSequence, LevelCurriculum
from rlbus.actors.common.feed import (
    FedTask,
    Position,
    TaskSequence,
    assign_region,
    fed_id,
    listed_tasks,
    load_position,
    position_matches,
    task_seed,
    task_sequence,
    task_source,
    verifier_for,
)
from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage, TopologyError
from rlbus.messages.history import Start, read_batches, stored_at
from rlbus.messages.kv import put_at
from rlbus.messages.schemas import Rollout, WeightManifest
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.subjects import LATEST_KEY, POSITION_KEY

log = structlog.get_logger()

LEVELS_KEPT: Final = 1 << 16
"""Curriculum: the levels of this many of the latest fed tasks are kept, to place their rollouts' rewards."""



class Feeder(Actor):
    """Keeps every region's TASKS backlog at `backlog_per_region`.

    Task sources: the built-in family `model.tasks.train_tasks(seed)`, HumanEval's problems of
    `tasks = "humaneval"`, the built-in repository tasks of `tasks = "repo"` / `"repo:LEVEL"`, the repository
    task file of `tasks = "PATH"`, or a JSONL file of tasks (the layouts: actors/common/feed.py); a listed source is
    fed for `epochs` (default: without end), each epoch after the first shuffled, its tasks under ids "ID~eE".
    A finite sequence fed to its end is said once: the log line `feed_exhausted` and the gauge `exhausted`. The lockstep
    schedule (`lockstep`) feeds one batch of tasks per new policy version, for the synchronous arm of
    `rlbus bench async`.

    Task `i` of the sequence goes to region `assign_region(seed, i, weights)`, a pure function, and only
    there. Each region has its own cursor (the next sequence index it has not been given), so a cut-off
    region stops only its own cursor: its tasks wait for it, never move elsewhere (a retry reuses the msg id
    `task_id`, so the region's stream stores it once) and the other regions keep going. The cursors are
    saved after every batch of publishes; a restarted feeder republishes at most the tasks after the last
    save, which the streams' duplicate window drops: nothing is repeated, nothing skipped.

    With `[feeder.curriculum]` the sequence is a `CurriculumSequence`: the feeder follows the hub's ROLLOUTS
    (from its start on), gives each rollout's reward to a `LevelCurriculum` by the level of its task (tasks it
    fed; rollouts of tasks fed before a restart are not placed), and when that opens a level it starts a new
    stage at the first index not drawn yet and saves the position before publishing any task of it: the saved
    stages rebuild the same sequence after a restart and for the task ledger. A restarted feeder keeps the
    levels it opened; the pass-rate windows fill again from new rollouts.
    """

    kind = "feeder"

    def __init__(self, ident: ActorId, bus: Bus, config: FeederConfig, limits: ActorLimits | None = None,
                 launch: FeederLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config
        self.launch = launch or FeederLaunch()
        self.weights = feed_weights(config, self.launch, ident.region)
        self.source = task_source(config, self.launch)
        self._file_source = names_task_file(config.tasks) and config.tasks_file is None
        """Repository tasks from a file: their verifiers carry the reference edit (`verifier_for`)."""
        self.cursors: dict[str, int] = {r: 0 for r, _ in self.weights}
        self.fed_versions: dict[str, int] = {}
        """Lockstep: per region, the last policy version whose batch it was given."""
        self._revision: int | None = None
        self._save_lock = anyio.Lock()
        self._troubled: set[str] = set()
        self._listed: list[FedTask] | None = None
        self.tasks: TaskSequence | CurriculumSequence[FedTask]
        self.curriculum: LevelCurriculum | None = None
        self._task_levels: dict[str, int] = {}
        """Curriculum: task id → level of the latest `LEVELS_KEPT` tasks fed."""
        self._opened: int | None = None
        """Curriculum: a level the rewards opened that no stage starts yet (`_start_stage`)."""
        self._since = time.time()
        self.counters.update(dict.fromkeys(("tasks", "duplicates", "publish_failures"), 0))

    async def setup(self) -> None:
        if not self.weights:
            raise TopologyError(f"feeder: region_weights {self.config.region_weights} give no region of "
                                f"{self.launch.regions or [self.ident.region]} a share; give at least one a "
                                f"positive weight")
        self._listed = await anyio.to_thread.run_sync(listed_tasks, self.config)
        self.tasks = task_sequence(self.config, self.launch, self._listed)
        self.kv = await self.bus.js.key_value(self.bus.subjects.partials_bucket(self.ident.region))
        self._since = time.time()
        await self._load_position()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            if self.curriculum is not None:
                tg.start_soon(self._watch_rewards)
            if self.config.lockstep:
                for region, _ in self.weights:
                    tg.start_soon(self._lockstep, region)
            else:
                await self._poll()

    async def _poll(self) -> None:
        """Top every region up, save the cursors, every `poll_interval_s`, forever."""
        while True:
            fed = 0
            backlogs = {region: await self._backlog(region) for region, _ in self.weights}   # one read a poll
            room = await self._room(backlogs)
            for region, _ in self.weights:
                n = await self._top_up(region, backlogs[region], room)
                fed += n
                room = None if room is None else room - n
            self.tasks.forget_below(min(self.cursors.values()))
            self.gauges["position"] = float(min(self.cursors.values()))
            if fed:
                await self._save_position()
            self.count("polls")                    # a whole poll done: what a watcher waits on, never a clock
            if self._exhausted():
                self._report_exhausted()
                await anyio.sleep_forever()
            await anyio.sleep(self.config.poll_interval_s)

    # ---- feeding --------------------------------------------------------------------------------
    def _next_index(self, region: str) -> int | None:
        """The first index at or after the region's cursor assigned to it, or None past the end."""
        index = self.cursors[region]
        while self.tasks.end is None or index < self.tasks.end:
            if assign_region(self.config.seed, index, self.weights) == region:
                return index
            index += 1
        return None

    def _exhausted(self) -> bool:
        return all(self._next_index(r) is None for r, _ in self.weights)

    def _report_exhausted(self) -> None:
        """Say once that a finite sequence is fed to its end: the log line `feed_exhausted` and the heartbeat gauge
        `exhausted` (the sequence's length, what `rlbus up` prints). Nothing more is fed to train on."""
        if "exhausted" in self.gauges:
            return
        assert self.tasks.end is not None
        self.gauges["exhausted"] = float(self.tasks.end)
        log.info("feed_exhausted", tasks=self.tasks.end, source=self.source, published=self.counters.get("tasks", 0),
                 cursors=self.cursors)

    async def _backlog(self, region: str) -> int | None:
        """Messages in the region's TASKS stream, or None when its server does not answer."""
        js = self.bus.jetstream(self.launch.domains.get(region, region))
        try:
            with anyio.fail_after(max(1.0, self.config.poll_interval_s * 2)):
                info = await js.stream_info(self.bus.subjects.tasks_stream(region))
        except (nats.errors.Error, TimeoutError) as err:
            self.count("region_unreachable")
            self._trouble(region, "feeder_region_unreachable", error=repr(err))
            return None
        return int(info.state.messages)

    async def _room(self, backlogs: dict[str, int | None]) -> int | None:
        """Tasks the regions may still be given under `max_rollouts_ahead` (None: no bound): the bound less the
        tasks queued in every region that answers (`backlogs`, x group size) and the rollouts waiting for the
        trainer, in tasks; 0 while the trainer's consumer does not answer."""
        bound = self.config.max_rollouts_ahead
        if bound is None:
            return None
        hub = self.launch.hub or self.ident.region
        js = self.bus.jetstream(self.launch.domains.get(hub, hub))
        try:
            with anyio.fail_after(max(1.0, self.config.poll_interval_s * 2)):
                info = await js.consumer_info(self.bus.subjects.hub_rollouts_stream(),
                                              self.bus.subjects.durable("trainer"))
        except nats.js.errors.NotFoundError:
            waiting = 0                            # no trainer consumer yet: nothing handed on, nothing waiting
        except (nats.errors.Error, TimeoutError) as err:
            self.count("trainer_unreachable")
            self._trouble(hub, "feeder_trainer_queue_unknown", error=repr(err))
            return 0
        else:
            waiting = int(info.num_pending)
        queued = sum(b or 0 for b in backlogs.values())    # a cut-off region's tasks wait there; the others go on
        ahead = queued * self.launch.group_size + waiting
        self.gauges["rollouts_ahead"] = float(ahead)
        return max(0, (bound - ahead) // self.launch.group_size)

    def _trouble(self, region: str, event: str, **fields: str) -> None:
        """Log a region's trouble once per outage (polls repeat it every `poll_interval_s`)."""
        if region not in self._troubled:
            self._troubled.add(region)
            log.warning(event, region=region, **fields)

    def _fine(self, region: str) -> None:
        if region in self._troubled:
            self._troubled.discard(region)
            log.info("feeder_region_back", region=region)

    async def _top_up(self, region: str, backlog: int | None, room: int | None = None) -> int:
        """Publish the region's next tasks until its `backlog` (None: its server did not answer) is at the bound,
        at most `room` of them (None: no limit); returns how many."""
        if backlog is None:
            return 0
        if backlog >= self.config.backlog_per_region:
            self._fine(region)
        self.gauges[f"backlog_{region}"] = float(backlog)
        fed = 0
        with self.busy():
            while backlog + fed < self.config.backlog_per_region and (room is None or fed < room):
                if not await self._publish_next(region):
                    break        # the end, or retried next poll (same region, same msg id)
                fed += 1
        if fed:
            log.info("feeder_topped_up", region=region, tasks=fed, backlog=backlog + fed,
                     cursor=self.cursors[region])
        return fed

    async def _publish_next(self, region: str, min_version: int = 0) -> bool | None:
        """Publish the region's next task and advance its cursor: True; False: the publish failed (try
        again later, same msg id); None: the sequence has no task left for the region."""
        index = self._next_index(region)
        if index is None:
            return None
        if self._opened is not None:
            await self._start_stage()
        message = self._message(index, region, min_version)
        try:
            ack = await self.bus.publish(self.bus.subjects.tasks(region), message, msg_id=message.task_id)
        except (nats.errors.Error, TimeoutError) as err:
            self.count("publish_failures")
            self._trouble(region, "feeder_publish_failed", task_id=message.task_id, error=repr(err))
            return False
        self._fine(region)
        self.cursors[region] = index + 1
        self.count("duplicates" if ack.duplicate else "tasks")
        return True

    def _message(self, index: int, region: str, min_version: int = 0) -> TaskMessage:
        task, task_id = self.tasks.get(index), fed_id(self.tasks, index)
        if self.curriculum is not None:
            self._task_levels[task_id] = task.level
            if len(self._task_levels) > LEVELS_KEPT:
                del self._task_levels[next(iter(self._task_levels))]
        return TaskMessage(task_id=task_id, prompt=task.prompt,
                           verifier=verifier_for(task, with_reference=self._file_source), group_size=self.launch.group_size, region=region,
                           seed=task_seed(self.config.seed, index), min_version=min_version)

    # ---- curriculum -----------------------------------------------------------------------------
    async def _watch_rewards(self) -> None:
        """Follow the hub's ROLLOUTS from the feeder's start (or the last one read, after an outage) and give each
        rollout of a task it fed to the curriculum; an unreachable hub is retried every `poll_interval_s`."""
        assert self.curriculum is not None
        hub = self.launch.hub or self.ident.region
        js = self.bus.jetstream(self.launch.domains.get(hub, hub))
        last_seq = 0
        while True:
            try:
                async for msgs in read_batches(js, self.bus.subjects.hub_rollouts_stream(), follow=True,
                                               start=Start.since(self._since)):
                    for msg in msgs:
                        if msg.metadata.sequence.stream <= last_seq:
                            continue
                        last_seq, self._since = msg.metadata.sequence.stream, stored_at(msg)
                        self._observe(msg.data, msg.headers)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as err:
                self.count("rewards_unreadable")
                self._trouble(hub, "feeder_rewards_unreadable", error=repr(err))
                await anyio.sleep(self.config.poll_interval_s)

    def _observe(self, data: bytes, headers: Mapping[str, str] | None) -> None:
        """Give one stored rollout's reward to the curriculum, by its task's level; note a level it opens."""
        assert self.curriculum is not None
        try:
            rollout = codec.decode_as(data, headers, Rollout)
        except BadMessage:
            self.count("rewards_unreadable")
            return
        level = self._task_levels.get(rollout.task_id)
        if level is None:
            self.count("rewards_unplaced")          # a task fed before this feeder started
            return
        self.count("rewards_observed")
        if self.curriculum.observe(level, rollout.reward):
            self._opened = self.curriculum.top
            log.info("feeder_curriculum_level_opened", level=self.curriculum.top,
                     pass_rate=self.curriculum.pass_rate(level))
        if (rate := self.curriculum.pass_rate(level)) is not None:
            self.gauges[f"pass_rate_level_{level}"] = rate

    async def _start_stage(self) -> None:
        """Start the stage of the level the rewards opened at the first index not drawn yet, and save it before
        any task of it is published."""
        assert isinstance(self.tasks, CurriculumSequence) and self._opened is not None
        top, self._opened = self._opened, None
        first = self.tasks.raise_to(top)
        self.gauges["curriculum_top"] = float(top)
        log.info("feeder_curriculum_stage", top=top, first_index=first, stages=self.tasks.stages)
        await self._save_position()

    # ---- lockstep -------------------------------------------------------------------------------
    async def _lockstep(self, region: str) -> None:
        """Follow the region's LATEST weights key; for each version newer than the last one fed, publish
        `backlog_per_region` tasks with `min_version` = that version (a failed publish is retried after
        `poll_interval_s`), then save the position. No timer: the next batch waits for the next version."""
        js = self.bus.jetstream(self.launch.domains.get(region, region))
        kv = await js.key_value(self.bus.subjects.latest_bucket(region))
        watcher = await kv.watch(LATEST_KEY)
        try:
            async for entry in watcher:
                if entry is None or not entry.value:     # end-of-history marker, delete or purge
                    continue
                try:
                    version = codec.decode_as(entry.value, None, WeightManifest).version
                except BadMessage as err:
                    log.warning("feeder_manifest_unreadable", region=region, error=str(err))
                    continue
                if version <= self.fed_versions.get(region, -1):
                    continue
                fed = 0
                with self.busy():
                    while fed < self.config.backlog_per_region:
                        published = await self._publish_next(region, min_version=version)
                        if published is None:
                            break
                        if published:
                            fed += 1
                        else:
                            await anyio.sleep(self.config.poll_interval_s)
                self.fed_versions[region] = version
                if self._exhausted():
                    self._report_exhausted()
                self.tasks.forget_below(min(self.cursors.values()))
                self.gauges["position"] = float(min(self.cursors.values()))
                log.info("feeder_lockstep_batch", region=region, version=version, tasks=fed,
                         cursor=self.cursors[region])
                await self._save_position()
        finally:
            with anyio.move_on_after(2.0, shield=True):
                await watcher.stop()

    # ---- position -------------------------------------------------------------------------------
    async def _load_position(self) -> None:
        """Resume the saved cursors. :raises BadMessage: the saved position is unreadable (`load_position`)."""
        saved, self._revision = await load_position(self.kv, self.bus.subjects.partials_bucket(self.ident.region))
        matches = saved is not None and position_matches(saved, self.config, self.launch, self.ident.region)
        self._restore_curriculum(saved.stages if saved is not None and matches else [])
        if saved is None:
            log.info("feeder_position_new", source=self.source)
            return
        if not matches:
            start = max(saved.cursors.values(), default=0)
            log.warning("feeder_assignment_changed", saved_seed=saved.seed, saved_source=saved.source,
                        saved_weights=saved.weights, restart_at=start)
            self.cursors = {r: start for r in self.cursors}
        else:
            self.cursors = {r: saved.cursors.get(r, 0) for r in self.cursors}
            self.fed_versions = {r: v for r, v in saved.versions.items() if r in self.cursors}
        log.info("feeder_position_loaded", cursors=self.cursors)

    def _restore_curriculum(self, stages: list[tuple[int, int]]) -> None:
        """Under a curriculum, the sequence of the saved `stages` (none: the first stage), and the highest open
        level its last stage says (the pass-rate windows are kept across a reload)."""
        if self.config.curriculum is None:
            return
        self.tasks = task_sequence(self.config, self.launch, self._listed, stages)
        assert isinstance(self.tasks, CurriculumSequence)
        top = self.tasks.stages[-1][1]
        if self.curriculum is None:
            self.curriculum = LevelCurriculum(self.config.curriculum, REPO_LEVELS, top)
        self.curriculum.top = top
        self._opened = None
        self.gauges["curriculum_top"] = float(top)

    async def _save_position(self) -> None:
        """Compare-and-set the cursors; a lost race (two feeders) reloads the winner's position."""
        async with self._save_lock:      # lockstep saves from one task per region
            await self._save_position_locked()

    async def _save_position_locked(self) -> None:
        value = msgspec.json.encode(Position(seed=self.config.seed, source=self.source,
                                             weights=dict(self.weights), cursors=dict(self.cursors),
                                             versions=dict(self.fed_versions),
                                             stages=self.tasks.stages if isinstance(self.tasks, CurriculumSequence) else []))
        bucket = self.bus.subjects.partials_bucket(self.ident.region)
        try:
            self._revision = await put_at(self.bus.js, bucket, POSITION_KEY, value, revision=self._revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            log.warning("feeder_position_conflict")
            self.count("position_conflicts")
            await self._load_position()


def build_feeder(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                 launch: FeederLaunch | None = None) -> Feeder:
    """`actors/kinds.py` entry: the topology's `[feeder]` section as plain values.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Feeder(ident, bus, decode_config("feeder", settings, FeederConfig), limits, launch)
