"""A repository task file as the feeder's source (`[feeder] tasks = "PATH"`): its tasks are walked in file order,
each with the repository verifier that rebuilds it; the feeder serves them through real NATS to a generator whose
scripted reference policy solves each in a real sandbox session (reward 1); `rlbus validate` accepts the file and
refuses a bad one in one line naming the file, the line and the key."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import eventually, hosted, new_run

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import FeederConfig, FeederLaunch
from rlbus.actors.common.errors import TaskError
from rlbus.actors.common.feed import task_sequence, task_source, verifier_for
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.feeder import Feeder
from rlbus.actors.generator.actor import Generator, GeneratorConfig
from rlbus.actors.generator.config import AgenticSettings
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import available_levels
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Rollout
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import Subjects
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.repo import VERIFIER_KIND, RepoTask
from rlbus.topology.file.load import validate
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=3.0)
BASE = (Path(__file__).resolve().parents[1] / "topology" / "bad" / "levels_with_tasks_file.toml").read_text().split(
    "[feeder]")[0]
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=4.0, wall_seconds=8.0, memory_mb=256,
                        max_processes=16, max_file_mb=1, max_open_files=64, max_output_kb=16, max_sessions=8,
                        workspace_mb=4, max_lease_s=60.0, session_spares=0)
CALC = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a - b\n"}
TESTS = {"tests/test_calc.py": "import unittest\n\nfrom calc.core import add\n\n\nclass Calc(unittest.TestCase):\n"
                               "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"}


def rows() -> list[dict[str, object]]:
    """Two repository tasks: a bug to fix, and a module to add that the hidden tests import."""
    return [{"task_id": "calc-fix", "instruction": "add() subtracts; make it add.", "files": CALC,
             "hidden_tests": TESTS, "solution": {"calc/core.py": "def add(a, b):\n    return a + b\n"}},
            {"task_id": "calc-new", "instruction": "Write calc/core.py with add(a, b) returning the sum.",
             "files": {"calc/__init__.py": ""}, "hidden_tests": TESTS, "level": 2, "tags": ["new-module"],
             "solution": {"calc/core.py": "def add(a, b):\n    return a + b\n"}}]


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_repository_task_file_is_walked_in_file_order_with_repository_verifiers(tmp_path: Path) -> None:
    """The sequence of one epoch is the file's tasks in order and ends with it; each verifier rebuilds its task; the
    saved position names the file; a bad file is refused naming its line and key."""
    path = write(tmp_path / "calc.jsonl", rows())
    config = FeederConfig(tasks=str(path), epochs=1)
    sequence = task_sequence(config, FeederLaunch())
    tasks = [sequence.get(i) for i in range(2)]
    assert sequence.end == 2 and [t.task_id for t in tasks] == ["calc-fix", "calc-new"]
    assert all(isinstance(t, RepoTask) for t in tasks)
    for task in tasks:
        assert task.reference and RepoTask.from_spec(verifier_for(task)).reference == ()
        spec = verifier_for(task, with_reference=True)
        assert spec["kind"] == VERIFIER_KIND
        assert RepoTask.from_spec(spec) == msgspec.structs.replace(task, solution={})
    assert task_source(config) == f"{path}:0"
    write(path, [rows()[0], {**rows()[1], "files": {"/etc/passwd": ""}}])
    with pytest.raises(TaskError, match=r"calc.jsonl:2: key 'files'"):
        task_sequence(config, FeederLaunch())


def test_validate_accepts_a_repository_task_file_and_refuses_a_bad_one_in_one_line(tmp_path: Path) -> None:
    """A good file validates clean (with a context long enough for repository tasks); a file with a bad row, one
    of functions to write, and a missing file are each one error on feeder.tasks (the same file as the evaluator's
    held-out set validates, a bad row there is one error on evaluator.tasks); `rlbus validate` prints the bad row's file, line and key on one line
    and exits non-zero."""
    tasks = write(tmp_path / "calc.jsonl", rows())
    path = tmp_path / "t.toml"
    path.write_text(f'{BASE}[feeder]\ntasks = "{tasks}"\n[pretrain]\nmax_seq_len = 2048\n')
    assert validate(path, local_cores=64)[1] == []
    write(tasks, [rows()[0], {**rows()[1], "timeout_s": -1}])
    topology, problems = validate(path, local_cores=64)
    assert topology is None and [(p.key, p.severity) for p in problems] == [("feeder.tasks", "error")]
    assert f"{tasks}:2: key 'timeout_s'" in problems[0].message
    done = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if "calc.jsonl:2: key 'timeout_s'" in line]
    assert done.returncode != 0 and len(said) == 1 and "feeder.tasks" in said[0], done.stdout + done.stderr
    write(tasks, [{"task_id": "f", "prompt": "def f(x):\n", "entry_point": "f", "tests": [{"args": "(1,)",
                                                                                          "expected": "1"}]}])
    (problem,) = validate(path, local_cores=64)[1]
    assert problem.key == "feeder.tasks" and "feeder.tasks_file" in problem.message
    path.write_text(f'{BASE}[feeder]\ntasks = "{tmp_path / "nothing.jsonl"}"\n[pretrain]\nmax_seq_len = 2048\n')
    (problem,) = validate(path, local_cores=64)[1]
    assert problem.key == "feeder.tasks" and "no such file" in problem.message
    write(tasks, rows())
    path.write_text(f'{BASE}[evaluator]\ntasks = "{tasks}"\n')
    assert validate(path, local_cores=64)[1] == []
    write(tasks, [{**rows()[0], "hidden_tests": {"notes.txt": ""}}])
    (problem,) = validate(path, local_cores=64)[1]
    assert problem.key == "evaluator.tasks" and f"{tasks}:1: key 'hidden_tests'" in problem.message


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[RegionSet, str]]:
    run = new_run()
    rs = RegionSet.start(tmp_path / "regions", ["hub"], "hub", run=run)
    try:
        yield rs, run
    finally:
        rs.stop()


async def connect(rs: RegionSet, run: str, role: str) -> Bus:
    cred = rs.credentials(role)
    return await Bus.connect(rs.url("hub"), run=run, domain="hub",
                             options=ConnectOptions(user=cred.user, password=cred.password))


@asynccontextmanager
async def served(rs: RegionSet, run: str, tasks: Path, model: Transformer) -> AsyncIterator[Generator]:
    """A sandbox supervisor, a scripted-reference generator and a feeder of `tasks`, all in the hub."""
    buses = [await connect(rs, run, role) for role in ("sandbox", "generator", "feeder")]
    sandbox = SandboxSupervisor(ActorId(run, "hub", "sandbox", "sb"), buses[0], SANDBOX, FAST,
                                SandboxLaunch(isolation=available_levels()[0]))  # type: ignore[arg-type]
    config = GeneratorConfig(group_size=2, script="reference", max_tokens=600, concurrent_tasks=2,
                             sandbox_timeout_s=20.0, agentic=AgenticSettings(max_turns=4))
    generator = Generator(ActorId(run, "hub", "generator", "g1"), buses[1], config, FAST,
                          weights=LocalWeights(model, version=1))
    feeder = Feeder(ActorId(run, "hub", "feeder", "f1"), buses[2],
                    FeederConfig(tasks=str(tasks), backlog_per_region=4, poll_interval_s=0.2, epochs=1),
                    FAST, FeederLaunch(regions=["hub"], group_size=2))
    async with hosted(sandbox, generator, feeder, close=buses):
        yield generator


async def test_the_feeder_serves_a_repository_task_file_to_a_generator_that_solves_it(
        hub: tuple[RegionSet, str], tmp_path: Path) -> None:
    """Every task of the file reaches the generator as an agentic episode; the reference script earns reward 1 on
    each, with one turn per reference edit plus the submit; the feeder stops at the file's end."""
    rs, run = hub
    admin = await connect(rs, run, "admin")
    try:
        await provision_run(admin.nc, Subjects(run), hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        await wait_routable(admin.nc, admin.subjects.tasks("hub"))
        torch.manual_seed(0)
        model = Transformer(ModelConfig.tiny(max_seq_len=2048)).eval()  # type: ignore[arg-type]
        path = write(tmp_path / "calc.jsonl", rows())
        async with served(rs, run, path, model) as generator:
            await eventually(lambda: generator.counters.get("tasks", 0), lambda n: n == 2, timeout_s=180,
                             what="both tasks of the file rolled out")
        stream = admin.subjects.rollouts_stream("hub")
        info = await admin.js.stream_info(stream)
        out: list[Rollout] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await admin.js.get_msg(stream, seq)
            out.append(codec.decode_as(msg.data, msg.headers, Rollout))
    finally:
        await admin.close()
    assert sorted((r.task_id, r.reward, r.verdict.status) for r in out) == [
        ("calc-fix", 1.0, "ok"), ("calc-fix", 1.0, "ok"), ("calc-new", 1.0, "ok"), ("calc-new", 1.0, "ok")]
    assert all(r.timings["turns"] == 2 for r in out)        # one write_file, then submit
    assert generator.counters.get("sandbox_errors", 0) == 0


def test_the_evaluators_repository_tasks_are_never_fed(tmp_path: Path) -> None:
    """With a repository task file as the evaluator's held-out set, the feeder's file sequence skips every task of
    it (by prompt hash) in every epoch, and its saved position says so."""
    train = write(tmp_path / "train.jsonl", rows())
    held = write(tmp_path / "held.jsonl", rows()[:1])
    config, launch = FeederConfig(tasks=str(train)), FeederLaunch(eval_tasks=str(held))
    sequence = task_sequence(config, launch)
    assert sequence.end is None and [sequence.get(i).task_id for i in range(3)] == ["calc-new"] * 3
    assert task_source(config, launch) == f"{train}:0:excluding={held}"
