"""The actors' named errors (actors/common/errors.py): each is an `RlbusError` and the `ValueError` its raisers
raised before, and each is what a real raiser raises — a junk or foreign partial group, a malformed tasks
file line or verifier, an architecture that is not one, a durable checkpoint with its object missing or
changed, a trainer state of another format — with the bad value named. Pure: no server."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest
import torch
from helpers.function_partials import new_group

from rlbus.actors.common.checkpoints import read_durable_state
from rlbus.actors.common.errors import CheckpointError, PartialGroupError, TaskError, WeightsError
from rlbus.actors.common.feed import read_tasks_file, task_from_verifier, verifier_for
from rlbus.actors.common.weight_source import open_weights
from rlbus.actors.generator.group import PartialLimits, check_partial, decode_partial
from rlbus.actors.trainer.core import STATE_FORMAT, build_core
from rlbus.actors.trainer.resume import load_state
from rlbus.messages.bus import digest
from rlbus.messages.errors import RlbusError, TopologyError
from rlbus.messages.schemas import CheckpointMark
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.policies.builtin import config_dict, config_from_spec, estimated_params
from rlbus.model.policies.interface import PolicyError
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig
from rlbus.model.tasks.builtin import eval_tasks

TOK = ByteTokenizer()
TASK = eval_tasks(5, n=1)[0]
LIMITS = PartialLimits(group_size=2, max_attempts=1, max_tokens=16, max_seq_len=1024, vocab_size=TOK.vocab_size,
                       held_version=0)


@pytest.mark.parametrize("cls", [TaskError, PartialGroupError, WeightsError, CheckpointError])
def test_each_error_is_an_rlbus_error_and_still_a_value_error(cls: type[Exception]) -> None:
    """`except RlbusError` (the CLI) and the `except ValueError` callers of before both catch it."""
    assert issubclass(cls, RlbusError) and issubclass(cls, ValueError)
    assert cls.__doc__ and "Raised by" in cls.__doc__
    with pytest.raises(ValueError, match="bad value"):
        raise cls("bad value")


def test_junk_or_foreign_partials_are_partial_group_errors() -> None:
    """Bytes that are no PartialGroup, and a partial another task saved, are refused naming what is wrong."""
    with pytest.raises(PartialGroupError, match="not a partial group"):
        decode_partial(b"\x01\x02")
    other = new_group(TASK, "other-task", 2, TOK, now=0.0)
    with pytest.raises(PartialGroupError, match="task 'other-task'; expected 1, 't'"):
        check_partial(other, TASK, "t", TOK, LIMITS)
    grown = new_group(TASK, "t", 4, TOK, now=0.0)
    with pytest.raises(PartialGroupError, match=r"group size 4; expected one of \[2\]"):
        check_partial(grown, TASK, "t", TOK, LIMITS)
    check_partial(new_group(TASK, "t", 2, TOK, now=0.0), TASK, "t", TOK, LIMITS)


def test_a_malformed_tasks_file_line_is_a_task_error_naming_file_and_line(tmp_path: Path) -> None:
    """A line without the task fields, one that is no JSON, and one nested past the parser's depth."""
    good = json.loads(verifier_for(TASK)["task"])
    for bad in ('{"task_id": "t2", "prompt": "p"}', "{not json", "[" * 100_000):
        path = tmp_path / "tasks.jsonl"
        path.write_text(f"{json.dumps(good)}\n\n{bad}\n")
        with pytest.raises(TaskError, match=r"tasks.jsonl:3: "):
            read_tasks_file(path)
    path.write_text(json.dumps({**good, "tests": []}) + "\n")
    with pytest.raises(TaskError, match=rf"task {TASK.task_id!r} has no tests"):
        read_tasks_file(path)


def test_an_unusable_verifier_is_a_task_error() -> None:
    """The generator dead-letters a Task whose verifier is of another kind or not a task object."""
    with pytest.raises(TaskError, match="verifier kind 'python_tests'"):
        task_from_verifier(TaskMessage(task_id="t", prompt="p", verifier={"kind": "python_tests"}))
    verifier = {**verifier_for(TASK), "task": "[1, 2]"}
    with pytest.raises(TaskError, match="verifier task is a JSON list, not an object"):
        task_from_verifier(TaskMessage(task_id="t", prompt="p", verifier=verifier))


def test_an_architecture_that_is_not_one_is_a_policy_error() -> None:
    """Unknown fields, sizes ModelConfig refuses, and a size of 0 are refused naming the value."""
    fields = config_dict(ModelConfig.tiny())
    with pytest.raises(PolicyError, match="is not a ModelConfig"):
        config_from_spec({**fields, "n_wheels": 3})
    with pytest.raises(PolicyError, match="d_model 64 must split into n_heads 5"):
        config_from_spec({**fields, "n_heads": 5})
    with pytest.raises(PolicyError, match=r"positive integers: \{'d_ff': 0\}"):
        estimated_params(ModelConfig.tiny(d_ff=0))
    assert config_from_spec(fields) == ModelConfig.tiny()


@pytest.mark.anyio
async def test_an_unknown_weights_spec_is_a_topology_error() -> None:
    """`open_weights` refuses a spec other than sync or local:<path> before it touches the bus."""
    with pytest.raises(TopologyError, match="generator weights 'remote:x'"):
        async with open_weights("remote:x", None, "r"):  # type: ignore[arg-type]  # never reached
            await anyio.lowlevel.checkpoint()


def test_a_durable_checkpoint_with_its_object_missing_or_changed_is_a_checkpoint_error(tmp_path: Path) -> None:
    """read_durable_state names the file and the digests; a mark whose objects and digests differ in number,
    or that lists none, is refused too; a mark of several objects (a sharded state) reads each."""
    data = b"trainer state"
    mark = CheckpointMark(step=3, policy_version=2, objects=["state.pt"], digests=[digest(data)])
    with pytest.raises(CheckpointError, match=r"state.pt: missing or empty; the mark of step 3 lists it"):
        read_durable_state(tmp_path, mark)
    (tmp_path / "state.pt").write_bytes(b"another state")
    with pytest.raises(CheckpointError, match=rf"digest {digest(b'another state')}; the mark expects"):
        read_durable_state(tmp_path, mark)
    uneven = CheckpointMark(step=3, policy_version=2, objects=["a", "b"], digests=["x"])
    with pytest.raises(CheckpointError, match="lists 2 objects with 1 digests"):
        read_durable_state(tmp_path, uneven)
    with pytest.raises(CheckpointError, match="lists 0 objects"):
        read_durable_state(tmp_path, CheckpointMark(step=3, policy_version=2))
    (tmp_path / "state.pt").write_bytes(data)
    assert read_durable_state(tmp_path, mark) == {"state.pt": data}
    (tmp_path / "shard").write_bytes(b"shard")
    two = CheckpointMark(step=3, policy_version=2, objects=["state.pt", "shard"], digests=[digest(data), digest(b"x")])
    with pytest.raises(CheckpointError, match=r"shard: digest .*; the mark expects"):
        read_durable_state(tmp_path, two)


@pytest.mark.anyio
async def test_a_mark_or_state_the_trainer_cannot_resume_from_is_a_checkpoint_error() -> None:
    """`load_state` refuses a mark without a digest per object before it reads anything; `load_state_blob` a
    state of another format, naming the format found and the one expected."""
    uneven = CheckpointMark(step=4, policy_version=3, objects=["a", "b"], digests=["x"])
    with pytest.raises(CheckpointError, match="mark of step 4 lists 2 objects with 1 digests"):
        await load_state(None, uneven, "")  # type: ignore[arg-type]  # refused before the bus is used
    buffer = io.BytesIO()
    torch.save({"format": STATE_FORMAT + 1}, buffer)
    with pytest.raises(CheckpointError, match=rf"format {STATE_FORMAT + 1}, expected {STATE_FORMAT}"):
        build_core("", lr=1e-3, seed=0).load_state_blob(buffer.getvalue())
