"""Held-out evaluation of repository tasks: one agentic episode per task (greedy, or sampled), in sandbox
sessions.

- Owns: `evaluate_repo_tasks` (each task's episode in a session of a region's sandbox supervisors, until
  `submit` or a budget ends it and the hidden tests grade the workspace), `eval_environment` and
  `EpisodeResult` (the verdict and what the episode cost). Used by the evaluator (actors/evaluator.py),
  `rlbus eval` and the closing evaluation of `rlbus up`.
- Does not: checkpoint or resume (an evaluation a fault interrupts raises and is not reported), score a set
  of episodes (model/sampling/scores.py), or publish anything.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio
import msgspec
import torch

from rlbus.actors.common.sessions import SandboxSession, SessionPort
from rlbus.messages.bus import Bus
from rlbus.messages.errors import SandboxCrashed
from rlbus.model.env import AgenticBudgets, AgenticEnvironment, AgenticState, state_context
from rlbus.model.policies.interface import Policy
from rlbus.model.sampling.evaluate import greedy_complete
from rlbus.model.sampling.generate import generate, sampling_kv_dtype
from rlbus.model.tasks.repo import RepoTask

LEASE_S: Final = 300.0
"""Lease of a held-out episode's session (capped by the supervisor's `max_lease_s`); every call renews it."""
OPEN_EPISODES: Final = 8
"""Episodes open at once: their sessions and their rows of one greedy decoding call."""


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """One held-out episode: its task, whether the hidden tests passed, its reward, policy turns, why it ended, and
    what else it cost: tool-call blocks (malformed ones count) and the calls run by tool, the tokens the policy
    wrote and the observation tokens it read, seconds from its start to its end."""

    task_id: str
    level: int
    passed: bool
    reward: float
    turns: int
    ended: str
    tool_calls: int = 0
    tool_calls_by_tool: dict[str, int] = field(default_factory=dict)
    policy_tokens: int = 0
    observation_tokens: int = 0
    wall_s: float = 0.0


def episode_result(state: AgenticState, wall_s: float) -> EpisodeResult:
    """The result of a finished episode's state, `wall_s` seconds long."""
    task = state.task
    return EpisodeResult(task.task_id, task.level, state.verdict == "passed", float(state.reward),
                         state.policy_turns, state.ended, tool_calls=state.tool_calls,
                         tool_calls_by_tool=dict(sorted(Counter(c.name for c in state.calls).items())),
                         policy_tokens=sum(len(t.ids) for t in state.turns if t.role == "assistant"),
                         observation_tokens=sum(len(t.ids) for t in state.turns if t.role == "observation"),
                         wall_s=max(0.0, wall_s))


def eval_environment(policy: Policy, budgets: AgenticBudgets | None = None) -> AgenticEnvironment:
    """The environment of a held-out episode: `budgets` (default `AgenticBudgets()`) with the context capped by the
    policy's and no summaries; the compact tool list for a context under 4096 tokens (as the generator's "auto")."""
    base = budgets or AgenticBudgets()
    budgets = msgspec.structs.replace(base, max_tokens=min(base.max_tokens, policy.max_seq_len), summary_tokens=0)
    compact = policy.max_seq_len < 4096
    return AgenticEnvironment(policy.tokenizer, budgets, tool_list="compact" if compact else "full")


def _cut(ids: Sequence[int], stops: frozenset[int], vocab: int) -> list[int]:
    """A decoded turn up to and with its first stop id; an id the tokenizer has no text for ends it before."""
    out: list[int] = []
    for t in ids:
        if not 0 <= t < vocab:
            break
        out.append(int(t))
        if t in stops:
            break
    return out


async def evaluate_repo_tasks(bus: Bus, region: str, policy: Policy, tasks: Sequence[RepoTask], *, max_tokens: int,
                              budgets: AgenticBudgets | None = None, on_step: Callable[[int], None] | None = None,
                              open_episodes: int = OPEN_EPISODES, temperature: float = 0.0,
                              seed: int = 0) -> list[EpisodeResult]:
    """One episode per task through `region`'s sandbox supervisors, `open_episodes` at a time; results in task
    order. Turns are greedy at `temperature` 0, else sampled at it from one generator seeded with `seed` (the same
    tasks, policy and arguments give the same turns). `max_tokens` caps each policy turn; `on_step` runs before
    every decoding step (a cancellation it raises ends the evaluation).

    Each episode's session is opened with the task's files; the open episodes' next turns are decoded
    together, each capped by `AgenticEnvironment.room` and `max_tokens`; each turn is stepped through its
    session until `submit` or a budget ends the episode and the hidden tests grade the workspace. Episodes
    take no summaries (`summary_tokens` 0: a full context ends the episode); the wall budget counts on this
    machine's clock.

    :raises SandboxCrashed: a session could not be opened, or one was lost mid-episode.
    """
    env = eval_environment(policy, budgets)
    sampler = torch.Generator(device=policy.device).manual_seed(seed) if temperature > 0 else None
    out: list[EpisodeResult] = []
    size = max(1, open_episodes)
    for first in range(0, len(tasks), size):
        wave = list(tasks[first:first + size])
        sessions: list[SandboxSession] = []
        try:
            for task in wave:
                files = {path: text.encode() for path, text in task.files.items()}
                sessions.append(await SandboxSession.open(bus, region, files, lease_s=LEASE_S))
            finished = await _episodes(env, policy, wave, sessions, max_tokens, on_step, temperature, sampler)
        finally:
            with anyio.CancelScope(shield=True):
                for session in sessions:
                    try:
                        await session.close()
                    except SandboxCrashed:
                        pass                # its lease ends it
        out += [episode_result(state, ended - state.started_at) for state, ended in finished]
    return out


async def _episodes(env: AgenticEnvironment, policy: Policy, tasks: Sequence[RepoTask],
                    sessions: Sequence[SandboxSession], max_tokens: int, on_step: Callable[[int], None] | None,
                    temperature: float = 0.0,
                    sampler: torch.Generator | None = None) -> list[tuple[AgenticState, float]]:
    """Run each task's episode in its session to the end: every turn, the open episodes' next turns decoded
    (one call per distinct cap), then each stepped through its session. Each final state comes with the time it
    ended."""
    tok = env.tokenizer
    stops, vocab = frozenset(tok.stop_ids), tok.vocab_size
    states = [env.start(task, now=time.time()) for task in tasks]
    ended = [0.0] * len(states)

    def decode(rows: list[int], contexts: list[list[int]], cap: int) -> dict[int, list[int]]:
        if temperature > 0:
            with torch.no_grad():
                out = generate(policy, contexts, max_new_tokens=cap, temperature=temperature, eos_id=tok.stop_id,
                               pad_id=tok.pad_id, generator=sampler, on_step=on_step,
                               kv_dtype=sampling_kv_dtype(policy.device))
            ids = [s.tokens.tolist() for s in out]
        else:
            ids = greedy_complete(policy, contexts, max_new_tokens=cap, stop_id=tok.stop_id, pad_id=tok.pad_id,
                                  batch_size=len(rows), on_step=on_step)
        return {i: _cut(row, stops, vocab) or [tok.stop_id] for i, row in zip(rows, ids, strict=True)}

    async def step(i: int, ids: list[int]) -> None:
        states[i] = (await env.step(states[i], ids, SessionPort(sessions[i]), now=time.time(), clock=time.time)).state
        if states[i].done:
            ended[i] = time.time()

    while open_rows := [i for i, s in enumerate(states) if not s.done]:
        caps = {i: max(1, min(max_tokens, env.room(states[i]))) for i in open_rows}
        turns: dict[int, list[int]] = {}
        for cap in sorted(set(caps.values())):
            rows = [i for i in open_rows if caps[i] == cap]
            contexts = [state_context(states[i], tok) for i in rows]
            turns.update(await anyio.to_thread.run_sync(decode, rows, contexts, cap))
        async with anyio.create_task_group() as tg:
            for i in open_rows:
                tg.start_soon(step, i, turns[i])
    return list(zip(states, ended, strict=True))


__all__ = ["LEASE_S", "OPEN_EPISODES", "EpisodeResult", "episode_result", "eval_environment", "evaluate_repo_tasks"]
