"""The trainer's exactly-once books without a bus: consumed ids, deliveries held for a mark, mark coverage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.actors.trainer.exactly_once import RolloutBook, Seen


def test_a_consumed_rollout_is_held_until_a_mark_of_its_step() -> None:
    """Deliveries of step 1 and 2 are held; a mark of the step-1 upload releases step 1's only."""
    book: RolloutBook[str] = RolloutBook()
    assert book.seen("a", "a#1") is Seen.NEW
    book.consume(1, [("a", "a#1"), ("b", "b#1")])
    book.consume(2, [("c", "c#1")])
    book.uploaded(1, "state-1")
    book.uploaded(2, "state-2")
    assert sorted(book.cover(1, ["state-1", "other"]) or []) == ["a#1", "b#1"]
    assert book.held == {"c": "c#1"} and book.marked_step == 1 and book.uploads == {2: "state-2"}
    assert book.cover(2, ["state-2"]) == ["c#1"]
    assert not book.held and not book.uploads


def test_a_redelivery_is_acked_when_covered_else_held_in_place_of_the_first() -> None:
    """A consumed rollout delivered again: ACK once a mark covers its step, else HELD (the newest delivery kept)."""
    book: RolloutBook[str] = RolloutBook()
    book.consume(1, [("a", "a#1")])
    book.uploaded(1, "s1")
    assert book.seen("a", "a#2") is Seen.HELD and book.held == {"a": "a#2"}
    assert book.cover(1, ["s1"]) == ["a#2"]
    assert book.seen("a", "a#3") is Seen.ACK and not book.held
    assert book.seen("z", "z#1") is Seen.NEW and not book.held


def test_a_mark_of_another_upload_or_an_older_step_releases_nothing() -> None:
    """Marks of another lineage's objects, of a step never uploaded here, or not newer than the last, do nothing."""
    book: RolloutBook[str] = RolloutBook()
    book.consume(3, [("a", "a#1")])
    book.uploaded(3, "mine-3")
    assert book.cover(3, ["theirs-3"]) is None
    assert book.cover(4, ["mine-3"]) is None                 # no upload of step 4 here
    assert book.held == {"a": "a#1"} and book.marked_step == 0
    assert book.cover(3, ["mine-3"]) == ["a#1"]
    book.uploaded(3, "mine-3")                                # the same upload seen again
    assert book.cover(3, ["mine-3"]) is None                  # not newer than the mark


def test_a_resumed_book_acks_what_the_state_consumed_and_records_it() -> None:
    """After resuming from a step-5 state, its ids are covered (ACK) and every later save records them."""
    book: RolloutBook[str] = RolloutBook()
    book.resume(5, ["x", "y"])
    assert book.seen("x", "x#9") is Seen.ACK and book.marked_step == 5
    book.consume(6, [("n", "n#1")])
    assert book.consumed_by(5) == ["x", "y"] and book.consumed_by(6) == ["n", "x", "y"]


def test_a_rollout_cannot_enter_two_steps() -> None:
    """Consuming an id a step already consumed is refused, naming the id and its step; nothing changes."""
    book: RolloutBook[str] = RolloutBook()
    book.consume(1, [("a", "a#1")])
    with pytest.raises(ValueError, match=r"step 2: rollouts \['a'\] were consumed already \(at steps \[1\]\)"):
        book.consume(2, [("b", "b#1"), ("a", "a#2")])
    assert book.consumed == {"a": 1} and book.held == {"a": "a#1"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=30))
def test_every_consumed_delivery_is_released_once_and_only_by_a_covering_mark(
        plan: list[tuple[int, bool, bool]]) -> None:
    """Steps of 0-3 rollouts, each step uploaded or not and marked or not (marks may arrive late): a delivery is
    released at most once, only by a mark at or after its step; a final mark releases everything left."""
    book: RolloutBook[str] = RolloutBook()
    step_of: dict[str, int] = {}
    released: list[str] = []
    unmarked: list[int] = []
    for step, (size, upload, mark) in enumerate(plan, start=1):
        ids = [f"r{step}.{i}" for i in range(size)]
        book.consume(step, [(rid, rid) for rid in ids])
        step_of.update(dict.fromkeys(ids, step))
        if upload:
            book.uploaded(step, f"s{step}")
            unmarked.append(step)
        if mark and unmarked:
            marked = unmarked.pop(0)                           # the oldest upload's mark arrives
            out = book.cover(marked, [f"s{marked}"])
            if out is not None:
                assert all(step_of[rid] <= marked for rid in out)
                released += out
    last = len(plan) + 1
    book.uploaded(last, "final")
    released += book.cover(last, ["final"]) or []
    assert sorted(released) == sorted(step_of) and not book.held and not book.uploads
