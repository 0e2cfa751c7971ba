"""The evaluator against a real nats-server, the real publisher and the real sandbox supervisor: versions the
trainer uploads reach it through the publisher's LATEST manifests, and it publishes one EvalReport on EVALS
for version 0 and every `every_versions`-th version after it, graded in the region's sandboxes, with n, pass@1
and the Wilson interval consistent with each other."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import nats.js.errors
import pytest
import torch
from helpers import eventually, new_run

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import EvaluatorConfig, EvaluatorLaunch, PublisherConfig, PublisherLaunch
from rlbus.actors.common.ledger import read_all
from rlbus.actors.evaluator import Evaluator
from rlbus.actors.publisher import Publisher
from rlbus.actors.sandbox.supervisor import SandboxConfig, SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import EvalReport, Heartbeat, WeightManifest
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.messages.subjects import LATEST_KEY
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.evaluate import wilson_interval
from rlbus.ops.bench.version_source import published_state, upload_version
from rlbus.topology.backends.local import LocalSupervisor, ProcessSpec, RestartPolicy
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

pytestmark = pytest.mark.anyio

FAST = ActorLimits(heartbeat_interval_s=0.3, drain_timeout_s=2.0)
SETTINGS = EvaluatorConfig(every_versions=2, n_tasks=3, seed=1)
EVAL_LAUNCH = EvaluatorLaunch(max_tokens=16, batch_size=4)
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256,
                        max_processes=8, max_file_mb=1, max_open_files=32, max_output_kb=16)
PUBLISHER = PublisherConfig(keep_versions=4, full_every=4)
PUBLISHER_LAUNCH = PublisherLaunch(regions=["hub"], hub="hub", region_wait_s=2.0, retry_initial_s=0.2,
                                   retry_max_s=1.0, ack_wait_s=5.0, threads=1)


@dataclass
class _Hub:
    """A one-region run (bucket writes granted for it, every stream provisioned) and the buses opened on it."""

    rs: RegionSet
    run: str
    buses: list[Bus] = field(default_factory=list)

    async def bus(self, role: str) -> Bus:
        cred = self.rs.credentials(role)
        bus = await Bus.connect(self.rs.url("hub"), run=self.run, domain="hub",
                                identity=Identity(f"hub-{role}", role, "hub"),
                                options=ConnectOptions(user=cred.user, password=cred.password))
        self.buses.append(bus)
        return bus


@asynccontextmanager
async def _hub(tmp_path: Path) -> AsyncIterator[_Hub]:
    run = new_run()
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(tmp_path / "regions", ["hub"], "hub", run=run))
    hub = _Hub(rs, run)
    try:
        admin = await hub.bus("admin")
        await provision_run(admin.nc, admin.subjects, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        yield hub
    finally:
        for bus in hub.buses:
            await bus.close()
        await anyio.to_thread.run_sync(rs.stop)


async def _reports(bus: Bus) -> list[EvalReport]:
    """Every EvalReport stored on the run's EVALS stream, in stream order."""
    return await read_all(bus.js, bus.subjects.evals_stream(), bus.subjects.evals(), EvalReport)


async def _wait_reported(bus: Bus, version: int, timeout_s: float = 60) -> None:
    await eventually(lambda: _reports(bus), lambda reports: any(r.policy_version == version for r in reports),
                     what=f"a report of version {version}", timeout_s=timeout_s)


async def _wait_held(evaluator: Evaluator, version: int, timeout_s: float = 60) -> None:
    await eventually(lambda: (held := evaluator.sync.held_version) is not None and held >= version,
                     what=f"the evaluator holding version {version}", timeout_s=timeout_s, poll_s=0.05)


async def _wait_latest(bus: Bus, version: int, timeout_s: float = 60) -> None:
    """Until the publisher has pointed the hub's LATEST key at `version`."""
    kv = await bus.js.key_value(bus.subjects.latest_bucket("hub"))

    async def latest() -> int:
        entry = await kv.get(LATEST_KEY)
        return codec.decode_as(entry.value or b"", None, WeightManifest).version

    await eventually(latest, lambda latest_version: latest_version >= version, what=f"LATEST at version {version}",
                     timeout_s=timeout_s, ignoring=(nats.js.errors.KeyNotFoundError,))


async def _upload(trainer: Bus, model: Transformer, version: int) -> None:
    """Upload `version` as the trainer does: version 0 is `model` as it is, each later one a trainer step
    stand-in (every weight nudged); the bf16 cast is what is published."""
    if version:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    await upload_version(trainer, version=version, step=version, state=published_state(model),
                         model_config=model.config)


@asynccontextmanager
async def _actors(hub: _Hub, *, evaluator: bool = True, settings: EvaluatorConfig = SETTINGS
                  ) -> AsyncIterator[tuple[anyio.abc.TaskGroup, Evaluator, SandboxSupervisor]]:
    """The publisher and a sandbox supervisor (and, unless told otherwise, the evaluator) served in this
    process until the block ends."""
    async with anyio.create_task_group() as tg:
        await tg.start(Publisher(ActorId(hub.run, "hub", "publisher", "hub-publisher-0"), await hub.bus("publisher"),
                                 PUBLISHER, FAST, PUBLISHER_LAUNCH).serve)
        sandbox = SandboxSupervisor(ActorId(hub.run, "hub", "sandbox", "hub-sandbox-0"), await hub.bus("sandbox"),
                                    SANDBOX, FAST)
        await tg.start(sandbox.serve)
        actor = Evaluator(ActorId(hub.run, "hub", "evaluator", "hub-evaluator-0"), await hub.bus("evaluator"),
                          settings, FAST, EVAL_LAUNCH)
        if evaluator:
            await tg.start(actor.serve)
        yield tg, actor, sandbox
        tg.cancel_scope.cancel()


def _check_report(report: EvalReport) -> None:
    """n is the held-out set, pass@1 a count over it, and the interval the 95% Wilson interval of that count; the
    levels add up to the set and their passes to the count."""
    assert report.task_seed == SETTINGS.seed and report.n == SETTINGS.n_tasks
    assert sum(s.n for s in report.by_level.values()) == report.n
    assert sum(round(s.pass_at_1 * s.n) for s in report.by_level.values()) == round(report.pass_at_1 * report.n)
    assert 0.0 <= report.pass_at_1 <= 1.0
    passed = round(report.pass_at_1 * report.n)
    assert report.pass_at_1 == passed / report.n
    assert (report.ci_low, report.ci_high) == wilson_interval(passed, report.n)
    assert report.ci_low <= report.pass_at_1 <= report.ci_high and report.ci_low < report.ci_high


@pytest.mark.parametrize("n", [1, 3, 4, 5, 10, 31, 64])
def test_wilson_interval_contains_the_estimate_at_the_edges(n: int) -> None:
    """No passes gives a lower bound of exactly 0 and all passes an upper bound of exactly 1, so every
    EvalReport's interval contains its pass@1 (float rounding must not push an edge past the estimate)."""
    assert wilson_interval(0, n)[0] == 0.0
    assert wilson_interval(n, n)[1] == 1.0


async def test_evaluates_version_zero_and_every_kth_version_once_with_consistent_reports(tmp_path: Path) -> None:
    """Versions 0-4 uploaded one at a time (each held by the evaluator before the next is uploaded) with
    every_versions=2 give exactly one EvalReport each for versions 0, 2 and 4 (none for 1 and 3), each over
    the configured held-out tasks, graded by the sandbox service, with pass@1 = passed/n and the 95% Wilson
    interval of that count around it."""
    async with _hub(tmp_path) as hub, _actors(hub) as (_, evaluator, sandbox):
        trainer, admin = await hub.bus("trainer"), hub.buses[0]
        torch.manual_seed(0)
        model = Transformer(ModelConfig.tiny()).eval()
        for version in range(5):
            await _upload(trainer, model, version)
            await _wait_held(evaluator, version)   # the next version only once this one is live: none skipped
        await _wait_reported(admin, 4)             # versions are taken in order: 0-3 were decided before 4
        reports = await _reports(admin)
    assert [r.policy_version for r in reports] == [0, 2, 4]
    assert evaluator.counters.get("evaluations") == 3 and "eval_errors" not in evaluator.counters
    assert sandbox.counters.get("executions") == 3 * SETTINGS.n_tasks    # every held-out task graded there, once
    assert evaluator.last_evaluated == 4 and evaluator.sync.held_version == 4
    for report in reports:
        _check_report(report)
    assert evaluator.gauges["pass_at_1"] == reports[-1].pass_at_1


async def test_an_evaluator_joining_late_evaluates_the_version_it_finds_then_each_new_bucket_once(
        tmp_path: Path) -> None:
    """Started when LATEST is already version 3, the evaluator evaluates 3 (the first version it holds,
    whatever it is), then 4 (the first of the next bucket of every_versions=2), not 5, then 6: "every k-th"
    means the first version held in each new bucket of k versions, not the multiples of k."""
    async with _hub(tmp_path) as hub, _actors(hub, evaluator=False) as (tg, evaluator, sandbox):
        trainer, admin = await hub.bus("trainer"), hub.buses[0]
        torch.manual_seed(1)
        model = Transformer(ModelConfig.tiny()).eval()
        for version in range(4):
            await _upload(trainer, model, version)
        await _wait_latest(admin, 3)
        await tg.start(evaluator.serve)
        await _wait_reported(admin, 3)
        for version in range(4, 7):
            await _upload(trainer, model, version)
            await _wait_held(evaluator, version)
        await _wait_reported(admin, 6)
        reports = await _reports(admin)
    assert [r.policy_version for r in reports] == [3, 4, 6]
    assert evaluator.counters.get("evaluations") == 3 and "eval_errors" not in evaluator.counters
    assert sandbox.counters.get("executions") == 3 * SETTINGS.n_tasks    # every held-out task graded there, once
    for report in reports:
        _check_report(report)


MBPP_HELD_OUT = [
    {"task_id": 1, "text": "Add one.", "code": "def inc(x):\r\n  return x + 1", "test_list": ["assert inc(1) == 2"],
     "test_setup_code": ""},
    {"task_id": 2, "text": "Halve.", "code": "def half(x):\r\n  return x // 2", "test_list": ["assert half(4) == 2"],
     "test_setup_code": ""},
    {"task_id": 3, "text": "Negate.", "code": "def neg(x):\r\n  return -x", "test_list": ["assert neg(1) == -1"],
     "test_setup_code": ""},
]


@pytest.mark.parametrize("source", ["mbpp-file", "humaneval"])
async def test_the_held_out_set_comes_from_the_configured_task_source(tmp_path: Path, source: str) -> None:
    """With `tasks` set to a JSONL file (MBPP layout) or "humaneval", version 0 is evaluated on the first n_tasks
    of that source, each graded in the sandbox; prompts longer than the tiny model's context get an empty
    completion, fail, and stay in n."""
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MBPP_HELD_OUT))
    settings = EvaluatorConfig(every_versions=2, n_tasks=3, seed=1,
                               tasks=str(path) if source == "mbpp-file" else "humaneval")
    async with _hub(tmp_path) as hub, _actors(hub, settings=settings) as (_, evaluator, sandbox):
        trainer, admin = await hub.bus("trainer"), hub.buses[0]
        torch.manual_seed(0)
        await _upload(trainer, Transformer(ModelConfig.tiny()).eval(), 0)
        await _wait_reported(admin, 0)
        (report,) = await _reports(admin)
    expected = ["mbpp-1", "mbpp-2", "mbpp-3"] if source == "mbpp-file" else ["HumanEval/0", "HumanEval/1",
                                                                             "HumanEval/2"]
    assert [t.task_id for t in evaluator.tasks] == expected
    assert report.n == 3 and sandbox.counters.get("executions") == 3
    _check_report(report)
    if source == "humaneval":       # 331+ bytes of prompt and 16 new tokens do not fit 256
        assert evaluator.gauges["prompts_too_long"] == 3.0 and report.pass_at_1 == 0.0
    else:
        assert "prompts_too_long" not in evaluator.gauges


async def _collect(bus: Bus, subject: str, into: list[Heartbeat], busy: anyio.Event, last: anyio.Event) -> None:
    """Append every heartbeat on `subject`; set `busy` at the first busy one, `last` at a stopped or failed one."""
    async for hb in bus.follow(subject, Heartbeat):
        into.append(hb)
        if hb.state == "busy":
            busy.set()
        if hb.state in ("stopped", "failed"):
            last.set()


async def test_a_drain_cancels_an_evaluation_in_progress(tmp_path: Path) -> None:
    """An evaluator process scoring a held-out set far too large to finish within a drain bound (2000 tasks
    of 48 greedy tokens: about a minute of decoding on 2 cores) is stopped the way `rlbus up` stops actors
    (SIGTERM, then SIGKILL once the launcher's drain timeout has passed) while its heartbeats say busy: it
    exits by itself (exit code 0, not killed past the timeout), its last heartbeat says stopped with the
    evaluation counted as cancelled, and nothing of the half-scored version was graded or reported."""
    settings = {"every_versions": 2, "n_tasks": 2000, "seed": 1}
    launch = {"max_tokens": 48, "batch_size": 4}
    actor_id = "hub-evaluator-0"
    beats: list[Heartbeat] = []
    async with _hub(tmp_path) as hub, _actors(hub, evaluator=False) as (_, _unused, sandbox):
        trainer, admin = await hub.bus("trainer"), hub.buses[0]
        torch.manual_seed(2)
        await _upload(trainer, Transformer(ModelConfig.tiny()).eval(), 0)
        spec = ProcessSpec(actor_id=actor_id, kind="evaluator", region="hub", args=(
            "--kind", "evaluator", "--run", hub.run, "--region", "hub", "--id", actor_id, "--domain", "hub",
            "--role", "evaluator", "--url", hub.rs.url("hub"),
            "--credentials", str(hub.rs.base_dir / CREDENTIALS_NAME), "--settings", json.dumps(settings),
            "--launch", json.dumps(launch), "--heartbeat-s", "0.3", "--drain-s", "2"))
        supervisor = LocalSupervisor([spec], policy=RestartPolicy(max_restarts=0), log_dir=tmp_path / "logs")
        busy, last = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, admin, admin.subjects.health("hub", "evaluator", actor_id), beats, busy, last)
            async with anyio.create_task_group() as launched:
                await launched.start(supervisor.run)
                with anyio.fail_after(120):          # hang guard only
                    await busy.wait()
                launched.cancel_scope.cancel()       # the supervisor stops it: SIGTERM, bounded drain, SIGKILL
            with anyio.move_on_after(5):             # the last heartbeat is on its way
                await last.wait()
            tg.cancel_scope.cancel()
        reports = await _reports(admin)
    process = supervisor.actors[actor_id].process
    assert process is not None and process.returncode == 0   # it drained; SIGKILL would read -9
    assert beats[-1].state == "stopped"
    assert beats[-1].counters.get("evaluations_cancelled") == 1 and "evaluations" not in beats[-1].counters
    assert reports == [] and sandbox.counters.get("executions", 0) == 0
