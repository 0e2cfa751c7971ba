"""The durable checkpoint layout on disk: `<state_dir>/checkpoints/step-<N>/` with its `mark.json`.

Owns: where a step's durable copy lives (`checkpoint_dir`), which steps are durable (`durable_steps`,
`durable_marks`), writing one atomically (`write_durable`: temporary directory, fsync, rename) and reading
its state object back with its digest checked (`read_durable_state`).
Does not: decide when to checkpoint (actors/trainer/), download or announce checkpoints (actors/checkpointer.py).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Final

import msgspec
import structlog

from rlbus.actors.common.errors import CheckpointError
from rlbus.messages.bus import digest
from rlbus.messages.schemas import CheckpointMark

log = structlog.get_logger()

CHECKPOINTS_DIR: Final = "checkpoints"
MARK_FILE: Final = "mark.json"
_STEP_PREFIX: Final = "step-"


def checkpoint_dir(state_dir: Path, step: int) -> Path:
    """Where the durable copy of step N's checkpoint lives: `<state_dir>/checkpoints/step-<N>/`."""
    return state_dir / CHECKPOINTS_DIR / f"{_STEP_PREFIX}{step}"


def durable_steps(state_dir: Path) -> list[int]:
    """Steps with a complete durable copy under `state_dir`, ascending (temporary directories excluded)."""
    root = state_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        suffix = entry.name.removeprefix(_STEP_PREFIX)
        if entry.name.startswith(_STEP_PREFIX) and suffix.isdigit() and (entry / MARK_FILE).exists():
            steps.append(int(suffix))
    return sorted(steps)


def read_durable_state(step_dir: Path, mark: CheckpointMark) -> dict[str, bytes]:
    """The mark's state objects (object name -> bytes: one trainer state, or a sharded checkpoint's every file)
    from their durable copy in `step_dir`, each checked against the mark's digest.

    :raises CheckpointError: the mark lists no object (or not one digest each), or a file is missing or differs.
    """
    if not mark.objects or len(mark.objects) != len(mark.digests):
        raise CheckpointError(f"the mark of step {mark.step} lists {len(mark.objects)} objects with "
                              f"{len(mark.digests)} digests; expected at least one object, each with its digest")
    out: dict[str, bytes] = {}
    for name, expected in zip(mark.objects, mark.digests, strict=True):
        path = step_dir / name
        data = path.read_bytes() if path.is_file() else b""
        if not data:
            raise CheckpointError(f"{path}: missing or empty; the mark of step {mark.step} lists it")
        if digest(data) != expected:
            raise CheckpointError(f"{path}: digest {digest(data)}; the mark expects {expected}")
        out[name] = data
    return out


def durable_marks(state_dir: Path) -> list[tuple[int, list[str]]]:
    """(step, object names) of every durable copy under `state_dir`, oldest step first."""
    out = []
    for step in durable_steps(state_dir):
        try:
            mark = json.loads((checkpoint_dir(state_dir, step) / MARK_FILE).read_text())
            out.append((step, [str(name) for name in mark["objects"]]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def write_durable(state_dir: Path, mark: CheckpointMark, blobs: dict[str, bytes]) -> Path:
    """Write the objects and `mark.json` into a temporary directory, fsync, then rename it into place.

    A directory of the same step already there (a redelivered upload) is replaced only after the new one
    is complete, so a reader sees the old or the new copy, never a partial one.
    """
    final = checkpoint_dir(state_dir, mark.step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for name, data in blobs.items():
        _write_synced(tmp / name, data)
    _write_synced(tmp / MARK_FILE, json.dumps(msgspec.to_builtins(mark), indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():
        old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
