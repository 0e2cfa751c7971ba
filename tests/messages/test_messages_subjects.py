"""Subject names: one scheme under rlbus.<run>., validated tokens, and role permissions."""

from __future__ import annotations

import pytest

from rlbus.messages.errors import SubjectError
from rlbus.messages.subjects import ROLES, Subjects, role_permissions


def test_subjects_live_under_the_run() -> None:
    """Every subject of a run starts with rlbus.<run>."""
    s = Subjects("r1")
    assert s.tasks("eu") == "rlbus.r1.tasks.eu"
    assert s.rollouts("eu") == "rlbus.r1.rollouts.eu"
    assert s.health("eu", "generator", "g-1") == "rlbus.r1.health.eu.generator.g-1"
    assert s.dead_letter("ROLLOUTS_r1") == "rlbus.r1.dlq.ROLLOUTS_r1"
    assert s.tasks_stream("eu") == "TASKS_r1_eu"
    assert s.hub_rollouts_stream() == "ROLLOUTS_r1"


@pytest.mark.parametrize("bad", ["eu.west", "a b", "*", ">", "", "eu/1", "ü"])
def test_bad_tokens_are_refused(bad: str) -> None:
    """A region that would add or wildcard a subject token is refused with the reason."""
    with pytest.raises(SubjectError, match="cannot be a subject token"):
        Subjects("r1").tasks(bad)
    with pytest.raises(SubjectError):
        Subjects(bad)


def test_generator_may_not_publish_trainer_subjects() -> None:
    """Role permissions: generators write rollouts, never weights, checkpoints, tasks or TRAINLOG."""
    pub, _ = role_permissions("generator")
    assert "rlbus.*.rollouts.*" in pub
    for forbidden in ("rlbus.*.weights", "rlbus.*.checkpoints", "rlbus.*.tasks.*", "rlbus.*.trainlog"):
        assert forbidden not in pub
    assert not any(p.startswith("$O.") for p in pub)
    trainer_pub, _ = role_permissions("trainer")
    assert "rlbus.*.trainlog" in trainer_pub
    assert set(ROLES) >= {"feeder", "generator", "trainer", "publisher", "checkpointer", "sandbox",
                          "evaluator", "observer"}
