"""The ledger's rules on hand-built TRAINLOGs: lineage truncation by restarts, trained twice, lost, drops."""

from __future__ import annotations

from rlbus.actors.ledger import final_lineage, ledger, lost, reason_category, trained_twice
from rlbus.messages.schemas import DroppedRollout, TrainStep


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
