"""One loop for every environment: a task's group of G episodes sampled, stepped, checkpointed and published.

- Owns: `GroupLoop` (a group from its partial, or fresh, to its Rollouts), the group in memory (`Group`,
  `LoopEpisode`), `Plug` (what an environment brings: its partial layout, port, summaries, outcome), the plugs
  by verifier kind (`register_environment`, `plug_factory`) and an episode's Rollout (`episode_rollout`).
- Guarantee: the partial is saved (compare-and-set) after every sampled chunk, summary step and stepped round,
  so a replacement resumes mid-turn; every trained id keeps its behaviour logprob at the sampling temperature.
- Does not: know any environment (model/env/; actors/generator/function.py and agentic.py plug them in), fetch
  weights (actors/common/weight_source.py) or run code (actors/sandbox/).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

import anyio
import msgspec
import nats.errors
import nats.js.errors
import numpy as np
import structlog
import torch
import zstandard

from rlbus.actors.common.errors import PartialGroupError
from rlbus.actors.generator.group import (
    MAX_PARTIAL_BYTES,
    PartialLimits,
    SampledSummary,
    check_segment,
    fill_versions,
    group_sizes,
)
from rlbus.messages.kv import put_at, read_key
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Event, Rollout, SandboxVerdict, Segment, TensorBlob
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env.agentic import SummaryPlan
from rlbus.model.env.base import Environment, EnvState, state_context, state_tokens, summarized
from rlbus.model.env.episodes import Turn
from rlbus.model.policies.interface import ChatTokenizer

if TYPE_CHECKING:
    from rlbus.actors.generator.actor import Generator

log = structlog.get_logger()

NO_ROOM: Final = "no_room"
"""`Plug.summary_plan`'s answer when the episode has no context left for another turn and no summary makes any."""
GENERIC_MAGIC: Final = b"RLGL1"
"""Prefix of a `BasePlug` partial (then zstd-compressed msgpack)."""
GENERIC_FORMAT: Final = "loop-1"


@dataclass
class LoopEpisode:
    """One episode in memory: its environment state, the logprobs and versions of each policy turn of the state
    since its last summary, the turn being sampled (draft), routing of the current sequence (MoE), the segments
    its summaries closed, and the plug's own record (`extra`)."""

    state: EnvState
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    draft_logprobs: list[float] = field(default_factory=list)
    draft_versions: list[int] = field(default_factory=list)
    draft_done: bool = False
    routing: TensorBlob | None = None
    segments: list[Segment] = field(default_factory=list)
    summaries: int = 0
    ended: str = ""
    """"no_room": no context left for a turn and no summary would make any; else ""."""
    extra: Any = None

    @property
    def done(self) -> bool:
        return self.state.done or bool(self.ended)


@dataclass
class Group:
    """A task's group in memory: what every plug's partial layout holds."""

    task_id: str
    group_size: int
    episodes: list[LoopEpisode]
    rounds: int = 0
    """Stepped rounds (one policy turn of every open episode) completed."""
    chunks: int = 0
    """Sampling and summary calls completed; seeds the next one, so a resumed group samples what the original would."""
    sampled_tokens: int = 0
    generate_s: float = 0.0
    step_s: float = 0.0
    started_at: float = 0.0
    writer: str = ""
    resumes: int = 0
    extra: Any = None

    def finished(self) -> bool:
        return all(ep.done for ep in self.episodes)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an episode is published: its reward, the verdict and per-episode timings."""

    reward: float
    verdict: SandboxVerdict
    timings: Mapping[str, float]


class Round:
    """One stepped round of a group: each done draft taken as a turn through the environment (`step`), then
    `close` once every step of the round returned."""

    def __init__(self, plug: BasePlug, group: Group) -> None:
        self.plug, self.group = plug, group

    async def step(self, g: int, ep: LoopEpisode, ids: list[int]) -> EnvState:
        """The state after the policy turn `ids` (the plug's port handed to the environment)."""
        return (await self.plug.env.step(ep.state, ids, self.plug.port, now=time.time())).state

    async def close(self, stepped: list[int]) -> None:
        """After the round's steps (episodes `stepped`)."""


class BasePlug:
    """An environment as the loop drives it, with defaults that fit a plain `Environment`: no summaries, the
    turn capped only by `[generator] max_tokens` and the context, `port` handed to every step, reward >= 1
    counts as a pass, and a partial layout of its own (`GENERIC_MAGIC`). Function-writing and agentic plugs
    override what their environment needs (actors/generator/function.py, agentic.py)."""

    routing: bool = True
    """The Rollouts carry the MoE routing record."""
    step_time: str = "step_s"
    """The timing under which the group's step time is published."""
    log_fields: ClassVar[Mapping[str, str]] = {}
    """Added to the loop's log lines of a group (an environment's name, say)."""

    def __init__(self, gen: Generator, env: Environment[Any], task: Any, *, port: Any = None) -> None:
        self.gen, self.env, self.task, self.port = gen, env, task, port

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.env.tokenizer

    def start(self, *, now: float) -> LoopEpisode:
        return LoopEpisode(state=self.env.start(self.task, now=now))

    def fits(self) -> str:
        """Why the task's first context leaves no room for a turn ("" when it does)."""
        first = len(state_context(self.env.start(self.task), self.tokenizer))
        if first + 1 > self.gen.model.max_seq_len:
            return f"the first context of {first} tokens does not fit max_seq_len {self.gen.model.max_seq_len}"
        return ""

    def room(self, ep: LoopEpisode) -> int:
        """Tokens the environment lets the next turn take (the loop also caps it by max_tokens and the context)."""
        return self.gen.config.max_tokens

    def prepare(self, ep: LoopEpisode) -> EnvState | None:
        """Before a turn: a state the environment moves to first (a summary asked for, say), or None."""
        return None

    def restart(self, ep: LoopEpisode) -> EnvState | None:
        """After a step: the state the episode goes on from in a fresh context (its turns so far, the last one
        written to carry them over, close a segment), or None."""
        return None

    def summary_plan(self, ep: LoopEpisode) -> SummaryPlan | Literal["no_room"] | None:
        """Before a turn: how to summarise the history (the policy writes it), `NO_ROOM`, or None (no summary)."""
        return None

    def summarize(self, ep: LoopEpisode, ids: list[int]) -> EnvState:
        return summarized(ep.state, ids)

    def scripted(self, ep: LoopEpisode) -> list[int] | None:
        """The ids of a scripted turn (scored, not sampled), or None: sample it."""
        return None

    def passed(self, ep: LoopEpisode) -> bool:
        return ep.state.done and ep.state.reward >= 1.0

    def outcome(self, ep: LoopEpisode) -> Outcome:
        ok = self.passed(ep)
        return Outcome(float(ep.state.reward), SandboxVerdict(passed=int(ok), total=1, status="ok" if ok else "failed"),
                       {"summaries": float(ep.summaries)})

    def round(self, group: Group) -> Round:
        return Round(self, group)

    async def background(self) -> None:
        """Runs beside the group's steps (renewing leases, say) until they end: nothing here."""

    async def close(self) -> None:
        """After the group's steps, published or not (sessions to close, say): nothing here."""

    async def resume(self, group: Group) -> None:
        """Before a resumed group's first step. :raises PartialGroupError: it cannot be resumed."""

    async def cleanup(self, group: Group) -> None:
        """After the group is published."""

    # ---- the partial layout --------------------------------------------------------------------
    def encode(self, group: Group) -> bytes:
        saved = _Saved(task_id=group.task_id, group_size=group.group_size, rounds=group.rounds, chunks=group.chunks,
                       sampled_tokens=group.sampled_tokens, generate_s=group.generate_s, step_s=group.step_s,
                       started_at=group.started_at, writer=group.writer, resumes=group.resumes,
                       episodes=[_SavedEpisode(state=msgspec.msgpack.encode(ep.state), logprobs=ep.logprobs,
                                               versions=ep.versions, draft_ids=ep.draft_ids,
                                               draft_logprobs=ep.draft_logprobs, draft_versions=ep.draft_versions,
                                               draft_done=ep.draft_done, routing=ep.routing, segments=ep.segments,
                                               summaries=ep.summaries, ended=ep.ended)
                                 for ep in group.episodes])
        return GENERIC_MAGIC + zstandard.ZstdCompressor(level=3).compress(msgspec.msgpack.encode(saved))

    def decode(self, data: bytes, task_id: str, group_size: int) -> Group:
        """:raises PartialGroupError: not a partial this task's group could have saved (`check_episode`)."""
        if not data.startswith(GENERIC_MAGIC):
            raise PartialGroupError("not a partial of this environment (no tag)")
        try:
            raw = zstandard.ZstdDecompressor().stream_reader(memoryview(data)[len(GENERIC_MAGIC):]).read(
                MAX_PARTIAL_BYTES + 1)
            if len(raw) > MAX_PARTIAL_BYTES:
                raise PartialGroupError(f"inflates past {MAX_PARTIAL_BYTES} bytes")
            saved = msgspec.msgpack.decode(raw, type=_Saved)
            kind = type(self.env.start(self.task))
            episodes = [LoopEpisode(state=msgspec.msgpack.decode(e.state, type=kind), logprobs=e.logprobs,
                                    versions=e.versions, draft_ids=e.draft_ids, draft_logprobs=e.draft_logprobs,
                                    draft_versions=e.draft_versions, draft_done=e.draft_done, routing=e.routing,
                                    segments=e.segments, summaries=e.summaries, ended=e.ended)
                        for e in saved.episodes]
        except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError, ValueError) as err:
            raise PartialGroupError(f"not a partial: {err}") from None
        if (saved.format, saved.task_id) != (GENERIC_FORMAT, task_id):
            raise PartialGroupError(f"saved for format {saved.format!r}, task {saved.task_id!r}")
        limits = self.limits(group_size)
        if saved.group_size not in group_sizes(group_size, limits.max_group_size) or \
                len(episodes) != saved.group_size:
            raise PartialGroupError(f"{len(episodes)} episodes, group size {saved.group_size}")
        counts = (saved.rounds, saved.chunks, saved.sampled_tokens, saved.resumes)
        if min(counts) < 0 or not all(math.isfinite(x) and x >= 0 for x in (saved.generate_s, saved.step_s)):
            raise PartialGroupError("negative or non-finite counters")
        first = self.env.start(self.task).turns[0]
        for g, ep in enumerate(episodes):
            try:
                check_episode(ep, first, self.tokenizer, limits, routing=self.routing)
            except (ValueError, TypeError, IndexError) as err:
                raise PartialGroupError(f"episode {g}: {err}") from None
        return Group(task_id=saved.task_id, group_size=saved.group_size, episodes=episodes, rounds=saved.rounds,
                     chunks=saved.chunks, sampled_tokens=saved.sampled_tokens, generate_s=saved.generate_s,
                     step_s=saved.step_s, started_at=saved.started_at, writer=saved.writer, resumes=saved.resumes)

    def limits(self, group_size: int) -> PartialLimits:
        """What a partial read back must fit (this generator's model and settings)."""
        gen = self.gen
        policy = gen.model
        moe, experts = policy.moe, policy.n_experts
        routing = (*moe, experts) if moe is not None and experts is not None else None
        return PartialLimits(group_size=group_size, max_group_size=gen.config.max_group_size,
                             max_attempts=gen.config.max_attempts, max_tokens=gen.config.max_tokens,
                             max_seq_len=policy.max_seq_len, vocab_size=policy.vocab_size,
                             held_version=gen.held_version(), routing=routing)


class _SavedEpisode(msgspec.Struct, kw_only=True):
    state: bytes
    logprobs: list[list[float]] = []
    versions: list[list[int]] = []
    draft_ids: list[int] = []
    draft_logprobs: list[float] = []
    draft_versions: list[int] = []
    draft_done: bool = False
    routing: TensorBlob | None = None
    segments: list[Segment] = []
    summaries: int = 0
    ended: str = ""


class _Saved(msgspec.Struct, kw_only=True):
    format: str = GENERIC_FORMAT
    task_id: str
    group_size: int
    episodes: list[_SavedEpisode]
    rounds: int = 0
    chunks: int = 0
    sampled_tokens: int = 0
    generate_s: float = 0.0
    step_s: float = 0.0
    started_at: float = 0.0
    writer: str = ""
    resumes: int = 0


def _check_policy_ids(ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], limits: PartialLimits,
                      what: str) -> None:
    if not len(ids) == len(logprobs) == len(versions):
        raise ValueError(f"{what}: {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
    if any(not (math.isfinite(x) and x <= 0.0) for x in logprobs):
        raise ValueError(f"{what}: a logprob that is not finite and <= 0")
    if any(not 0 <= v <= limits.held_version for v in versions):
        raise ValueError(f"{what}: a policy version outside [0, {limits.held_version}]")


def check_episode(ep: LoopEpisode, first: Turn, tokenizer: ChatTokenizer, limits: PartialLimits, *,
                  routing: bool) -> None:
    """Raise ValueError (naming the first problem) unless `ep` is an episode of this task a generator within
    `limits` could have saved: it starts with the task's first turn; ids in the vocabulary; one list of logprobs
    (finite, <= 0) and versions (0..held) per policy turn, as long as its ids, and so for the draft; within
    max_seq_len; segments and routing of the model's shape."""
    state = ep.state
    if not state.turns or state.turns[0] != first:
        raise ValueError("not this task's episode")
    if any(t.role == "user" for t in state.turns[1:]) or ep.summaries < 0 or ep.ended not in ("", NO_ROOM):
        raise ValueError("turn roles, summaries or end reason out of place")
    if any(not 0 <= t < limits.vocab_size for turn in state.turns for t in turn.ids) or any(
            not 0 <= t < limits.vocab_size for t in ep.draft_ids):
        raise ValueError(f"token id outside the vocabulary [0, {limits.vocab_size})")
    policy = [t for t in state.turns if t.role == "assistant"]
    if len(ep.logprobs) != len(policy) or len(ep.versions) != len(policy):
        raise ValueError(f"{len(ep.logprobs)} logprob lists for {len(policy)} policy turns")
    for k, (turn, lps, vers) in enumerate(zip(policy, ep.logprobs, ep.versions, strict=True)):
        _check_policy_ids(turn.ids, lps, vers, limits, f"policy turn {k}")
    _check_policy_ids(ep.draft_ids, ep.draft_logprobs, ep.draft_versions, limits, "draft")
    if len(ep.draft_ids) > limits.max_tokens or (ep.draft_done and not ep.draft_ids) or (state.done and ep.draft_ids):
        raise ValueError(f"draft of {len(ep.draft_ids)} tokens (max_tokens {limits.max_tokens})")
    if len(ep.segments) > 2 * ep.summaries:
        raise ValueError(f"{len(ep.segments)} segments for {ep.summaries} summaries")
    for k, seg in enumerate(ep.segments):
        check_segment(seg, limits, what=f"segment {k}")
    length = len(state_context(state, tokenizer)) + len(ep.draft_ids)
    if length > limits.max_seq_len:
        raise ValueError(f"{length} tokens, past max_seq_len {limits.max_seq_len}")
    if ep.routing is None:
        return
    if limits.routing is None or not routing:
        raise ValueError("routing saved for a dense model")
    layers, top_k, experts = limits.routing
    rows = ep.routing.numpy()
    if (ep.routing.dtype != "int64" or rows.ndim != 3 or rows.shape[1:] != (layers, top_k)
            or rows.shape[0] > length or (rows.size and not (0 <= rows.min() and rows.max() < experts))):
        raise ValueError(f"routing {ep.routing.dtype} {rows.shape} does not fit ({length}, {layers}, {top_k})")


# ---- plugs by verifier kind ------------------------------------------------------------------------
PlugFactory = Callable[["Generator", TaskMessage], BasePlug]
"""Builds the plug of one task (`TaskMessage.verifier` names its kind). :raises ValueError: the task is unusable
(a `TaskError` names why): it is dead-lettered."""
_FACTORIES: dict[str, PlugFactory] = {}


def register_environment(kind: str, factory: PlugFactory) -> None:
    """Drive tasks whose verifier's "kind" is `kind` through the plug `factory` builds (replacing any before)."""
    _FACTORIES[kind] = factory


def plug_factory(kind: str) -> PlugFactory | None:
    return _FACTORIES.get(kind)


# ---- rollouts --------------------------------------------------------------------------------------
def tail_segment(ep: LoopEpisode, tokenizer: ChatTokenizer, *, routing: bool = True) -> Segment | None:
    """The episode's turns since its last summary as trained tokens: prompt = the first turn's context (bos, the
    first turn, the assistant header); completion = the rest up to the last policy id; loss mask exactly the ids of
    its policy turns (a summary turn is context here: it is a segment of its own), their behaviour logprobs and
    versions (other tokens' versions filled from the nearest policy token); routing over prompt + completion.
    None when no policy turn follows the first turn (or the last summary).

    :raises ValueError: the logprobs kept are not one per policy id, or the routing is short.
    """
    state = ep.state
    flat = state_tokens(state, tokenizer)
    n_prompt = len(state_context(msgspec.structs.replace(state, turns=state.turns[:1]), tokenizer))
    mask = [m if k >= 0 and state.turns[k].role == "assistant" else 0
            for m, k in zip(flat.loss_mask, flat.turn, strict=True)]
    policy = [i for i, m in enumerate(mask) if m]
    lps = [x for turn in ep.logprobs for x in turn]
    vers = [v for turn in ep.versions for v in turn]
    if not policy and not lps:
        return None
    if len(policy) != len(lps) or policy[0] < n_prompt:
        raise ValueError(f"{len(policy)} policy ids for {len(lps)} logprobs")
    end = policy[-1] + 1
    logprobs, versions = [0.0] * end, [-1] * end
    for i, lp, v in zip(policy, lps, vers, strict=True):
        logprobs[i], versions[i] = lp, v
    versions = fill_versions(versions)
    rows = None
    if routing and ep.routing is not None:
        held = ep.routing.numpy()
        if held.shape[0] < end:
            raise ValueError(f"routing covers {held.shape[0]} of {end} tokens")
        rows = TensorBlob.of(held[:end], "int64")
    return Segment(prompt_tokens=TensorBlob.of(flat.ids[:n_prompt], "int32"),
                   completion_tokens=TensorBlob.of(flat.ids[n_prompt:end], "int32"),
                   behaviour_logprobs=TensorBlob.of(logprobs[n_prompt:end], "float32"),
                   policy_versions=TensorBlob.of(versions[n_prompt:end], "int32"),
                   loss_mask=TensorBlob.of(mask[n_prompt:end], "uint8"), routing=rows)


def episode_rollout(ep: LoopEpisode, plug: BasePlug, *, task_id: str, group_index: int, group_size: int,
                    region: str, generator_id: str, timings: Mapping[str, float]) -> Rollout:
    """A finished episode as a Rollout: its turns since the last summary (`tail_segment`), its earlier segments,
    reward, verdict and timings from the plug's `outcome`."""
    try:
        tail = tail_segment(ep, plug.tokenizer, routing=plug.routing)
    except ValueError as err:
        raise ValueError(f"episode {task_id}-{group_index}: {err}") from None
    if tail is None:
        raise ValueError(f"episode {task_id}-{group_index} has no policy id to train on")
    out = plug.outcome(ep)
    return Rollout(
        rollout_id=f"{task_id}-{group_index}", task_id=task_id, group_index=group_index, group_size=group_size,
        prompt_tokens=tail.prompt_tokens, completion_tokens=tail.completion_tokens,
        behaviour_logprobs=tail.behaviour_logprobs, policy_versions=tail.policy_versions,
        loss_mask=tail.loss_mask, routing=tail.routing, reward=out.reward, verdict=out.verdict,
        timings={**timings, **out.timings}, region=region, generator_id=generator_id, segments=list(ep.segments))


def published(group: Group, plug: BasePlug, group_size: int) -> list[LoopEpisode]:
    """`group_size` episodes of a grown group, in their order: its passing ones (at most G - 1, so a failure stays)
    and failing ones drawn at random to fill G, seeded by the task id (a republish sends the same rollouts).
    Without a pass: the first G."""
    passed = [g for g, ep in enumerate(group.episodes) if plug.passed(ep)]
    if not passed:
        return group.episodes[:group_size]
    failed = [g for g, ep in enumerate(group.episodes) if not plug.passed(ep)]
    keep = passed[:group_size - 1]
    rng = random.Random(hashlib.sha256(f"{group.task_id}:subsample".encode()).digest())
    keep += rng.sample(failed, min(len(failed), group_size - len(keep)))
    return [group.episodes[g] for g in sorted(keep)]


def add_chunk(ep: LoopEpisode, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
              routing: np.ndarray | None, context_len: int, *, stop_ids: Sequence[int], limit: int) -> int:
    """Append a sampled chunk to the draft, cut after its first stop id; returns the ids kept. `routing`
    (context_len + len(tokens), L, k) is the call's record: the rows not yet held are appended. The draft is done
    at a stop id or at `limit` ids."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    ep.draft_ids += [int(t) for t in tokens[:cut]]
    ep.draft_logprobs += [min(float(x), 0.0) for x in logprobs[:cut]]
    ep.draft_versions += [int(v) for v in versions[:cut]]
    if routing is not None:
        held = ep.routing.numpy() if ep.routing is not None else np.zeros((0, *routing.shape[1:]), np.int64)
        rows = np.concatenate([held, routing[held.shape[0]: context_len + cut]])
        ep.routing = TensorBlob.of(rows, "int64")
    stopped = cut > 0 and tokens[cut - 1] in stop_ids
    ep.draft_done = stopped or len(ep.draft_ids) >= limit
    return cut


def _seed(task_id: str, *parts: object) -> int:
    """Sampler seed of a group's call: stable across a resume (task id and the calls done so far)."""
    text = ":".join([task_id, *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


class _TakenOver(Exception):
    """Another generator saved this task's partial since we read it: it owns the task now."""


class _Place:
    """A task's hold on one of the generator's `concurrent_tasks` sampling places (`tasks_ahead`)."""

    def __init__(self, places: anyio.Semaphore | None) -> None:
        self._places = places
        self.held = False

    async def take(self) -> None:
        if not self.held and self._places is not None:
            await self._places.acquire()
            self.held = True

    def give_up(self) -> None:
        if self.held and self._places is not None:
            self._places.release()
            self.held = False


class GroupLoop:
    """One task's group, whatever its environment.

    Load the partial (the plug's layout; one that is garbage, foreign or hostile is discarded with an
    Event(incident)) and resume it, or start G episodes. Then step until every episode is done, saving after
    each step. Before a turn, the environment may move first (`Plug.prepare`: a summary asked for), and summaries
    due are written (`Plug.summary_plan`: the live policy writes one; the turns it replaces and the summary become
    segments), a step of their own; else one chunk of every open draft is sampled together
    (`partial_every_tokens` ids at most, each capped by max_tokens, the environment's room and the context;
    weights swapped in flight; a scripted turn is scored by one forward pass instead and taken in the same step);
    else a round: each done draft taken as a policy turn through the environment (`Plug.round`), and an episode
    that goes on in a fresh context (`Plug.restart`) closes its turns so far as a segment. An episode that ended
    frees its sampling rows at once (`Generator.release_episode`). With `max_group_size`, a finished group without
    a pass grows by G. Then the Rollouts go out (msg id = rollout id), the partial is
    deleted and the plug cleans up.
    """

    def __init__(self, gen: Generator, plug: BasePlug, message: TaskMessage, key: str) -> None:
        self.gen, self.plug, self.message, self.key = gen, plug, message, key
        self.group_size = message.group_size if message.group_size >= 1 else gen.config.group_size
        self._released: set[int] = set()
        """Episodes whose sampling rows were released (done when loaded, or since)."""

    async def run(self) -> Literal["published", "taken_over"]:
        gen, plug = self.gen, self.plug
        group, revision = await self._load()
        if group is None:
            now = time.time()
            group = Group(task_id=self.message.task_id, group_size=self.group_size, started_at=now,
                          episodes=[plug.start(now=now) for _ in range(self.group_size)])
        else:
            group.resumes += 1
            gen.count("resumed")
            log.info("partial_resumed", task_id=group.task_id, rounds=group.rounds, chunks=group.chunks,
                     tokens=group.sampled_tokens, writer=group.writer, **plug.log_fields)
        place = _Place(gen.places)
        self._released = {g for g, ep in enumerate(group.episodes) if ep.done}
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(plug.background)
                try:
                    while True:
                        while not group.finished():
                            await self._advance(group, place)
                            self._release_ended(group)
                            group.writer = gen.ident.actor_id
                            revision = await self._save(group, revision)
                        if any(plug.passed(ep) for ep in group.episodes) or \
                                group.group_size + self.group_size > gen.config.max_group_size:
                            break
                        now = time.time()      # saved, so a resume samples the rest
                        group.episodes.extend(plug.start(now=now) for _ in range(self.group_size))
                        group.group_size += self.group_size
                        gen.count("groups_grown")
                        revision = await self._save(group, revision)
                except _TakenOver:
                    return "taken_over"
                finally:
                    tg.cancel_scope.cancel()
        finally:
            place.give_up()
            await plug.close()
        await self._publish(group)
        return "published"

    async def _advance(self, group: Group, place: _Place) -> None:
        eps = group.episodes
        starting = [g for g, ep in enumerate(eps) if not ep.done and not ep.draft_ids and not ep.draft_done]
        for g in starting:
            if (asked := self.plug.prepare(eps[g])) is not None:
                eps[g].state = asked
        if await self._summaries(group, starting):
            return
        sampling = [g for g, ep in enumerate(eps) if not ep.done and not ep.draft_done]
        if sampling:
            await place.take()
            if await self._sample(group, sampling):
                return
            # only scored turns (a script's): nothing sampled to keep mid-turn, the round follows in this step
        place.give_up()
        stepping = [g for g, ep in enumerate(eps) if not ep.done and ep.draft_done]
        if stepping:
            await self._round(group, stepping)

    def _release_ended(self, group: Group) -> None:
        """The generator frees the sampling rows of the episodes that ended in this step (their group may still
        sample for a while)."""
        for g, ep in enumerate(group.episodes):
            if ep.done and g not in self._released:
                self._released.add(g)
                self.gen.release_episode(state_tokens(ep.state, self.plug.tokenizer).ids)

    async def _summaries(self, group: Group, starting: list[int]) -> bool:
        """Summarise each starting episode whose plug asks for it (or end it: `NO_ROOM`); True when any was
        summarised (a step of its own, saved before sampling)."""
        gen, plug, tok = self.gen, self.plug, self.plug.tokenizer
        due: list[tuple[int, SummaryPlan]] = []
        for g in starting:
            plan = plug.summary_plan(group.episodes[g])
            if plan == NO_ROOM:
                group.episodes[g].ended = NO_ROOM
            elif isinstance(plan, SummaryPlan):
                due.append((g, plan))
        for g, plan in due:
            ep = group.episodes[g]
            context = state_context(ep.state, tok)
            seed = _seed(group.task_id, "summary", group.chunks, g)
            started = time.monotonic()
            written: SampledSummary = await anyio.to_thread.run_sync(functools.partial(
                gen.write_summary, context, budget=plan.budget, keep=plan.keep, prompt=list(plan.prompt),
                tokens=plan.tokens, seed=seed))
            group.generate_s += time.monotonic() - started
            before = tail_segment(ep, tok, routing=plug.routing)
            if before is not None:
                ep.segments.append(before)
            ep.segments.append(written.segment(routing=plug.routing))
            ep.state = plug.summarize(ep, written.ids)
            ep.logprobs, ep.versions, ep.routing = [], [], None
            ep.summaries += 1
            group.sampled_tokens += len(written.ids)
            gen.count("summaries")
            gen.count("tokens", len(written.ids))
            log.info("episode_summarised", task_id=group.task_id, group_index=g, context=len(context),
                     summary=len(written.ids), **plug.log_fields)
        if due:
            group.chunks += 1
        return bool(due)

    async def _sample(self, group: Group, rows: list[int]) -> bool:
        """Up to `partial_every_tokens` more ids for every open draft, in one batch; scripted turns (and a turn with
        no room, the stop id alone) are scored instead. True when any ids were sampled."""
        gen, plug, tok = self.gen, self.plug, self.plug.tokenizer
        max_len = gen.model.max_seq_len
        eps = group.episodes
        bases = {g: state_context(eps[g].state, tok) for g in rows}
        caps = {g: max(0, min(gen.config.max_tokens, plug.room(eps[g]), max_len - len(bases[g]))) for g in rows}
        scored: dict[int, list[int]] = {}
        for g in rows:
            if eps[g].draft_ids:
                continue
            script = plug.scripted(eps[g])
            if script is not None:
                scored[g] = script[:caps[g]] or [tok.stop_id]
            elif caps[g] < 1:
                scored[g] = [tok.stop_id]
        started = time.monotonic()
        kept = 0
        if scored:
            out = await anyio.to_thread.run_sync(gen.score, {g: bases[g] for g in scored}, scored)
            for g, (ids, lps, vers) in out.items():
                ep = eps[g]
                ep.draft_ids, ep.draft_logprobs, ep.draft_versions, ep.draft_done = ids, lps, vers, True
                kept += len(ids)
        sampling = [g for g in rows if g not in scored]
        if sampling:
            contexts = [bases[g] + eps[g].draft_ids for g in sampling]
            n = min(gen.config.partial_every_tokens, *(caps[g] - len(eps[g].draft_ids) for g in sampling))
            samples = await gen.sample_rows(contexts, n, _seed(group.task_id, group.chunks))
            for g, out_, context in zip(sampling, samples, contexts, strict=True):
                routing = out_.routing.numpy() if out_.routing is not None and plug.routing else None
                kept += add_chunk(eps[g], out_.tokens.tolist(), out_.logprobs.tolist(), out_.versions.tolist(),
                                  routing, len(context), stop_ids=tok.stop_ids, limit=caps[g])
        elapsed = time.monotonic() - started
        group.chunks += 1
        group.sampled_tokens += kept
        group.generate_s += elapsed
        gen.count("tokens", kept)
        gen.note_version()
        return bool(sampling)

    async def _round(self, group: Group, rows: list[int]) -> None:
        """Each done draft taken as a turn (concurrently), its ids, logprobs and versions kept with the state."""
        started = time.monotonic()
        round_ = self.plug.round(group)

        async def step(g: int) -> None:
            ep = group.episodes[g]
            ids = list(ep.draft_ids)
            new = await round_.step(g, ep, ids)
            n = len(ep.state.turns)
            if len(new.turns) <= n or new.turns[n] != Turn("assistant", tuple(ids)):
                raise ValueError(f"the state after the turn does not follow the episode's {n} turns and its draft")
            ep.logprobs.append(list(ep.draft_logprobs))
            ep.versions.append(list(ep.draft_versions))
            ep.state = new
            ep.draft_ids, ep.draft_logprobs, ep.draft_versions, ep.draft_done = [], [], [], False
            if (fresh := self.plug.restart(ep)) is not None:
                closed = tail_segment(ep, self.plug.tokenizer, routing=self.plug.routing)
                if closed is not None:
                    ep.segments.append(closed)
                ep.state, ep.logprobs, ep.versions, ep.routing = fresh, [], [], None
                ep.summaries += 1
                self.gen.count("summaries")
                log.info("episode_restarted", task_id=group.task_id, group_index=g, summaries=ep.summaries,
                         **self.plug.log_fields)

        async with anyio.create_task_group() as tg:
            for g in rows:
                tg.start_soon(step, g)
        await round_.close(rows)
        group.step_s += time.monotonic() - started
        group.rounds += 1

    # ---- partials -------------------------------------------------------------------------------
    async def _load(self) -> tuple[Group | None, int | None]:
        gen, task_id = self.gen, self.message.task_id
        entry = await read_key(gen.bus.js, gen.bus.subjects.partials_bucket(gen.ident.region), self.key,
                               give_up_after_s=GIVE_UP_S)
        if entry.value is None:
            return None, None
        try:
            group = self.plug.decode(entry.value, task_id, self.group_size)
            await self.plug.resume(group)
        except PartialGroupError as err:
            gen.count("partials_discarded")
            log.warning("partial_discarded", task_id=task_id, revision=entry.revision, error=str(err)[:300])
            await gen.bus.event(Event(event="incident", actor_id=gen.ident.actor_id, actor_kind=gen.kind,
                                      region=gen.ident.region, detail=f"partial discarded: {str(err)[:300]}",
                                      data={"what": "partial_discarded", "task_id": task_id[:200]}))
            return None, entry.revision
        return group, entry.revision

    async def _save(self, group: Group, revision: int | None) -> int:
        """Compare-and-set the partial; raises _TakenOver when another generator wrote it meanwhile."""
        gen = self.gen
        try:
            return await put_at(gen.bus.js, gen.bus.subjects.partials_bucket(gen.ident.region), self.key,
                                self.plug.encode(group), revision=revision, give_up_after_s=GIVE_UP_S)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _TakenOver(group.task_id) from None

    async def _publish(self, group: Group) -> None:
        """Publish the group (msg id = rollout id, retried until stored), then delete the partial. A grown group
        with `grown_subsample` goes out as G of its episodes (`published`)."""
        gen, plug = self.gen, self.plug
        now = time.time()
        timings = {"generate_s": group.generate_s, plug.step_time: group.step_s, "wall_s": now - group.started_at,
                   "queue_s": max(0.0, group.started_at - self.message.created_at), "resumes": float(group.resumes)}
        episodes = group.episodes
        if gen.config.grown_subsample and group.group_size > self.group_size:
            episodes = published(group, plug, self.group_size)
            gen.count("grown_unpublished", group.group_size - len(episodes))
        rollouts = [episode_rollout(ep, plug, task_id=group.task_id, group_index=g, group_size=len(episodes),
                                    region=gen.ident.region, generator_id=gen.ident.actor_id, timings=timings)
                    for g, ep in enumerate(episodes)]
        subject = gen.bus.subjects.rollouts(gen.ident.region)
        retry = retry_policy("rollouts_not_published", on=(nats.errors.Error, TimeoutError), initial_s=0.5, max_s=5.0,
                             forever="the group is in hand and its task held: ride out the region's outage rather "
                                     "than give the work back", task_id=group.task_id)
        async for attempt in retry:
            with attempt:
                try:
                    await gen.bus.publish_batch([(subject, r, r.rollout_id) for r in rollouts])
                except (nats.errors.Error, TimeoutError):
                    gen.count("publish_failures")
                    raise
        gen.count("rollouts", len(rollouts))
        try:
            await gen.kv.delete(self.key)
            await plug.cleanup(group)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("partial_not_deleted", task_id=group.task_id, error=repr(err))
        log.info("group_published", task_id=group.task_id, rollouts=len(rollouts),
                 rewards=[r.reward for r in rollouts], rounds=group.rounds, turns=group.rounds,
                 tokens=group.sampled_tokens, resumes=group.resumes, **plug.log_fields)


def score_turns(model: Any, contexts: Mapping[int, list[int]], turns: Mapping[int, list[int]], *, temperature: float,
                version: int) -> dict[int, tuple[list[int], list[float], list[int]]]:
    """Behaviour logprobs of turns the policy did not sample (scripted, or the stop id alone): one forward pass each
    of context + ids, log softmax(logits / temperature) as a sampled token's (model/sampling/generate.py) and as the
    trainer scores it. The caller holds the model lock."""
    tau = temperature or 1.0
    out: dict[int, tuple[list[int], list[float], list[int]]] = {}
    with torch.no_grad():
        for g, ids in turns.items():
            context = contexts[g][-(model.max_seq_len - len(ids)):]   # all of it: the cap left room
            x = torch.tensor([[*context, *ids]], device=model.device)
            logits = model(x).logits[0, len(context) - 1:-1].float()
            lps = torch.log_softmax(logits / tau, dim=-1).gather(-1, x[0, len(context):, None])[:, 0]
            out[g] = (list(ids), [min(float(v), 0.0) for v in lps.tolist()], [version] * len(ids))
    return out


__all__ = ["GENERIC_MAGIC", "NO_ROOM", "BasePlug", "Group", "GroupLoop", "LoopEpisode", "Outcome", "PlugFactory",
           "Round", "add_chunk", "check_episode", "episode_rollout", "plug_factory", "published", "register_environment",
           "score_turns", "tail_segment"]
