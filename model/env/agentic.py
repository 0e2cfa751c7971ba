"""The agentic coding environment: a small repository, an instruction, tools in a sandboxed workspace, hidden
tests on submit.

- Owns: `AgenticBudgets`, `AgenticState` and `AgenticEnvironment`: rendering a `RepoTask`, taking a policy
  turn (its tool calls run through the `WorkspacePort`), the budgets, self-summarisation and the reward; the
  pieces of its framing that SFT renders demonstrations with (model/training/sft.py): `task_text`,
  `with_tool_list`, `cut_result`, `observation_ids` and `compact_tool_list`.
- Guarantee: the wall clock is passed in, never read.
- Does not: own the tools or the workspace (the sandbox, behind the port), the tool-call text formats
  (model/tools/calls.py), a chat template's framing of tools (model/tools/template.py) or the tasks
  (model/tasks/repo.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Literal

import msgspec

from rlbus.model.env.base import (
    EnvState,
    StepOutcome,
    WorkspacePort,
    refuse_done,
    state_context,
    state_tokens,
    summarized,
)
from rlbus.model.env.episodes import Turn, completion_text
from rlbus.model.env.summaries import FRESH_HEAD, SUMMARY_REQUEST, fresh_context
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.grading import GradeResult
from rlbus.model.tasks.repo import RepoTask
from rlbus.model.tools.calls import (
    BadCall,
    CallStyle,
    ToolCall,
    outcome_text,
    parse_turn,
    response_text,
    tools_text,
)
from rlbus.model.tools.template import TemplateTools, template_tools

EndReason = Literal["", "submit", "turns", "tool_calls", "tokens", "wall"]
NO_CALL: Final = ("error: no tool call in this turn. Call a tool as <tool_call>\n"
                  '{"name": ..., "arguments": {...}}\n</tool_call>, and submit when the change is done.')
COMPACT_TOOLS: Final = (
    "Tools: list_files{path=\".\"}, read_file{path, start_line?, end_line?}, write_file{path, content}, "
    "edit_file{path, old, new}, search{pattern, path=\".\"}, run{command, timeout_s?}, submit{}. Call one as "
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "..."}}\n</tool_call>.')
"""The tool list in one paragraph, for a policy whose context is short (the built-in byte policy)."""


AUTO_COMPACT_BELOW: Final = 4096
"""`tool_list = "auto"` ([generator.agentic]) lists the tools compactly for a policy whose context is shorter."""


def compact_tool_list(tool_list: str, max_seq_len: int) -> bool:
    """Whether `[generator.agentic] tool_list` ("auto", "full" or "compact") lists the tools compactly
    (`COMPACT_TOOLS`) for a policy of `max_seq_len` tokens."""
    return tool_list == "compact" or (tool_list == "auto" and max_seq_len < AUTO_COMPACT_BELOW)


def task_text(task: RepoTask) -> str:
    """A task as its first user turn says it, without any tool list: the instruction, the repository's files and how
    to finish. The environment's user turn is this after the tool list (`with_tool_list`)."""
    files = "\n".join(sorted(task.files))
    return (f"{task.instruction}\n\nThe repository (your working directory):\n{files}\n\n"
            "Call submit when the change is done: the hidden tests then run on the repository as you leave it.")


def with_tool_list(text: str, tool_list: str) -> str:
    """A first user turn: the tool list where the chat template does not render it (`tool_list`; "" when it does),
    a blank line, then `text` (the task, or the task and a summary, `fresh_context`). The list comes first, as a
    template's system turn would, so the same text takes any list."""
    return f"{tool_list}\n\n{text}" if tool_list else text


def cut_result(text: str, limit: int) -> str:
    """One tool result as the policy reads it: past `limit` characters, cut, saying so."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[output truncated: {len(text)} characters, the first {limit} shown]"


def observation_ids(tokenizer: ChatTokenizer, results: Sequence[str], limit: int, *, templated: bool) -> tuple[int, ...]:
    """The observation answering a turn with `results` (none: the turn had no call, `no_call_text`): in the
    template's tool role where `templated` (`tokenizer` is then a `TemplateTools`), else as `response_text`
    (`NO_CALL` bare); cut to `limit` tokens, saying so."""
    if templated:
        assert isinstance(tokenizer, TemplateTools)
        return tuple(tokenizer.results_ids(list(results) or [no_call_text(tokenizer.style)], limit))
    ids = tokenizer.encode(response_text(list(results)) if results else NO_CALL)
    if len(ids) <= limit:
        return tuple(ids)
    notice = tokenizer.encode(f"\n[observation truncated to {limit} tokens]")
    return tuple(ids[: max(limit - len(notice), 0)] + notice)


def no_call_text(style: CallStyle) -> str:
    """The answer to a turn without a tool call: `NO_CALL`, or its Llama-3.1 wording."""
    if style == "hermes":
        return NO_CALL
    return ('error: no tool call in this turn. Call a tool by answering with only its JSON, '
            '{"name": ..., "parameters": {...}}, and submit when the change is done.')


class AgenticBudgets(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What ends an agentic episode besides `submit`, and how much of a tool's output the policy reads."""

    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 20
    """Policy turns; the episode is graded after the last one."""
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] = 100
    """Tool-call blocks over the episode (malformed ones count); the one past it ends the episode."""
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    """Tokens of the whole episode (prompt, turns, observations, framing): the policy's context."""
    min_turn_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32
    """The episode ends once fewer than this many of `max_tokens` are left for the next turn."""
    wall_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    """Seconds from the start (the clock handed to `start` and `step`); checked before each tool call (the calls
    left in a turn that spends it are cut off) and after each turn."""
    observation_chars: Annotated[int, msgspec.Meta(ge=1)] = 4000
    """Characters of one tool result shown; longer ones are cut, saying so."""
    observation_tokens: Annotated[int, msgspec.Meta(ge=16)] = 1024
    """Tokens of one observation turn (all the turn's results); longer ones are cut, saying so."""
    run_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """A `run` call's wall timeout when it names none, and the most it may ask for."""
    summary_tokens: Annotated[int, msgspec.Meta(ge=0)] = 256
    """Tokens of a self-summary: once the context leaves fewer than `min_turn_tokens` for the next turn, the
    policy summarises its history in at most this many (fewer where `max_tokens` leaves fewer after the task and
    a turn) and the episode goes on from the task and the summary, in the same workspace; 0: no summaries, the
    token budget ends the episode."""
    partial_credit: bool = False
    """The reward: false, 1.0 when every hidden test passes, else 0.0; true, the fraction of hidden tests that
    passed (0.0 when the grade is void or timed out)."""
    summary_at_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Once the context reaches this many tokens before a turn, a user turn asks the policy to summarise its work
    (model/env/summaries.py `SUMMARY_REQUEST`); its answer (at most `summary_tokens` when that is set) is a policy
    turn, and the episode goes on in a fresh context: the task and the summary (`fresh_context`), in the same
    workspace. 0: off."""


class AgenticState(EnvState, frozen=True, kw_only=True, tag="agentic"):
    """An agentic episode: its task, when it started, what it has spent, the calls run (in order, as run),
    why it ended and the hidden tests' grade."""

    task: RepoTask
    started_at: float = 0.0
    policy_turns: int = 0
    tool_calls: int = 0
    calls: tuple[ToolCall, ...] = ()
    ended: EndReason = ""
    grade: GradeResult | None = None
    summaries: int = 0
    """Times the history was replaced by a summary (`AgenticEnvironment.summarize`, or `restart` after a requested
    one)."""
    summarizing: bool = False
    """A summary was asked for (`request_summary`): the next policy turn is the summary, no tool call runs."""


@dataclass(frozen=True, slots=True)
class SummaryPlan:
    """How a history is summarised (model/sampling/summarize.py `summarize_if_over_budget`'s arguments): the policy reads
    the context (its oldest turns after the task dropped past what it can read) and `prompt`, writes at most
    `tokens`; the first `keep` tokens (bos and the task) stay, and the new context fits `budget`."""

    keep: int
    budget: int
    tokens: int
    prompt: tuple[int, ...]


class AgenticEnvironment:
    """Fix or extend a small repository with tools; graded by its hidden tests (`RepoTask`).

    It renders a `RepoTask` (instruction, file list, tool list); takes a policy turn (its tool calls parsed,
    checked, run through the `WorkspacePort` in order, their results as one observation turn, each truncated
    to the observation budget); enforces the turn, tool-call, token and wall budgets; plans the
    self-summarisation of a history that fills the context (`summary_plan`, `needs_summary`, `summarize`:
    the generator samples the summary); and, once `submit` is called or a budget runs out, computes the
    reward (the hidden tests on a fresh copy of the final workspace, a per-test report: 1.0 when every test
    passes, else 0.0, or the fraction passed with `partial_credit`).

    `tool_list` "full" gives the tools in the policy's own chat-template format where its template renders
    tools (model/tools/template.py: the schemas in the system turn, calls parsed in the template's style, results
    in its tool role; `tokenizer` is then that view of the policy's tokenizer), else the tool signatures at the
    head of the user turn as Qwen2/Qwen3 templates word them (`tools_text`), Hermes calls, results in the
    observation role; "compact" gives `COMPACT_TOOLS`, a paragraph for short contexts, at the head of the user
    turn, Hermes calls. `templated` says which way "full" went, or why not.
    """

    def __init__(self, tokenizer: ChatTokenizer, budgets: AgenticBudgets | None = None, *,
                 tool_list: Literal["full", "compact"] = "full") -> None:
        self.budgets = budgets or AgenticBudgets()
        self.tool_list = tool_list
        framed = template_tools(tokenizer) if tool_list == "full" else "the tool list is compact"
        self._tools = framed if isinstance(framed, TemplateTools) else None
        self.templated: str = "" if self._tools else framed
        """Empty when the chat template renders the tools; else why it does not (one line)."""
        self._tokenizer: ChatTokenizer = self._tools or tokenizer
        self.call_style: CallStyle = self._tools.style if self._tools else "hermes"

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def tool_list_text(self) -> str:
        """The tool list the first user turn starts with: `tools_text()` ("full"), `COMPACT_TOOLS` ("compact"), or ""
        where the template's system turn holds the tools."""
        return "" if self._tools else tools_text() if self.tool_list == "full" else COMPACT_TOOLS

    def render(self, task: RepoTask) -> str:
        """The user turn: the tool list (unless the template's system turn holds it), then the task (`task_text`: the
        instruction, the repository's files and how to finish)."""
        return with_tool_list(task_text(task), self.tool_list_text)

    def start(self, task: RepoTask, *, now: float = 0.0) -> AgenticState:
        """The rendered task as the user turn; the wall budget counts from `now`."""
        return AgenticState(turns=(Turn("user", tuple(self._tokenizer.encode(self.render(task)))),), task=task,
                            started_at=now)

    async def step(self, state: AgenticState, policy_ids: Sequence[int], port: WorkspacePort, *,
                   now: float = 0.0, clock: Callable[[], float] | None = None) -> StepOutcome[AgenticState]:
        """Run the turn's tool calls in order and answer them in one observation turn; on `submit` or a spent
        budget, grade the workspace and end (no observation then). A context that leaves no room for another turn
        ends the episode ("tokens") unless a summary would make room (`summary_plan`) and the context is within
        `max_tokens`: then it goes on, and `needs_summary` says so.

        A malformed call or an unknown tool is answered with what is wrong (the port is not called); calls
        after a `submit` are not run; a turn without a call is answered with `no_call_text`. A raise from the port
        (no sandbox answered) propagates and no state is returned; the calls of this turn that ran before it
        have changed the workspace, so the generator takes the turn again only over a workspace restored to
        the state's (a snapshot), never by running the calls twice.

        The wall budget: `clock` (seconds, on the clock of `started_at`; default: `now` throughout) is read before
        each call; once `wall_s` is spent the turn's remaining calls are cut off and the episode ends ("wall"), and
        a `run` call's timeout is capped by what is left of it.
        :raises ValueError: the episode is done.
        """
        refuse_done(state)
        if state.summarizing:        # the summary asked for: nothing runs, `restart` goes on from it
            return StepOutcome(msgspec.structs.replace(state, turns=(*state.turns, Turn("assistant", tuple(policy_ids)))),
                               None)
        b = self.budgets
        clock = clock or (lambda: now)
        text = completion_text(policy_ids, self._tokenizer)
        parsed = parse_turn(text, self.call_style)
        results: list[str] = []
        calls, spent, ended = list(state.calls), state.tool_calls, ""
        for item in parsed:
            if spent >= b.max_tool_calls:
                ended = "tool_calls"
                break
            left = b.wall_s - (clock() - state.started_at)
            if left <= 0:
                ended = "wall"
                break
            spent += 1
            if isinstance(item, BadCall):
                results.append(f"error: {item.problem}")
                continue
            if item.name == "submit":
                ended = "submit"
                break
            call = self._bounded(item, left)
            outcome = await port.tool(call.name, dict(call.arguments))
            calls.append(call)
            results.append(self._cut(outcome_text(call, outcome)))
        turns = (*state.turns, Turn("assistant", tuple(policy_ids)))
        observation = Turn("observation", self._observation_ids(results)) if results or not parsed else None
        new = msgspec.structs.replace(state, turns=turns, policy_turns=state.policy_turns + 1, tool_calls=spent,
                                      calls=tuple(calls))
        if not ended:
            with_obs = msgspec.structs.replace(new, turns=(*turns, observation)) if observation else new
            if new.policy_turns >= b.max_turns:
                ended = "turns"
            elif clock() - state.started_at >= b.wall_s:
                ended = "wall"
            elif (length := len(state_tokens(with_obs, self._tokenizer).ids)) + b.min_turn_tokens > b.max_tokens and (
                    length > b.max_tokens or (self.summary_plan(with_obs) is None
                                              and self.request_summary(with_obs) is None)):
                ended = "tokens"          # no room for a turn, and no summary makes any (or the context is past it)
            else:
                return StepOutcome(with_obs, observation)
        report = await port.grade_workspace(state.task)
        grade = report.result()
        done = msgspec.structs.replace(new, done=True, reward=report.reward(partial_credit=b.partial_credit),
                                       verdict=grade.status, ended=ended, grade=grade)
        return StepOutcome(done, None)

    def summary_plan(self, state: AgenticState) -> SummaryPlan | None:
        """How this episode's history is summarised; None when summaries are off (`summary_tokens` 0) or the task,
        a summary of one token and a turn of `min_turn_tokens` would not fit `max_tokens`."""
        b, tok = self.budgets, self._tokenizer
        if not b.summary_tokens:
            return None
        keep = len(state_tokens(msgspec.structs.replace(state, turns=state.turns[:1]), tok).ids)
        after = len(tok.closing()) + len(tok.header("assistant")) + b.min_turn_tokens
        prompt = tuple(tok.header("summary"))
        budget = b.max_tokens - after
        tokens = min(b.summary_tokens, budget - keep - len(prompt))
        return SummaryPlan(keep=keep, budget=budget, tokens=tokens, prompt=prompt) if tokens >= 1 else None

    def needs_summary(self, state: AgenticState) -> bool:
        """The episode goes on, its context leaves fewer than `min_turn_tokens` for the next turn, it has a history
        after the task, and a summary fits (`summary_plan`): the generator summarises before the next turn."""
        return (not state.done and len(state.turns) > 1 and self.room(state) < self.budgets.min_turn_tokens
                and self.summary_plan(state) is not None)

    def summarize(self, state: AgenticState, summary_ids: Sequence[int]) -> AgenticState:
        """The state with its history after the task replaced by the policy's summary (`summarized`); the calls,
        budgets spent and workspace are kept.

        :raises ValueError: the episode is done, or the summary is longer than `summary_plan` allows.
        """
        refuse_done(state)
        plan = self.summary_plan(state)
        if plan is None or not 0 < len(summary_ids) <= plan.tokens:
            raise ValueError(f"a summary of {len(summary_ids)} tokens; this episode allows "
                             f"{plan.tokens if plan else 0}")
        return msgspec.structs.replace(summarized(state, summary_ids), summaries=state.summaries + 1)

    def request_summary(self, state: AgenticState) -> AgenticState | None:
        """Before a turn: the state with `SUMMARY_REQUEST` as a user turn when the context has reached
        `summary_at_tokens`, the episode has a policy turn since its (fresh) start, and the request leaves
        `min_turn_tokens` for the summary; else None."""
        b = self.budgets
        if (not b.summary_at_tokens or state.done or state.summarizing
                or not any(t.role == "assistant" for t in state.turns)
                or len(state_context(state, self._tokenizer)) < b.summary_at_tokens):
            return None
        asked = msgspec.structs.replace(state, summarizing=True, turns=(
            *state.turns, Turn("user", tuple(self._tokenizer.encode(SUMMARY_REQUEST)))))
        return asked if self.room(asked) >= b.min_turn_tokens else None

    def restart(self, state: AgenticState) -> AgenticState | None:
        """After the summary asked for: the state going on in a fresh context, the task and the summary as its one
        user turn (`fresh_context`); calls, budgets spent and workspace kept. None when no summary was just written.
        """
        if not state.summarizing or state.done or state.turns[-1].role != "assistant":
            return None
        summary = completion_text(state.turns[-1].ids, self._tokenizer)
        fresh = Turn("user", tuple(self._tokenizer.encode(fresh_context(self.render(state.task), summary))))
        return msgspec.structs.replace(state, turns=(fresh,), summarizing=False, summaries=state.summaries + 1)

    def restarted(self, state: AgenticState) -> bool:
        """The state's first turn is a fresh context `restart` made (the task, then a summary), not the task's."""
        first = self._tokenizer.decode([t for t in state.turns[0].ids if 0 <= t < self._tokenizer.vocab_size])
        return bool(state.summaries) and first.startswith(f"{self.render(state.task)}\n\n{FRESH_HEAD}\n")

    def room(self, state: AgenticState) -> int:
        """Tokens the next policy turn may take: what `max_tokens` leaves after the context (at least 0); the
        generator caps its sampling there."""
        return max(self.budgets.max_tokens - len(state_context(state, self._tokenizer)), 0)

    def _bounded(self, call: ToolCall, wall_left: float) -> ToolCall:
        """A `run` call with its timeout set and capped by the budget and by `wall_left` (seconds of the wall
        budget left); other calls as they are."""
        if call.name != "run":
            return call
        cap = min(self.budgets.run_timeout_s, wall_left)
        asked = float(call.arguments.get("timeout_s", cap))
        if not math.isfinite(asked):  # Python's JSON reads NaN and Infinity
            asked = cap
        return ToolCall("run", {**call.arguments, "timeout_s": min(max(asked, 0.1), cap)})

    def _cut(self, text: str) -> str:
        return cut_result(text, self.budgets.observation_chars)

    def _observation_ids(self, results: list[str]) -> tuple[int, ...]:
        return observation_ids(self._tokenizer, results, self.budgets.observation_tokens, templated=bool(self._tools))
