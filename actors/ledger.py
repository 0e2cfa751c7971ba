"""The exactly-once ledger: walk TRAINLOG along the final checkpoint lineage and account for every rollout.

Owns: the pure rules — `final_lineage` (in stream order, a TrainStep whose step is ≤ the last kept step
truncates the lineage back to before it: a trainer restarted from an older checkpoint abandons the steps
after it), `trained_twice` (an id used in two steps of the final lineage), `lost` (in ROLLOUTS, in no step
of the final lineage and never dropped there), `ledger` (the summary) — and `read_ledger(bus)`, which
reads TRAINLOG and the hub's ROLLOUTS through ephemeral consumers and applies them.
Does not: judge pending work (a rollout not yet consumed counts as lost until it is: read the ledger once
the trainer has caught up) or check tasks (the feeder's side).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import Message, Rollout, TrainStep

log = structlog.get_logger()

M = TypeVar("M", bound=Message)


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
    """The steps that survive, in order: each record drops every kept step with step >= its own first."""
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


async def read_ledger(bus: Bus, *, domain: str | None = None) -> Ledger:
    """Read TRAINLOG and the hub's ROLLOUTS as they are now and return the `Ledger`.

    `domain`: the hub's JetStream domain when `bus` is connected elsewhere. Needs only JetStream API rights.
    """
    s = bus.subjects
    js = bus.jetstream(domain) if domain is not None else bus.js
    floor = (await js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))).ack_floor
    acked_through = int(floor.stream_seq) if floor is not None and floor.stream_seq is not None else 0
    steps = await read_all(js, s.trainlog_stream(), s.trainlog(), TrainStep)
    rollouts = await _read(js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout)
    return ledger(steps, [r.rollout_id for _, r in rollouts],
                  pending=[r.rollout_id for seq, r in rollouts if seq > acked_through])


async def read_all(js: JetStreamContext, stream: str, subject: str, kind: type[M], *,
                   timeout_s: float = 60.0) -> list[M]:
    """Every message of `kind` on `subject` in `stream` as stored when the call began, in stream order.

    Messages that do not decode as `kind` are skipped (logged). Uses an ephemeral, unacknowledged consumer.
    """
    return [message for _, message in await _read(js, stream, subject, kind, timeout_s=timeout_s)]


async def _read(js: JetStreamContext, stream: str, subject: str, kind: type[M], *,
                timeout_s: float = 60.0) -> list[tuple[int, M]]:
    """`read_all` with each message's stream sequence."""
    info = await js.stream_info(stream)
    if not info.state.messages:
        return []
    name = f"ledger-{uuid.uuid4().hex[:12]}"
    await js.add_consumer(stream, ConsumerConfig(
        name=name, filter_subject=subject, ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
        inactive_threshold=30.0, mem_storage=True, num_replicas=1))
    psub = await js.pull_subscribe_bind(consumer=name, stream=stream)
    out: list[tuple[int, M]] = []
    last = int(info.state.last_seq)
    try:
        with anyio.fail_after(timeout_s):
            while True:
                try:
                    msgs = await psub.fetch(256, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    if (await psub.consumer_info()).num_pending == 0:
                        return out
                    continue
                for msg in msgs:
                    try:
                        out.append((int(msg.metadata.sequence.stream), codec.decode_as(msg.data, msg.headers, kind)))
                    except BadMessage as err:
                        log.warning("ledger_message_skipped", stream=stream, error=str(err))
                    meta = msg.metadata
                    if meta.sequence.stream >= last or meta.num_pending == 0:
                        return out
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await psub.unsubscribe()
            try:
                await js.delete_consumer(stream, name)
            except nats.js.errors.NotFoundError:
                pass
