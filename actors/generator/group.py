"""A function-writing group's partial layout (`PartialGroup`, saved under the task id in a region's PARTIALS KV).

- Owns: `PartialGroup` (its encoding, and `function_state`: an episode's state for model/env/function.py),
  `check_partial` (refuses a hostile or corrupt partial), and what every plug shares (`SampledSummary`,
  `check_segment`, `fill_versions`, `group_sizes`).
- Guarantee: pure: no bus, no model, no clock.
- Does not: change a group, sample, grade or talk to NATS (actors/generator/loop.py drives a group and builds its
  Rollouts; function.py converts the loop's group to and from this layout).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

import msgspec
import numpy as np
import zstandard

from rlbus.actors.common.errors import PartialGroupError
from rlbus.messages.schemas import SandboxVerdict, Segment, TensorBlob
from rlbus.model.env import FunctionState, state_of
from rlbus.model.env.episodes import Episode, Turn
from rlbus.model.policies.interface import ChatTokenizer, frame_turn
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeResult, Status

PARTIAL_FORMAT: Final = 1
"""Version of the PartialGroup layout; a partial of another format is ignored (the group starts over)."""
COMPRESS_ABOVE: Final = 64 * 1024
ZSTD_MAGIC: Final = b"RLZ1"
"""Prefix of a zstd-compressed partial (a msgpack map never starts with it)."""
MAX_PARTIAL_BYTES: Final = 64 * 1024 * 1024
"""Largest decompressed partial read back; a frame that inflates past it is refused, not allocated."""
_STATUSES: Final = frozenset(get_args(Status))


class Attempt(msgspec.Struct, kw_only=True):
    """One graded attempt: the grade the policy saw as feedback and the sandbox's verdict."""

    status: str
    n_passed: int
    n_tests: int
    feedback: str
    verdict: SandboxVerdict = SandboxVerdict()
    sandbox_error: bool = False
    """The sandbox gave no verdict on the code (no reply, crashed, error): graded as a failed attempt."""

    def grade(self) -> GradeResult:
        return GradeResult(self.status, self.n_passed, self.n_tests, self.feedback)  # type: ignore[arg-type]


class TurnState(msgspec.Struct, kw_only=True):
    """A turn of the episode; assistant turns also carry each id's behaviour logprob and version."""

    role: Literal["user", "assistant", "observation", "summary"]
    ids: list[int]
    logprobs: list[float] = []
    versions: list[int] = []


class EpisodeState(msgspec.Struct, kw_only=True):
    """One of the G episodes: finished turns, the attempt being sampled (draft), routing so far."""

    turns: list[TurnState]
    attempts: list[Attempt] = []
    draft_ids: list[int] = []
    draft_logprobs: list[float] = []
    draft_versions: list[int] = []
    draft_done: bool = False
    """The draft is complete (stop token or length) and waits for grading."""
    ended: str = ""
    """Why the episode stopped before its attempts were spent ("no_room": no context left), else ""."""
    summaries: int = 0
    routing: TensorBlob | None = None
    """int64 (R, n_moe_layers, top_k): experts of the first R tokens of the current sequence (MoE only)."""
    segments: list[Segment] = []
    """What each summary closed, oldest first: the turns before it and the summary itself,
    each with the context it was sampled under; the Rollout carries them (`Rollout.segments`)."""

    @property
    def passed(self) -> bool:
        """The last attempt passed every test."""
        return bool(self.attempts) and self.attempts[-1].status == "passed"

    def done(self, max_attempts: int) -> bool:
        """Passed, out of attempts, or ended."""
        return self.passed or len(self.attempts) >= max_attempts or bool(self.ended)


class PartialGroup(msgspec.Struct, kw_only=True):
    """A task's group in progress, saved after every sampled chunk and every graded round: a msgpack map
    via msgspec (`encode_partial`), zstd-compressed past 64 KiB; `format` = PARTIAL_FORMAT. Written and read
    back by actors/generator/function.py (`FunctionPlug.encode` / `decode`)."""

    format: int = PARTIAL_FORMAT
    task_id: str
    group_size: int
    episodes: list[EpisodeState]
    rounds: int = 0
    """Graded rounds (agent turns of the group) completed."""
    chunks: int = 0
    """Sampling calls completed; seeds the next one, so a resumed group samples what the original would."""
    sampled_tokens: int = 0
    generate_s: float = 0.0
    grade_s: float = 0.0
    started_at: float = 0.0
    writer: str = ""
    """Generator that saved it last."""
    resumes: int = 0

    def finished(self, max_attempts: int) -> bool:
        return all(ep.done(max_attempts) for ep in self.episodes)


def encode_partial(state: PartialGroup) -> bytes:
    """msgpack map; past COMPRESS_ABOVE bytes zstd-compressed behind ZSTD_MAGIC (KV values must stay
    under the server's max payload, 1 MiB by default)."""
    data = msgspec.msgpack.encode(state)
    if len(data) <= COMPRESS_ABOVE:
        return data
    return ZSTD_MAGIC + zstandard.ZstdCompressor(level=3).compress(data)


def decode_partial(data: bytes) -> PartialGroup:
    """:raises PartialGroupError: the bytes are not a PartialGroup (or inflate past MAX_PARTIAL_BYTES)."""
    try:
        if data.startswith(ZSTD_MAGIC):
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data[len(ZSTD_MAGIC):]))
            data = reader.read(MAX_PARTIAL_BYTES + 1)     # streamed: a lying frame header allocates nothing
            if len(data) > MAX_PARTIAL_BYTES:
                raise PartialGroupError(f"inflates past {MAX_PARTIAL_BYTES} bytes")
        return msgspec.msgpack.decode(data, type=PartialGroup)
    except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError, ValueError) as err:
        raise PartialGroupError(f"not a partial group: {err}") from None


@dataclass(frozen=True, slots=True)
class PartialLimits:
    """What a partial read back must fit to be resumed by this generator (its model and settings)."""

    group_size: int
    max_attempts: int
    max_tokens: int
    max_seq_len: int
    vocab_size: int
    held_version: int
    """No token may claim a policy version newer than the weights this generator holds."""
    max_group_size: int = 0
    """A group without a pass may have grown by `group_size` at a time up to this many episodes;
    0 or <= group_size: it never grows."""
    routing: tuple[int, int, int] | None = None
    """(n_moe_layers, top_k, n_experts) of an MoE model; None: a dense model, partials carry no routing."""


def check_partial(state: PartialGroup, task: Task, task_id: str, tokenizer: ChatTokenizer,
                  limits: PartialLimits) -> None:
    """Raise PartialGroupError (naming the first problem) unless `state` is a partial this task's group could
    have saved: same format and task; a group size of G or, grown, a multiple of G up to
    `limits.max_group_size`, with that many episodes that start with the task's own prompt; token ids in
    the vocabulary; per-token logprobs (finite, <= 0) and versions (0..held) as long as the ids; attempts
    graded against the task's tests, at most `max_attempts`, only the last one passed; drafts within
    `max_tokens`; every episode within `max_seq_len`; routing of the model's shape and expert range.
    A partial that passes is resumed; one that fails is discarded and the group starts over.
    """
    if (state.format, state.task_id) != (PARTIAL_FORMAT, task_id):
        raise PartialGroupError(f"saved for format {state.format}, task {state.task_id!r}; expected "
                                f"{PARTIAL_FORMAT}, {task_id!r}")
    if state.group_size not in group_sizes(limits.group_size, limits.max_group_size):
        raise PartialGroupError(f"group size {state.group_size}; expected one of "
                                f"{list(group_sizes(limits.group_size, limits.max_group_size))}")
    if len(state.episodes) != state.group_size:
        raise PartialGroupError(f"{len(state.episodes)} episodes for a group of {state.group_size}")
    counts = (state.rounds, state.chunks, state.sampled_tokens, state.resumes)
    if min(counts) < 0 or not all(math.isfinite(x) and x >= 0 for x in (state.generate_s, state.grade_s)):
        raise PartialGroupError("negative or non-finite counters")
    prompt = tokenizer.encode(task.prompt)
    for g, ep in enumerate(state.episodes):
        try:
            _check_episode(ep, task, prompt, tokenizer, limits)
        except (ValueError, TypeError, IndexError, OverflowError) as err:
            raise PartialGroupError(f"episode {g}: {err}") from None


def _check_tokens(ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], *, policy: bool,
                  limits: PartialLimits, what: str) -> None:
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise PartialGroupError(f"{what}: token id outside the vocabulary [0, {limits.vocab_size})")
    if not policy:
        if logprobs or versions:
            raise PartialGroupError(f"{what}: logprobs or versions on tokens the policy did not sample")
        return
    if not len(ids) == len(logprobs) == len(versions):
        raise PartialGroupError(f"{what}: {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
    if any(not (math.isfinite(x) and x <= 0.0) for x in logprobs):
        raise PartialGroupError(f"{what}: a logprob that is not finite and <= 0")
    if any(not 0 <= v <= limits.held_version for v in versions):
        raise PartialGroupError(f"{what}: a policy version outside [0, {limits.held_version}]")


def _check_episode(ep: EpisodeState, task: Task, prompt: Sequence[int], tokenizer: ChatTokenizer,
                   limits: PartialLimits) -> None:
    if not ep.turns or ep.turns[0].role != "user" or ep.turns[0].ids != list(prompt):
        raise PartialGroupError("does not start with the task's prompt")
    if any(turn.role == "user" for turn in ep.turns[1:]) or ep.summaries < 0 or ep.ended not in ("", "no_room"):
        raise PartialGroupError("turn roles, summaries or end reason out of place")
    for k, turn in enumerate(ep.turns):
        _check_tokens(turn.ids, turn.logprobs, turn.versions, policy=turn.role == "assistant", limits=limits,
                      what=f"turn {k}")
    _check_tokens(ep.draft_ids, ep.draft_logprobs, ep.draft_versions, policy=True, limits=limits, what="draft")
    if len(ep.draft_ids) > limits.max_tokens or (ep.draft_done and not ep.draft_ids):
        raise PartialGroupError(f"draft of {len(ep.draft_ids)} tokens (max_tokens {limits.max_tokens})")
    answered = sum(turn.role == "assistant" for turn in ep.turns)
    if len(ep.attempts) > limits.max_attempts or answered > len(ep.attempts) or (
            not ep.summaries and answered != len(ep.attempts)):
        raise PartialGroupError(f"{len(ep.attempts)} attempts for {answered} answers "
                                f"(max_attempts {limits.max_attempts})")
    for n, attempt in enumerate(ep.attempts):
        passed = attempt.status == "passed"
        if (attempt.status not in _STATUSES or attempt.n_tests != len(task.tests)
                or not 0 <= attempt.n_passed <= attempt.n_tests
                or (passed and (attempt.n_passed != attempt.n_tests or n != len(ep.attempts) - 1))):
            raise PartialGroupError(f"attempt {n} ({attempt.status}, {attempt.n_passed}/{attempt.n_tests}) "
                                    f"does not fit the task's {len(task.tests)} tests")
    if len(ep.segments) > 2 * ep.summaries:
        raise PartialGroupError(f"{len(ep.segments)} segments for {ep.summaries} summaries")
    for k, seg in enumerate(ep.segments):
        check_segment(seg, limits, what=f"segment {k}")
    length = len(flatten(ep, tokenizer).ids) + len(tokenizer.header("assistant")) + len(ep.draft_ids)
    if length > limits.max_seq_len:
        raise PartialGroupError(f"{length} tokens, past max_seq_len {limits.max_seq_len}")
    if ep.routing is None:
        return
    if limits.routing is None:
        raise PartialGroupError("routing saved for a dense model")
    layers, top_k, experts = limits.routing
    rows = ep.routing.numpy()
    if (ep.routing.dtype != "int64" or rows.ndim != 3 or rows.shape[1:] != (layers, top_k)
            or rows.shape[0] > length or (rows.size and not (0 <= rows.min() and rows.max() < experts))):
        raise PartialGroupError(f"routing {ep.routing.dtype} {rows.shape} does not fit "
                                f"({length}, {layers}, {top_k}) experts < {experts}")


def check_segment(seg: Segment, limits: PartialLimits, *, what: str) -> None:
    """Raise PartialGroupError unless `seg` is a segment a partial within `limits` could hold."""
    prompt, ids = seg.prompt_tokens.tolist(), seg.completion_tokens.tolist()
    mask = seg.loss_mask.tolist()
    if not prompt or len(mask) != len(ids) or len(prompt) + len(ids) > limits.max_seq_len:
        raise PartialGroupError(f"{what}: {len(prompt)} prompt ids, {len(ids)} ids, {len(mask)} mask values "
                                f"(max_seq_len {limits.max_seq_len})")
    _check_tokens(prompt, [], [], policy=False, limits=limits, what=what)
    _check_tokens(ids, seg.behaviour_logprobs.tolist(), seg.policy_versions.tolist(), policy=True, limits=limits,
                  what=what)
    if seg.routing is not None and limits.routing is None:
        raise PartialGroupError(f"{what}: routing saved for a dense model")


def group_sizes(group_size: int, max_group_size: int) -> range:
    """The sizes a group started at `group_size` can have: G, 2G, ... up to max_group_size (at least G)."""
    return range(group_size, max(group_size, max_group_size) + 1, group_size)


def episode_of(ep: EpisodeState, task: Task, max_attempts: int) -> Episode:
    """The model/env/episodes.py view of the finished turns (the draft is not part of it)."""
    return Episode(task, tuple(Turn(t.role, tuple(t.ids)) for t in ep.turns),
                   tuple(a.grade() for a in ep.attempts), max_attempts)


def function_state(ep: EpisodeState, task: Task, max_attempts: int) -> FunctionState:
    """The function-writing environment's state of the finished turns (the draft is not part of it)."""
    return state_of(episode_of(ep, task, max_attempts))


def prompt_length(task: Task, tokenizer: ChatTokenizer) -> int:
    """Tokens kept ahead of a summary: bos and the user turn (<|bos|><|user|>prompt<|end_turn|>)."""
    return (len(tokenizer.bos()) + len(tokenizer.header("user")) + len(tokenizer.encode(task.prompt))
            + len(tokenizer.closing()))


@dataclass(frozen=True, slots=True)
class SampledSummary:
    """A summary as the policy wrote it: what it read (`source`), then per sampled id its logprob, version and
    (MoE) the routing over source + ids."""

    source: list[int]
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: np.ndarray | None = None

    def segment(self, *, routing: bool = True) -> Segment:
        """The summary as a trained segment under what the policy read (mask 1 on every id); `routing` False leaves
        the MoE record out (a rollout that carries none)."""
        return Segment(
            prompt_tokens=TensorBlob.of(self.source, "int32"),
            completion_tokens=TensorBlob.of(self.ids, "int32"),
            behaviour_logprobs=TensorBlob.of(self.logprobs, "float32"),
            policy_versions=TensorBlob.of(self.versions, "int32"),
            loss_mask=TensorBlob.of([1] * len(self.ids), "uint8"),
            routing=None if self.routing is None or not routing else TensorBlob.of(self.routing, "int64"))


@dataclass(frozen=True, slots=True)
class Flat:
    """An episode as one sequence (L,) with the per-token arrays."""

    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    """-1 where no policy token is."""


def flatten(ep: EpisodeState, tokenizer: ChatTokenizer) -> Flat:
    """The finished turns as laid out by model/env/episodes.py `episode_tokens`, with per-token arrays; the loss
    mask covers the assistant turns' sampled ids (a summary's logprobs are not kept: it is context here)."""
    bos = tokenizer.bos()
    ids, mask, lps, vers = list(bos), [0] * len(bos), [0.0] * len(bos), [-1] * len(bos)
    for turn in ep.turns:
        framed, _ = frame_turn(tokenizer, turn.role, turn.ids)
        head = len(tokenizer.header(turn.role))
        tail = len(framed) - head - len(turn.ids)
        ids += framed
        if turn.role == "assistant":
            mask += [0] * head + [1] * len(turn.ids) + [0] * tail
            lps += [0.0] * head + list(turn.logprobs) + [0.0] * tail
            vers += [-1] * head + list(turn.versions) + [-1] * tail
        else:
            mask += [0] * len(framed)
            lps += [0.0] * len(framed)
            vers += [-1] * len(framed)
    return Flat(ids, mask, lps, vers)


def fill_versions(versions: Sequence[int]) -> list[int]:
    """Replace each -1 by the nearest real version before it, or after it for a leading run.

    [-1, -1, 3, -1, 4, -1] -> [3, 3, 3, 3, 4, 4]; all -1 stays all -1.
    """
    out = list(versions)
    last = -1
    for i, v in enumerate(out):
        last = v if v != -1 else last
        out[i] = last
    first = next((v for v in out if v != -1), -1)
    return [first if v == -1 else v for v in out]


def attempt_reward(attempt: Attempt, partial_credit: float = 0.0) -> float:
    """1.0 for an attempt that passed every test, else partial_credit * n_passed / n_tests (0 < credit < 1
    rewards a failed attempt for the tests it did pass, a denser signal for a weak policy)."""
    if attempt.status == "passed":
        return 1.0
    return partial_credit * attempt.n_passed / attempt.n_tests if attempt.n_tests > 0 else 0.0
