"""Publishing a recording back onto a bus, under a (new) run, at a chosen speed.

Owns: `subject_for()` (where each recorded kind goes in the target run), `republish()` (time-scaled,
pipelined publishing with each rollout's id as `Nats-Msg-Id`, so publishing twice stores once) and
`PublishResult`. This is also how a fresh trainer will be fed a recording: publish the rollouts to a new
run's ROLLOUTS and start the trainer on that run (its durable consumer reads them like live ones).
Does not: choose or open the recording (ops/recording/replay.py) or provision streams (messages/streams.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import anyio
import structlog

from rlbus.messages.bus import Bus
from rlbus.messages.schemas import (
    CheckpointMark,
    EvalReport,
    Event,
    Message,
    Rollout,
    TrainStep,
    WeightManifest,
)
from rlbus.messages.subjects import Subjects
from rlbus.ops.recording.playback import Entry

log = structlog.get_logger()

DEFAULT_KINDS: Final = frozenset({"rollout"})
"""What `rlbus replay publish` sends unless told otherwise: the rollouts (what a trainer consumes)."""
_BATCH: Final = 256


@dataclass(slots=True)
class PublishResult:
    """What a publish-back did."""

    published: int = 0
    duplicates: int = 0
    """Publishes the target stream recognised by Nats-Msg-Id and stored no second time."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Kinds that have no subject in a run (e.g. heartbeats), by kind."""
    remapped: dict[str, str] = field(default_factory=dict)
    """Recorded region → target region, for rollouts whose region the target run lacks."""
    seconds: float = 0.0


def subject_for(entry: Entry, subjects: Subjects, *, region: str) -> tuple[str, str | None] | None:
    """(subject, Nats-Msg-Id) of a recorded message in the target run; None for kinds not republished."""
    m = entry.message
    match m:
        case Rollout():
            return subjects.rollouts(region), m.rollout_id
        case TrainStep():
            return subjects.trainlog(), None
        case WeightManifest():
            return subjects.weights(), None
        case CheckpointMark():
            return subjects.checkpoints(), None
        case EvalReport():
            return subjects.evals(), None
        case Event():
            return subjects.events(m.region or region, m.actor_kind or "replay"), None
        case _:
            return None


def recorded_region(entry: Entry) -> str:
    """The region a rollout was published in: the last token of its recorded subject (else its field)."""
    token = entry.subject.rsplit(".", 1)[-1]
    if isinstance(entry.message, Rollout) and not token:
        return entry.message.region
    return token


async def republish(entries: Iterable[Entry], bus: Bus, *, speed: float = 0.0, regions: set[str] | None = None,
                    hub: str = "hub", region: str | None = None,
                    on_progress: Callable[[PublishResult], None] | None = None) -> PublishResult:
    """Publish `entries` (time-ordered) to `bus`'s run.

    `speed` 0 publishes as fast as acks come back; X > 0 keeps the recorded spacing divided by X (2 = twice
    as fast). Rollouts go to `region` if given, else their recorded region when the target has it
    (`regions` None: assume it does), else to `hub`.
    """
    result = PublishResult()
    started = time.monotonic()
    first: float | None = None
    pending: list[tuple[str, Message, str | None]] = []
    last_report = started
    for entry in entries:
        dest = region or recorded_region(entry)
        if region is None and regions is not None and dest not in regions:
            result.remapped.setdefault(dest, hub)
            dest = hub
        target = subject_for(entry, bus.subjects, region=dest)
        if target is None:
            result.skipped[entry.kind] = result.skipped.get(entry.kind, 0) + 1
            continue
        if speed > 0:
            first = entry.time if first is None else first
            due = started + (entry.time - first) / speed
            if (wait := due - time.monotonic()) > 0:
                await _flush(bus, pending, result)       # what is due now goes out before we wait
                await anyio.sleep(wait)
        pending.append((target[0], entry.message, target[1]))
        if len(pending) >= _BATCH:
            await _flush(bus, pending, result)
        if on_progress is not None and time.monotonic() - last_report > 2.0:
            last_report = time.monotonic()
            on_progress(result)
    await _flush(bus, pending, result)
    result.seconds = time.monotonic() - started
    if result.remapped:
        log.warning("replay_regions_remapped", remapped=result.remapped)
    return result


async def _flush(bus: Bus, pending: list[tuple[str, Message, str | None]], result: PublishResult) -> None:
    if not pending:
        return
    acks = await bus.publish_batch(list(pending))
    result.published += len(acks)
    result.duplicates += sum(1 for ack in acks if ack.duplicate)
    pending.clear()
