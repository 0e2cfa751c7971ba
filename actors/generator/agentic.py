"""The agentic environment's plug: a repository task's G episodes, each in its own sandbox session.

- Owns: `AgenticPlug` (what `GroupLoop` drives for a Task whose verifier is of the repository kind), its partial
  layout (`AgenticPartial`, refused when corrupt or foreign by `check_agentic_partial`) and the workspace
  snapshots (`WorkspaceSnapshot`).
- Guarantee: a resume keeps every edit (sessions reopen from snapshots, never by re-running commands);
  sandbox failures are never trained as the policy's.
- Does not: drive the group (actors/generator/loop.py), parse tool calls, run budgets or grade
  (model/env/agentic.py), run tools (actors/sandbox/).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
import zstandard

from rlbus.actors.common.errors import PartialGroupError, TaskError
from rlbus.actors.common.sessions import (
    SandboxSession,
    SessionPort,
    SessionRefused,
    answered,
    open_session,
    restore_files,
)
from rlbus.actors.generator.group import MAX_PARTIAL_BYTES, PartialLimits, check_segment, group_sizes
from rlbus.actors.generator.loop import BasePlug, Group, LoopEpisode, Outcome, Round
from rlbus.messages.errors import DigestMismatch, RlbusError, SandboxCrashed
from rlbus.messages.kv import RETRIED
from rlbus.messages.objects import digest
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Event, SandboxVerdict, Segment, ToolResult
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
from rlbus.model.env.agentic import SummaryPlan
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
    draft_ids: list[int] = []
    """The policy turn being sampled (a partial saved mid-turn), its logprobs and versions; `draft_done`: complete,
    waiting for its step."""
    draft_logprobs: list[float] = []
    draft_versions: list[int] = []
    draft_done: bool = False


class AgenticPartial(msgspec.Struct, kw_only=True):
    """An agentic group in progress, saved after every turn under the task's PARTIALS key."""

    format: str = AGENTIC_FORMAT
    task_id: str
    group_size: int
    episodes: list[AgenticEpisode]
    turns: int = 0
    """Group turns done (one policy turn of every open episode)."""
    chunks: int = 0
    """Sampling and summary calls done (they seed the next one)."""
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
    max_group_size: int = 0
    """A group without a pass may have grown by `group_size` at a time up to this many episodes."""
    max_tokens: int = 0
    """The longest draft (`[generator] max_tokens`); 0: max_seq_len."""


def check_agentic_partial(partial: AgenticPartial, task: RepoTask, task_id: str, env: AgenticEnvironment,
                          limits: AgenticLimits) -> None:
    """Raise PartialGroupError (naming the first problem) unless `partial` is one this task's group could have
    saved: its format, task and group size; every episode's state of this very task, starting with its rendered
    user turn; one list of logprobs (finite, <= 0) and versions (0..held) per policy turn, as long as its ids;
    ids in the vocabulary; within max_seq_len; snapshot names that are content addresses."""
    if (partial.format, partial.task_id) != (AGENTIC_FORMAT, task_id):
        raise PartialGroupError(f"saved for format {partial.format!r}, task {partial.task_id!r}; expected "
                                f"{AGENTIC_FORMAT!r}, {task_id!r}")
    if partial.group_size not in group_sizes(limits.group_size, limits.max_group_size) or \
            len(partial.episodes) != partial.group_size:
        raise PartialGroupError(f"{len(partial.episodes)} episodes, group size {partial.group_size}; expected "
                                f"{limits.group_size}")
    if min(partial.turns, partial.chunks, partial.sampled_tokens, partial.resumes) < 0 or not all(
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
    if state.task != task or not state.turns or (state.turns[0] != first and not env.restarted(state)):
        raise PartialGroupError("not this task's episode")
    policy = [t for t in state.turns if t.role == "assistant"]
    summary = 1 if state.turns[1:2] and state.turns[1].role == "summary" else 0  # only the turn after the first
    asked = [k for k, t in enumerate(state.turns) if k and t.role == "user"]   # a summary request, the last turn
    if (state.summaries < 0 or (asked and (not state.summarizing or asked != [len(state.turns) - 1]))
            or (state.summarizing and not asked)
            or any(t.role == "summary" for t in state.turns[1 + summary:]) or (summary and not state.summaries)
            or (len(policy) != state.policy_turns if not state.summaries else len(policy) > state.policy_turns)):
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
    if any(not 0 <= t < limits.vocab_size for turn in state.turns for t in turn.ids) or any(
            not 0 <= t < limits.vocab_size for t in ep.draft_ids):
        raise PartialGroupError(f"token id outside the vocabulary [0, {limits.vocab_size})")
    if not len(ep.draft_ids) == len(ep.draft_logprobs) == len(ep.draft_versions) or any(
            not (math.isfinite(x) and x <= 0.0) for x in ep.draft_logprobs) or any(
            not 0 <= v <= limits.held_version for v in ep.draft_versions):
        raise PartialGroupError("a draft whose logprobs or versions do not fit its ids")
    if len(ep.draft_ids) > (limits.max_tokens or limits.max_seq_len) or (ep.draft_done and not ep.draft_ids) or (
            state.done and ep.draft_ids):
        raise PartialGroupError(f"a draft of {len(ep.draft_ids)} ids (done: {ep.draft_done}, episode done: "
                                f"{state.done})")
    length = len(state_tokens(state, env.tokenizer).ids)
    if ep.draft_ids:
        length += len(env.tokenizer.header("assistant")) + len(ep.draft_ids)
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
                          summary_tokens=a.summary_tokens, partial_credit=a.partial_credit,
                          summary_at_tokens=a.summary_at_tokens)


def environment_of(generator: Generator) -> AgenticEnvironment:
    a = generator.config.agentic
    compact = a.tool_list == "compact" or (a.tool_list == "auto" and generator.model.max_seq_len < 4096)
    return AgenticEnvironment(generator.tokenizer, budgets_of(generator), tool_list="compact" if compact else "full")


@dataclass
class _Workspace:
    """An episode's sandbox record in the loop: its last snapshot and what ended it for want of a sandbox."""

    snapshot: str = ""
    snapshot_digest: str = ""
    workspace_digest: str = ""
    sandbox_error: str = ""


_HELD: weakref.WeakKeyDictionary[Generator, dict[int, int]] = weakref.WeakKeyDictionary()
"""Per generator: sessions each of its agentic groups holds open now (the `sessions_held` gauge)."""


class AgenticPlug(BasePlug):
    """A repository task (model/tasks/repo.py `VERIFIER_KIND`) as `GroupLoop` drives it: each episode's turns run
    in a sandbox session of its own through `AgenticEnvironment.step`.

    The partial is `AgenticPartial`, a tagged layout behind `AGENTIC_MAGIC` (a function group's partial and an
    agentic one are never taken for each other); workspace snapshots are content-addressed objects in the region's
    WORKSPACES bucket, digest-checked both ways. A turn is capped by `AgenticEnvironment.room` as well; with
    `[generator] script` it is the script's, scored by one forward pass of the live policy. A history that fills the
    context is summarised when `AgenticEnvironment.needs_summary` says so. After a step that may have changed the
    workspace (`CHANGING_TOOLS`), it is snapshotted.

    A replacement generator reopens each unfinished episode's session seeded with the task's files overlaid by the
    snapshot (`restore_files`), never by re-running commands; a snapshot always holds every change since the task's
    own files (`overlay`), so any number of resumes keeps every edit. The sandbox's digest of the workspace is kept
    with each snapshot, and a restored session's must equal it (`_check_restored`: counted, told as an event; a
    mismatch loses the session like a crash).

    Leases: the open sessions' leases are renewed while turns are sampled (`background`). Sandbox failures are never
    trained as the policy's: a session lost mid-turn (its supervisor died, its lease ran out, a call went
    unanswered) is reopened from the episode's last snapshot and the turn taken again (`SESSION_LOSSES` times a
    turn, each reopen tried `REOPEN_TRIES` times); an episode whose session cannot be opened (`OPEN_TRIES`) or
    reopened ends the group: every open episode ends with reward 0, verdict "error" and
    `Rollout.timings["sandbox_error"]` 1 (counted in `sandbox_errors`), and the trainer drops the group with the
    reason `sandbox_error`; the generator goes on.
    """

    routing = False
    step_time = "tool_s"
    log_fields: ClassVar[Mapping[str, str]] = {"kind": "agentic"}

    def __init__(self, gen: Generator, task: RepoTask) -> None:
        super().__init__(gen, environment_of(gen), task)
        self.task: RepoTask = task
        self.env: AgenticEnvironment = self.env   # type: ignore[assignment]
        self.bucket = gen.bus.subjects.workspaces_bucket(gen.ident.region)
        self.sessions: dict[int, SandboxSession] = {}
        self.snapshots: dict[int, WorkspaceSnapshot] = {}
        self._bases: dict[int, WorkspaceSnapshot | None] = {}
        """id of an open session → the snapshot it was restored from (None: the task's own files)."""
        self._script: tuple[str, ...] = ()
        if gen.config.script:
            self._script = {"reference": reference_script, "edits": edits_script}.get(
                gen.config.script, lambda _: SUBMIT_SCRIPT)(task)

    def start(self, *, now: float) -> LoopEpisode:
        return LoopEpisode(state=self.env.start(self.task, now=now), extra=_Workspace())

    def room(self, ep: LoopEpisode) -> int:
        state: AgenticState = ep.state   # type: ignore[assignment]
        room = self.env.room(state)
        cap = self.env.budgets.summary_tokens
        return min(room, cap) if state.summarizing and cap else room

    def prepare(self, ep: LoopEpisode) -> AgenticState | None:
        return self.env.request_summary(ep.state)   # type: ignore[arg-type]

    def restart(self, ep: LoopEpisode) -> AgenticState | None:
        return self.env.restart(ep.state)   # type: ignore[arg-type]

    def summary_plan(self, ep: LoopEpisode) -> SummaryPlan | None:
        state: AgenticState = ep.state   # type: ignore[assignment]
        return self.env.summary_plan(state) if self.env.needs_summary(state) else None

    def summarize(self, ep: LoopEpisode, ids: list[int]) -> AgenticState:
        return self.env.summarize(ep.state, ids)   # type: ignore[arg-type]

    def scripted(self, ep: LoopEpisode) -> list[int] | None:
        """The script's turn; a summary asked for is sampled (a script has none)."""
        if not self._script or ep.state.summarizing:   # type: ignore[attr-defined]
            return None
        return scripted_ids(self._script, ep.state, self.tokenizer)  # type: ignore[arg-type]

    def outcome(self, ep: LoopEpisode) -> Outcome:
        state: AgenticState = ep.state   # type: ignore[assignment]
        grade = state.grade
        status = "ok" if state.verdict == "passed" else ("timeout" if state.verdict == "timeout" else
                                                       "error" if state.verdict == "error" else "failed")
        verdict = SandboxVerdict(passed=grade.n_passed if grade else 0, total=grade.n_tests if grade else 1,
                                 status=status)  # type: ignore[arg-type]
        return Outcome(float(state.reward), verdict,
                       {"turns": float(state.policy_turns), "tool_calls": float(state.tool_calls),
                        "sandbox_error": float(bool(ep.extra.sandbox_error)), "summaries": float(state.summaries)})

    def round(self, group: Group) -> Round:
        return _SessionRound(self, group)

    async def background(self) -> None:
        """Renew the open sessions' leases while turns are sampled (a slow policy's turn may outlast a lease): a
        cheap call on each every third of `session_lease_s`; a failed one is left to the next real call."""
        every = max(self.gen.config.session_lease_s / 3, 0.5)
        while True:
            await anyio.sleep(every)
            for session in list(self.sessions.values()):
                if not session.closed:
                    with anyio.move_on_after(every):
                        try:
                            await session.tool("list_files", {"path": "."})
                        except (RlbusError, nats.errors.Error, TimeoutError):
                            pass

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            for g in list(self.sessions):
                await self._close(g)

    async def resume(self, group: Group) -> None:
        self.snapshots = await self._restore(group)

    async def cleanup(self, group: Group) -> None:
        store = await self.gen.bus.js.object_store(self.bucket)
        for name in group.extra or []:
            await store.delete(name)

    # ---- the partial layout: AgenticPartial -----------------------------------------------------
    def encode(self, group: Group) -> bytes:
        return encode_agentic(AgenticPartial(
            task_id=group.task_id, group_size=group.group_size, turns=group.rounds, chunks=group.chunks,
            sampled_tokens=group.sampled_tokens, generate_s=group.generate_s, tool_s=group.step_s,
            started_at=group.started_at, writer=group.writer, resumes=group.resumes, objects=list(group.extra or []),
            episodes=[AgenticEpisode(state=encode_state(ep.state), logprobs=ep.logprobs,  # type: ignore[arg-type]
                                     versions=ep.versions, snapshot=ep.extra.snapshot,
                                     snapshot_digest=ep.extra.snapshot_digest,
                                     workspace_digest=ep.extra.workspace_digest, sandbox_error=ep.extra.sandbox_error,
                                     segments=ep.segments, draft_ids=ep.draft_ids, draft_logprobs=ep.draft_logprobs,
                                     draft_versions=ep.draft_versions, draft_done=ep.draft_done)
                      for ep in group.episodes]))

    def decode(self, data: bytes, task_id: str, group_size: int) -> Group:
        partial = decode_agentic(data)
        gen = self.gen
        check_agentic_partial(partial, self.task, task_id, self.env, AgenticLimits(
            group_size=group_size, max_seq_len=gen.model.max_seq_len, vocab_size=gen.model.vocab_size,
            held_version=gen.held_version(), max_group_size=gen.config.max_group_size,
            max_tokens=gen.config.max_tokens))
        episodes = []
        for ep in partial.episodes:
            state = episode_state(ep)
            episodes.append(LoopEpisode(
                state=state, logprobs=ep.logprobs, versions=ep.versions, draft_ids=ep.draft_ids,
                draft_logprobs=ep.draft_logprobs, draft_versions=ep.draft_versions, draft_done=ep.draft_done,
                segments=ep.segments, summaries=state.summaries,
                extra=_Workspace(ep.snapshot, ep.snapshot_digest, ep.workspace_digest, ep.sandbox_error)))
        return Group(task_id=partial.task_id, group_size=partial.group_size, episodes=episodes, rounds=partial.turns,
                     chunks=partial.chunks, sampled_tokens=partial.sampled_tokens, generate_s=partial.generate_s,
                     step_s=partial.tool_s, started_at=partial.started_at, writer=partial.writer,
                     resumes=partial.resumes, extra=list(partial.objects))

    # ---- sessions and snapshots ----------------------------------------------------------------
    async def step_in_session(self, group: Group, g: int, state: AgenticState, ids: list[int], *,
                              tries: int) -> AgenticState:
        """Episode `g`'s turn through its session (opened first, restored from its last snapshot, when it has
        none), then a snapshot if the turn may have changed the workspace.

        :raises SandboxCrashed: the session was lost (or none opens: `SessionRefused`); nothing of the turn is
            kept, and the workspace it leaves is not the state's.
        """
        ws: _Workspace = group.episodes[g].extra
        if g not in self.sessions:
            self.sessions[g] = await self._open(self.snapshots.get(g), tries=tries)
            self._bases[id(self.sessions[g])] = self.snapshots.get(g)
            self._held()
            if self.snapshots.get(g) is not None and ws.workspace_digest:
                await self._check_restored(group, g, self.sessions[g])
        session = self.sessions[g]
        calls = len(state.calls)
        new = (await self.env.step(state, ids, SessionPort(session), now=time.time(), clock=time.time)).state
        if not new.done and any(c.name in CHANGING_TOOLS for c in new.calls[calls:]):
            await self._snapshot(group, g, session)
        return new

    async def _open(self, snapshot: WorkspaceSnapshot | None, *, tries: int) -> SandboxSession:
        """A session seeded with the task's files (overlaid by `snapshot`); tried `tries` times (1 s, 2 s, 4 s ...
        apart).

        :raises SessionRefused: none could be opened.
        """
        gen = self.gen
        files = {path: text.encode() for path, text in self.task.files.items()}
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

    async def _check_restored(self, group: Group, g: int, session: SandboxSession) -> None:
        """Compare a session restored from episode `g`'s snapshot with the workspace the snapshot was taken of (the
        sandbox's `digest` of both); counted (`restores_checked`, `restores_equal`) and told as an
        `Event(incident)` with `what` workspace_restored.

        :raises DigestMismatch: they differ (the session is lost: the turn is taken again in another one).
        """
        gen = self.gen
        ws: _Workspace = group.episodes[g].extra
        want = ws.workspace_digest
        got = await session.digest()
        equal = got == want
        gen.count("restores_checked")
        gen.count("restores_equal", int(equal))
        log.info("workspace_restored", task_id=group.task_id, group_index=g, equal=equal, session_id=session.session_id)
        await gen.bus.event(Event(event="incident", actor_id=gen.ident.actor_id, actor_kind=gen.kind,
                                  region=gen.ident.region,
                                  detail=f"workspace restored from its snapshot: digest {'equal' if equal else 'differs'}",
                                  data={"what": "workspace_restored", "equal": str(equal).lower(),
                                        "task_id": group.task_id[:200], "group_index": str(g)}))
        if not equal:
            raise DigestMismatch(f"session {session.session_id} restored from {ws.snapshot}: its "
                                 f"digest {got[:80]} is not the snapshotted workspace's {want}")

    async def _snapshot(self, group: Group, g: int, session: SandboxSession) -> None:
        """Snapshot the workspace's changed files, check each file's digest, lay them over the snapshot the
        session was restored from (`overlay`: the changes since the task's own files, however many resumes ago),
        store that under its own content address (unless it is there already) and point the episode at it."""
        ws: _Workspace = group.episodes[g].extra
        objects: list[str] = group.extra if group.extra is not None else []
        group.extra = objects
        result = answered(await session.snapshot())
        if not result.ok:
            raise SandboxCrashed(f"snapshot of session {session.session_id} refused: {result.error[:200]}")
        for path, data in result.files.items():
            if result.digests.get(path) != hashlib.sha256(data).hexdigest():
                raise DigestMismatch(f"snapshot of session {session.session_id}: {path} does not match its digest")
        snap = overlay(self._bases.get(id(session)), result.files, result.deleted, task_id=group.task_id,
                       task_files=self.task.files)
        blob = msgspec.msgpack.encode(snap)
        name = self.gen.bus.subjects.workspace_object(hashlib.sha256(blob).hexdigest())
        if name != ws.snapshot:
            if name not in objects:
                await self.gen.bus.put_object(self.bucket, name, blob)
                if name not in objects:     # another episode's identical snapshot may have been put meanwhile
                    objects.append(name)
            ws.snapshot, ws.snapshot_digest = name, digest(blob)
        ws.workspace_digest = await session.digest()
        self.snapshots[g] = snap

    async def _restore(self, group: Group) -> dict[int, WorkspaceSnapshot]:
        """The snapshot of every unfinished episode that has one, fetched and digest-checked.

        :raises PartialGroupError: one is missing, corrupt or does not decode.
        """
        out: dict[int, WorkspaceSnapshot] = {}
        for g, ep in enumerate(group.episodes):
            ws: _Workspace = ep.extra
            if not ws.snapshot or ep.state.done:
                continue
            # an outage of the region's server is ridden out (as the partial's own read); a missing or corrupt
            # object, or one that still does not come after GIVE_UP_S, discards the partial
            retry = retry_policy("snapshot_fetch_retry", on=RETRIED, initial_s=0.5, max_s=5.0,
                                 give_up_after_s=GIVE_UP_S, task_id=group.task_id, object=ws.snapshot)
            try:
                async for attempt in retry:
                    with attempt:
                        blob = await self.gen.bus.get_object(self.bucket, ws.snapshot,
                                                             expected_digest=ws.snapshot_digest, timeout_s=30.0)
                out[g] = msgspec.msgpack.decode(blob, type=WorkspaceSnapshot)
            except (nats.js.errors.NotFoundError, DigestMismatch, msgspec.DecodeError, *RETRIED) as err:
                raise PartialGroupError(f"episode {g}: workspace snapshot {ws.snapshot}: {err!r}"[:300]) from None
            if out[g].task_id != group.task_id:
                raise PartialGroupError(f"episode {g}: workspace snapshot {ws.snapshot} is task "
                                        f"{out[g].task_id[:100]!r}'s")
        return out

    async def _close(self, g: int) -> None:
        session = self.sessions.pop(g)
        self._bases.pop(id(session), None)
        with anyio.move_on_after(5.0, shield=True):
            try:
                await session.close()
            except (RlbusError, nats.errors.Error, TimeoutError) as err:   # its lease ends it
                log.warning("session_not_closed", session_id=session.session_id, error=repr(err)[:200])
        self._held()

    def _held(self) -> None:
        """The `sessions_held` gauge: sessions this generator holds open, over every group it runs."""
        held = _HELD.setdefault(self.gen, {})
        held[id(self)] = len(self.sessions)
        if not self.sessions:
            del held[id(self)]
        self.gen.gauges["sessions_held"] = float(sum(held.values()))


class _SessionRound(Round):
    """One turn of every open episode, each through its session; a sandbox that cannot be reached drops the group."""

    plug: AgenticPlug

    async def step(self, g: int, ep: LoopEpisode, ids: list[int]) -> AgenticState:
        plug, state = self.plug, ep.state
        losses = 0
        while True:
            try:
                new = await plug.step_in_session(self.group, g, state, ids,  # type: ignore[arg-type]
                                                 tries=REOPEN_TRIES if losses else OPEN_TRIES)
                break
            except (SandboxCrashed, nats.errors.Error, TimeoutError, DigestMismatch) as err:
                plug.gen.count("sessions_lost")
                if g in plug.sessions:           # the session is gone or unusable: its lease ends what is left
                    with anyio.move_on_after(1.0):
                        await plug._close(g)
                losses += 1
                if losses <= SESSION_LOSSES and not isinstance(err, SessionRefused):
                    log.warning("agentic_session_lost", task_id=self.group.task_id, group_index=g, losses=losses,
                                error=repr(err)[:300])
                    continue                # the turn again, in a new session restored from the last snapshot
                plug.gen.count("sandbox_errors")
                log.warning("agentic_sandbox_error", task_id=self.group.task_id, group_index=g, error=repr(err)[:300])
                ep.extra.sandbox_error = f"{type(err).__name__}: {err}"[:300]
                new = _ended_by_sandbox(state, ids)   # type: ignore[arg-type]
                break
        if new.done and g in plug.sessions:
            await plug._close(g)
        return new

    async def close(self, stepped: list[int]) -> None:
        """Once one episode's sandbox is beyond reopening, the group is dropped (never trained): the others end now."""
        eps = self.group.episodes
        lost = [g for g in stepped if eps[g].extra.sandbox_error]
        for g in (g for g, ep in enumerate(eps) if lost and not ep.done):
            eps[g].extra.sandbox_error = f"the group is dropped: episode {lost[0]}'s sandbox failed"
            eps[g].state = msgspec.structs.replace(eps[g].state, done=True, reward=0.0, verdict="error")
            eps[g].draft_ids, eps[g].draft_logprobs, eps[g].draft_versions, eps[g].draft_done = [], [], [], False
            if g in self.plug.sessions:
                await self.plug._close(g)


def agentic_plug(gen: Generator, message: TaskMessage) -> AgenticPlug:
    """The plug of a repository task. :raises TaskError: the verifier is unusable, or the task's first context
    leaves no room for a turn."""
    task = RepoTask.from_spec(message.verifier)
    plug = AgenticPlug(gen, task)
    if not fits(task, plug.env):
        raise TaskError(f"the first context of repository task {message.task_id} leaves no room for a turn in the "
                        f"episode's {plug.env.budgets.max_tokens} tokens ([generator.agentic] max_tokens, capped by "
                        f"max_seq_len {gen.model.max_seq_len})")
    return plug



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


def fits(task: RepoTask, env: AgenticEnvironment) -> bool:
    """Whether the task's first context leaves room for a turn of `min_turn_tokens` in the episode's token budget
    (`[generator.agentic] max_tokens`, capped by the policy's context: `budgets_of`)."""
    return len(state_context(env.start(task), env.tokenizer)) + env.budgets.min_turn_tokens <= env.budgets.max_tokens


__all__ = ["AGENTIC_FORMAT", "AGENTIC_MAGIC", "AgenticEpisode", "AgenticLimits", "AgenticPartial", "AgenticPlug",
           "WorkspaceSnapshot", "agentic_plug", "check_agentic_partial", "decode_agentic", "encode_agentic", "fits",
           "overlay"]
