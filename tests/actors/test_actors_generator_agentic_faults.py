"""Agentic episodes through crashes, against a real nats-server, real sandbox supervisors and real generator
processes: a generator SIGKILLed three times in one episode, at three turns, leaves a workspace equal file by file
to that of the same episode run without a kill; a SIGKILLed sandbox supervisor costs the episode a reopened
session, never its edits or its reward, and a group whose sandbox cannot be reopened is dropped as `sandbox_error`,
never trained; a generator rides out its server's outage past the old give-up; scripted turns are scored at the
sampling temperature; an episode that asks for its own summaries survives a SIGKILL between two of them."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
from helpers import eventually, hosted, new_run
from helpers.generator_bus import (
    FAST,
    Env,
    env_fixture,
    provisioned,
    reap,
    rollouts,
    save_checkpoint,
    serve_generator,
    serve_sandbox,
    server_fixture,
    spawn,
)

from rlbus.actors.base import ActorId
from rlbus.actors.common.feed import verifier_for
from rlbus.actors.common.ledger import reason_category
from rlbus.actors.common.sessions import restore_files
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.agentic import (
    AgenticPartial,
    WorkspaceSnapshot,
    decode_agentic,
    episode_state,
    overlay,
)
from rlbus.actors.generator.config import AgenticSettings
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import available_levels
from rlbus.actors.trainer.core import TrainerCore, plan_step, rollout_batch
from rlbus.messages.errors import NO_LEADER_S
from rlbus.messages.schemas import Rollout, TensorBlob, ToolResult
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.streams import StreamSettings
from rlbus.messages.subjects import BucketScope
from rlbus.model.env import AgenticEnvironment, state_context
from rlbus.model.env.summaries import FRESH_HEAD, SUMMARY_REQUEST
from rlbus.model.policies.interface import as_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.model.tasks.repo import RepoTask, repo_task
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUNS = tuple(new_run() for _ in range(6))
TOK = ByteTokenizer()
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=4.0, wall_seconds=8.0, memory_mb=256,
                        max_processes=16, max_file_mb=1, max_open_files=64, max_output_kb=16, max_sessions=16,
                        workspace_mb=4, max_lease_s=60.0, session_spares=0)
LAUNCH = SandboxLaunch(isolation=available_levels()[0])  # type: ignore[arg-type]
EDITS = {"group_size": 1, "max_tokens": 1200, "script": "edits", "sandbox_timeout_s": 20.0, "session_lease_s": 3.0}
"""Generator settings of the scripted episodes here: one episode, the `edits` script, short leases."""
LISTING = re.compile(r"^([0-9a-f]{64})  \./(\S+)$", re.MULTILINE)
SETTINGS = dataclasses.replace(StreamSettings.tiny(), max_deliver=8)     # a task outlives three SIGKILLs


server = server_fixture("faults", RUNS)
env = env_fixture(RUNS, SETTINGS)


def tiny_model(**shape: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(max_seq_len=8192, **shape)).eval()  # type: ignore[arg-type]


def slow_model() -> Transformer:
    """A policy slow enough to score (about a second a turn on one thread) that a kill lands between turns."""
    return tiny_model(d_model=384, n_layers=6, n_heads=6, d_ff=1152)


def message(task: RepoTask, task_id: str, group_size: int = 1) -> TaskMessage:
    return TaskMessage(task_id=task_id, prompt=task.prompt, verifier=task.verifier_spec(), group_size=group_size,
                       region="hub", seed=1)


def supervisor(env: Env) -> Any:
    return serve_sandbox(env, SANDBOX, LAUNCH)


def generator(env: Env, model: Transformer, config: GeneratorConfig) -> Any:
    return serve_generator(env, model, config, version=2)


async def published(env: Env, task_id: str, n: int = 1) -> list[Rollout]:
    return await eventually(lambda: rollouts(env, task_id), lambda rs: len(rs) >= n, what=f"{task_id} published",
                            timeout_s=180)


def listing(rollout: Rollout) -> dict[str, str]:
    """The workspace's files and their sha256 as the episode's own `find | sha256sum` turn saw them."""
    text = TOK.decode([*rollout.prompt_tokens.tolist(), *rollout.completion_tokens.tolist()])
    return {path: sha for sha, path in LISTING.findall(text)}


def expected_listing(task: RepoTask) -> dict[str, str]:
    """What the `edits` script leaves: the reference solution without README.md, with the notes it writes."""
    files = {p: t.encode() for p, t in task.solution.items() if p != "README.md"}
    files |= {"notes/plan.md": b"done: edit, then submit\n", "notes/more/b.txt": b"more\n"}
    return {p: hashlib.sha256(v).hexdigest() for p, v in files.items()}


# ---- pure ---------------------------------------------------------------------------------------------------
def test_snapshots_laid_over_their_base_keep_every_change_across_restores() -> None:
    """Four sessions in a row, each restored from the snapshot the one before left and each changing the workspace
    (a new file, a task file deleted, the new file edited, a task file edited then deleted then written again):
    the last snapshot restores exactly the workspace all four changes made."""
    task = {"a.py": "a\n", "b.py": "b\n", "README.md": "r\n"}
    base = {p: t.encode() for p, t in task.items()}
    changes: list[tuple[dict[str, bytes], list[str]]] = [
        ({"new.txt": b"1\n"}, []),
        ({}, ["README.md"]),
        ({"new.txt": b"2\n", "a.py": b"A\n"}, []),
        ({"a.py": b"AA\n"}, ["b.py"]),
    ]
    live = dict(base)
    snap: WorkspaceSnapshot | None = None
    for files, deleted in changes:
        for path in deleted:
            del live[path]
        live |= files
        snap = overlay(snap, files, deleted, task_id="t", task_files=task)
        restored = restore_files(base, ToolResult(session_id="", call_id="", ok=True, files=snap.files,
                                                  deleted=snap.deleted))
        assert restored == live
    assert snap is not None and snap.deleted == ["README.md", "b.py"] and set(snap.files) == {"new.txt", "a.py"}


def _rollout(task: str, g: int, *, sandbox_error: bool) -> Rollout:
    return Rollout(rollout_id=f"{task}-{g}", task_id=task, group_index=g, group_size=2,
                   prompt_tokens=TensorBlob.of([3], "int32"), completion_tokens=TensorBlob.of([1, 2], "int32"),
                   behaviour_logprobs=TensorBlob.of([-1.0, -1.0], "float32"),
                   policy_versions=TensorBlob.of([0, 0], "int32"), loss_mask=TensorBlob.of([], "uint8"),
                   reward=0.0, timings={"sandbox_error": float(sandbox_error)})


def test_a_group_with_a_sandbox_error_is_dropped_never_trained() -> None:
    """One member's sandbox failed: its whole group is dropped with the reason category `sandbox_error` (what
    TrainStep.dropped and the ledger record), and a clean group beside it is trained."""
    groups = {"hurt": [_rollout("hurt", 0, sandbox_error=False), _rollout("hurt", 1, sandbox_error=True)],
              "clean": [_rollout("clean", 0, sandbox_error=False), _rollout("clean", 1, sandbox_error=False)]}
    plan = plan_step(groups, version=0, staleness_versions=0, batch_rollouts=2)
    assert plan.train == ("clean",)
    assert [(task, reason_category(why)) for task, why in plan.drop] == [("hurt", "sandbox_error")]


# ---- through the generator ----------------------------------------------------------------------------------
async def test_scripted_turns_are_scored_at_the_sampling_temperature(env: Env) -> None:
    """At temperature 0.7 the behaviour logprobs of a scripted episode are what the trainer computes at 0.7 (and
    not the temperature-1 ones), so its importance weights start at 1."""
    model = tiny_model()
    task = repo_task(1, 5)
    config = GeneratorConfig(group_size=1, script="reference", max_tokens=600, temperature=0.7,
                             sandbox_timeout_s=20.0, agentic=AgenticSettings(max_turns=4))
    async with supervisor(env), generator(env, model, config):
        await env.admin.publish(env.admin.subjects.tasks("hub"), message(task, "warm"), msg_id="warm")
        (rollout,) = await published(env, "warm")
    assert rollout.reward == 1.0
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch([rollout])
    with torch.no_grad():
        at_07 = core.logprobs(core.policy, batch, temperature=0.7)[batch.mask]
        at_1 = core.logprobs(core.policy, batch, temperature=1.0)[batch.mask]
    torch.testing.assert_close(at_07, batch.behaviour[batch.mask], atol=1e-4, rtol=0)
    assert (at_1 - batch.behaviour[batch.mask]).abs().max() > 1e-2


@pytest.mark.chaos
async def test_three_generator_sigkills_in_one_episode_keep_every_edit(env: Env, tmp_path: Path) -> None:
    """The `edits` episode run once without a kill, then again with its generator process SIGKILLed after three
    different turns (each heir resumes from the last snapshot, the last one finishes): the workspace the episode
    lists before its submit is the same file by file, the one the script makes, and the reward is 1 both times."""
    model = slow_model()
    task = repo_task(2, 8)
    s = env.admin.subjects
    checkpoint = save_checkpoint(model, tmp_path / "pretrain.pt")
    settings = {**EDITS, "weights": f"local:{checkpoint}", "local_version": 1}
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    procs: list[subprocess.Popen[bytes]] = []
    killed: list[int] = []
    async with supervisor(env) as sandbox:
        config = GeneratorConfig(**{k: v for k, v in EDITS.items() if k != "session_lease_s"})  # type: ignore[arg-type]
        async with generator(env, tiny_model(), config):
            await env.admin.publish(s.tasks("hub"), message(task, "whole"), msg_id="whole")
            (whole,) = await published(env, "whole")
        try:
            # this task's partials only: the generator above may have stopped before acking "whole", which is then
            # delivered again (to a victim) and its repeated rollout dropped by the stream's duplicate window
            watcher = await kv.watch(partial_key("killed"))
            await env.admin.publish(s.tasks("hub"), message(task, "killed"), msg_id="killed")
            procs.append(spawn(env, "generator", "victim-0", settings, tmp_path / "victim-0.log"))
            with anyio.fail_after(240):
                async for entry in watcher:
                    if entry is None or not entry.value:
                        continue
                    partial: AgenticPartial = decode_agentic(entry.value)
                    if partial.writer != f"victim-{len(killed)}":
                        continue
                    os.kill(procs[-1].pid, signal.SIGKILL)      # at its first saved turn
                    procs[-1].wait()
                    killed.append(partial.turns)
                    name = f"victim-{len(killed)}" if len(killed) < 3 else "heir"
                    procs.append(spawn(env, "generator", name, settings, tmp_path / f"{name}.log"))
                    if len(killed) == 3:
                        break
            await watcher.stop()
            (resumed,) = await published(env, "killed")
        finally:
            reap(*procs)
        await eventually(lambda: len(sandbox.sessions.sessions) if sandbox.sessions else -1, lambda n: n == 0,
                         what="every session gone", timeout_s=20)
    assert killed == sorted(set(killed)) and len(killed) == 3 and killed[0] >= 1, killed
    assert resumed.generator_id == "heir" and resumed.timings["resumes"] == 3.0
    assert (whole.reward, resumed.reward) == (1.0, 1.0)
    assert listing(whole) == listing(resumed) == expected_listing(task)
    assert Counter(r.task_id for r in await rollouts(env)) == {"whole": 1, "killed": 1}


@pytest.mark.chaos
async def test_a_sigkilled_sandbox_supervisor_costs_a_session_not_the_episode(env: Env, tmp_path: Path) -> None:
    """The supervisor holding the episode's session is SIGKILLed after its first turn and a second one started:
    the episode's session is reopened there from its last snapshot (the sandbox's digest of it equal to the
    snapshotted workspace's), the episode finishes with every edit (its
    listing is the script's) and reward 1, no sandbox error; the group is published once and planned for training,
    not dropped."""
    task = repo_task(3, 9)
    s = env.admin.subjects
    kv = await env.admin.js.key_value(s.partials_bucket("hub"))
    first = spawn(env, "sandbox", "sb-a", msgspec.to_builtins(SANDBOX), tmp_path / "sb-a.log",
                   msgspec.to_builtins(LAUNCH))
    second: subprocess.Popen[bytes] | None = None
    config = GeneratorConfig(**{k: v for k, v in EDITS.items() if k != "session_lease_s"})  # type: ignore[arg-type]
    try:
        async with generator(env, slow_model(), config) as actor:
            watcher = await kv.watch("*")
            await env.admin.publish(s.tasks("hub"), message(task, "crash"), msg_id="crash")
            with anyio.fail_after(120):
                async for entry in watcher:
                    if entry is not None and entry.value and decode_agentic(entry.value).turns >= 1:
                        break
            await watcher.stop()
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            second = spawn(env, "sandbox", "sb-b", msgspec.to_builtins(SANDBOX), tmp_path / "sb-b.log",
                            msgspec.to_builtins(LAUNCH))
            (rollout,) = await published(env, "crash")
            counters = dict(actor.counters)
    finally:
        reap(first, second)
    assert counters["sessions_lost"] >= 1 and counters.get("sandbox_errors", 0) == 0
    assert counters["restores_checked"] == counters["restores_equal"] >= 1, counters  # the reopened workspace's digest
    assert (rollout.reward, rollout.timings["sandbox_error"]) == (1.0, 0.0)
    assert listing(rollout) == expected_listing(task), TOK.decode(rollout.completion_tokens.tolist())[-3000:]
    plan = plan_step({"crash": [rollout]}, version=2, staleness_versions=4, batch_rollouts=1)
    assert plan.train == ("crash",) and plan.drop == ()


@pytest.mark.chaos
async def test_a_generator_rides_out_its_servers_outage(tmp_path: Path) -> None:
    """The region's only nats-server SIGKILLed while a generator saves a function group's partials, down for
    longer than a KV read or write used to be tried (`NO_LEADER_S`), then restarted on its store: the same
    generator (never failed, never restarted) saves its partial, finishes the group and publishes it once."""
    run = new_run()
    srv = EmbeddedServer.start(tmp_path / "js", ServerOptions(name="outage",
                                                            scope=BucketScope(runs=(run,), regions=("hub",))))
    try:
        env = await provisioned(srv, run, SETTINGS)
        try:
            task = eval_tasks(11, n=1)[0]
            model = slow_model()
            config = GeneratorConfig(group_size=2, max_tokens=96, partial_every_tokens=4, max_attempts=1,
                                     sandbox_timeout_s=20.0)
            s = env.admin.subjects
            kv = await env.admin.js.key_value(s.partials_bucket("hub"))
            async with supervisor(env), generator(env, model, config) as actor:
                watcher = await kv.watch("*")
                await env.admin.publish(s.tasks("hub"), TaskMessage(
                    task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task), group_size=2,
                    region="hub", seed=1), msg_id=task.task_id)
                with anyio.fail_after(120):
                    async for entry in watcher:
                        if entry is not None and entry.value:
                            break
                await watcher.stop()
                await anyio.to_thread.run_sync(srv.kill)
                await anyio.sleep(NO_LEADER_S + 5.0)        # the outage itself, not a synchronisation
                await anyio.to_thread.run_sync(srv.restart)
                await eventually(lambda: actor.counters.get("tasks", 0), lambda n: n == 1,
                                 what="the group published after the outage", timeout_s=180)
                assert actor.counters.get("sandbox_errors", 0) == 0
            group = await rollouts(env)
            assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1, f"{task.task_id}-1": 1}
        finally:
            await env.admin.close()
    finally:
        srv.stop()


@pytest.mark.chaos
async def test_a_generator_started_while_its_server_is_down_waits_for_it(tmp_path: Path) -> None:
    """A generator (re)started while its region's only nats-server is SIGKILLed, down for longer than one JetStream
    request waits: its setup rides out the outage (it neither fails nor gives up), and once the server is back on
    its store it takes the task queued before the outage and publishes its group once."""
    run = new_run()
    srv = EmbeddedServer.start(tmp_path / "js", ServerOptions(name="startup",
                                                            scope=BucketScope(runs=(run,), regions=("hub",))))
    try:
        env = await provisioned(srv, run, SETTINGS)
        try:
            task = eval_tasks(12, n=1)[0]
            s = env.admin.subjects
            await env.admin.publish(s.tasks("hub"), TaskMessage(
                task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task), group_size=1, region="hub",
                seed=1), msg_id=task.task_id)
            bus = await env.bus("generator")
            await anyio.to_thread.run_sync(srv.kill)
            config = GeneratorConfig(group_size=1, max_tokens=16, max_attempts=1, sandbox_timeout_s=20.0)
            actor = Generator(ActorId(env.run, "hub", "generator", "g-late"), bus, config, FAST,
                              weights=LocalWeights(tiny_model(), version=2))
            async with anyio.create_task_group() as tg:
                async def restart_later() -> None:
                    await anyio.sleep(8.0)                  # the outage itself, not a synchronisation
                    await anyio.to_thread.run_sync(srv.restart)
                tg.start_soon(restart_later)
                async with hosted(actor, close=[bus]), supervisor(env):
                    await eventually(lambda: actor.counters.get("tasks", 0), lambda n: n == 1,
                                     what="the group published after the outage", timeout_s=120)
            group = await rollouts(env)
            assert Counter(r.rollout_id for r in group) == {f"{task.task_id}-0": 1}
        finally:
            await env.admin.close()
    finally:
        srv.stop()


def text_of(ids: list[int]) -> str:
    """The text of ids, skipping those past the tokenizer (a random policy samples embedding rows it has no text for)."""
    return TOK.decode([t for t in ids if t < TOK.vocab_size])


@pytest.mark.chaos
async def test_requested_summaries_survive_a_sigkill_between_them_and_every_segment_rescores(env: Env,
                                                                                             tmp_path: Path) -> None:
    """`summary_at_tokens`: once the context reaches it a user turn asks for a summary, the policy writes one (a
    sampled, trained turn) and the episode goes on from the task and the summary. The `edits` episode summarises
    more than once; its generator process is SIGKILLed after the first summary, before the second, and the heir
    resumes and writes the rest. The Rollout carries one segment per summary (the turns since the last fresh
    context, the request masked, the summary trained), every segment's and the tail's logprobs that the trainer
    recomputes under the same weights equal the behaviour logprobs, the workspace keeps every edit, reward 1."""
    model = tiny_model()
    task = repo_task(2, 8)
    first = len(state_context(AgenticEnvironment(TOK, tool_list="compact").start(task), TOK))
    checkpoint = save_checkpoint(model, tmp_path / "pretrain.pt")
    settings = {**EDITS, "weights": f"local:{checkpoint}", "local_version": 2,
                "agentic": {"summary_at_tokens": first + 200, "summary_tokens": 12}}
    kv = await env.admin.js.key_value(env.admin.subjects.partials_bucket("hub"))
    procs: list[subprocess.Popen[bytes]] = []
    async with supervisor(env):
        try:
            watcher = await kv.watch("*")
            await env.admin.publish(env.admin.subjects.tasks("hub"), message(task, "chain"), msg_id="chain")
            procs.append(spawn(env, "generator", "victim", settings, tmp_path / "victim.log", nice=19))
            with anyio.fail_after(120):
                async for entry in watcher:
                    if entry is None or not entry.value:
                        continue
                    partial = decode_agentic(entry.value)
                    if partial.writer == "victim" and episode_state(partial.episodes[0]).summaries == 1:
                        os.kill(procs[-1].pid, signal.SIGKILL)     # after the first summary
                        procs[-1].wait()
                        break
            await watcher.stop()
            left = decode_agentic((await kv.get("chain")).value or b"")
            assert episode_state(left.episodes[0]).summaries == 1   # ... and before the second
            procs.append(spawn(env, "generator", "heir", settings, tmp_path / "heir.log"))
            (rollout,) = await published(env, "chain")
        finally:
            reap(*procs)
    assert rollout.generator_id == "heir" and rollout.timings["resumes"] == 1.0
    texts = [text_of([*r.prompt_tokens.tolist(), *r.completion_tokens.tolist()]) for r in [*rollout.segments, rollout]]
    seen = {path: sha for text in texts for sha, path in LISTING.findall(text)}   # the listing may be summarised away
    assert rollout.reward == 1.0 and seen == expected_listing(task)
    summaries = int(rollout.timings["summaries"])
    assert summaries >= 2 and len(rollout.segments) == summaries
    for seg in rollout.segments:
        text = text_of([*seg.prompt_tokens.tolist(), *seg.completion_tokens.tolist()])
        runs = re.findall("1+", "".join(map(str, seg.loss_mask.tolist())))
        assert SUMMARY_REQUEST in text and seg.loss_mask.tolist()[-1] == 1 and 0 < len(runs[-1]) <= 12
    for later in [*rollout.segments[1:], rollout]:                 # each goes on from the task and a summary
        assert FRESH_HEAD in text_of(later.prompt_tokens.tolist())
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch([rollout])
    assert batch.tokens.shape[0] == summaries + 1
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)
