"""Invariants of decoded messages beyond their types: what a consumer checks before it acts on one.

Owns: `check(message)`, raising `BadMessage` with the field and the reason for a message whose types are
right but whose values cannot be meant: per-token arrays of a Rollout that disagree in length or do not
hold the bytes their dtype and shape need, a group index outside its group, NaN rewards, negative
versions, digests that are not `sha256:<hex>`, object names that are not plain file names, limits that
are not positive. `Bus.consume` applies it after decoding, so such a message is dead-lettered like an
undecodable one. Does not: check what depends on a model (vocabulary, context length: the trainer drops
those with a reason) or on the world (whether an object exists: the consumer finds out).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np

from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import (
    CheckpointMark,
    Message,
    Rollout,
    SandboxRequest,
    Segment,
    StateUploaded,
    Task,
    TensorBlob,
    VersionReady,
    WeightManifest,
)

MAX_GROUP_SIZE: Final = 1024
"""Largest group a Task or Rollout may announce (a generator samples that many completions)."""
MAX_ID_LENGTH: Final = 256
"""Longest task, rollout or request id (ids become message ids and KV keys)."""
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")
_HEX: Final = re.compile(r"(?:[0-9a-f]{2})*")
_INTEGER_KINDS: Final = frozenset("iu")
_FLOAT_KINDS: Final = frozenset("f")


def check(message: Message) -> None:
    """Raise `BadMessage` naming the field if `message` breaks an invariant of its kind (see the module)."""
    match message:
        case Rollout():
            _rollout(message)
        case Task():
            _id(message.task_id, "task_id")
            if message.group_size > MAX_GROUP_SIZE:
                _bad("group_size", f"{message.group_size} is above the largest group {MAX_GROUP_SIZE}")
        case VersionReady():
            _non_negative(message.version, "version")
            _non_negative(message.step, "step")
            _objects([message.object], [message.digest], "object")
            _hex(message.version_digest, "version_digest")
        case StateUploaded() | CheckpointMark():
            _non_negative(message.step, "step")
            _non_negative(message.policy_version, "policy_version")
            if message.parent_step is not None:
                _non_negative(message.parent_step, "parent_step")
            if not message.objects:
                _bad("objects", "no objects listed")
            _objects(message.objects, message.digests, "objects")
        case WeightManifest():
            _manifest(message)
        case SandboxRequest():
            _request(message)
        case _:
            pass


def _bad(field: str, why: str) -> None:
    raise BadMessage(f"{why} - at `$.{field}`")


def _non_negative(value: int, field: str) -> None:
    if value < 0:
        _bad(field, f"{value} is negative")


def _id(value: str, field: str) -> None:
    if not value:
        _bad(field, "empty id")
    if len(value) > MAX_ID_LENGTH:
        _bad(field, f"id of {len(value)} characters (at most {MAX_ID_LENGTH})")


def _hex(value: str, field: str) -> None:
    if not _HEX.fullmatch(value):
        _bad(field, f"{value[:80]!r} is not lowercase hex")


def _objects(names: Sequence[str], digests: Sequence[str], field: str) -> None:
    """Object names are plain file names (a checkpointer writes them to disk), each with a sha256 digest."""
    if len(names) != len(digests):
        _bad(field, f"{len(names)} objects with {len(digests)} digests")
    for i, name in enumerate(names):
        if not name or name in (".", "..") or len(name) > 255 or any(c in name for c in "/\\\0"):
            _bad(f"{field}[{i}]", f"object name {name[:80]!r} is not a plain file name")
    for i, digest in enumerate(digests):
        if not _DIGEST.fullmatch(digest):
            _bad(f"digests[{i}]", f"{digest[:80]!r} is not a `sha256:<64 hex>` digest")


def _manifest(m: WeightManifest) -> None:
    _non_negative(m.version, "version")
    if m.base_version is not None and not 0 <= m.base_version < m.version:
        _bad("base_version", f"{m.base_version} is not an earlier version than {m.version}")
    if not m.objects:
        _bad("objects", "no objects listed")
    _objects(m.objects, m.digests, "objects")
    if len(m.sizes) != len(m.objects) or any(size < 0 for size in m.sizes):
        _bad("sizes", f"{len(m.sizes)} sizes for {len(m.objects)} objects, or a negative size")
    for name, values in (("bases", m.bases), ("yields", m.yields)):
        if values and len(values) != len(m.objects):
            _bad(name, f"{len(values)} entries for {len(m.objects)} objects")
        if any(v is not None and not 0 <= v <= m.version for v in values):
            _bad(name, f"a version outside 0..{m.version}")
    _hex(m.version_digest, "version_digest")


def _request(r: SandboxRequest) -> None:
    if len(r.request_id) > MAX_ID_LENGTH:
        _bad("request_id", f"id of {len(r.request_id)} characters (at most {MAX_ID_LENGTH})")
    limits = r.limits
    for name in ("cpu_seconds", "wall_seconds"):
        value = getattr(limits, name)
        if not (math.isfinite(value) and value > 0):
            _bad(f"limits.{name}", f"{value} is not a positive number of seconds")
    for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "max_output_kb"):
        if getattr(limits, name) < (0 if name == "max_file_mb" else 1):
            _bad(f"limits.{name}", f"{getattr(limits, name)} is too small")


def _array(blob: TensorBlob, field: str, kinds: Iterable[str], *, ndim: int = 1) -> np.ndarray:
    """The blob as a numpy array, after checking dtype family, rank and byte count."""
    try:
        dtype = np.dtype(blob.dtype)
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in set(kinds) or dtype.hasobject:
        _bad(field, f"dtype {blob.dtype[:40]!r} is not one of the kinds {''.join(sorted(kinds))!r}")
        raise AssertionError  # unreachable, for the type checker
    if len(blob.shape) != ndim or any(d < 0 for d in blob.shape):
        _bad(field, f"shape {blob.shape[:8]} is not a {ndim}-d shape")
    count = math.prod(blob.shape)
    if count * dtype.itemsize != len(blob.data):
        _bad(field, f"{blob.dtype}{list(blob.shape)} needs {count * dtype.itemsize} bytes, has {len(blob.data)}")
    return blob.numpy()


def _rollout(r: Rollout) -> None:
    _id(r.rollout_id, "rollout_id")
    _id(r.task_id, "task_id")
    if not 1 <= r.group_size <= MAX_GROUP_SIZE:
        _bad("group_size", f"{r.group_size} is not in 1..{MAX_GROUP_SIZE}")
    if not 0 <= r.group_index < r.group_size:
        _bad("group_index", f"{r.group_index} is not in 0..{r.group_size - 1}")
    _token_arrays(r, "")
    for i, segment in enumerate(r.segments):
        _token_arrays(segment, f"segments[{i}].")
    if not math.isfinite(r.reward):
        _bad("reward", f"{r.reward} is not finite")


def _token_arrays(r: Rollout | Segment, at: str) -> None:
    """The per-token arrays of a rollout or one of its segments (`at` prefixes the field names)."""
    prompt = _array(r.prompt_tokens, at + "prompt_tokens", _INTEGER_KINDS)
    completion = _array(r.completion_tokens, at + "completion_tokens", _INTEGER_KINDS)
    logprobs = _array(r.behaviour_logprobs, at + "behaviour_logprobs", _FLOAT_KINDS)
    versions = _array(r.policy_versions, at + "policy_versions", _INTEGER_KINDS)
    mask = _array(r.loss_mask, at + "loss_mask", _INTEGER_KINDS | {"b"})
    T = completion.shape[0]
    for name, values in (("behaviour_logprobs", logprobs), ("policy_versions", versions)):
        if values.shape[0] != T:
            _bad(at + name, f"{values.shape[0]} values for {T} completion tokens")
    if mask.shape[0] not in (0, T):
        _bad(at + "loss_mask", f"{mask.shape[0]} values for {T} completion tokens")
    if T and prompt.shape[0] == 0:
        _bad(at + "prompt_tokens", "a completion without a prompt token")
    for name, ids in (("prompt_tokens", prompt), ("completion_tokens", completion)):
        if ids.size and int(ids.min()) < 0:
            _bad(at + name, "a negative token id")
    if versions.size and int(versions.min()) < 0:
        _bad(at + "policy_versions", "a negative policy version")
    if logprobs.size and not bool(np.isfinite(logprobs).all()):
        _bad(at + "behaviour_logprobs", "a NaN or infinite log-probability")
    if r.routing is not None:
        routing = _array(r.routing, at + "routing", _INTEGER_KINDS, ndim=3)
        if routing.shape[0] != prompt.shape[0] + T:
            _bad(at + "routing", f"{routing.shape[0]} rows for {prompt.shape[0] + T} tokens")
        if routing.size and int(routing.min()) < 0:
            _bad(at + "routing", "a negative expert index")
