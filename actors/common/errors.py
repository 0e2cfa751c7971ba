"""Errors the actors raise on purpose about what they were handed: a task, a saved partial group, weights,
a checkpoint.

Owns: the actor-level subclasses of `messages.errors.RlbusError`. Each is also a `ValueError`, the class
their raisers raised before, so a caller that catches `ValueError` keeps working; a caller that means
"this input is unusable" catches the named class instead. Bus, digest and topology errors live in
messages/errors.py; these are raised only below ops/ and above messages/ (actors/, and read by ops/).
"""

from __future__ import annotations

from rlbus.messages.errors import RlbusError


class TaskError(RlbusError, ValueError):
    """A coding task that cannot be used: a tasks-file line or a Task message's verifier that does not
    rebuild into a `model.tasks.Task`, or a prompt that does not fit the model.

    Raised by actors/common/feed.py (`task_from_json`, `task_from_verifier`, `read_tasks_file`, naming the
    file and line) and the generator. The generator dead-letters the Task message; a feeder, the task
    ledger or a command reading a tasks file stops with the message, which names the file, line and field.
    """


class PartialGroupError(RlbusError, ValueError):
    """A saved partial group (a PARTIALS KV value) that this generator must not resume: bytes that are
    not a `PartialGroup`, or one that this task's group could not have saved (`check_partial`).

    Raised by actors/generator/group.py (`decode_partial`, `check_partial`). The generator discards the
    partial with an `Event(incident)` and starts the group over (overwriting it by compare-and-set).
    """


class WeightsError(RlbusError, ValueError):
    """Weights that cannot be used: a `model_config` that is not an architecture, a weights object that
    applies to another version than the one staged, or a published version whose tensors differ from the
    model's.

    Raised by actors/common/weight_sync.py. While staging, `WeightSync` catches it itself: it rejects the
    manifest or object (`Event(weights_rejected)`) and plans its next fetch around it (a full snapshot), and
    the live model is never touched. At a swap it reaches the generator, which fails (its model is not the
    published architecture). The final evaluation, building a model from a checkpoint's architecture,
    is skipped with the message.
    """


class CheckpointError(RlbusError, ValueError):
    """A checkpoint that cannot be restored: a mark that does not list exactly one state object, a durable
    copy whose object is missing or fails its digest, or a trainer state of another format or architecture.

    Raised by actors/common/checkpoints.py (`read_durable_state`), actors/trainer/resume.py (`load_state`)
    and actors/trainer/core.py (`TrainerCore.load_state_blob`). The trainer's resume reads the CKPT copy,
    else the durable copy (logging why that one failed), and stops its setup with this error when neither
    is usable: restore the checkpoint or start a fresh run. `rlbus eval` and the final evaluation report
    the checkpoint as damaged.
    """
