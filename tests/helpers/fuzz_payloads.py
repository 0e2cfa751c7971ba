"""Hostile payloads for every subject an actor consumes: hypothesis draws the recipes, each recipe is built
deterministically from valid samples.

`payloads(target, n)` → n `Payload`s for one target (tasks, rollouts, version_ready, state_upload,
checkpoints, latest, sandbox). A recipe is (category, variant, seed) drawn by hypothesis from a fixed seed
with a bounded example count (derandomized: CI sends the same messages every run); the seed and the
payload's index pick the values. Categories: random bytes, truncated and byte-flipped valid messages,
other kinds, newer schema versions, bad compression headers (unknown, lying, a decompression bomb) and
valid-but-absurd values per kind (negative group sizes, NaN rewards, arrays that disagree in length,
unknown dtypes, path-traversing object names, huge token arrays, unusable model configs, ...). Every
payload is bad by construction; `expect` says how the consumer must account for it ("dlq": a dead letter;
"drop": a TrainStep drop with a reason, for what only the model can tell).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import numpy as np
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rlbus.actors.common.feed import verifier_for
from rlbus.messages import checks, codec
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import (
    CheckpointMark,
    Message,
    Rollout,
    SandboxLimits,
    SandboxRequest,
    StateUploaded,
    Task,
    TensorBlob,
    VersionReady,
    WeightManifest,
)
from rlbus.model.tasks.builtin import make_task

Target = Literal["tasks", "rollouts", "version_ready", "state_upload", "checkpoints", "latest", "sandbox"]
TARGETS: Final[tuple[Target, ...]] = ("tasks", "rollouts", "version_ready", "state_upload", "checkpoints",
                                      "latest", "sandbox")
CATEGORIES: Final = ("garbage", "truncated", "flipped", "wrong_kind", "newer_schema", "encoding", "absurd", "absurd",
                     "absurd", "absurd")
"""Recipe category by index (valid-but-absurd values are the richest family: drawn 4 times in 10)."""
VOCAB: Final = 264
"""The trainer's fresh tiny model's vocabulary (ByteTokenizer)."""
MAX_SEQ_LEN: Final = 512
"""The trainer's fresh tiny model's context."""
D: Final = "sha256:" + "ab" * 32
"""A well-formed digest that matches no object."""


@dataclass(frozen=True, slots=True)
class Payload:
    """One message to send: raw bytes, headers, why it is bad, and how the consumer must account for it."""

    data: bytes
    headers: dict[str, str] | None
    category: str
    expect: Literal["dlq", "drop"] = "dlq"


def _blob(values: list[Any] | np.ndarray, dtype: str) -> TensorBlob:
    return TensorBlob.of(values, dtype)


@functools.cache
def _task_sample() -> Task:
    task = make_task(random.Random("fuzz"), "fz-task")
    return Task(task_id="fz-task", prompt=task.prompt, verifier=verifier_for(task), group_size=2)


def valid(target: Target, tag: str = "v") -> Message:
    """A valid message of the kind `target` consumes (ids made unique by `tag`)."""
    match target:
        case "tasks":
            return msgspec.structs.replace(_task_sample(), task_id=f"fz-{tag}")
        case "rollouts":
            return Rollout(rollout_id=f"fz-{tag}-0", task_id=f"fz-{tag}", group_index=0, group_size=2,
                           prompt_tokens=_blob([1, 2, 3], "int32"), completion_tokens=_blob([4, 5], "int32"),
                           behaviour_logprobs=_blob([-0.5, -1.0], "float32"),
                           policy_versions=_blob([0, 0], "int32"), loss_mask=_blob([1, 1], "uint8"), reward=0.5)
        case "version_ready":
            return VersionReady(version=1_000_000, step=1, object=f"weights-fz-{tag}", digest=D)
        case "state_upload":
            return StateUploaded(step=1, policy_version=1, objects=[f"state-fz-{tag}"], digests=[D])
        case "checkpoints":
            return CheckpointMark(step=1, policy_version=1, objects=[f"state-fz-{tag}"], digests=[D])
        case "latest":
            return WeightManifest(version=1, objects=["v1.full"], digests=[D], sizes=[10])
        case "sandbox":
            return SandboxRequest(request_id=f"fz-{tag}", code="x = 1", tests="assert x == 1")
    raise ValueError(target)


def rejected(data: bytes, headers: dict[str, str] | None, target: Target) -> bool:
    """Whether the codec or messages/checks.py refuses these bytes as `target`'s kind."""
    try:
        checks.check(codec.decode_as(data, headers, type(valid(target))))
    except BadMessage:
        return True
    return False


def _encode(message: Message) -> bytes:
    return codec.encode(message, compress_above=1 << 40)[0]


def _replace(message: Message, **fields: Any) -> bytes:
    """The message with fields replaced (no validation: msgspec builds whatever it is given)."""
    return _encode(msgspec.structs.replace(message, **fields))


@functools.cache
def _bomb() -> bytes:
    """A small zstd frame that decompresses past the codec's limit."""
    return zstandard.ZstdCompressor(level=3).compress(bytes(codec.MAX_DECOMPRESSED + 1024))


# ---- valid-but-absurd values, per kind ------------------------------------------------------------------
def _absurd_rollout(rng: random.Random, variant: int, tag: str) -> Payload:
    base = valid("rollouts", tag)
    assert isinstance(base, Rollout)
    nan = rng.choice([math.nan, math.inf, -math.inf])
    choice = variant % 14
    match choice:
        case 0:
            data = _replace(base, group_size=rng.randint(-(2 ** 31), 0))
        case 1:
            data = _replace(base, group_size=rng.randint(checks.MAX_GROUP_SIZE + 1, 2 ** 40))
        case 2:
            data = _replace(base, group_index=rng.choice([rng.randint(-(2 ** 31), -1), rng.randint(2, 2 ** 31)]))
        case 3:
            data = _replace(base, reward=nan)
        case 4:
            data = _replace(base, behaviour_logprobs=_blob([-0.5, nan], "float32"))
        case 5:    # per-token arrays that disagree in length
            n = rng.choice([0, 1, 3, 4, 7])
            field = rng.choice(["behaviour_logprobs", "policy_versions", "loss_mask"])
            values = {"behaviour_logprobs": ([-0.1] * n, "float32"), "policy_versions": ([0] * n, "int32"),
                      "loss_mask": ([1] * max(n, 1), "uint8")}[field]
            data = _replace(base, **{field: _blob(*values)})
        case 6:    # a dtype no reader knows, or the wrong family
            dtype = rng.choice(["bfloat17", "object", "str", "float32", "complex64", "U4", "", "i4,i4"])
            data = _replace(base, completion_tokens=TensorBlob(dtype=dtype, shape=(2,), data=bytes(8)))
        case 7:    # bytes that do not fill the shape
            data = _replace(base, policy_versions=TensorBlob(dtype="int32", shape=(2,),
                                                             data=bytes(8 + rng.randint(1, 64))))
        case 8:
            data = _replace(base, prompt_tokens=_blob([1, -rng.randint(1, 2 ** 31 - 1), 3], "int32"))
        case 9:
            data = _replace(base, policy_versions=_blob([0, -rng.randint(1, 2 ** 31 - 1)], "int32"))
        case 10:   # a 2-d array where a 1-d one belongs
            data = _replace(base, completion_tokens=_blob([[4], [5]], "int32"))
        case 11:   # a huge token array (zstd on the wire): longer than the model's context → the trainer drops it
            n = rng.randint(MAX_SEQ_LEN, 250_000 if variant % 10 == 0 else 20_000)
            data = _replace(base, group_size=1, completion_tokens=_blob(np.full(n, 7), "int32"),
                            behaviour_logprobs=_blob(np.full(n, -1.0), "float32"),
                            policy_versions=_blob(np.zeros(n), "int32"), loss_mask=_blob(np.ones(n), "uint8"))
            return Payload(zstandard.ZstdCompressor(level=1).compress(data), {codec.ENCODING_HEADER: codec.ZSTD},
                           "absurd_huge_tokens", "drop")
        case 12:   # token ids outside the vocabulary → the trainer drops it
            data = _replace(base, group_size=1, completion_tokens=_blob([4, rng.randint(VOCAB, 2 ** 31 - 1)], "int32"))
            return Payload(data, None, "absurd_vocab", "drop")
        case _:
            data = _replace(base, rollout_id="r" * rng.randint(checks.MAX_ID_LENGTH + 1, 10_000))
    return Payload(data, None, f"absurd_{choice}")


def _absurd_task(rng: random.Random, variant: int, tag: str) -> Payload:
    base = valid("tasks", tag)
    assert isinstance(base, Task)
    choice = variant % 8
    noise = "".join(rng.choice("{}[]\":,abc01 \\") for _ in range(rng.randint(0, 40)))
    match choice:
        case 0:
            data = _replace(base, group_size=rng.randint(checks.MAX_GROUP_SIZE + 1, 2 ** 62))
        case 1:
            data = _replace(base, verifier={"kind": noise})
        case 2:    # the verifier's task is not JSON (a trailing '{' never parses)
            data = _replace(base, verifier={**base.verifier, "task": noise + "{"})
        case 3:    # nested deeper than the JSON parser goes
            depth = rng.randint(2_000, 20_000)
            data = _replace(base, verifier={**base.verifier, "task": "[" * depth + "]" * depth})
        case 4:
            data = _replace(base, verifier={**base.verifier, "task": rng.choice(["[]", "1", '"x"', "null"])})
        case 5:    # a task without tests
            data = _replace(base, verifier={**base.verifier, "task": '{"task_id": "x", "prompt": "p", '
                                                                      '"entry_point": "f", "tests": []}'})
        case 6:    # a prompt that cannot fit the model's context
            doc = ('{"task_id": "x", "prompt": "' + "p" * rng.randint(4 * MAX_SEQ_LEN, 20_000) + '", '
                   '"entry_point": "f", "tests": [{"args": "1", "expected": "1"}]}')
            data = _replace(base, verifier={**base.verifier, "task": doc})
        case _:
            data = _replace(base, task_id=rng.choice(["", "t" * (checks.MAX_ID_LENGTH + 1)]))
    return Payload(data, None, f"absurd_{choice}")


def _absurd_other(rng: random.Random, variant: int, target: Target, tag: str) -> Payload:
    base = valid(target, tag)
    bad_digest = rng.choice(["", "sha256:", "md5:abc", "sha256:" + "g" * 64, "SHA256:" + "ab" * 32])
    bad_name = rng.choice(["", ".", "..", "../../etc/passwd", "a/b", "a\\b", "a\0b", "x" * 300])
    negative = rng.randint(-(2 ** 63), -1)
    options: list[dict[str, Any]]
    match target:
        case "version_ready":      # {}: well-formed, but its object is missing
            options = [{"version": negative}, {"step": negative}, {"digest": bad_digest}, {"object": bad_name},
                       {"version_digest": "zz"}, {}]
        case "state_upload" | "checkpoints":
            options = [{"step": negative}, {"policy_version": negative}, {"objects": [bad_name]},
                       {"digests": [bad_digest]}, {"objects": []}, {"digests": [D, D]}, {"parent_step": negative}]
            if target == "state_upload":
                options.append({})
        case "latest":
            options = [{"version": negative}, {"digests": [bad_digest]}, {"objects": [bad_name]}, {"sizes": []},
                       {"sizes": [negative]}, {"objects": []}, {"bases": [5]}, {"yields": [1, 1]},
                       {"base_version": 1}, {"version_digest": "xyz"},
                       {"model_config": rng.choice([
                           {"d_model": -64, "n_heads": 2}, {"vocab_size": 10 ** 12}, {"no_such_field": 1},
                           {"n_layers": 10 ** 9}, {"d_model": "wide"}, {"vocab_size": 1}])}]
        case "sandbox":
            limit = rng.choice([0.0, -1.0, math.nan, math.inf])
            options = [{"limits": SandboxLimits(cpu_seconds=limit)}, {"limits": SandboxLimits(wall_seconds=limit)},
                       {"limits": SandboxLimits(memory_mb=rng.randint(-10, 0))},
                       {"limits": SandboxLimits(max_processes=0)}, {"request_id": "q" * 300}]
        case _:
            raise ValueError(target)
    fields = options[variant % len(options)]
    return Payload(_replace(base, **fields), None, "absurd_" + (",".join(fields) or "missing_object"))


# ---- recipes → payloads ----------------------------------------------------------------------------------
def build(target: Target, recipe: tuple[int, int, int], index: int) -> Payload:
    """The payload of one recipe (category, variant, seed); `index` makes its ids unique."""
    category_index, variant, seed = recipe
    category = CATEGORIES[category_index % len(CATEGORIES)]
    rng = random.Random(f"{target}:{seed}:{variant}:{index}")
    tag = f"{index}-{seed:x}"
    base = valid(target, tag)
    raw = _encode(base)
    match category:
        case "garbage":
            data = rng.randbytes(rng.randint(0, 300))
            return Payload(data if rejected(data, None, target) else b"\xc1" + data, None, category)
        case "truncated":
            return Payload(raw[:rng.randint(0, len(raw) - 1)], None, category)
        case "flipped":
            data = bytearray(raw)
            for _ in range(1 + variant % 4):
                data[rng.randrange(len(data))] = rng.randrange(256)
            if not rejected(bytes(data), None, target):    # the flips kept it valid: cut it short
                data = data[: len(data) // 2]
            return Payload(bytes(data), None, category)
        case "wrong_kind":
            others = [t for t in TARGETS if type(valid(t)) is not type(base)]
            return Payload(_encode(valid(others[variant % len(others)], tag)), None, category)
        case "newer_schema":
            doc = msgspec.to_builtins(base, builtin_types=(bytes,)) | {
                "schema": rng.randint(2, 2 ** 31), "added_in_a_later_version": [1, 2]}
            return Payload(msgspec.msgpack.encode(doc), None, category)
        case "encoding" if target == "latest":     # KV values carry no headers: compressed bytes read as garbage
            packed = zstandard.ZstdCompressor(level=1).compress(raw) if variant % 2 else _bomb()
            return Payload(packed, None, "encoding_without_header")
        case "encoding":
            match variant % 3:
                case 0:
                    name = rng.choice(["gzip", "br", "ZSTD", "zstd ", "", "lz4", "none"])
                    return Payload(raw, {codec.ENCODING_HEADER: name}, "encoding_unknown")
                case 1:
                    return Payload(raw, {codec.ENCODING_HEADER: codec.ZSTD}, "encoding_lying")
                case _:
                    return Payload(_bomb(), {codec.ENCODING_HEADER: codec.ZSTD}, "encoding_bomb")
    match target:
        case "rollouts":
            return _absurd_rollout(rng, variant, tag)
        case "tasks":
            return _absurd_task(rng, variant, tag)
        case _:
            return _absurd_other(rng, variant, target, tag)


def recipes(n: int, *, per_example: int = 50) -> list[tuple[int, int, int]]:
    """`n` recipes (category, variant, seed), drawn by hypothesis `per_example` at a time from a fixed seed."""
    out: list[tuple[int, int, int]] = []
    recipe = st.tuples(st.integers(0, len(CATEGORIES) - 1), st.integers(0, 2 ** 16), st.integers(0, 2 ** 32))

    @settings(max_examples=-(-n // per_example), derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(recipe, min_size=per_example, max_size=per_example))
    def collect(batch: list[tuple[int, int, int]]) -> None:
        out.extend(batch)

    collect()
    return out[:n]


def payloads(target: Target, n: int) -> list[Payload]:
    """`n` hostile payloads for `target` (see the module docstring)."""
    return [build(target, recipe, i) for i, recipe in enumerate(recipes(n))]
