"""The ledger's rules on hand-built TRAINLOGs (lineage truncation by restarts, trained twice, lost, drops) and
on hand-built task sets (every fed task rolled out, pending or dead-lettered)."""

from __future__ import annotations

import dataclasses

import pytest

from rlbus.actors.common.ledger import (
    ORIGINAL_MSG_ID_HEADER,
    final_lineage,
    ledger,
    lost,
    reason_category,
    stored_task_id,
    task_ledger,
    trained_twice,
)
from rlbus.messages import codec
from rlbus.messages.schemas import DroppedRollout, Task, TrainStep


def _s(step: int, used: str, dropped: str = "", reason: str = "stale: 3 versions behind (bound 2)") -> TrainStep:
    return TrainStep(step=step, policy_version=step, rollout_ids=list(used),
                     dropped=[DroppedRollout(rollout_id=r, reason=reason) for r in dropped])


# Two incarnations: the first ran steps 1-4, crashed; the second resumed from the mark of step 2.
CRASHED = [_s(1, "ab"), _s(2, "cd"), _s(3, "ef", dropped="g"), _s(4, "hi"),
           _s(3, "fe"), _s(4, "gh", dropped="i", reason="too_long: 600 tokens > max_seq_len 512"), _s(5, "jc")]


def test_a_restart_from_an_older_mark_truncates_the_abandoned_steps() -> None:
    """The resumed step 3 drops the first incarnation's steps 3 and 4: lineage 1, 2, 3', 4', 5."""
    lineage = final_lineage(CRASHED)
    assert [r.step for r in lineage] == [1, 2, 3, 4, 5]
    assert [r.rollout_ids for r in lineage] == [list("ab"), list("cd"), list("fe"), list("gh"), list("jc")]


def test_nested_restarts_keep_only_the_last_branch() -> None:
    """1 2 3 | restart from 1: 2' 3' | restart from 2': 3'' → lineage 1, 2', 3''."""
    log = [_s(1, "a"), _s(2, "b"), _s(3, "c"), _s(2, "x"), _s(3, "y"), _s(3, "z")]
    assert [r.rollout_ids for r in final_lineage(log)] == [["a"], ["x"], ["z"]]


def test_trained_twice_lost_and_drops_are_counted_along_the_lineage() -> None:
    """c is used in steps 2 and 5 (twice); k was produced and never consumed (lost); g, used in 4' after its
    abandoned drop, is trained, not dropped; i is dropped as too_long in 4'."""
    produced = list("abcdefghijk")
    result = ledger(CRASHED, produced)
    assert result.trained_twice == ["c"]
    assert result.lost == ["k"]
    assert result.dropped == {"too_long": 1}
    assert result.produced == 11 and result.trained == 9   # a b c d e f g h j
    assert result.lineage == [1, 2, 3, 4, 5] and result.abandoned_steps == 2
    assert result.unknown == [] and not result.clean


def test_a_clean_run_and_ids_the_stream_does_not_hold() -> None:
    """Every produced id in exactly one lineage step: clean; an id only the TRAINLOG knows is `unknown`."""
    log = [_s(1, "ab"), _s(2, "c", dropped="d")]
    result = ledger(log, "abcd")
    assert result.clean and result.lost == [] and result.trained_twice == [] and result.dropped == {"stale": 1}
    assert ledger(log, "abc").unknown == ["d"]
    assert lost("abcz", log) == ["z"] and trained_twice(log) == []
    assert reason_category("invalid: empty prompt") == "invalid" and reason_category("") == "unknown"


def test_unacknowledged_ids_are_pending_not_lost() -> None:
    """An id in no step whose message the trainer has not acked yet is pending; acked and unused is lost."""
    steps = [TrainStep(step=1, policy_version=1, rollout_ids=["a"])]
    book = ledger(steps, ["a", "b", "c"], pending=["c"])
    assert book.lost == ["b"] and book.pending == ["c"] and not book.clean
    assert ledger(steps, ["a", "c"], pending=["c"]).clean


def test_a_fed_task_in_none_of_the_three_is_lost() -> None:
    """Fed a b c d: a rolled out, b pending, c dead-lettered, d nowhere → d is lost and the ledger unclean."""
    book = task_ledger("abcd", rolled_out="a", pending="b", dead_lettered="c")
    assert book.lost == ["d"] and not book.clean
    assert (book.fed, book.rolled_out, book.pending, book.dead_lettered) == (4, 1, 1, 1)
    assert book.unfed == []


@pytest.mark.parametrize("kind", ["rolled_out", "pending", "dead_lettered"])
def test_each_of_the_three_accounts_for_a_fed_task(kind: str) -> None:
    """A fed task found only as a rollout, only queued, or only in the DLQ is accounted: clean, counted there."""
    found = {"rolled_out": "", "pending": "", "dead_lettered": ""} | {kind: "xy"}
    book = task_ledger("xy", **found)
    assert book.clean and book.lost == []
    counts = {k: getattr(book, k) for k in ("rolled_out", "pending", "dead_lettered")}
    assert counts == {k: (2 if k == kind else 0) for k in counts}


def test_counts_split_the_fed_tasks_once_each_and_unfed_ids_are_no_fault() -> None:
    """A task both rolled out and still queued (acked after its rollouts) counts as rolled out; one both
    dead-lettered and queued counts as dead-lettered; ids never fed (z rolled out, y queued, w dead-lettered)
    are listed as unfed and leave the ledger clean."""
    book = task_ledger(["a", "b", "c", "a"], rolled_out=["a", "a", "z"], pending=["a", "b", "c", "y"],
                       dead_lettered=["b", "w"])
    assert book.clean and book.fed == 3
    assert (book.rolled_out, book.dead_lettered, book.pending) == (1, 1, 1)
    assert book.fed == book.rolled_out + book.dead_lettered + book.pending + len(book.lost)
    assert book.unfed == ["w", "y", "z"]
    assert task_ledger([], rolled_out="z", pending="", dead_lettered="").clean
    with pytest.raises(dataclasses.FrozenInstanceError):
        book.fed = 4  # type: ignore[misc]


def test_a_stored_tasks_id_comes_from_the_task_else_from_its_msg_id_header() -> None:
    """A dead letter whose bytes are not a Task still names its task through the original msg id header."""
    data, headers = codec.encode(Task(task_id="t7", prompt="p"))
    assert stored_task_id(data, headers, ORIGINAL_MSG_ID_HEADER) == "t7"
    assert stored_task_id(b"\xc1garbage", {ORIGINAL_MSG_ID_HEADER: "t8"}, ORIGINAL_MSG_ID_HEADER) == "t8"
    assert stored_task_id(b"\xc1garbage", None, ORIGINAL_MSG_ID_HEADER) is None
