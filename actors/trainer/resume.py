"""Where a starting trainer picks up: after the checkpointer has caught up, the newest mark's state, and
the next version number.

Owns: `resume_point(bus, ...)` → `Resume`. Waiting for the checkpointer first matters: a mark published
late for an upload of a crashed incarnation would otherwise land after this incarnation chose an older
mark, and the two lineages would interleave. Does not: load the state into a model (the trainer does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import nats.js.errors
import structlog

from rlbus.actors.common.checkpoints import checkpoint_dir, read_durable_state
from rlbus.actors.common.errors import CheckpointError
from rlbus.messages.bus import Bus
from rlbus.messages.errors import DigestMismatch
from rlbus.messages.history import last_message
from rlbus.messages.schemas import CheckpointMark, VersionReady

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Resume:
    """What a starting trainer continues from."""

    mark: CheckpointMark | None
    """The newest mark (None: a fresh run)."""
    state: dict[str, bytes] | None
    """The mark's state objects, name -> bytes (digest-checked)."""
    source: Literal["ckpt", "disk", "fresh"]
    next_version: int
    """The version the held weights are published as: after every VersionReady so far, and the mark's."""
    next_mark_seq: int
    """CHECKPOINTS stream sequence where the trainer starts watching for its own marks."""


async def resume_point(bus: Bus, *, state_dir: str = "", wait_s: float = 300.0,
                       gauges: dict[str, float] | None = None) -> Resume:
    """Wait for the checkpointer (up to `wait_s`), then read the newest mark, its state and the versions.

    :raises CheckpointError: the newest mark's state is neither in CKPT nor on disk with the right digest.
    """
    s = bus.subjects
    await wait_for_checkpointer(bus, wait_s=wait_s, gauges=gauges if gauges is not None else {})
    info = await bus.js.stream_info(s.checkpoints_stream())
    next_mark_seq = int(info.state.last_seq) + 1
    mark = await last_message(bus.js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
    last_version = await last_message(bus.js, s.state_stream(), s.version_ready(), VersionReady)
    next_version = max(last_version.version + 1 if last_version else 0, mark.policy_version + 1 if mark else 0)
    if mark is None:
        return Resume(None, None, "fresh", next_version, next_mark_seq)
    state, source = await load_state(bus, mark, state_dir)
    return Resume(mark, state, source, next_version, next_mark_seq)


async def wait_for_checkpointer(bus: Bus, *, wait_s: float, gauges: dict[str, float]) -> None:
    """Return once the checkpointer's consumer has handled (acked) the last `StateUploaded` on STATE, or
    after `wait_s` with a warning. Nothing to wait for in a fresh run."""
    s = bus.subjects
    try:
        last = await bus.js.get_last_msg(s.state_stream(), s.state_uploads())
    except nats.js.errors.NotFoundError:
        return
    seq = int(last.seq or 0)
    deadline = time.monotonic() + wait_s
    gauges["waiting_for_checkpointer"] = 1.0
    try:
        while True:
            try:
                info = await bus.js.consumer_info(s.state_stream(), s.durable("checkpointer"))
                delivered = int(info.delivered.stream_seq or 0) if info.delivered else 0
                if delivered >= seq and not info.num_ack_pending:
                    return
            except nats.js.errors.NotFoundError:
                pass
            if time.monotonic() > deadline:
                log.warning("trainer_checkpointer_not_caught_up", upload_seq=seq, waited_s=wait_s)
                return
            await anyio.sleep(0.25)
    finally:
        gauges.pop("waiting_for_checkpointer", None)


async def load_state(bus: Bus, mark: CheckpointMark, state_dir: str) -> tuple[dict[str, bytes], Literal["ckpt", "disk"]]:
    """The mark's state objects (name -> bytes) from CKPT, else all from the checkpointer's durable copy;
    digest-checked. One object for a one-rank trainer, every shard file for a sharded one.

    :raises CheckpointError: the mark lists no object, or neither copy is complete with its digests.
    """
    if not mark.objects or len(mark.objects) != len(mark.digests):
        raise CheckpointError(f"checkpoint mark of step {mark.step} lists {len(mark.objects)} objects with "
                              f"{len(mark.digests)} digests; expected at least one object, each with its digest")
    files: dict[str, bytes] = {}
    try:
        for name, expected in zip(mark.objects, mark.digests, strict=True):
            files[name] = await bus.get_object(bus.subjects.checkpoint_bucket(), name, expected_digest=expected)
        return files, "ckpt"
    except (nats.js.errors.NotFoundError, DigestMismatch) as err:
        log.warning("trainer_state_not_in_ckpt", step=mark.step, objects=len(mark.objects), error=repr(err))
    if state_dir:
        try:
            return await anyio.to_thread.run_sync(read_durable_state, checkpoint_dir(Path(state_dir), mark.step),
                                                  mark), "disk"
        except CheckpointError as err:
            log.warning("trainer_state_not_on_disk", step=mark.step, error=str(err))
    raise CheckpointError(f"the state of checkpoint step {mark.step} ({mark.objects[0]}"
                          f"{f' and {len(mark.objects) - 1} more' if len(mark.objects) > 1 else ''}) is neither in "
                          f"CKPT nor on disk under {state_dir or '(no state_dir)'} with its digests; restore the "
                          f"checkpoint or start a fresh run")
