"""Agentic groups through the real generator, sandbox supervisor and NATS: a scripted policy that follows the
reference edit solves a repository task of every level (reward 1) and one that submits at once gets 0, with
rollouts whose loss mask is exactly the policy's ids and whose behaviour logprobs a forward pass reproduces; a
generator process SIGKILLed mid-episode leaves a partial and a workspace snapshot from which another one
finishes the group (reward still 1, published once); no session is left open afterwards."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.js.errors
import pytest
import torch
from helpers import eventually, new_run
from helpers.function_partials import new_group
from helpers.generator_bus import (
    Env,
    env_fixture,
    reap,
    rollouts,
    save_checkpoint,
    serve_generator,
    serve_sandbox,
    server_fixture,
    spawn,
    stop,
    stored,
    teacher_forced,
)

from rlbus.actors.common.errors import PartialGroupError
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.agentic import (
    AgenticEpisode,
    AgenticPartial,
    WorkspaceSnapshot,
    decode_agentic,
    encode_agentic,
    episode_state,
)
from rlbus.actors.generator.config import AgenticSettings
from rlbus.actors.generator.group import decode_partial, encode_partial
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import available_levels
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.actors.trainer.core import TrainerCore, rollout_batch
from rlbus.messages.schemas import Rollout, Segment, TensorBlob
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import (
    SUBMIT_SCRIPT,
    AgenticBudgets,
    AgenticEnvironment,
    encode_state,
    reference_script,
    scripted_ids,
    state_context,
)
from rlbus.model.env.episodes import Turn
from rlbus.model.policies.interface import as_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.model.tasks.repo import RepoTask, repo_task

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUNS = tuple(new_run() for _ in range(8))
"""Run ids of this module (one per test that takes `env`): the server grants their buckets to the roles."""
TOK = ByteTokenizer()
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=4.0, wall_seconds=8.0, memory_mb=256,
                        max_processes=16, max_file_mb=1, max_open_files=64, max_output_kb=16, max_sessions=8,
                        workspace_mb=4, max_lease_s=60.0, session_spares=0)


server = server_fixture("agentic", RUNS)
env = env_fixture(RUNS)


def tiny_model(**shape: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(max_seq_len=2048, **shape)).eval()  # type: ignore[arg-type]


def message(task: RepoTask, group_size: int = 2) -> TaskMessage:
    return TaskMessage(task_id=task.task_id, prompt=task.prompt, verifier=task.verifier_spec(),
                       group_size=group_size, region="hub", seed=1)


def supervisor(env: Env) -> Any:
    return serve_sandbox(env, SANDBOX, SandboxLaunch(isolation=available_levels()[0]))  # type: ignore[arg-type]


def generator(env: Env, model: Transformer, config: GeneratorConfig) -> Any:
    return serve_generator(env, model, config, version=2)


async def workspace_objects(env: Env) -> list[str]:
    store = await env.admin.js.object_store(env.admin.subjects.workspaces_bucket("hub"))
    try:
        return [o.name for o in await store.list() if not o.deleted]
    except nats.js.errors.NotFoundError:
        return []


def sessions_open(actor: SandboxSupervisor) -> int:
    return int(actor.gauges.get("sessions_open", -1)) if actor.sessions is None else len(actor.sessions.sessions)


def test_agentic_settings_mirror_the_environment_budgets() -> None:
    """`[generator.agentic]` has every `AgenticBudgets` field with the same default (plus the tool list)."""
    budgets = {k: getattr(AgenticBudgets(), k) for k in AgenticBudgets.__struct_fields__}
    settings = {k: getattr(AgenticSettings(), k) for k in AgenticSettings.__struct_fields__}
    assert settings.pop("tool_list") == "auto"
    assert settings == budgets


async def test_scripted_policies_solve_or_fail_every_level_through_the_real_sandbox(env: Env) -> None:
    """The reference script earns 1.0 on a repository task of each level, the submit script 0.0 on the same
    three; each rollout's loss mask covers exactly the policy's ids, its behaviour logprobs are those of a forward
    pass of the live policy; every session is closed, the partials and the workspace snapshots are gone."""
    model = tiny_model()
    tasks = [repo_task(level, 7) for level in (1, 2, 3)]
    s = env.admin.subjects
    results: dict[str, list[Rollout]] = {}
    async with supervisor(env) as sandbox:
        for script in ("reference", "submit"):
            config = GeneratorConfig(group_size=2, script=script, max_tokens=600, concurrent_tasks=3,
                                     sandbox_timeout_s=20.0, agentic=AgenticSettings(max_turns=4))
            before = await stored(env, s.rollouts_stream("hub"))
            async with generator(env, model, config) as actor:
                for task in tasks:
                    named = msgspec.structs.replace(message(task), task_id=f"{script}-{task.task_id}")
                    await env.admin.publish(s.tasks("hub"), named, msg_id=named.task_id)

                async def done(actor: Generator = actor) -> bool:
                    return actor.counters.get("tasks", 0) == len(tasks)
                await eventually(done, timeout_s=120, what=f"{script}: every group published")
                assert actor.counters.get("sandbox_errors", 0) == 0 and actor.gauges["sessions_held"] == 0.0
            assert await stored(env, s.rollouts_stream("hub")) == before + 2 * len(tasks)
            results[script] = [r for r in await rollouts(env) if r.task_id.startswith(script)]
        await eventually(lambda: sessions_open(sandbox), lambda n: n == 0, what="every session closed", timeout_s=10)
    solved, failed = results["reference"], results["submit"]
    assert [r.reward for r in solved] == [1.0] * 6 and all(r.verdict.status == "ok" for r in solved)
    assert [r.reward for r in failed] == [0.0] * 6 and all(r.verdict.status == "failed" for r in failed)
    for r in solved + failed:
        task = next(t for t in tasks if r.task_id.endswith(t.task_id))
        mask = r.loss_mask.tolist()
        turns = len(task.reference) + 1 if r in solved else 1
        assert r.timings["turns"] == turns and sum(mask) > 0 and mask[-1] == 1
        assert r.prompt_tokens.tolist()[-1] == TOK.assistant_id
        assert task.instruction in TOK.decode(r.prompt_tokens.tolist())
        assert set(r.policy_versions.tolist()) == {2}
        keep = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r)[keep], torch.tensor(r.behaviour_logprobs.tolist())[keep],
                                   atol=1e-4, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(r.behaviour_logprobs.tolist(), mask, strict=True) if not m)
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    for r in solved + failed:
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(partial_key(r.task_id))
    assert await workspace_objects(env) == []


async def test_sampled_turns_are_capped_and_scored_as_sampled(env: Env) -> None:
    """Sampled (unscripted) turns of a random policy: each at most max_tokens ids, the episode ended by its turn
    budget with reward 0 and graded once; the rollout's masked ids are exactly the sampled ones, their behaviour
    logprobs reproduced by a forward pass (float32 rounding); the observations between turns are masked."""
    model = tiny_model()
    task = repo_task(1, 21)
    config = GeneratorConfig(group_size=2, max_tokens=16, sandbox_timeout_s=20.0, agentic=AgenticSettings(max_turns=2))
    async with supervisor(env) as sandbox, generator(env, model, config) as actor:
        await env.admin.publish(env.admin.subjects.tasks("hub"), message(task), msg_id=task.task_id)

        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1
        await eventually(done, timeout_s=60, what="the group published")
        assert actor.counters["tokens"] > 0 and actor.counters.get("sandbox_errors", 0) == 0
        await eventually(lambda: sessions_open(sandbox), lambda n: n == 0, what="every session closed", timeout_s=10)
    group = await rollouts(env)
    assert len(group) == 2
    for r in group:
        mask = r.loss_mask.tolist()
        spans = [len(run) for run in "".join(map(str, mask)).split("0") if run]
        assert r.timings["turns"] == 2 and r.reward == 0.0 and r.verdict.status == "failed"
        assert len(spans) == 2 and all(0 < n <= 16 for n in spans) and mask[-1] == 1
        keep = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r)[keep], torch.tensor(r.behaviour_logprobs.tolist())[keep],
                                   atol=1e-4, rtol=0)
        between = r.completion_tokens.tolist()[spans[0]:len(mask) - spans[1]]
        assert TOK.observation_id in between and "tool call" in TOK.decode(between)


async def test_unusable_repository_tasks_are_dead_lettered_not_run(env: Env) -> None:
    """A repository verifier whose task JSON is broken, and a task whose first context leaves no turn in the
    episode's token budget, are each dead-lettered with the reason (the generator goes on; no rollout)."""
    model = tiny_model()
    task = repo_task(2, 31)
    broken = msgspec.structs.replace(message(task), task_id="broken",
                                     verifier={**task.verifier_spec(), "task": '{"task_id": 3'})
    config = GeneratorConfig(group_size=2, script="submit", agentic=AgenticSettings(max_tokens=300))
    s = env.admin.subjects
    async with generator(env, model, config) as actor:
        await env.admin.publish(s.tasks("hub"), broken, msg_id="broken")
        await env.admin.publish(s.tasks("hub"), message(task), msg_id=task.task_id)

        async def rejected() -> int:
            return actor.counters.get("rejected", 0)
        await eventually(rejected, lambda n: n == 2, what="both tasks rejected")
    assert await stored(env, s.rollouts_stream("hub")) == 0
    dlq = s.dead_letter_stream()
    info = await env.admin.js.stream_info(dlq)
    reasons = [(await env.admin.js.get_msg(dlq, seq)).headers or {}
               for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    text = " ".join(str(h) for h in reasons)
    assert "repository task verifier" in text and "leaves no room for a turn in the episode's 300 tokens" in text


def test_agentic_and_function_partials_are_never_taken_for_each_other() -> None:
    """Each decoder refuses the other kind's bytes (so a task's partial of the other kind is discarded)."""
    task = repo_task(1, 0)
    state = AgenticEnvironment(TOK).start(task)
    agentic = encode_agentic(AgenticPartial(task_id=task.task_id, group_size=1,
                                            episodes=[AgenticEpisode(state=encode_state(state))]))
    function = encode_partial(new_group(eval_tasks(11, n=1)[0], task.task_id, 1, TOK, now=0.0))
    with pytest.raises(PartialGroupError):
        decode_partial(agentic)
    with pytest.raises(PartialGroupError, match="no agentic tag"):
        decode_agentic(function)
    assert decode_agentic(agentic).episodes[0].state == encode_state(state)


async def test_unusable_partials_are_discarded_and_a_missing_sandbox_ends_episodes_as_errors(env: Env) -> None:
    """With no sandbox supervisor in the region, every session open fails (tried three times): each episode ends
    after its first turn with reward 0 and verdict "error", counted, and the group is still published; the
    generator lives. A function group's partial under the task's key, and an agentic one whose workspace snapshot
    is not in the store, are each discarded with an incident rather than resumed."""
    model = tiny_model()
    env_ = AgenticEnvironment(TOK)
    foreign, missing = repo_task(1, 11), repo_task(3, 12)
    s = env.admin.subjects
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    await kv.put(partial_key(foreign.task_id), encode_partial(new_group(eval_tasks(11, n=1)[0], foreign.task_id, 2,
                                                                        TOK, now=0.0)))
    ghost = "ws-" + "0" * 64
    await kv.put(partial_key(missing.task_id), encode_agentic(AgenticPartial(
        task_id=missing.task_id, group_size=2, objects=[ghost],
        episodes=[AgenticEpisode(state=encode_state(env_.start(missing)), snapshot=ghost,
                                 snapshot_digest="sha256:" + "0" * 64) for _ in range(2)])))
    config = GeneratorConfig(group_size=2, script="submit", concurrent_tasks=2, sandbox_timeout_s=5.0)
    async with generator(env, model, config) as actor:
        for task in (foreign, missing):
            await env.admin.publish(s.tasks("hub"), message(task), msg_id=task.task_id)

        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 2
        await eventually(done, timeout_s=60, what="both groups published")
        counters = dict(actor.counters)
    assert counters["partials_discarded"] == 2 and counters["sandbox_errors"] == 4 and counters["resumed"] == 0
    group = await rollouts(env)
    assert len(group) == 4 and all((r.reward, r.verdict.status, r.timings["sandbox_error"]) == (0.0, "error", 1.0)
                                   for r in group)
    assert all(r.timings["turns"] == 1 and sum(r.loss_mask.tolist()) > 0 for r in group)


async def test_a_full_context_is_summarised_trained_per_segment_and_kept_across_a_resume(env: Env) -> None:
    """A context budget the reference edit and its observation fill: before its next turn each episode's history is
    replaced by the policy's own summary, the submit after it still earns 1.0 (the workspace is kept), and the
    rollout carries two segments (the edit under the task's context, the summary under what the policy read), whose
    logprobs the trainer recomputes under the same weights equal the behaviour logprobs. A redelivered task whose
    partial holds a summarised episode is resumed with those segments as saved."""
    model = tiny_model()
    fresh, saved = repo_task(1, 2), repo_task(1, 4)
    tools = AgenticEnvironment(TOK, tool_list="compact")
    first = tools.start(fresh)
    edit = len(scripted_ids(reference_script(fresh), first, TOK))
    agentic = AgenticSettings(max_turns=4, max_tokens=len(state_context(first, TOK)) + edit + 82, min_turn_tokens=100,
                              summary_tokens=16)
    config = GeneratorConfig(group_size=2, script="reference", max_tokens=600, concurrent_tasks=2,
                             sandbox_timeout_s=20.0, agentic=agentic)
    env_ = AgenticEnvironment(TOK, AgenticBudgets(**{k: getattr(agentic, k) for k in AgenticBudgets.__struct_fields__}),
                              tool_list="compact")
    start = env_.start(RepoTask.from_spec(saved.verifier_spec()))     # the task as the generator rebuilds it
    turn = Turn("assistant", tuple(scripted_ids(reference_script(saved), start, TOK)))
    summary = [*TOK.encode("edited the file"), TOK.stop_id]
    state = env_.summarize(msgspec.structs.replace(start, turns=(*start.turns, turn), policy_turns=1), summary)
    context = state_context(start, TOK)
    segments = [_segment(context, list(turn.ids), -0.5), _segment([*context, *turn.ids, TOK.summary_id], summary, -0.25)]
    s = env.admin.subjects
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    await kv.put(partial_key(saved.task_id), encode_agentic(AgenticPartial(
        task_id=saved.task_id, group_size=2, turns=2,
        episodes=[AgenticEpisode(state=encode_state(state), segments=segments) for _ in range(2)])))
    async with supervisor(env), generator(env, model, config) as actor:
        for task in (fresh, saved):
            await env.admin.publish(s.tasks("hub"), message(task), msg_id=task.task_id)

        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 2
        await eventually(done, timeout_s=120, what="both groups published")
        counters = dict(actor.counters)
    assert counters["summaries"] == 2 and counters["resumed"] == 1 and counters.get("sandbox_errors", 0) == 0
    group = await rollouts(env)
    summarised = [r for r in group if r.task_id == fresh.task_id]
    for r in summarised:
        assert (r.reward, r.timings["summaries"], r.timings["turns"]) == (1.0, 1.0, 2.0)
        closed, written = r.segments
        assert closed.prompt_tokens.tolist() == context_of(fresh) and sum(closed.loss_mask.tolist()) == edit
        assert 0 < len(written.completion_tokens) <= 16 and written.prompt_tokens.tolist()[-1] == TOK.summary_id
        assert written.loss_mask.tolist() == [1] * len(written.completion_tokens)
        completion = r.completion_tokens.tolist()
        assert r.prompt_tokens.tolist()[-1] == TOK.summary_id          # the summary follows the task, as context
        assert completion[:len(written.completion_tokens)] == written.completion_tokens.tolist()
        assert TOK.decode(completion[-len(SUBMIT_SCRIPT[0]) - 1:-1]) == SUBMIT_SCRIPT[0]
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch(summarised)
    assert batch.tokens.shape[0] == 6 and batch.owner.tolist() == [0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)
    for r in (r for r in group if r.task_id == saved.task_id):
        assert msgspec.msgpack.encode(r.segments) == msgspec.msgpack.encode(segments)
        assert r.timings["resumes"] == 1.0 and r.prompt_tokens.tolist()[-1] == TOK.summary_id


def context_of(task: RepoTask) -> list[int]:
    """The first context of a repository task under the built-in policy's (compact) tool list."""
    return state_context(AgenticEnvironment(TOK, tool_list="compact").start(task), TOK)


def _segment(prompt: list[int], ids: list[int], logprob: float) -> Segment:
    return Segment(prompt_tokens=TensorBlob.of(prompt, "int32"), completion_tokens=TensorBlob.of(ids, "int32"),
                   behaviour_logprobs=TensorBlob.of([logprob] * len(ids), "float32"),
                   policy_versions=TensorBlob.of([1] * len(ids), "int32"),
                   loss_mask=TensorBlob.of([1] * len(ids), "uint8"))


# ---- chaos: a generator process SIGKILLed mid-episode ------------------------------------------------------
@pytest.mark.chaos
async def test_sigkilled_generator_mid_episode_is_resumed_from_the_workspace_snapshot(env: Env,
                                                                                    tmp_path: Path) -> None:
    """SIGKILL a generator process between the reference edit and the submit: the partial holds both episodes'
    states and a snapshot of their edited workspaces; a new generator process restores the snapshot into new
    sessions (it does not redo the edit: its first scripted turn is the submit), the hidden tests pass (reward 1)
    and the group is in ROLLOUTS exactly once; the dead one's sessions expire, the heir's are closed."""
    # a policy slow enough to score (about a second a turn on one thread) that the kill lands between the turns
    model = tiny_model(d_model=384, n_layers=6, n_heads=6, d_ff=1152)
    checkpoint = save_checkpoint(model, tmp_path / "pretrain.pt")
    task = repo_task(2, 3)
    settings = {"weights": f"local:{checkpoint}", "group_size": 2, "max_tokens": 600, "script": "reference",
                "sandbox_timeout_s": 20.0, "session_lease_s": 3.0}
    s = env.admin.subjects
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    key = partial_key(task.task_id)
    saved: list[AgenticPartial] = []
    async with supervisor(env) as sandbox:
        victim = spawn(env, "generator", "victim", {**settings, "local_version": 1}, tmp_path / "victim.log")
        heir: subprocess.Popen[bytes] | None = None
        try:
            watcher = await kv.watch(key)
            await env.admin.publish(s.tasks("hub"), message(task), msg_id=task.task_id)
            with anyio.fail_after(120):
                async for entry in watcher:
                    if entry is None or not entry.value:
                        continue
                    partial = decode_agentic(entry.value)
                    if partial.turns == 1:
                        os.kill(victim.pid, signal.SIGKILL)
                        saved.append(partial)
                        break
            await watcher.stop()
            victim.wait()
            assert await stored(env, s.rollouts_stream("hub")) == 0, (tmp_path / "victim.log").read_text()[-3000:]
            (partial,) = saved
            assert partial.writer == "victim" and all(ep.snapshot for ep in partial.episodes)
            blob = await env.admin.get_object(s.workspaces_bucket("hub"), partial.episodes[0].snapshot,
                                              expected_digest=partial.episodes[0].snapshot_digest)
            snapshot = msgspec.msgpack.decode(blob, type=WorkspaceSnapshot)
            edited = {p: v.decode() for p, v in snapshot.files.items()}
            assert edited and all(task.solution[p] == text for p, text in edited.items())
            assert not any(episode_state(ep).done for ep in partial.episodes)
            heir = spawn(env, "generator", "heir", {**settings, "local_version": 2}, tmp_path / "heir.log")

            async def published() -> bool:
                return (await stored(env, s.rollouts_stream("hub")) >= 2
                        and await stored(env, s.tasks_stream("hub")) == 0)
            await eventually(published, timeout_s=120, what="the heir published the group")
            assert stop(heir) == 0, (tmp_path / "heir.log").read_text()[-3000:]
        finally:
            reap(victim, heir)
        await eventually(lambda: sessions_open(sandbox), lambda n: n == 0, what="every session gone", timeout_s=15)
    group = await rollouts(env)
    assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1, f"{task.task_id}-1": 1}
    for r in group:
        assert (r.reward, r.generator_id, r.timings["resumes"], r.timings["turns"]) == (1.0, "heir", 1.0, 2.0)
        versions = [v for v, m in zip(r.policy_versions.tolist(), r.loss_mask.tolist(), strict=True) if m]
        assert versions[0] == 1 and versions[-1] == 2       # the edit turn is the victim's, the submit the heir's
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(key)
    assert await workspace_objects(env) == []
