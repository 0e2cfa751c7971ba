"""Agentic groups: a repository task's G episodes, each in its own sandbox session, driven turn by turn.

- Owns: `AgenticGroups` (what the generator runs for a Task whose verifier is of the repository kind), its
  partial (`AgenticPartial`, refused when corrupt or foreign by `check_agentic_partial`), the workspace
  snapshots (`WorkspaceSnapshot`) and the Rollouts of the group (`agentic_rollout`).
- Guarantee: a resume keeps every edit (sessions reopen from snapshots, never by re-running commands);
  sandbox failures are never trained as the policy's.
- Does not: parse tool calls, run budgets or grade (model/env/agentic.py), run tools (actors/sandbox/).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
import torch
import zstandard

from rlbus.actors.common.errors import PartialGroupError
from rlbus.actors.common.sessions import (
    SandboxSession,
    SessionPort,
    SessionRefused,
    answered,
    open_session,
    restore_files,
)
from rlbus.actors.generator.group import MAX_PARTIAL_BYTES, PartialLimits, check_segment, fill_versions
from rlbus.messages.errors import DigestMismatch, RlbusError, SandboxCrashed
from rlbus.messages.kv import RETRIED, put_at, read_key
from rlbus.messages.objects import digest
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Event, Rollout, SandboxVerdict, Segment, TensorBlob, ToolResult
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import (
    SUBMIT_SCRIPT,
    AgenticBudgets,
    AgenticEnvironment,
    AgenticState,
    decode_state,
    edits_script,
    encode_state,
    reference_script,
    scripted_ids,
    state_context,
    state_tokens,
)
from rlbus.model.env.episodes import Turn
from rlbus.model.tasks.repo import RepoTask

if TYPE_CHECKING:
    from rlbus.actors.generator.actor import Generator

log = structlog.get_logger()

AGENTIC_MAGIC: Final = b"RLAG1"
"""Prefix of an agentic partial (then zstd-compressed msgpack); a function group's partial never starts with it."""
AGENTIC_FORMAT: Final = "agentic-1"
"""`AgenticPartial.format`: a layout of another version is discarded (the group starts over)."""
OPEN_TRIES: Final = 3
"""Tries to open an episode's session (1 s, then 2 s apart) before the episode ends as a sandbox error."""
REOPEN_TRIES: Final = 6
"""Tries to reopen a lost session (1, 2, 4, 8, 16 s apart: long enough for a SIGKILLed supervisor's restart, or
the region's server to come back)."""
SESSION_LOSSES: Final = 3
"""Sessions an episode may lose in one turn (each reopened from its last snapshot and the turn taken again)
before its group is dropped as a sandbox error."""
CHANGING_TOOLS: Final = frozenset({"write_file", "edit_file", "run"})
"""Tools after which a workspace is snapshotted (the others only read it)."""
_OBJECT: Final = re.compile(r"ws-[0-9a-f]{64}")
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")


class _TakenOver(Exception):
    """Another generator saved this task's partial since we read it: it owns the task now."""


class WorkspaceSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A workspace's changes since it opened, as stored in the WORKSPACES bucket (msgpack). The task id is part of
    the content, so two tasks whose workspaces changed alike never share an object (each group deletes its own)."""

    task_id: str
    files: dict[str, bytes] = {}
    deleted: list[str] = []


class AgenticEpisode(msgspec.Struct, kw_only=True):
    """One episode of an agentic group: its environment state (`encode_state`), the behaviour logprobs and
    policy versions of each of its policy turns, its workspace snapshot, and a sandbox failure that ended it."""

    state: bytes
    logprobs: list[list[float]] = []
    versions: list[list[int]] = []
    snapshot: str = ""
    """WORKSPACES object of the workspace after the last turn that may have changed it; "": as opened."""
    snapshot_digest: str = ""
    """`sha256:<hex>` of that object."""
    workspace_digest: str = ""
    """The sandbox's `digest` of the snapshotted workspace (its files' paths and contents) when the snapshot was
    taken; a session restored from the snapshot must have it ("": no snapshot, or one taken before digests)."""
    sandbox_error: str = ""
    segments: list[Segment] = []
    """What each summary closed, oldest first: the policy turns before it (under the episode's first context) and
    the summary itself (under what the policy read); the Rollout carries them (`Rollout.segments`)."""


class AgenticPartial(msgspec.Struct, kw_only=True):
    """An agentic group in progress, saved after every turn under the task's PARTIALS key."""

    format: str = AGENTIC_FORMAT
    task_id: str
    group_size: int
    episodes: list[AgenticEpisode]
    turns: int = 0
    """Group turns done (one policy turn of every open episode)."""
    sampled_tokens: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    started_at: float = 0.0
    writer: str = ""
    resumes: int = 0
    objects: list[str] = []
    """Every snapshot object the group wrote (deleted once it is published)."""


def encode_agentic(partial: AgenticPartial) -> bytes:
    return AGENTIC_MAGIC + zstandard.ZstdCompressor(level=3).compress(msgspec.msgpack.encode(partial))


def decode_agentic(data: bytes) -> AgenticPartial:
    """:raises PartialGroupError: the bytes are not an agentic partial (a function group's, garbage, too big)."""
    if not data.startswith(AGENTIC_MAGIC):
        raise PartialGroupError("not an agentic partial (no agentic tag)")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(memoryview(data)[len(AGENTIC_MAGIC):])
        raw = reader.read(MAX_PARTIAL_BYTES + 1)
        if len(raw) > MAX_PARTIAL_BYTES:
            raise PartialGroupError(f"inflates past {MAX_PARTIAL_BYTES} bytes")
        return msgspec.msgpack.decode(raw, type=AgenticPartial)
    except (msgspec.DecodeError, zstandard.ZstdError, ValueError) as err:
        raise PartialGroupError(f"not an agentic partial: {err}") from None


def episode_state(ep: AgenticEpisode) -> AgenticState:
    state = decode_state(ep.state)
    if not isinstance(state, AgenticState):
        raise PartialGroupError(f"an episode's state is a {type(state).__name__}, not an agentic one")
    return state


@dataclass(frozen=True, slots=True)
class AgenticLimits:
    """What an agentic partial read back must fit to be resumed (this generator's model and settings)."""

    group_size: int
    max_seq_len: int
    vocab_size: int
    held_version: int


def check_agentic_partial(partial: AgenticPartial, task: RepoTask, task_id: str, env: AgenticEnvironment,
                          limits: AgenticLimits) -> None:
    """Raise PartialGroupError (naming the first problem) unless `partial` is one this task's group could have
    saved: its format, task and group size; every episode's state of this very task, starting with its rendered
    user turn; one list of logprobs (finite, <= 0) and versions (0..held) per policy turn, as long as its ids;
    ids in the vocabulary; within max_seq_len; snapshot names that are content addresses."""
    if (partial.format, partial.task_id) != (AGENTIC_FORMAT, task_id):
        raise PartialGroupError(f"saved for format {partial.format!r}, task {partial.task_id!r}; expected "
                                f"{AGENTIC_FORMAT!r}, {task_id!r}")
    if partial.group_size != limits.group_size or len(partial.episodes) != partial.group_size:
        raise PartialGroupError(f"{len(partial.episodes)} episodes, group size {partial.group_size}; expected "
                                f"{limits.group_size}")
    if min(partial.turns, partial.sampled_tokens, partial.resumes) < 0 or not all(
            math.isfinite(x) and x >= 0 for x in (partial.generate_s, partial.tool_s)):
        raise PartialGroupError("negative or non-finite counters")
    if any(not _OBJECT.fullmatch(name) for name in partial.objects):
        raise PartialGroupError("a snapshot object name that is not a content address")
    first = env.start(task).turns[0]
    for g, ep in enumerate(partial.episodes):
        try:
            _check_episode(ep, task, first, env, limits)
        except (msgspec.DecodeError, ValueError, TypeError) as err:
            raise PartialGroupError(f"episode {g}: {err}") from None


def _check_episode(ep: AgenticEpisode, task: RepoTask, first: Turn, env: AgenticEnvironment,
                   limits: AgenticLimits) -> None:
    state = episode_state(ep)
    if state.task != task or not state.turns or state.turns[0] != first:
        raise PartialGroupError("not this task's episode")
    policy = [t for t in state.turns if t.role == "assistant"]
    summary = 1 if state.summaries else 0        # a summary is the turn after the task, and only that one
    if (any(t.role == "user" for t in state.turns[1:]) or state.summaries < 0
            or any(t.role == "summary" for t in state.turns[1 + summary:])
            or (summary and (len(state.turns) < 2 or state.turns[1].role != "summary"))
            or (len(policy) != state.policy_turns if not summary else len(policy) > state.policy_turns)):
        raise PartialGroupError("turn roles out of place")
    if len(ep.segments) > 2 * state.summaries:
        raise PartialGroupError(f"{len(ep.segments)} segments for {state.summaries} summaries")
    for k, seg in enumerate(ep.segments):
        check_segment(seg, PartialLimits(group_size=limits.group_size, max_attempts=1, max_tokens=limits.max_seq_len,
                                         max_seq_len=limits.max_seq_len, vocab_size=limits.vocab_size,
                                         held_version=limits.held_version), what=f"segment {k}")
    if len(ep.logprobs) != len(policy) or len(ep.versions) != len(policy):
        raise PartialGroupError(f"{len(ep.logprobs)} logprob and {len(ep.versions)} version lists for "
                                f"{len(policy)} policy turns")
    for turn, lps, vers in zip(policy, ep.logprobs, ep.versions, strict=True):
        if not len(turn.ids) == len(lps) == len(vers):
            raise PartialGroupError(f"a turn of {len(turn.ids)} ids with {len(lps)} logprobs, {len(vers)} versions")
        if any(not (math.isfinite(x) and x <= 0.0) for x in lps):
            raise PartialGroupError("a logprob that is not finite and <= 0")
        if any(not 0 <= v <= limits.held_version for v in vers):
            raise PartialGroupError(f"a policy version outside [0, {limits.held_version}]")
    if any(not 0 <= t < limits.vocab_size for turn in state.turns for t in turn.ids):
        raise PartialGroupError(f"token id outside the vocabulary [0, {limits.vocab_size})")
    length = len(state_tokens(state, env.tokenizer).ids)
    if length > limits.max_seq_len:
        raise PartialGroupError(f"{length} tokens, past max_seq_len {limits.max_seq_len}")
    if (ep.snapshot or ep.snapshot_digest) and not (
            _OBJECT.fullmatch(ep.snapshot) and ep.snapshot_digest == f"sha256:{ep.snapshot[3:]}"):
        raise PartialGroupError(f"snapshot {ep.snapshot[:80]!r} ({ep.snapshot_digest[:80]!r}) is not a content "
                                f"address")
    if ep.workspace_digest and not (ep.snapshot and _DIGEST.fullmatch(ep.workspace_digest)):
        raise PartialGroupError(f"workspace digest {ep.workspace_digest[:80]!r} without a snapshot, or not a sha256")


def budgets_of(generator: Generator) -> AgenticBudgets:
    """The `[generator.agentic]` budgets, the episode's tokens capped by the policy's context."""
    a = generator.config.agentic
    return AgenticBudgets(max_turns=a.max_turns, max_tool_calls=a.max_tool_calls,
                          max_tokens=min(a.max_tokens, generator.model.max_seq_len), min_turn_tokens=a.min_turn_tokens,
                          wall_s=a.wall_s, observation_chars=a.observation_chars,
                          observation_tokens=a.observation_tokens, run_timeout_s=a.run_timeout_s,
                          summary_tokens=a.summary_tokens, partial_credit=a.partial_credit)


def environment_of(generator: Generator) -> AgenticEnvironment:
    a = generator.config.agentic
    compact = a.tool_list == "compact" or (a.tool_list == "auto" and generator.model.max_seq_len < 4096)
    return AgenticEnvironment(generator.tokenizer, budgets_of(generator), tool_list="compact" if compact else "full")


@dataclass
class _Turn:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]


class AgenticGroups:
    """Runs agentic groups for one generator; the generator's hook is `run`.

    For a Task whose verifier is of the repository kind (model/tasks/repo.py `VERIFIER_KIND`). The partial
    (`AgenticPartial`) is a tagged layout of its own behind `AGENTIC_MAGIC`, so a function group's partial
    and an agentic one are never taken for each other; workspace snapshots are content-addressed objects in
    the region's WORKSPACES bucket, digest-checked both ways.

    A turn: one policy turn for every open episode (sampled together through the generator's batcher, each
    capped by `AgenticEnvironment.room` and `[generator] max_tokens`, weights swapped in flight; or, with
    `[generator] script`, the script's turn scored by one forward pass of the live policy), then
    `AgenticEnvironment.step` through the episode's session, then a snapshot of each workspace a turn may
    have changed, then the partial saved (compare-and-set). Before a turn, an episode whose context is due
    for a summary (`AgenticEnvironment.needs_summary`) gets one instead, as a step of its own: the live
    policy writes it, the turns it replaces and the summary become segments under their own contexts
    (`AgenticEpisode.segments`; the Rollout carries them).

    A replacement generator reopens each unfinished episode's session seeded with the task's files overlaid
    by the snapshot (`restore_files`), never by re-running commands; a snapshot always holds every change
    since the task's own files (`overlay`: a restored session's changes laid over the snapshot it was
    restored from), so any number of resumes keeps every edit. The sandbox's digest of the workspace is kept
    with each snapshot, and a restored session's must equal it (`_check_restored`: counted, told as an
    event; a mismatch loses the session like a crash).

    Leases: the open sessions' leases are renewed while turns are sampled (`_keep_alive`). Sandbox failures
    are never trained as the policy's: a session lost mid-turn (its supervisor died, its lease ran out, a
    call went unanswered) is reopened from the episode's last snapshot and the turn taken again
    (`SESSION_LOSSES` times a turn, each reopen tried `REOPEN_TRIES` times); an episode whose session cannot
    be opened (`OPEN_TRIES`) or reopened ends the group: every open episode ends with reward 0, verdict
    "error" and `Rollout.timings["sandbox_error"]` 1 (counted in `sandbox_errors`), and the trainer drops the
    group with the reason `sandbox_error`; the generator goes on.
    """

    def __init__(self, generator: Generator) -> None:
        self.gen = generator
        self.bucket = generator.bus.subjects.workspaces_bucket(generator.ident.region)
        self._open_by_group: dict[int, int] = {}
        self._bases: dict[int, WorkspaceSnapshot | None] = {}
        """id of an open session → the snapshot it was restored from (None: the task's own files)."""

    # ---- one group ------------------------------------------------------------------------------
    async def run(self, message: TaskMessage, task: RepoTask, key: str) -> Literal["published", "taken_over"]:
        gen = self.gen
        env = environment_of(gen)
        group_size = message.group_size if message.group_size >= 1 else gen.config.group_size
        partial, revision, snapshots = await self._load(key, message.task_id, group_size, task, env)
        if partial is None:
            now = time.time()
            partial = AgenticPartial(task_id=message.task_id, group_size=group_size, started_at=now,
                                     episodes=[AgenticEpisode(state=encode_state(env.start(task, now=now)))
                                               for _ in range(group_size)])
            snapshots = {}
        else:
            partial.resumes += 1
            gen.count("resumed")
            log.info("partial_resumed", task_id=message.task_id, turns=partial.turns, writer=partial.writer,
                     kind="agentic")
        sessions: dict[int, SandboxSession] = {}
        states = [episode_state(ep) for ep in partial.episodes]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_alive, sessions)
                try:
                    while not all(s.done for s in states):
                        if not await self._summarise(partial, states, env):
                            await self._turn(partial, states, sessions, snapshots, task, env)
                        partial.writer = gen.ident.actor_id
                        revision = await self._save(key, partial, revision)
                except _TakenOver:
                    return "taken_over"
                finally:
                    tg.cancel_scope.cancel()
        finally:
            await self._close_all(sessions)
        await self._publish(partial, states, message, key, env)
        return "published"

    async def _keep_alive(self, sessions: dict[int, SandboxSession]) -> None:
        """Renew the open sessions' leases while turns are sampled (a slow policy's turn may outlast a lease):
        a cheap call on each every third of `session_lease_s`; a failed one is left to the next real call."""
        every = max(self.gen.config.session_lease_s / 3, 0.5)
        while True:
            await anyio.sleep(every)
            for session in list(sessions.values()):
                if not session.closed:
                    with anyio.move_on_after(every):
                        try:
                            await session.tool("list_files", {"path": "."})
                        except (RlbusError, nats.errors.Error, TimeoutError):
                            pass

    async def _summarise(self, partial: AgenticPartial, states: list[AgenticState], env: AgenticEnvironment) -> bool:
        """Summarise every open episode whose context leaves no room for its next turn (`needs_summary`): the policy
        writes the summary (sampled, scripted policy or not), the turns before it and the summary become segments,
        the history is replaced. A step of its own, saved before the next turn; False when none was due."""
        due = [g for g, s in enumerate(states) if env.needs_summary(s)]
        gen = self.gen
        for g in due:
            state, ep = states[g], partial.episodes[g]
            plan = env.summary_plan(state)
            assert plan is not None          # needs_summary
            context = state_context(state, env.tokenizer)
            seed = int.from_bytes(hashlib.sha256(f"{partial.task_id}:agentic-summary:{partial.turns}:{g}".encode())
                                  .digest()[:7], "big")
            started = time.monotonic()
            written = await anyio.to_thread.run_sync(functools.partial(
                gen.write_summary, context, budget=plan.budget, keep=plan.keep, prompt=list(plan.prompt),
                tokens=plan.tokens, seed=seed))
            partial.generate_s += time.monotonic() - started
            before = agentic_segment(ep, state, env)
            if before is not None:
                ep.segments.append(before)
            ep.segments.append(written.segment(routing=False))     # agentic rollouts carry no routing
            states[g] = env.summarize(state, written.ids)
            ep.state, ep.logprobs, ep.versions = encode_state(states[g]), [], []
            partial.sampled_tokens += len(written.ids)
            gen.count("summaries")
            gen.count("tokens", len(written.ids))
            log.info("episode_summarised", task_id=partial.task_id, group_index=g, context=len(context),
                     summary=len(written.ids), kind="agentic")
        return bool(due)

    async def _turn(self, partial: AgenticPartial, states: list[AgenticState], sessions: dict[int, SandboxSession],
                    snapshots: dict[int, WorkspaceSnapshot], task: RepoTask, env: AgenticEnvironment) -> None:
        """One turn of every open episode: open what has no session, a policy turn each, the steps, snapshots."""
        open_ = [g for g, s in enumerate(states) if not s.done]
        started = time.monotonic()
        turns = await self._policy_turns(partial, [(g, states[g]) for g in open_], env, task)
        partial.generate_s += time.monotonic() - started
        started = time.monotonic()

        async def step(g: int) -> None:
            ep, state, turn = partial.episodes[g], states[g], turns[g]
            ep.logprobs.append(turn.logprobs)
            ep.versions.append(turn.versions)
            losses = 0
            while True:
                try:
                    new = await self._step_in_session(partial, g, state, turn.ids, sessions, snapshots, task, env,
                                                      tries=REOPEN_TRIES if losses else OPEN_TRIES)
                    break
                except (SandboxCrashed, nats.errors.Error, TimeoutError, DigestMismatch) as err:
                    self.gen.count("sessions_lost")
                    if g in sessions:           # the session is gone or unusable: its lease ends what is left
                        with anyio.move_on_after(1.0):
                            await self._close(sessions.pop(g))
                        self._held(sessions)
                    losses += 1
                    if losses <= SESSION_LOSSES and not isinstance(err, SessionRefused):
                        log.warning("agentic_session_lost", task_id=partial.task_id, group_index=g, losses=losses,
                                    error=repr(err)[:300])
                        continue                # the turn again, in a new session restored from the last snapshot
                    self.gen.count("sandbox_errors")
                    log.warning("agentic_sandbox_error", task_id=partial.task_id, group_index=g, error=repr(err)[:300])
                    ep.sandbox_error = f"{type(err).__name__}: {err}"[:300]
                    new = _ended_by_sandbox(state, turn.ids)
                    break
            states[g] = new
            ep.state = encode_state(new)
            if new.done and g in sessions:
                await self._close(sessions.pop(g))
                self._held(sessions)

        async with anyio.create_task_group() as tg:
            for g in open_:
                tg.start_soon(step, g)
        lost = [g for g in open_ if partial.episodes[g].sandbox_error]
        for g in (g for g in open_ if lost and not states[g].done):
            # the group is dropped (never trained) once one episode's sandbox is beyond reopening: the others end now
            partial.episodes[g].sandbox_error = f"the group is dropped: episode {lost[0]}'s sandbox failed"
            states[g] = msgspec.structs.replace(states[g], done=True, reward=0.0, verdict="error")
            partial.episodes[g].state = encode_state(states[g])
            if g in sessions:
                await self._close(sessions.pop(g))
                self._held(sessions)
        partial.tool_s += time.monotonic() - started
        partial.turns += 1

    async def _step_in_session(self, partial: AgenticPartial, g: int, state: AgenticState, ids: list[int],
                               sessions: dict[int, SandboxSession], snapshots: dict[int, WorkspaceSnapshot],
                               task: RepoTask, env: AgenticEnvironment, *, tries: int) -> AgenticState:
        """Episode `g`'s turn through its session (opened first, restored from its last snapshot, when it has
        none), then a snapshot if the turn may have changed the workspace.

        :raises SandboxCrashed: the session was lost (or none opens: `SessionRefused`); nothing of the turn is
            kept, and the workspace it leaves is not the state's.
        """
        if g not in sessions:
            sessions[g] = await self._open(task, snapshots.get(g), tries=tries)
            self._bases[id(sessions[g])] = snapshots.get(g)
            self._held(sessions)
            if snapshots.get(g) is not None and partial.episodes[g].workspace_digest:
                await self._check_restored(partial, g, sessions[g])
        session = sessions[g]
        calls = len(state.calls)
        new = (await env.step(state, ids, SessionPort(session), now=time.time(), clock=time.time)).state
        if not new.done and any(c.name in CHANGING_TOOLS for c in new.calls[calls:]):
            await self._snapshot(partial, partial.episodes[g], session, snapshots, g, task)
        return new

    async def _policy_turns(self, partial: AgenticPartial, rows: list[tuple[int, AgenticState]],
                            env: AgenticEnvironment, task: RepoTask) -> dict[int, _Turn]:
        """The next policy turn of each open episode: sampled (all rows of the group, and of other tasks, in
        merged calls), or the script's, scored under the live policy."""
        gen = self.gen
        max_len = gen.model.max_seq_len
        contexts = {g: state_context(s, env.tokenizer) for g, s in rows}
        caps = {g: max(0, min(gen.config.max_tokens, env.room(s), max_len - len(contexts[g]))) for g, s in rows}
        if gen.config.script:
            script = {"reference": reference_script, "edits": edits_script}.get(gen.config.script,
                                                                                lambda _: SUBMIT_SCRIPT)(task)
            scripted = {g: scripted_ids(script, s, env.tokenizer)[:caps[g]] or [env.tokenizer.stop_id] for g, s in rows}
            return await anyio.to_thread.run_sync(self._score, contexts, scripted)
        out = {g: _Turn([], [], []) for g, _ in rows}
        stops = set(env.tokenizer.stop_ids)
        vocab = env.tokenizer.vocab_size
        pending = [g for g, _ in rows if caps[g] > 0]
        ended: set[int] = set()

        async def sample(g: int, seed: int) -> None:
            turn = out[g]
            (sample,) = await gen.sample_rows([contexts[g] + turn.ids], caps[g] - len(turn.ids), seed)
            for t, lp, v in zip(sample.tokens.tolist(), sample.logprobs.tolist(), sample.versions.tolist(),
                                strict=True):
                if not 0 <= t < vocab:       # an embedding row the tokenizer has no text for: the turn ends before it
                    ended.add(g)
                    break
                turn.ids.append(int(t))
                turn.logprobs.append(min(float(lp), 0.0))
                turn.versions.append(int(v))
                if t in stops:
                    ended.add(g)
                    break

        chunk = 0
        while pending:
            async with anyio.create_task_group() as tg:
                for g in pending:
                    tg.start_soon(sample, g, _seed(partial.task_id, partial.turns, g, chunk))
            chunk += 1
            pending = [g for g in pending if len(out[g].ids) < caps[g] and g not in ended]
        empty = {g: [env.tokenizer.stop_id] for g, _ in rows if not out[g].ids}
        if empty:                            # the turn is the stop id alone, scored like a scripted one
            out.update(await anyio.to_thread.run_sync(self._score, contexts, empty))
        kept = sum(len(t.ids) for t in out.values())
        partial.sampled_tokens += kept
        gen.count("tokens", kept)
        gen.note_version()
        return out

    def _score(self, contexts: Mapping[int, list[int]], turns: Mapping[int, list[int]]) -> dict[int, _Turn]:
        """Behaviour logprobs of scripted turns (and of a sampled turn that came back empty: the stop id alone): one
        forward pass each of context + ids under the live policy, log softmax(logits / temperature) as the trainer
        scores them (worker thread, the generator's model lock held)."""
        gen = self.gen
        tau = gen.config.temperature or 1.0
        weights = gen.weights_source()
        out: dict[int, _Turn] = {}
        with gen.model_lock, torch.no_grad():
            weights.maybe_swap(0)
            version = weights.held_version or 0
            model = weights.model
            for g, ids in turns.items():
                context = contexts[g][-(model.max_seq_len - len(ids)):]   # all of it: the cap left room
                x = torch.tensor([[*context, *ids]], device=model.device)
                logits = model(x).logits[0, len(context) - 1:-1].float()
                # at the sampling temperature, as a sampled token's logprob (model/sampling/generate.py sample_next)
                lps = torch.log_softmax(logits / tau, dim=-1).gather(-1, x[0, len(context):, None])[:, 0]
                out[g] = _Turn(list(ids), [min(float(v), 0.0) for v in lps.tolist()], [version] * len(ids))
        return out

    # ---- sessions and snapshots ----------------------------------------------------------------
    async def _open(self, task: RepoTask, snapshot: WorkspaceSnapshot | None, *, tries: int) -> SandboxSession:
        """A session seeded with the task's files (overlaid by `snapshot`); tried `tries` times (1 s, 2 s, 4 s ...
        apart).

        :raises SessionRefused: none could be opened.
        """
        gen = self.gen
        files = {path: text.encode() for path, text in task.files.items()}
        if snapshot is not None:
            files = restore_files(files, ToolResult(session_id="", call_id="", ok=True, files=snapshot.files,
                                                    deleted=snapshot.deleted))
        for attempt in range(tries):
            try:
                session_id = await open_session(gen.bus, gen.ident.region, files, lease_s=gen.config.session_lease_s)
                return SandboxSession(gen.bus, gen.ident.region, session_id,
                                      call_timeout_s=gen.config.sandbox_timeout_s)
            except SessionRefused as err:
                if attempt == tries - 1:
                    raise
                log.warning("session_open_retry", attempt=attempt + 1, error=str(err)[:300])
                await anyio.sleep(2.0 ** attempt)
        raise AssertionError("unreachable")

    async def _check_restored(self, partial: AgenticPartial, g: int, session: SandboxSession) -> None:
        """Compare a session restored from episode `g`'s snapshot with the workspace the snapshot was taken of (the
        sandbox's `digest` of both); counted (`restores_checked`, `restores_equal`) and told as an
        `Event(incident)` with `what` workspace_restored.

        :raises DigestMismatch: they differ (the session is lost: the turn is taken again in another one).
        """
        gen = self.gen
        want = partial.episodes[g].workspace_digest
        got = await session.digest()
        equal = got == want
        gen.count("restores_checked")
        gen.count("restores_equal", int(equal))
        log.info("workspace_restored", task_id=partial.task_id, group_index=g, equal=equal, session_id=session.session_id)
        await gen.bus.event(Event(event="incident", actor_id=gen.ident.actor_id, actor_kind=gen.kind,
                                  region=gen.ident.region,
                                  detail=f"workspace restored from its snapshot: digest {'equal' if equal else 'differs'}",
                                  data={"what": "workspace_restored", "equal": str(equal).lower(),
                                        "task_id": partial.task_id[:200], "group_index": str(g)}))
        if not equal:
            raise DigestMismatch(f"session {session.session_id} restored from {partial.episodes[g].snapshot}: its "
                                 f"digest {got[:80]} is not the snapshotted workspace's {want}")

    async def _snapshot(self, partial: AgenticPartial, ep: AgenticEpisode, session: SandboxSession,
                        snapshots: dict[int, WorkspaceSnapshot], g: int, task: RepoTask) -> None:
        """Snapshot the workspace's changed files, check each file's digest, lay them over the snapshot the
        session was restored from (`overlay`: the changes since the task's own files, however many resumes ago),
        store that under its own content address (unless it is there already) and point the episode at it."""
        result = answered(await session.snapshot())
        if not result.ok:
            raise SandboxCrashed(f"snapshot of session {session.session_id} refused: {result.error[:200]}")
        for path, data in result.files.items():
            if result.digests.get(path) != hashlib.sha256(data).hexdigest():
                raise DigestMismatch(f"snapshot of session {session.session_id}: {path} does not match its digest")
        snap = overlay(self._bases.get(id(session)), result.files, result.deleted, task_id=partial.task_id,
                       task_files=task.files)
        blob = msgspec.msgpack.encode(snap)
        hexdigest = hashlib.sha256(blob).hexdigest()
        name = self.gen.bus.subjects.workspace_object(hexdigest)
        if name != ep.snapshot:
            if name not in partial.objects:
                await self.gen.bus.put_object(self.bucket, name, blob)
                if name not in partial.objects:     # another episode's identical snapshot may have been put meanwhile
                    partial.objects.append(name)
            ep.snapshot, ep.snapshot_digest = name, digest(blob)
        ep.workspace_digest = await session.digest()
        snapshots[g] = snap

    async def _restore(self, partial: AgenticPartial) -> dict[int, WorkspaceSnapshot]:
        """The snapshot of every unfinished episode that has one, fetched and digest-checked.

        :raises PartialGroupError: one is missing, corrupt or does not decode.
        """
        out: dict[int, WorkspaceSnapshot] = {}
        for g, ep in enumerate(partial.episodes):
            if not ep.snapshot or episode_state(ep).done:
                continue
            # an outage of the region's server is ridden out (as the partial's own read); a missing or corrupt
            # object, or one that still does not come after GIVE_UP_S, discards the partial
            retry = retry_policy("snapshot_fetch_retry", on=RETRIED, initial_s=0.5, max_s=5.0,
                                 give_up_after_s=GIVE_UP_S, task_id=partial.task_id, object=ep.snapshot)
            try:
                async for attempt in retry:
                    with attempt:
                        blob = await self.gen.bus.get_object(self.bucket, ep.snapshot,
                                                             expected_digest=ep.snapshot_digest, timeout_s=30.0)
                out[g] = msgspec.msgpack.decode(blob, type=WorkspaceSnapshot)
            except (nats.js.errors.NotFoundError, DigestMismatch, msgspec.DecodeError, *RETRIED) as err:
                raise PartialGroupError(f"episode {g}: workspace snapshot {ep.snapshot}: {err!r}"[:300]) from None
            if out[g].task_id != partial.task_id:
                raise PartialGroupError(f"episode {g}: workspace snapshot {ep.snapshot} is task "
                                        f"{out[g].task_id[:100]!r}'s")
        return out

    async def _close(self, session: SandboxSession) -> None:
        self._bases.pop(id(session), None)
        with anyio.move_on_after(5.0, shield=True):
            try:
                await session.close()
            except (RlbusError, nats.errors.Error, TimeoutError) as err:   # its lease ends it
                log.warning("session_not_closed", session_id=session.session_id, error=repr(err)[:200])

    async def _close_all(self, sessions: dict[int, SandboxSession]) -> None:
        with anyio.CancelScope(shield=True):
            for g in list(sessions):
                await self._close(sessions.pop(g))
                self._held(sessions)

    def _held(self, sessions: dict[int, SandboxSession]) -> None:
        """The `sessions_held` gauge: sessions this generator holds open, over every group it runs."""
        self._open_by_group[id(sessions)] = len(sessions)
        if not sessions:
            del self._open_by_group[id(sessions)]
        self.gen.gauges["sessions_held"] = float(sum(self._open_by_group.values()))

    # ---- partials -------------------------------------------------------------------------------
    async def _load(self, key: str, task_id: str, group_size: int, task: RepoTask, env: AgenticEnvironment
                    ) -> tuple[AgenticPartial | None, int | None, dict[int, WorkspaceSnapshot]]:
        """The saved partial, its revision and its episodes' snapshots; (None, revision, {}) when absent or
        unusable (discarded with an `Event(incident)`, like a function group's)."""
        gen = self.gen
        entry = await read_key(gen.bus.js, gen.bus.subjects.partials_bucket(gen.ident.region), key,
                               give_up_after_s=GIVE_UP_S)
        if entry.value is None:
            return None, None, {}
        try:
            partial = decode_agentic(entry.value)
            held = gen.held_version()
            check_agentic_partial(partial, task, task_id, env, AgenticLimits(
                group_size=group_size, max_seq_len=gen.model.max_seq_len, vocab_size=gen.model.vocab_size,
                held_version=held))
            snapshots = await self._restore(partial)
        except PartialGroupError as err:
            gen.count("partials_discarded")
            log.warning("partial_discarded", task_id=task_id, revision=entry.revision, error=str(err)[:300])
            await gen.bus.event(Event(event="incident", actor_id=gen.ident.actor_id, actor_kind=gen.kind,
                                      region=gen.ident.region, detail=f"partial discarded: {str(err)[:300]}",
                                      data={"what": "partial_discarded", "task_id": task_id[:200]}))
            return None, entry.revision, {}
        return partial, entry.revision, snapshots

    async def _save(self, key: str, partial: AgenticPartial, revision: int | None) -> int:
        bucket = self.gen.bus.subjects.partials_bucket(self.gen.ident.region)
        try:
            return await put_at(self.gen.bus.js, bucket, key, encode_agentic(partial), revision=revision,
                                give_up_after_s=GIVE_UP_S)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _TakenOver(partial.task_id) from None

    # ---- publishing -----------------------------------------------------------------------------
    async def _publish(self, partial: AgenticPartial, states: list[AgenticState], message: TaskMessage, key: str,
                       env: AgenticEnvironment) -> None:
        """Publish the G Rollouts (msg id = rollout id, retried until stored), then delete the partial and the
        group's snapshot objects."""
        gen = self.gen
        now = time.time()
        timings = {"generate_s": partial.generate_s, "tool_s": partial.tool_s, "wall_s": now - partial.started_at,
                   "queue_s": max(0.0, partial.started_at - message.created_at), "resumes": float(partial.resumes)}
        rollouts = [agentic_rollout(ep, state, env, task_id=partial.task_id, group_index=g,
                                    group_size=partial.group_size, region=gen.ident.region,
                                    generator_id=gen.ident.actor_id, timings=timings)
                    for g, (ep, state) in enumerate(zip(partial.episodes, states, strict=True))]
        subject = gen.bus.subjects.rollouts(gen.ident.region)
        retry = retry_policy("rollouts_not_published", on=(nats.errors.Error, TimeoutError), initial_s=0.5, max_s=5.0,
                             forever="the group is in hand and its task held: ride out the region's outage rather "
                                     "than give the work back", task_id=partial.task_id)
        async for attempt in retry:
            with attempt:
                try:
                    await gen.bus.publish_batch([(subject, r, r.rollout_id) for r in rollouts])
                except (nats.errors.Error, TimeoutError):
                    gen.count("publish_failures")
                    raise
        gen.count("rollouts", len(rollouts))
        try:
            await gen.kv.delete(key)
            store = await gen.bus.js.object_store(self.bucket)
            for name in partial.objects:
                await store.delete(name)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("partial_not_deleted", task_id=partial.task_id, error=repr(err))
        log.info("group_published", task_id=partial.task_id, rollouts=len(rollouts), kind="agentic",
                 rewards=[r.reward for r in rollouts], turns=partial.turns, tokens=partial.sampled_tokens,
                 resumes=partial.resumes)


def overlay(base: WorkspaceSnapshot | None, files: Mapping[str, bytes], deleted: list[str], *, task_id: str,
            task_files: Mapping[str, str]) -> WorkspaceSnapshot:
    """The workspace's changes since the task's own files: `base` (what its session was restored from; None: the
    task's files) with a session's changes since it opened laid over it (`files` changed or new, `deleted` paths
    gone). A path deleted now is dropped from the base's files and, if the task has it, named as deleted."""
    out = dict(base.files) if base is not None else {}
    gone = set(base.deleted) if base is not None else set()
    own = {path.strip("/") for path in task_files}
    for path in deleted:
        out.pop(path, None)
        if path in own:
            gone.add(path)
    for path, data in files.items():
        out[path] = data
        gone.discard(path)
    return WorkspaceSnapshot(task_id=task_id, files=dict(sorted(out.items())), deleted=sorted(gone))


def _ended_by_sandbox(state: AgenticState, ids: list[int]) -> AgenticState:
    """The episode ended after its turn `ids` because its sandbox could not be reached: reward 0, verdict error
    (its group is dropped, never trained: the trainer's `sandbox_error`)."""
    return msgspec.structs.replace(state, turns=(*state.turns, Turn("assistant", tuple(ids))),
                                   policy_turns=state.policy_turns + 1, done=True, reward=0.0, verdict="error")


def agentic_segment(ep: AgenticEpisode, state: AgenticState, env: AgenticEnvironment) -> Segment | None:
    """The episode's turns since its last summary as trained tokens: prompt = the first user turn's context (bos,
    the user turn, the assistant header's length of what follows); completion = the rest up to the last policy id;
    loss mask exactly the ids of its assistant turns (a summary turn is context here: it is a segment of its own),
    their behaviour logprobs and versions in order (versions of other tokens filled from the nearest policy
    token). None when no assistant turn follows the task (or the last summary).

    :raises ValueError: the logprobs kept are not one per policy id.
    """
    tok = env.tokenizer
    flat = state_tokens(state, tok)
    first = msgspec.structs.replace(state, turns=state.turns[:1])
    n_prompt = len(state_context(first, tok))
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
    return Segment(prompt_tokens=TensorBlob.of(flat.ids[:n_prompt], "int32"),
                   completion_tokens=TensorBlob.of(flat.ids[n_prompt:end], "int32"),
                   behaviour_logprobs=TensorBlob.of(logprobs[n_prompt:end], "float32"),
                   policy_versions=TensorBlob.of(versions[n_prompt:end], "int32"),
                   loss_mask=TensorBlob.of(mask[n_prompt:end], "uint8"))


def agentic_rollout(ep: AgenticEpisode, state: AgenticState, env: AgenticEnvironment, *, task_id: str,
                    group_index: int, group_size: int, region: str, generator_id: str,
                    timings: Mapping[str, float]) -> Rollout:
    """A finished episode as a Rollout: its turns since the last summary (`agentic_segment`), its earlier segments
    (`AgenticEpisode.segments`), reward and verdict from the final state."""
    try:
        tail = agentic_segment(ep, state, env)
    except ValueError as err:
        raise ValueError(f"episode {task_id}-{group_index}: {err}") from None
    if tail is None:
        raise ValueError(f"episode {task_id}-{group_index} has no policy id to train on")
    grade = state.grade
    status = "ok" if state.verdict == "passed" else ("timeout" if state.verdict == "timeout" else
                                                   "error" if state.verdict == "error" else "failed")
    verdict = SandboxVerdict(passed=grade.n_passed if grade else 0, total=grade.n_tests if grade else 1,
                             status=status)  # type: ignore[arg-type]
    return Rollout(
        rollout_id=f"{task_id}-{group_index}", task_id=task_id, group_index=group_index, group_size=group_size,
        prompt_tokens=tail.prompt_tokens, completion_tokens=tail.completion_tokens,
        behaviour_logprobs=tail.behaviour_logprobs, policy_versions=tail.policy_versions,
        loss_mask=tail.loss_mask, routing=None, reward=float(state.reward), verdict=verdict,
        timings={**timings, "turns": float(state.policy_turns), "tool_calls": float(state.tool_calls),
                 "sandbox_error": float(bool(ep.sandbox_error)), "summaries": float(state.summaries)},
        region=region, generator_id=generator_id, segments=list(ep.segments))


def _seed(task_id: str, turn: int, g: int, chunk: int) -> int:
    """Sampler seed of one episode's call: stable across a resume (task, turn, episode, call of the turn)."""
    return int.from_bytes(hashlib.sha256(f"{task_id}:agentic:{turn}:{g}:{chunk}".encode()).digest()[:7], "big")


def fits(task: RepoTask, env: AgenticEnvironment) -> bool:
    """Whether the task's first context leaves room for a turn of `min_turn_tokens` in the episode's token budget
    (`[generator.agentic] max_tokens`, capped by the policy's context: `budgets_of`)."""
    return len(state_context(env.start(task), env.tokenizer)) + env.budgets.min_turn_tokens <= env.budgets.max_tokens


__all__ = ["AGENTIC_FORMAT", "AGENTIC_MAGIC", "AgenticEpisode", "AgenticGroups", "AgenticLimits", "AgenticPartial",
           "WorkspaceSnapshot", "agentic_rollout", "agentic_segment", "check_agentic_partial", "decode_agentic", "encode_agentic",
           "fits", "overlay"]
