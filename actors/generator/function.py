"""The function-writing environment's plug: what `GroupLoop` needs for a coding task of the built-in kind.

- Owns: `FunctionPlug` (the grading port of a round, `_RoundGrades`: each distinct program once; the summary of
  an over-budget history; the reward with partial credit) and its partial layout, `PartialGroup`
  (actors/generator/group.py), converted to and from the loop's group.
- Guarantee: a round's identical programs run in the sandbox once; no verdict is a failed attempt, never a crash.
- Does not: drive the group (actors/generator/loop.py) or grade (the sandbox; model/env/function.py builds the case).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Literal

import anyio
import nats.errors
import structlog

from rlbus.actors.common.errors import TaskError
from rlbus.actors.common.feed import task_from_verifier
from rlbus.actors.common.sandbox_client import grade_result, request_for_case, run_in_sandbox
from rlbus.actors.generator.group import (
    Attempt,
    EpisodeState,
    PartialGroup,
    TurnState,
    attempt_reward,
    check_partial,
    decode_partial,
    encode_partial,
    function_state,
    prompt_length,
)
from rlbus.actors.generator.loop import NO_ROOM, BasePlug, Group, LoopEpisode, Outcome, Round
from rlbus.messages.errors import RlbusError
from rlbus.messages.schemas import SandboxLimits, SandboxVerdict
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import FunctionEnvironment, FunctionState, state_context, summarized
from rlbus.model.env.agentic import SummaryPlan
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeCase, GradeResult

if TYPE_CHECKING:
    from rlbus.actors.generator.actor import Generator

log = structlog.get_logger()


class FunctionPlug(BasePlug):
    """Write the function of a `model.tasks.Task` (model/env/function.py), `[generator] max_attempts` attempts.

    An attempt's program is graded in the region's sandbox (request/reply; a timeout or error is a failed attempt,
    counted in `sandbox_errors`); the attempts of a round with the same program share one verdict (`graded_repeats`).
    Before an attempt, a history past the context budget (`context_budget`, else max_seq_len - max_tokens) is
    summarised by the policy (at most max_tokens, after the prompt), or the episode ends ("no_room") when no summary
    fits. Reward: 1.0 when the last attempt passed every hidden test, else `partial_credit` times its fraction passed.
    """

    step_time = "grade_s"

    def __init__(self, gen: Generator, task: Task) -> None:
        super().__init__(gen, FunctionEnvironment(gen.tokenizer, max_attempts=gen.config.max_attempts), task)
        self.task: Task = task

    def start(self, *, now: float) -> LoopEpisode:
        return LoopEpisode(state=self.env.start(self.task, now=now), extra=[])

    def fits(self) -> str:
        if prompt_length(self.task, self.tokenizer) + 2 > self.gen.model.max_seq_len:
            return f"prompt of task {self.task.task_id} does not fit max_seq_len {self.gen.model.max_seq_len}"
        return ""

    def summary_plan(self, ep: LoopEpisode) -> SummaryPlan | Literal["no_room"] | None:
        cfg, tok = self.gen.config, self.tokenizer
        state: FunctionState = ep.state   # type: ignore[assignment]
        max_len = self.gen.model.max_seq_len
        budget = min(cfg.context_budget or max_len - cfg.max_tokens, max_len - 1)
        if not state.results or len(state_context(state, tok)) <= budget:    # the first attempt fits (checked per task)
            return None
        keep = prompt_length(self.task, tok)
        # the new context, prompt + summary header + summary + closing + assistant header, must fit the budget
        framing = len(tok.header("summary")) + len(tok.closing()) + len(tok.header("assistant"))
        tokens = min(cfg.max_tokens, budget - keep - framing)
        if tokens < 1:
            return NO_ROOM
        return SummaryPlan(keep=keep, budget=budget, tokens=tokens, prompt=tuple(tok.header("summary")))

    def summarize(self, ep: LoopEpisode, ids: list[int]) -> FunctionState:
        return summarized(ep.state, ids)   # type: ignore[return-value]

    def passed(self, ep: LoopEpisode) -> bool:
        return bool(ep.extra) and ep.extra[-1].status == "passed"

    def outcome(self, ep: LoopEpisode) -> Outcome:
        attempts: list[Attempt] = ep.extra
        last = attempts[-1] if attempts else Attempt(status="error", n_passed=0, n_tests=len(self.task.tests),
                                                     feedback="never attempted")
        return Outcome(attempt_reward(last, self.gen.config.partial_credit), last.verdict,
                       {"attempts": float(len(attempts))})

    def round(self, group: Group) -> Round:
        return _RoundGrades(self, group)

    # ---- the partial layout: PartialGroup ------------------------------------------------------
    def encode(self, group: Group) -> bytes:
        return encode_partial(PartialGroup(
            task_id=group.task_id, group_size=group.group_size, episodes=[_saved(ep) for ep in group.episodes],
            rounds=group.rounds, chunks=group.chunks, sampled_tokens=group.sampled_tokens,
            generate_s=group.generate_s, grade_s=group.step_s, started_at=group.started_at, writer=group.writer,
            resumes=group.resumes))

    def decode(self, data: bytes, task_id: str, group_size: int) -> Group:
        saved = decode_partial(data)
        check_partial(saved, self.task, task_id, self.tokenizer, self.limits(group_size))
        max_attempts = self.gen.config.max_attempts
        episodes = [LoopEpisode(state=function_state(ep, self.task, max_attempts),
                                logprobs=[list(t.logprobs) for t in ep.turns if t.role == "assistant"],
                                versions=[list(t.versions) for t in ep.turns if t.role == "assistant"],
                                draft_ids=list(ep.draft_ids), draft_logprobs=list(ep.draft_logprobs),
                                draft_versions=list(ep.draft_versions), draft_done=ep.draft_done, routing=ep.routing,
                                segments=list(ep.segments), summaries=ep.summaries, ended=ep.ended,
                                extra=list(ep.attempts))
                    for ep in saved.episodes]
        return Group(task_id=saved.task_id, group_size=saved.group_size, episodes=episodes, rounds=saved.rounds,
                     chunks=saved.chunks, sampled_tokens=saved.sampled_tokens, generate_s=saved.generate_s,
                     step_s=saved.grade_s, started_at=saved.started_at, writer=saved.writer, resumes=saved.resumes)


def _saved(ep: LoopEpisode) -> EpisodeState:
    turns, k = [], 0
    for t in ep.state.turns:
        if t.role == "assistant":
            turns.append(TurnState(role="assistant", ids=list(t.ids), logprobs=ep.logprobs[k], versions=ep.versions[k]))
            k += 1
        else:
            turns.append(TurnState(role=t.role, ids=list(t.ids)))  # type: ignore[arg-type]
    return EpisodeState(turns=turns, attempts=ep.extra, draft_ids=ep.draft_ids, draft_logprobs=ep.draft_logprobs,
                        draft_versions=ep.draft_versions, draft_done=ep.draft_done, ended=ep.ended,
                        summaries=ep.summaries, routing=ep.routing, segments=ep.segments)


class _RoundGrades(Round):
    """One graded round: each distinct case (program and tests) runs in the sandbox once, the round's other
    attempts with that case reuse its verdict (counted in `graded_repeats`)."""

    plug: FunctionPlug

    def __init__(self, plug: FunctionPlug, group: Group) -> None:
        super().__init__(plug, group)
        self.repeats = 0
        self._done: dict[GradeCase, Attempt] = {}
        self._running: dict[GradeCase, anyio.Event] = {}

    async def step(self, g: int, ep: LoopEpisode, ids: list[int]) -> FunctionState:
        port = _EpisodeGrade(self, len(ep.extra))
        new = (await self.plug.env.step(ep.state, ids, port)).state
        assert port.attempt is not None   # the step graded through it
        ep.extra.append(port.attempt)
        return new    # type: ignore[no-any-return]

    async def close(self, stepped: list[int]) -> None:
        self.plug.gen.count("graded_repeats", self.repeats)

    async def attempt(self, case: GradeCase, attempt: int) -> Attempt:
        running = self._running.get(case)
        if running is not None:
            await running.wait()
            self.repeats += 1
            return self._done[case]
        self._running[case] = done = anyio.Event()
        try:
            self._done[case] = await grade_case(self.plug.gen, self.plug.task, self.group.task_id, case,
                                                attempt=attempt)
        finally:
            done.set()
        return self._done[case]


class _EpisodeGrade:
    """One episode's `GradePort` in a round; keeps the `Attempt` (the grade with the sandbox's verdict)."""

    def __init__(self, round_: _RoundGrades, attempt: int) -> None:
        self.round, self.number = round_, attempt
        self.attempt: Attempt | None = None

    async def grade(self, case: GradeCase) -> GradeResult:
        self.attempt = await self.round.attempt(case, self.number)
        return self.attempt.grade()


async def grade_case(gen: Generator, task: Task, task_id: str, case: GradeCase, *, attempt: int) -> Attempt:
    """Grade `case` (an attempt's program on the task's hidden tests) in the region's sandbox; no verdict is a
    failed attempt, counted."""
    digest = hashlib.sha256(case.code.encode()).hexdigest()[:12]
    request = request_for_case(case, request_id=f"{task_id}-a{attempt}-{digest}", limits=SandboxLimits())
    try:
        result = await run_in_sandbox(gen.bus, gen.ident.region, request, timeout_s=gen.config.sandbox_timeout_s)
    except (RlbusError, nats.errors.Error, TimeoutError) as err:
        gen.count("sandbox_errors")
        log.warning("sandbox_unavailable", task_id=task_id, attempt=attempt, error=repr(err))
        return Attempt(status="error", n_passed=0, n_tests=len(task.tests),
                       feedback=f"the sandbox gave no verdict ({type(err).__name__})",
                       verdict=SandboxVerdict(total=len(task.tests), status="error"), sandbox_error=True)
    grade = grade_result(result)
    failed_infra = result.verdict.status in ("crashed", "error")
    if failed_infra:
        gen.count("sandbox_errors")
    return Attempt(status=grade.status, n_passed=grade.n_passed, n_tests=grade.n_tests,
                   feedback=grade.feedback, verdict=result.verdict, sandbox_error=failed_infra)


def function_plug(gen: Generator, message: TaskMessage) -> FunctionPlug:
    """The plug of a built-in coding task. :raises ValueError: the verifier is unusable or the prompt does not fit
    (a `TaskError`), or the tokenizer cannot encode it."""
    plug = FunctionPlug(gen, task_from_verifier(message))
    if why := plug.fits():
        raise TaskError(why)
    return plug
