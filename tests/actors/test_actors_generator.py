"""The generator against a real nats-server and the real sandbox supervisor, with a tiny random policy:
a task becomes G multi-turn Rollouts whose arrays are what the policy saw (teacher-forced logprobs equal
the behaviour logprobs), the task is acked only once the group is stored, a saved partial is resumed
instead of regenerated, a group without a pass grows up to max_group_size, an over-budget history is
summarised, a generator process SIGKILLed mid-rollout hands its task to a new one that resumes it and
publishes the group exactly once (then trained once: a clean ledger), a task held longer than the ack wait is
kept by in-progress acks and delivered once, and versions the publisher announces are swapped in mid-group
(WeightSync)."""

from __future__ import annotations

import copy
import itertools
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import anyio
import msgspec
import nats.js.errors
import pytest
import torch
from helpers import eventually, new_run
from helpers.function_partials import new_group, record_attempt
from helpers.generator_bus import (
    FAST,
    Env,
    env_fixture,
    reap,
    rollouts,
    save_checkpoint,
    serve_generator,
    serve_sandbox,
    server_fixture,
    serving,
    spans,
    spawn,
    stop,
    stored,
    stored_in,
    teacher_forced,
)
from helpers.hf import build_family
from nats.js.kv import KeyValue

from rlbus.actors.base import ActorId
from rlbus.actors.checkpointer import Checkpointer
from rlbus.actors.common.config import (
    CheckpointerConfig,
    CheckpointerLaunch,
    PublisherConfig,
    PublisherLaunch,
)
from rlbus.actors.common.feed import verifier_for
from rlbus.actors.common.ledger import Ledger, read_ledger
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.group import Attempt, PartialGroup, decode_partial, encode_partial
from rlbus.actors.publisher import Publisher
from rlbus.actors.sandbox.supervisor import SandboxConfig, SandboxSupervisor
from rlbus.actors.trainer.actor import Trainer
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
from rlbus.actors.trainer.core import TrainerCore, rollout_batch
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import Heartbeat, Rollout, SandboxVerdict
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.streams import StreamSettings, provision_region, provision_run
from rlbus.model.policies.interface import as_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.builtin import Task, eval_tasks
from rlbus.ops.bench.version_source import published_state, upload_version
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUNS = tuple(new_run() for _ in range(16))
"""Run ids of this module: the server grants their PARTIALS buckets to the generator role."""
TOK = ByteTokenizer()
CONFIG = GeneratorConfig(group_size=2, temperature=1.0, max_tokens=12, partial_every_tokens=5, max_attempts=3,
                         sandbox_timeout_s=10.0)
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256,
                        max_processes=8, max_file_mb=1, max_open_files=32, max_output_kb=16)


server = server_fixture("gen", RUNS)
env = env_fixture(RUNS)


def tiny_model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(max_seq_len=1024, **overrides)).eval()  # type: ignore[arg-type]


def coding_task(index: int = 0) -> Task:
    return eval_tasks(11, n=4)[index]


def task_message(task: Task, group_size: int = 2) -> TaskMessage:
    return TaskMessage(task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task), group_size=group_size,
                       region="hub", seed=1)


def generator(env: Env, model: Transformer, *, version: int, config: GeneratorConfig = CONFIG,
              actor_id: str = "g1") -> object:
    return serve_generator(env, model, config, version=version, actor_id=actor_id)


def sandbox(env: Env) -> object:
    return serve_sandbox(env, SANDBOX)


async def train_everything(env: Env, pretrained: Path, state: Path, produced: int) -> Ledger:
    """Serve a trainer and a checkpointer in this process until every rollout in ROLLOUTS is trained or dropped
    along the final lineage (hang guard: a lost rollout never gets there); return that ledger."""
    trainer = TrainerConfig(lr=1e-3, batch_rollouts=2)
    launch = TrainerLaunch(pretrained=str(pretrained), checkpoint_interval=1, mark_wait_s=2.0, resume_wait_s=0.0,
                           state_dir=str(state))
    marks = CheckpointerConfig(interval_steps=1, keep=1)
    at = CheckpointerLaunch(state_dir=str(state), drain_linger_s=0.2)
    async with serving(env, "checkpointer", lambda bus: Checkpointer(
            ActorId(env.run, "hub", "checkpointer", "hub-checkpointer-0"), bus, marks, FAST, at)), \
            serving(env, "trainer", lambda bus: Trainer(ActorId(env.run, "hub", "trainer", "hub-trainer-0"), bus,
                                                        trainer, FAST, launch)):
        return await eventually(lambda: read_ledger(env.admin),
                                lambda ledger: ledger.produced == produced and not ledger.lost and not ledger.pending,
                                what="every rollout trained or dropped", timeout_s=120, poll_s=0.5)


LOGPROB_ATOL = 1e-4
"""The generator's behaviour logprobs come from a batched, left-padded forward over a float32 KV cache, so
they differ from one plain teacher-forced forward by float32 rounding (~1e-6 here); a misaligned token
would differ by far more."""


def check_layout(rollout: Rollout, task: Task, attempts: int) -> None:
    """prompt = the first attempt's context; the completion alternates attempts and test feedback."""
    assert rollout.prompt_tokens.tolist() == TOK.prompt_ids(task.prompt)
    T = len(rollout.completion_tokens)
    assert len(rollout.behaviour_logprobs) == len(rollout.policy_versions) == len(rollout.loss_mask) == T
    completion, mask = rollout.completion_tokens.tolist(), rollout.loss_mask.tolist()
    turns = spans(mask)
    assert len(turns) == attempts and rollout.timings["attempts"] == attempts
    assert all(0 < e - s <= CONFIG.max_tokens for s, e in turns)
    assert turns[0][0] == 0 and turns[-1][1] == T           # starts and ends with sampled tokens
    for (_, end), (start, _) in itertools.pairwise(turns):   # between attempts: feedback, then a new turn
        between = completion[end:start]
        if completion[end - 1] != TOK.end_turn_id:
            assert between[0] == TOK.end_turn_id             # a truncated attempt is closed (masked)
            between = between[1:]
        assert between[0] == TOK.observation_id and between[-2:] == [TOK.end_turn_id, TOK.assistant_id]
        assert TOK.decode(between[1:-2]).split(" tests passed.")[0] in {f"{k}/6" for k in range(7)}
    assert all(lp == 0.0 for lp, m in zip(rollout.behaviour_logprobs.tolist(), mask, strict=True) if not m)


# ---- a task in, a group out ------------------------------------------------------------------------
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
async def test_task_becomes_a_group_of_consistent_multi_turn_rollouts(env: Env, moe: bool) -> None:
    """G Rollouts with ids task-g, prompt = the first context, 3 attempts with feedback between, versions of
    the held weights, loss mask on sampled tokens only, behaviour logprobs (and MoE routing) that a plain
    forward pass over prompt + completion reproduces; then the task is acked and the partial deleted."""
    model = tiny_model(moe_layers=(1,)) if moe else tiny_model()
    task = coding_task()
    await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task), msg_id=task.task_id)
    async with sandbox(env), generator(env, model, version=3) as actor:
        stream = env.admin.subjects.tasks_stream("hub")

        async def done() -> bool:
            return await stored(env, stream) == 0 and actor.counters.get("tasks", 0) == 1  # type: ignore[attr-defined]
        await eventually(done)
        counters = dict(actor.counters)  # type: ignore[attr-defined]
    group = await rollouts(env)
    assert [r.rollout_id for r in group] == [f"{task.task_id}-0", f"{task.task_id}-1"]
    assert counters["rollouts"] == 2 and counters.get("resumed", 0) == 0 and counters.get("sandbox_errors", 0) == 0
    for g, r in enumerate(group):
        assert (r.task_id, r.group_index, r.group_size, r.region, r.generator_id) == (task.task_id, g, 2, "hub", "g1")
        check_layout(r, task, attempts=3)        # a random policy fails every attempt
        assert r.reward == 0.0 and r.verdict.total == 6 and r.verdict.status in ("failed", "ok")
        assert set(r.policy_versions.tolist()) == {3}
        mask = torch.tensor(r.loss_mask.tolist(), dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r)[mask], torch.tensor(r.behaviour_logprobs.tolist())[mask],
                                   atol=LOGPROB_ATOL, rtol=0)
        if moe:
            assert r.routing is not None
            assert r.routing.shape == (len(r.prompt_tokens) + len(r.completion_tokens), 1, 2)
        else:
            assert r.routing is None
    assert counters["tokens"] == sum(int(sum(r.loss_mask.tolist())) for r in group)
    kv = await env.admin.js.key_value(env.admin.subjects.partials_bucket("hub"))
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(partial_key(task.task_id))


async def test_identical_drafts_of_a_round_run_in_the_sandbox_once(env: Env) -> None:
    """Greedy sampling gives a group of 3 the same program: the sandbox runs it once, the other two drafts
    reuse its verdict (counted as graded_repeats), and all three rollouts carry that verdict."""
    task = coding_task(2)
    greedy = msgspec.structs.replace(CONFIG, temperature=0.0, max_attempts=1)
    await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task, group_size=3), msg_id=task.task_id)
    async with sandbox(env) as supervisor, generator(env, tiny_model(), version=0, config=greedy) as actor:
        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1  # type: ignore[attr-defined]
        await eventually(done)
        counters, executions = dict(actor.counters), supervisor.counters.get("executions", 0)  # type: ignore[attr-defined]
    group = await rollouts(env)
    assert len(group) == 3 and len({tuple(r.completion_tokens.tolist()) for r in group}) == 1
    assert executions == 1 and counters["graded_repeats"] == 2 and counters.get("sandbox_errors", 0) == 0
    assert len({msgspec.json.encode(r.verdict) for r in group}) == 1 and group[0].verdict.total == 6


@pytest.mark.parametrize("continuous", [False, True])
async def test_concurrent_tasks_are_sampled_in_merged_batches_with_exact_logprobs(env: Env, continuous: bool) -> None:
    """concurrent_tasks = 3: the three tasks' drafts share decoding batches (merged calls of the batcher, or
    requests joining the engine driver's running batch), yet every rollout's behaviour logprobs equal a plain
    forward pass over its own tokens, and every group is whole."""
    model = tiny_model()
    tasks = [coding_task(i) for i in range(3)]
    for task in tasks:
        await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task), msg_id=task.task_id)
    config = msgspec.structs.replace(CONFIG, concurrent_tasks=3, max_attempts=1, continuous_batching=continuous)
    async with sandbox(env), generator(env, model, version=1, config=config) as actor:
        stream = env.admin.subjects.tasks_stream("hub")

        async def done() -> bool:
            return await stored(env, stream) == 0 and actor.counters.get("tasks", 0) == 3  # type: ignore[attr-defined]
        await eventually(done)
        batcher, driver = actor._batcher, actor._driver  # type: ignore[attr-defined]
        if continuous:
            assert batcher.calls == 0 and driver.requests == driver.submitted >= 3
        else:
            assert driver is None
            assert batcher.rows > batcher.calls       # some call carried more than one task's rows
            assert batcher.rows / batcher.calls > config.group_size
    group = await rollouts(env)
    assert sorted(r.rollout_id for r in group) == sorted(f"{t.task_id}-{g}" for t in tasks for g in range(2))
    for r in group:
        check_layout(r, next(t for t in tasks if t.task_id == r.task_id), attempts=1)
        mask = torch.tensor(r.loss_mask.tolist(), dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r)[mask], torch.tensor(r.behaviour_logprobs.tolist())[mask],
                                   atol=LOGPROB_ATOL, rtol=0)


async def test_tasks_ahead_wait_for_a_sampling_place_and_every_group_is_published_once(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """concurrent_tasks = 1 with tasks_ahead = 2: the generator holds three tasks, yet every sampling call
    carries the drafts of one task only (one place), each task's drafts are sampled in consecutive calls
    (a task keeps its place from its first chunk to its last), and all three groups are published whole."""
    model = tiny_model()
    tasks = [coding_task(i) for i in range(3)]
    prompts = {tuple(TOK.prompt_ids(t.prompt)): t.task_id for t in tasks}
    calls: list[set[str]] = []
    sample_rows = Generator._sample_rows

    def recording(self: Generator, contexts: list[list[int]], n: int, seed: int) -> object:
        calls.append({task_id for prompt, task_id in prompts.items()
                      for c in contexts if tuple(c[:len(prompt)]) == prompt})
        return sample_rows(self, contexts, n, seed)

    monkeypatch.setattr(Generator, "_sample_rows", recording)
    for task in tasks:
        await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task), msg_id=task.task_id)
    # the batcher's calls (`_sample_rows`) show which tasks sample together; the engine driver has no calls
    config = msgspec.structs.replace(CONFIG, concurrent_tasks=1, tasks_ahead=2, max_attempts=1,
                                     continuous_batching=False)
    async with sandbox(env), generator(env, model, version=1, config=config) as actor:
        stream = env.admin.subjects.tasks_stream("hub")

        async def done() -> bool:
            return await stored(env, stream) == 0 and actor.counters.get("tasks", 0) == 3  # type: ignore[attr-defined]
        await eventually(done)
    assert calls and all(len(c) == 1 for c in calls)
    order = [next(iter(c)) for c in calls]
    runs_of = [task_id for task_id, _ in itertools.groupby(order)]
    assert sorted(runs_of) == sorted(t.task_id for t in tasks)      # no task's chunks interleave with another's
    group = await rollouts(env)
    assert sorted(r.rollout_id for r in group) == sorted(f"{t.task_id}-{g}" for t in tasks for g in range(2))


async def test_task_is_acked_only_after_its_group_is_stored(env: Env) -> None:
    """With the region's ROLLOUTS stream gone the finished group cannot be stored: the task stays held (not
    acked), the generator retries; once the stream is back the group lands once and the task is acked.
    No sandbox answers here: every attempt is graded as a failed one, counted, and nothing crashes."""
    s = env.admin.subjects
    await env.admin.js.delete_stream(s.rollouts_stream("hub"))
    task = coding_task(1)
    await env.admin.publish(s.tasks("hub"), task_message(task), msg_id=task.task_id)
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    async with generator(env, tiny_model(), version=0) as actor:
        async def failing() -> bool:
            return actor.counters.get("publish_failures", 0) >= 2  # type: ignore[attr-defined]
        await eventually(failing)
        assert await stored(env, s.tasks_stream("hub")) == 1
        consumer = await env.admin.js.consumer_info(s.tasks_stream("hub"), s.durable("generator", "hub"))
        assert consumer.num_ack_pending == 1                      # delivered, held, not acked
        partial = decode_partial((await kv.get(partial_key(task.task_id))).value or b"")
        assert partial.finished(CONFIG.max_attempts)
        await provision_region(env.admin.nc, s, "hub", domain=None, settings=StreamSettings.tiny())

        async def acked() -> bool:
            return await stored(env, s.tasks_stream("hub")) == 0
        await eventually(acked)
        counters = dict(actor.counters)  # type: ignore[attr-defined]
    group = await rollouts(env)
    assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1, f"{task.task_id}-1": 1}
    assert counters["sandbox_errors"] + counters["graded_repeats"] == 6 and counters["tasks"] == 1
    assert all(r.verdict.status == "error" and r.reward == 0.0 for r in group)
    for r in group:
        check_layout(r, task, attempts=3)


async def redeliver_with_partial(env: Env, task: Task, first: list[int], *, version: int, feedback: str,
                                 max_attempts: int) -> KeyValue:
    """Save a partial of 2 episodes, each with one failed attempt `first` (logprobs -0.5 at `version`)
    and its feedback, then publish the task as if redelivered; returns the PARTIALS bucket."""
    state = new_group(task, task.task_id, 2, TOK, now=0.0)
    for ep in state.episodes:
        ep.draft_ids, ep.draft_logprobs, ep.draft_versions = list(first), [-0.5] * len(first), [version] * len(first)
        record_attempt(ep, task, Attempt(status="failed", n_passed=1, n_tests=6, feedback=feedback,
                                         verdict=SandboxVerdict(passed=1, total=6, status="failed")), TOK,
                       max_attempts)
    state.rounds = 1
    kv = await env.admin.js.key_value(env.admin.subjects.partials_bucket("hub"))
    await kv.create(partial_key(task.task_id), encode_partial(state))
    await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task), msg_id=task.task_id)
    return kv


async def test_redelivered_task_resumes_its_partial(env: Env) -> None:
    """A partial holding one graded attempt per episode is resumed: those tokens, logprobs, versions and the
    feedback stay as saved (not regenerated), the two remaining attempts come from the current weights."""
    task = coding_task(2)
    first = [*TOK.encode("return x"), TOK.end_turn_id]
    await redeliver_with_partial(env, task, first, version=5, feedback="f(1) returned 1, expected 3", max_attempts=3)
    model = tiny_model()
    async with sandbox(env), generator(env, model, version=9) as actor:
        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1  # type: ignore[attr-defined]
        await eventually(done)
        counters = dict(actor.counters)  # type: ignore[attr-defined]
    group = await rollouts(env)
    assert counters["resumed"] == 1
    feedback = TOK.encode("1/6 tests passed. f(1) returned 1, expected 3")
    for r in group:
        check_layout(r, task, attempts=3)
        completion = r.completion_tokens.tolist()
        n = len(first)
        expected = [*first, TOK.observation_id, *feedback, TOK.end_turn_id, TOK.assistant_id]
        assert completion[:len(expected)] == expected
        assert r.behaviour_logprobs.tolist()[:n] == [-0.5] * n and r.policy_versions.tolist()[:n] == [5] * n
        later = [i for i, m in enumerate(r.loss_mask.tolist()) if m and i >= n]
        assert later and {r.policy_versions.tolist()[i] for i in later} == {9}
        mask = torch.zeros(len(completion), dtype=torch.bool)
        mask[later] = True
        torch.testing.assert_close(teacher_forced(model, r)[mask], torch.tensor(r.behaviour_logprobs.tolist())[mask],
                                   atol=LOGPROB_ATOL, rtol=0)
    # only the resumed attempts were sampled here
    assert counters["tokens"] == sum(int(sum(r.loss_mask.tolist())) - len(first) for r in group)


@pytest.mark.parametrize("subsample", [False, True], ids=["all", "subsample"])
async def test_group_without_a_pass_grows_by_g_up_to_max_group_size(env: Env, subsample: bool) -> None:
    """max_group_size = 6, G = 2: a redelivered task whose saved group of 2 is finished without a pass is
    resumed and grown (its two episodes kept as saved), the random policy fails the new ones too, so it grows
    again to 6 and stops there; all 6 Rollouts carry group_size 6, the task is acked, the partial deleted.
    With grown_subsample the group goes out as G = 2 rollouts of group_size 2 (no pass: its first two)."""
    task = coding_task(3)
    first = [*TOK.encode("return x"), TOK.end_turn_id]
    kv = await redeliver_with_partial(env, task, first, version=4, feedback="no", max_attempts=1)
    config = msgspec.structs.replace(CONFIG, max_attempts=1, max_group_size=6, grown_subsample=subsample)
    async with sandbox(env), generator(env, tiny_model(), version=4, config=config) as actor:
        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1  # type: ignore[attr-defined]
        await eventually(done)
        counters = dict(actor.counters)  # type: ignore[attr-defined]
    group = await rollouts(env)
    size = 2 if subsample else 6
    assert [r.rollout_id for r in group] == [f"{task.task_id}-{g}" for g in range(size)]
    assert {r.group_size for r in group} == {size} and counters["groups_grown"] == 2 and counters["resumed"] == 1
    assert counters.get("grown_unpublished", 0) == 6 - size and all(r.reward == 0.0 for r in group)
    for r in group[:2]:                           # the saved episodes, not sampled again
        assert r.completion_tokens.tolist() == first and r.behaviour_logprobs.tolist() == [-0.5] * len(first)
    for r in group[2:]:
        check_layout(r, task, attempts=1)
    if not subsample:
        assert counters["tokens"] == sum(int(sum(r.loss_mask.tolist())) for r in group[2:])
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(partial_key(task.task_id))


async def test_over_budget_history_is_summarised(env: Env) -> None:
    """With a context budget just above the prompt, the history after a failed attempt is replaced by the
    policy's own summary; the next attempts read prompt + summary, as replayed. The rollout's segments keep
    the first attempt under the prompt and the summary under what the policy read, and the trainer's own
    logprobs of every segment, recomputed under the same weights, equal the behaviour logprobs."""
    task = coding_task(3)
    keep = len(TOK.encode(task.prompt)) + 3
    config = GeneratorConfig(
        group_size=2, max_tokens=12, partial_every_tokens=12, max_attempts=2, context_budget=keep + 16,
        sandbox_timeout_s=10.0)
    await env.admin.publish(env.admin.subjects.tasks("hub"), task_message(task), msg_id=task.task_id)
    model = tiny_model()
    async with sandbox(env), generator(env, model, version=1, config=config) as actor:
        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1  # type: ignore[attr-defined]
        await eventually(done)
        counters = dict(actor.counters)  # type: ignore[attr-defined]
    assert counters["summaries"] == 2            # one per episode, before its second attempt
    for r in await rollouts(env):
        completion, mask = r.completion_tokens.tolist(), r.loss_mask.tolist()
        assert r.prompt_tokens.tolist()[:-1] == TOK.prompt_ids(task.prompt)[:-1]
        assert r.prompt_tokens.tolist()[-1] == TOK.summary_id             # the summary follows the prompt
        assert len(spans(mask)) == 1 and r.timings["attempts"] == 2         # only the attempt after it is trained
        s, e = spans(mask)[0]
        assert completion[s - 1] == TOK.assistant_id and 0 < e - s <= 12 and e == len(completion)
        assert s <= 12 + 2 and len(r.prompt_tokens) + len(completion) <= keep + 16 + 12
        m = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r)[m], torch.tensor(r.behaviour_logprobs.tolist())[m],
                                   atol=LOGPROB_ATOL, rtol=0)
        first, written = r.segments
        assert first.prompt_tokens.tolist() == TOK.prompt_ids(task.prompt) and 0 < sum(first.loss_mask.tolist()) <= 12
        assert written.loss_mask.tolist() == [1] * len(written.completion_tokens)
        assert written.prompt_tokens.tolist()[-1] == TOK.summary_id
        assert completion[:len(written.completion_tokens)] == written.completion_tokens.tolist()
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch(await rollouts(env))
    assert batch.tokens.shape[0] == 6 and batch.owner.tolist() == [0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=LOGPROB_ATOL, rtol=0)


# ---- chaos: a generator process SIGKILLed mid-rollout ---------------------------------------------------
def _policy_files(kind: str, root: Path) -> Path:
    """What a `local:` generator and the trainer start from: a tiny built-in `pretrain.pt`, or a tiny Qwen2
    Hugging Face directory."""
    if kind == "hf":
        return build_family(root, "qwen2-tied", max_seq_len=1024)
    return save_checkpoint(tiny_model(), root / "pretrain.pt")


@pytest.mark.chaos
@pytest.mark.parametrize("kind", ["builtin", "hf"])
async def test_sigkilled_generator_task_is_resumed_by_another_and_published_once(env: Env, tmp_path: Path,
                                                                                 kind: str) -> None:
    """SIGKILL a generator process mid-rollout: the task comes back to a new generator process, which resumes
    the saved partial (resumed counter; every token saved before the kill is in the rollouts unchanged, with
    the old version, and only the rest is sampled anew) and the group is in ROLLOUTS exactly once; a trainer
    then trains on it: ledger 0 lost, 0 trained twice. The same for a built-in policy and a Hugging Face one."""
    checkpoint = _policy_files(kind, tmp_path)
    settings = {"weights": f"local:{checkpoint}", "group_size": 2, "max_tokens": 48, "partial_every_tokens": 4,
                "max_attempts": 3, "sandbox_timeout_s": 10.0}
    task = coding_task(0)
    s = env.admin.subjects
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    key = partial_key(task.task_id)
    heartbeats: dict[str, Heartbeat] = {}

    async def listen() -> None:
        sub = await env.admin.nc.subscribe(s.all_health())
        try:
            async for msg in sub.messages:
                beat = codec.decode_as(msg.data, msg.headers, Heartbeat)
                heartbeats[beat.actor_id] = beat
        finally:
            await sub.unsubscribe()

    async def partial() -> PartialGroup | None:
        try:
            return decode_partial((await kv.get(key)).value or b"")
        except nats.js.errors.KeyNotFoundError:
            return None

    async with sandbox(env), anyio.create_task_group() as tg:
        tg.start_soon(listen)
        victim = spawn(env, "generator", "victim", {**settings, "local_version": 1}, tmp_path / "victim.log")
        heir: subprocess.Popen[bytes] | None = None
        try:
            await env.admin.publish(s.tasks("hub"), task_message(task), msg_id=task.task_id)

            async def sampling() -> bool:
                state = await partial()
                return state is not None and state.sampled_tokens > 0
            await eventually(sampling)
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            saved = await partial()
            assert saved is not None and not saved.finished(3) and saved.writer == "victim"
            heir = spawn(env, "generator", "heir", {**settings, "local_version": 2}, tmp_path / "heir.log")

            async def published() -> bool:
                return await stored(env, s.rollouts_stream("hub")) >= 2 and await stored(env, s.tasks_stream("hub")) == 0
            await eventually(published, timeout_s=90)
            assert stop(heir) == 0, (tmp_path / "heir.log").read_text()[-3000:]

            async def heir_stopped() -> bool:
                return "heir" in heartbeats and heartbeats["heir"].state == "stopped"
            await eventually(heir_stopped)
        finally:
            reap(victim, heir)
            tg.cancel_scope.cancel()
    group = await rollouts(env)
    assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1, f"{task.task_id}-1": 1}
    prompt = LocalWeights.from_checkpoint(checkpoint).tokenizer.prompt_ids(task.prompt)   # framed by that policy
    assert all(r.prompt_tokens.tolist() == prompt for r in group)
    assert heartbeats["heir"].counters["resumed"] == 1 and heartbeats["heir"].state == "stopped"
    assert heartbeats["heir"].counters["tokens"] == sum(int(sum(r.loss_mask.tolist())) for r in group) - saved.sampled_tokens
    for r, ep in zip(group, saved.episodes, strict=True):
        before_kill = [t for turn in ep.turns if turn.role == "assistant" for t in turn.ids] + ep.draft_ids
        completion, versions = r.completion_tokens.tolist(), r.policy_versions.tolist()
        sampled = [i for i, m in enumerate(r.loss_mask.tolist()) if m]
        old = [i for i in sampled if versions[i] == 1]
        assert [completion[i] for i in old] == before_kill            # kept as saved, first, with version 1
        assert sampled[:len(old)] == old and {versions[i] for i in sampled[len(old):]} <= {2}
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(key)
    ledger = await train_everything(env, checkpoint, tmp_path / "state", produced=2)
    assert ledger.clean and ledger.trained == 2 and ledger.dropped == {}, (ledger.lost, ledger.trained_twice)


# ---- a task longer than the ack wait: in-progress acks hold it ---------------------------------------------
LONG = msgspec.structs.replace(CONFIG, max_tokens=240, partial_every_tokens=8, max_attempts=4)
"""Four attempts of up to 240 sampled tokens per episode, saved every 8."""
HOLD_S = 3.0
"""How long the test holds the generators' model locks once the task is held: longer than the 2 s ack wait of
`StreamSettings.tiny()` however fast the machine samples."""


async def test_task_longer_than_the_ack_wait_is_held_by_in_progress_and_delivered_once(env: Env) -> None:
    """Two generators share the TASKS consumer (tiny ack wait); a task held longer than the ack wait (the test
    holds the generators' model locks, so sampling waits) is kept by in-progress acks: JetStream delivers it once (never again to the idle generator), one generator
    publishes the group, which is in ROLLOUTS exactly once, and nobody resumed or took it over."""
    s = env.admin.subjects
    stream, durable = s.tasks_stream("hub"), s.durable("generator", "hub")
    ack_wait = float((await env.admin.js.consumer_info(stream, durable)).config.ack_wait or 0.0)
    assert 0.0 < ack_wait <= 2.0
    task = coding_task(0)
    redelivered: set[int] = set()
    async with sandbox(env), generator(env, tiny_model(), version=0, config=LONG, actor_id="g1") as g1, \
            generator(env, tiny_model(), version=0, config=LONG, actor_id="g2") as g2:
        actors = {"g1": g1, "g2": g2}

        async def pending() -> int:
            info = await env.admin.js.consumer_info(stream, durable)
            redelivered.add(info.num_redelivered)     # reset by the ack: read it while the task is held
            return info.num_ack_pending

        await env.admin.publish(s.tasks("hub"), task_message(task), msg_id=task.task_id)

        async def held() -> bool:
            return await pending() == 1
        await eventually(held)
        started = anyio.current_time()
        locks = [a.model_lock for a in actors.values()]  # type: ignore[attr-defined]
        for lock in locks:                                  # sampling waits: the task is held past the ack wait
            await anyio.to_thread.run_sync(lock.acquire)
        await anyio.sleep(HOLD_S)
        for lock in locks:
            lock.release()

        async def done() -> bool:
            return (await pending() == 0 and await stored(env, stream) == 0
                    and sum(a.counters.get("tasks", 0) for a in actors.values()) == 1)  # type: ignore[attr-defined]
        await eventually(done, timeout_s=180)
        held_s = anyio.current_time() - started
        counters = {name: dict(a.counters) for name, a in actors.items()}  # type: ignore[attr-defined]
    assert held_s > ack_wait, f"held {held_s:.1f}s, ack wait {ack_wait}s: the test proves nothing"
    info = await env.admin.js.consumer_info(stream, durable)
    # the consumer sequence counts every delivery, redeliveries included: one delivery of the one task
    assert (info.delivered.consumer_seq, info.delivered.stream_seq) == (1, 1)
    assert redelivered == {0}
    group = await rollouts(env)
    assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1, f"{task.task_id}-1": 1}
    (worker,) = {r.generator_id for r in group}
    idle = ({"g1", "g2"} - {worker}).pop()
    assert counters[worker]["tasks"] == 1 and counters[idle]["tasks"] == 0
    for c in counters.values():
        assert c["resumed"] == 0 and c.get("taken_over", 0) == 0


# ---- published weights: WeightSync swaps in flight --------------------------------------------------------
async def test_published_versions_reach_the_generator_mid_group(tmp_path: Path) -> None:
    """With weights = "sync" the generator samples the publisher's versions: a version published while a
    group is being sampled is swapped in between decoding steps, so the group's sampled tokens carry
    version 0 and then version 1 (never back), and the rollouts are published once."""
    run = new_run()
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(tmp_path / "regions", ["hub"], "hub", run=run))
    buses: list[Bus] = []

    async def connect(role: str) -> Bus:
        cred = rs.credentials(role)
        bus = await Bus.connect(rs.url("hub"), run=run, domain="hub", identity=Identity(f"hub-{role}", role, "hub"),
                                options=ConnectOptions(user=cred.user, password=cred.password))
        buses.append(bus)
        return bus

    try:
        admin = await connect("admin")
        s = admin.subjects
        await provision_run(admin.nc, s, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        config = GeneratorConfig(weights="sync", group_size=2, max_tokens=200, partial_every_tokens=8,
                                 sandbox_timeout_s=10.0)
        publisher_config = PublisherConfig(keep_versions=4, full_every=4)
        publisher_launch = PublisherLaunch(regions=["hub"], hub="hub", region_wait_s=2.0, retry_initial_s=0.2,
                                           retry_max_s=1.0, ack_wait_s=5.0, threads=1)
        model = tiny_model()
        trainer = await connect("trainer")
        task = coding_task(1)
        async with anyio.create_task_group() as tg:
            publisher = Publisher(ActorId(run, "hub", "publisher", "p"), await connect("publisher"),
                                  publisher_config, FAST, publisher_launch)
            await tg.start(publisher.serve)
            sandbox_actor = SandboxSupervisor(ActorId(run, "hub", "sandbox", "sb"), await connect("sandbox"),
                                              SANDBOX, FAST)
            await tg.start(sandbox_actor.serve)
            actor = Generator(ActorId(run, "hub", "generator", "g"), await connect("generator"), config, FAST)
            await tg.start(actor.serve)
            await upload_version(trainer, version=0, step=0, state=published_state(model), model_config=model.config)
            await admin.publish(s.tasks("hub"), task_message(task), msg_id=task.task_id)
            kv = await admin.js.key_value(s.partials_bucket("hub"))

            async def sampling() -> bool:
                try:
                    return decode_partial((await kv.get(partial_key(task.task_id))).value or b"").sampled_tokens > 0
                except nats.js.errors.KeyNotFoundError:
                    return False
            await eventually(sampling)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            await upload_version(trainer, version=1, step=1, state=published_state(model), model_config=model.config)

            async def published() -> bool:
                return await stored_in(admin, s.rollouts_stream("hub")) >= 2
            await eventually(published, timeout_s=90)
            tg.cancel_scope.cancel()
        stream = s.rollouts_stream("hub")
        group = [codec.decode_as((m := await admin.js.get_msg(stream, seq)).data, m.headers, Rollout)
                 for seq in (1, 2)]
        assert await stored_in(admin, stream) == 2
        sampled = [v for r in group for v, m in zip(r.policy_versions.tolist(), r.loss_mask.tolist(), strict=True) if m]
        assert set(sampled) == {0, 1}
        for r in group:
            versions = [v for v, m in zip(r.policy_versions.tolist(), r.loss_mask.tolist(), strict=True) if m]
            assert versions == sorted(versions)       # an in-flight swap only moves forward
        assert actor.gauges["held_version"] == 1.0
    finally:
        for bus in buses:
            await bus.close()
        await anyio.to_thread.run_sync(rs.stop)

