"""The exactly-once ledger: every rollout along the final checkpoint lineage, and every task the feeder fed.

- Owns: the pure rules (`final_lineage`, `trained_twice`, `lost`, `ledger`, `task_ledger`) and
  `read_ledger(bus)` / `read_task_ledger(bus, config, …)`, which read the streams and apply them.
- Does not: wait for work in flight (a task whose rollouts are still on their way from a leaf to the hub's
  ROLLOUTS counts as lost until they arrive), or decide which ids a cursor covers (actors/feeder.py
  `fed_task_ids`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from rlbus.actors.common.config import FeederConfig, FeederLaunch, feed_weights
from rlbus.actors.common.feed import fed_task_ids, position_matches, read_position, task_source
from rlbus.messages import codec
from rlbus.messages.bus import MSG_ID_HEADER, Bus
from rlbus.messages.errors import BadMessage, TopologyError
from rlbus.messages.history import read_all, read_messages, read_raw
from rlbus.messages.schemas import Rollout, Task, TrainStep

log = structlog.get_logger()

ORIGINAL_MSG_ID_HEADER: Final = "Rlbus-Original-" + MSG_ID_HEADER
"""Where a dead letter keeps its original's `Nats-Msg-Id` (messages/bus.py `store_dead_letter`): a task's id."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """Where every produced rollout ended up along the final lineage."""

    produced: int
    """Distinct rollout ids in ROLLOUTS."""
    trained: int
    """Distinct ids used by a step of the final lineage."""
    dropped: dict[str, int]
    """Ids dropped by a step of the final lineage, by reason category (the text before ':')."""
    lost: list[str]
    trained_twice: list[str]
    lineage: list[int]
    """Steps of the final lineage, in order."""
    abandoned_steps: int
    """TrainSteps truncated away by restarts from older checkpoints."""
    unknown: list[str] = field(default_factory=list)
    """Ids a lineage step used or dropped that ROLLOUTS does not hold (e.g. aged out)."""
    pending: list[str] = field(default_factory=list)
    """Ids in no step that the trainer has not acknowledged yet: still on their way (not lost)."""

    @property
    def clean(self) -> bool:
        """Nothing lost and nothing trained twice."""
        return not self.lost and not self.trained_twice


def final_lineage(steps: Iterable[TrainStep]) -> list[TrainStep]:
    """The steps that survive, in order: each record drops every kept step with step >= its own first
    (a trainer restarted from an older checkpoint abandons the steps after it)."""
    kept: list[TrainStep] = []
    for record in steps:
        while kept and kept[-1].step >= record.step:
            kept.pop()
        kept.append(record)
    return kept


def trained_twice(lineage: Sequence[TrainStep]) -> list[str]:
    """Ids used more than once across the lineage's steps (sorted)."""
    uses = Counter(rid for record in lineage for rid in record.rollout_ids)
    return sorted(rid for rid, n in uses.items() if n > 1)


def lost(produced: Iterable[str], lineage: Sequence[TrainStep]) -> list[str]:
    """Produced ids that no lineage step used or dropped (sorted)."""
    seen = {rid for record in lineage for rid in record.rollout_ids}
    seen |= {d.rollout_id for record in lineage for d in record.dropped}
    return sorted(set(produced) - seen)


def reason_category(reason: str) -> str:
    """"stale: 3 versions behind (bound 2)" → "stale"."""
    return reason.split(":", 1)[0].strip() or "unknown"


def ledger(steps: Sequence[TrainStep], produced: Iterable[str], pending: Iterable[str] = ()) -> Ledger:
    """Apply the rules to TRAINLOG's records (stream order) and the ids stored in ROLLOUTS.

    `pending`: ids whose ROLLOUTS message the trainer has not acknowledged yet (a run stopped, or still
    running, before they were trained); in no step, they are pending, not lost."""
    produced_ids = set(produced)
    waiting = set(pending)
    lineage = final_lineage(steps)
    used = {rid for record in lineage for rid in record.rollout_ids}
    drops = {d.rollout_id: d.reason for record in lineage for d in record.dropped}
    return Ledger(
        produced=len(produced_ids), trained=len(used),
        dropped=dict(Counter(reason_category(r) for r in drops.values())),
        lost=[rid for rid in lost(produced_ids, lineage) if rid not in waiting],
        trained_twice=trained_twice(lineage),
        lineage=[record.step for record in lineage], abandoned_steps=len(steps) - len(lineage),
        unknown=sorted((used | set(drops)) - produced_ids),
        pending=sorted(waiting - used - set(drops)))


@dataclass(frozen=True, slots=True)
class TaskLedger:
    """Where every task the feeder fed ended up. The counts split `fed`: fed = rolled_out + dead_lettered +
    pending + len(lost); a task in several places counts once, in that order."""

    fed: int
    """Distinct task ids below the feeder's saved cursors."""
    rolled_out: int
    """Fed ids with at least one Rollout in the hub's ROLLOUTS."""
    dead_lettered: int
    """Fed ids, not rolled out, whose task is in the DLQ."""
    pending: int
    """Fed ids, neither rolled out nor dead-lettered, still queued in their region's TASKS."""
    lost: list[str]
    """Fed ids in none of the three (sorted)."""
    unfed: list[str] = field(default_factory=list)
    """Ids rolled out, dead-lettered or queued that the cursors do not cover (sorted): fed after the cursors
    were saved, or by another feeder config. Not a loss."""

    @property
    def clean(self) -> bool:
        """No fed task is lost."""
        return not self.lost


def task_ledger(fed: Iterable[str], rolled_out: Iterable[str], pending: Iterable[str],
                dead_lettered: Iterable[str]) -> TaskLedger:
    """Every fed id is rolled out (some Rollout has it as `task_id`), dead-lettered or pending; any other is
    lost. Ids in the last three that were never fed are reported as `unfed`, not as a fault."""
    fed_ids, done, queued, dead = set(fed), set(rolled_out), set(pending), set(dead_lettered)
    rolled = fed_ids & done
    lettered = (fed_ids & dead) - rolled
    waiting = (fed_ids & queued) - rolled - lettered
    return TaskLedger(fed=len(fed_ids), rolled_out=len(rolled), dead_lettered=len(lettered),
                      pending=len(waiting), lost=sorted(fed_ids - done - dead - queued),
                      unfed=sorted((done | dead | queued) - fed_ids))


async def read_ledger(bus: Bus, *, domain: str | None = None) -> Ledger:
    """Read TRAINLOG and the hub's ROLLOUTS as they are now and return the `Ledger`.

    `domain`: the hub's JetStream domain when `bus` is connected elsewhere. Needs only JetStream API rights.
    """
    s = bus.subjects
    js = bus.jetstream(domain) if domain is not None else bus.js
    floor = (await js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))).ack_floor
    acked_through = int(floor.stream_seq) if floor is not None and floor.stream_seq is not None else 0
    steps = await read_all(js, s.trainlog_stream(), s.trainlog(), TrainStep)
    rollouts = await read_messages(js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout)
    return ledger(steps, [r.rollout_id for _, r in rollouts],
                  pending=[r.rollout_id for seq, r in rollouts if seq > acked_through])


async def read_task_ledger(bus: Bus, config: FeederConfig, launch: FeederLaunch, *, feeder_region: str, hub_domain: str | None = None,
                           timeout_s: float = 60.0) -> TaskLedger:
    """Read the feeder's saved cursors, every fed region's TASKS, the hub's DLQ and ROLLOUTS as they are now and
    return the `TaskLedger`. Every region's TASKS is read by sequence and the hub's DLQ and ROLLOUTS through
    ephemeral consumers. A task whose rollouts are still on their way from a leaf to the hub's ROLLOUTS
    counts as lost until they arrive.

    `config`, `launch`: the feeder's settings and what the launcher passed beside them (regions, domains);
    `feeder_region`: the region the feeder runs in (its cursors are in that region's PARTIALS KV).
    Regions are reached through `launch.domains` (default: the region name), as the feeder reaches them;
    `hub_domain`: the hub's JetStream domain when `bus` is connected elsewhere (None: `bus`'s own server).
    Read in this order so that a task moving on meanwhile is still found: cursors, then queued tasks, then
    dead letters and rollouts (a generator publishes its rollouts or dead letter before it acks the task).
    Needs only JetStream API rights.

    :raises TopologyError: the saved position belongs to another seed, task source or weights.
    :raises BadMessage: the saved position is unreadable.
    """
    position = await read_position(bus, feeder_region, domain=launch.domains.get(feeder_region, feeder_region))
    cursors: dict[str, int] = {}
    stages: list[tuple[int, int]] = []
    if position is not None:
        if not position_matches(position, config, launch, feeder_region):
            raise TopologyError(
                f"feeder position in region {feeder_region!r} (seed {position.seed}, source {position.source!r}, "
                f"weights {position.weights}) was not saved under this feeder config (seed {config.seed}, source "
                f"{task_source(config, launch)!r}, weights {dict(feed_weights(config, launch, feeder_region))}); pass the config the "
                f"feeder ran with")
        cursors, stages = position.cursors, position.stages
    fed = fed_task_ids(config, launch, cursors, feeder_region, stages=stages)
    s = bus.subjects
    pending: list[str] = []
    for region in fed:
        js = bus.jetstream(launch.domains.get(region, region))
        pending += await queued_task_ids(js, s.tasks_stream(region), s.tasks(region))
    hub = bus.jetstream(hub_domain) if hub_domain is not None else bus.js
    task_letters = {s.dead_letter(s.tasks_stream(region)) for region in fed}
    dead: list[str] = []
    for msg in await read_raw(hub, s.dead_letter_stream(), s.all_dead_letters(), timeout_s=timeout_s):
        if msg.subject not in task_letters:
            continue                               # a dead rollout, request, ...: not a task
        task_id = stored_task_id(msg.data, msg.headers, ORIGINAL_MSG_ID_HEADER)
        if task_id is None:
            log.warning("ledger_dead_letter_without_task_id", subject=msg.subject)
        else:
            dead.append(task_id)
    rollouts = await read_messages(hub, s.hub_rollouts_stream(), s.all_rollouts(), Rollout, timeout_s=timeout_s)
    book = task_ledger([i for ids in fed.values() for i in ids], [r.task_id for _, r in rollouts], pending, dead)
    log.info("task_ledger", fed=book.fed, rolled_out=book.rolled_out, dead_lettered=book.dead_lettered,
             pending=book.pending, lost=len(book.lost), unfed=len(book.unfed))
    return book


async def queued_task_ids(js: JetStreamContext, stream: str, subject: str) -> list[str]:
    """Ids of the tasks now stored in a TASKS work queue, in stream order, read by sequence (`get_msg` next by
    subject: a work queue takes no second consumer, and acked tasks leave gaps)."""
    info = await js.stream_info(stream)
    out: list[str] = []
    if not info.state.messages:
        return out
    seq, last = int(info.state.first_seq), int(info.state.last_seq)
    while seq <= last:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            break                                  # nothing stored at or after `seq` any more
        if raw.seq is None or raw.seq > last:
            break
        task_id = stored_task_id(raw.data or b"", raw.headers, MSG_ID_HEADER)
        if task_id is None:
            log.warning("ledger_task_without_id", stream=stream, seq=raw.seq)
        else:
            out.append(task_id)
        seq = int(raw.seq) + 1
    return out


def stored_task_id(data: bytes, headers: Mapping[str, str] | None, id_header: str) -> str | None:
    """The id of a stored task: decoded from the Task, else the msg id the feeder published it with."""
    try:
        return codec.decode_as(data, headers, Task).task_id
    except BadMessage:
        return (headers or {}).get(id_header)
