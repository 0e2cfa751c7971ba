"""The trainer's exactly-once bookkeeping: which step consumed each rollout, and what waits for a mark.

- Owns: `RolloutBook` — consumed rollout ids with the step that trained on or dropped them, the deliveries
  held until a CheckpointMark covers their step, the state uploads awaiting a mark, and the marked step.
- Guarantee: a delivery is released for acking only by a mark of one of this book's own uploads whose step
  covers it; a redelivered rollout that a step already consumed is never consumed again.
- Does not: ack, talk to the bus or train (actors/trainer/actor.py); pure: no NATS, no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from typing import Generic, TypeVar

D = TypeVar("D")
"""A delivery: whatever the caller acks once the book releases it (a JetStream `Delivery` in the trainer)."""


class Seen(enum.Enum):
    """What to do with a delivery of a rollout, by what the book knows of its id."""

    NEW = "new"
    """Never consumed: the caller buffers it for a step."""
    ACK = "ack"
    """Consumed at a step a mark covers (the earlier ack was lost): ack it now."""
    HELD = "held"
    """Consumed at a step no mark covers yet: the book holds it until one does."""


class RolloutBook(Generic[D]):
    """Consumed ids, held deliveries and uploads awaiting a mark, for one trainer incarnation."""

    def __init__(self) -> None:
        self.consumed: dict[str, int] = {}
        """Rollout id -> the step that trained on or dropped it (ids of a resumed state: the mark's step)."""
        self.held: dict[str, D] = {}
        """Consumed rollouts not yet covered by a mark: released by the mark that covers their step."""
        self.uploads: dict[int, str] = {}
        """Step -> first object name of this incarnation's state uploads not yet covered by a mark."""
        self.marked_step = 0
        """The step of the newest mark of this book's uploads (or of the state it resumed from)."""

    def resume(self, step: int, consumed: Iterable[str]) -> None:
        """Start from a checkpoint of `step` (covered by its mark) whose state consumed the ids `consumed`."""
        self.marked_step = step
        self.consumed = {rid: step for rid in consumed}

    def seen(self, rollout_id: str, delivery: D) -> Seen:
        """A delivery of `rollout_id` arrived: NEW, ACK, or HELD (then the book keeps `delivery`, replacing an
        earlier delivery of the same id)."""
        done_at = self.consumed.get(rollout_id)
        if done_at is None:
            return Seen.NEW
        if done_at <= self.marked_step:
            return Seen.ACK
        self.held[rollout_id] = delivery
        return Seen.HELD

    def consume(self, step: int, deliveries: Iterable[tuple[str, D]]) -> None:
        """Step `step` trained on or dropped these (rollout id, delivery) pairs: each is held until a mark covers
        `step`.

        :raises ValueError: an id was consumed before (it would enter two steps).
        """
        deliveries = list(deliveries)
        if twice := sorted({rid for rid, _ in deliveries if rid in self.consumed}):
            raise ValueError(f"step {step}: rollouts {twice[:5]} were consumed already (at steps "
                             f"{sorted({self.consumed[r] for r in twice})})")
        for rid, delivery in deliveries:
            self.consumed[rid] = step
            self.held[rid] = delivery

    def consumed_by(self, step: int) -> list[str]:
        """Sorted ids consumed at or before `step`: what a state saved at `step` records."""
        return sorted(rid for rid, at in self.consumed.items() if at <= step)

    def uploaded(self, step: int, first_object: str) -> None:
        """This incarnation uploaded the state of `step`; a mark naming `first_object` covers it."""
        self.uploads[step] = first_object

    def cover(self, step: int, objects: Collection[str]) -> list[D] | None:
        """A CheckpointMark of `step` listing `objects`. When it marks one of this book's uploads and is newer
        than the last mark: forget the uploads up to `step` and release every held delivery consumed at or
        before it. -> the deliveries to ack; None when the mark is not this book's or not newer."""
        if self.uploads.get(step) not in objects or step <= self.marked_step:
            return None
        self.marked_step = step
        for done in [s for s in self.uploads if s <= step]:
            del self.uploads[done]
        covered = [rid for rid in self.held if self.consumed[rid] <= step]
        return [self.held.pop(rid) for rid in covered]
