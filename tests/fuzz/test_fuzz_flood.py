"""Bounded resources: a flood of 5,000 rollouts at a trainer process and of 5,000 tasks at a generator
process. Neither holds more than its bound in memory (the trainer's `buffered` gauge ≤ its consumer's
`max_ack_pending`; the generator's unacked tasks ≤ `concurrent_tasks`), the rest waits in JetStream, the
process's RSS plateaus (the second half of the flood never above the first half's peak plus a margin), and
the actor keeps making progress — the trainer checkpoints early enough that its held rollouts never wedge
the consumer, though its regular checkpoint interval is far away."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from helpers import new_run
from nats.aio.client import Client as NATS

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.checkpointer import Checkpointer
from rlbus.actors.common.config import CheckpointerConfig, CheckpointerLaunch
from rlbus.actors.common.feed import verifier_for
from rlbus.actors.sandbox.supervisor import SandboxConfig, SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import Heartbeat, Rollout, Task, TensorBlob
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.messages.subjects import Subjects
from rlbus.model.tasks.builtin import make_task
from rlbus.model.training.pretrain import PretrainConfig, pretrain
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

pytestmark = pytest.mark.anyio
HUB = "hub"
FLOOD = 5000
BOUND = 256
"""The trainer consumer's max_ack_pending in these tests."""
WARM_UP = 200
WARM_UP_TASKS = 3
"""Rollouts trained before the trainer's RSS is sampled (its first steps and checkpoint allocate for good)."""
MARGIN_KB = 40 * 1024
"""RSS the second half of a flood may add over the first half's peak (allocator noise; an unbounded buffer
of these messages would add hundreds of MB)."""
LIMITS = ActorLimits(heartbeat_interval_s=0.25, drain_timeout_s=5.0)


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


@contextmanager
def actor_process(rs: RegionSet, run: str, kind: str, settings: dict[str, Any], log: Path,
                  launch: dict[str, Any] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """One actor as its own process (`python -m rlbus.ops.actor`), stopped by its PID afterwards."""
    cmd = [sys.executable, "-m", "rlbus.ops.actor", "--kind", kind, "--run", run, "--region", HUB,
           "--id", f"{HUB}-{kind}-0", "--url", rs.url(HUB), "--domain", HUB,
           "--credentials", str(rs.base_dir / CREDENTIALS_NAME), "--settings", json.dumps(settings),
           "--heartbeat-s", "0.25", "--drain-s", "5", *(["--launch", json.dumps(launch)] if launch else [])]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "RLBUS_TORCH_THREADS": "1"})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Probe:
    """Samples an actor process's RSS and its heartbeats until `done()`; the flood runs meanwhile."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss: list[int] = []
        self.beats: list[Heartbeat] = []

    async def heartbeats(self, nc: NATS, subject: str) -> None:
        sub = await nc.subscribe(subject)
        try:
            async for msg in sub.messages:
                self.beats.append(codec.decode_as(msg.data, msg.headers, Heartbeat))
        finally:
            await sub.unsubscribe()

    async def sample(self, done: Callable[[], Any], what: str, timeout_s: float = 240) -> None:
        try:
            with anyio.fail_after(timeout_s):
                while not await done():
                    self.rss.append(rss_kb(self.pid))
                    await anyio.sleep(0.2)
        except TimeoutError:
            raise AssertionError(f"hang guard: {what} within {timeout_s}s; last heartbeat "
                                 f"{self.beats[-1] if self.beats else None}") from None

    def assert_plateau(self) -> None:
        half = len(self.rss) // 2
        assert half >= 5, f"too few samples: {self.rss}"
        first, second = max(self.rss[:half]), max(self.rss[half:])
        assert second <= first + MARGIN_KB, f"RSS grew from {first} kB to {second} kB: {self.rss[::5]}"


@pytest.fixture
def run() -> str:
    return new_run()


@pytest.fixture
def hub(tmp_path: Path, run: str) -> Iterator[RegionSet]:
    rs = RegionSet.start(tmp_path / "nats", [HUB], HUB, run=run)
    try:
        yield rs
    finally:
        rs.stop()


async def _setup(rs: RegionSet, run: str) -> NATS:
    admin = await nats.connect(**rs.connect_options(HUB, "admin"))
    settings = dataclasses.replace(StreamSettings.tiny(), trainer_max_ack_pending=BOUND, storage="memory")
    await provision_run(admin, Subjects(run), hub=HUB, domains={HUB: HUB}, settings=settings)
    return admin


async def _role_bus(rs: RegionSet, run: str, role: str) -> Bus:
    cred = rs.credentials(role)
    return await Bus.connect(rs.url(HUB), run=run, identity=Identity(f"{HUB}-{role}-0", role, HUB), domain=HUB,
                             options=ConnectOptions(user=cred.user, password=cred.password))


def _rollouts(n: int) -> list[Rollout]:
    """Groups of 2 (one in ten left incomplete: its second member never comes), each rollout carrying an
    80 kB routing record (zeros: a few hundred bytes on the wire, 80 kB once decoded); a dense trainer
    ignores routing, so the flood costs memory, not compute."""
    out: list[Rollout] = []
    routing = TensorBlob(dtype="int64", shape=(5, 1000, 2), data=bytes(80_000))
    task = 0
    while len(out) < n:
        members = 1 if task % 10 == 9 else 2
        for g in range(min(members, n - len(out))):
            out.append(Rollout(
                rollout_id=f"fl-{task}-{g}", task_id=f"fl-{task}", group_index=g, group_size=2,
                prompt_tokens=TensorBlob.of([1, 2, 3], "int32"), completion_tokens=TensorBlob.of([4 + g, 5], "int32"),
                behaviour_logprobs=TensorBlob.of([-1.0, -1.5], "float32"), policy_versions=TensorBlob.of([0, 0], "int32"),
                loss_mask=TensorBlob.of([1, 1], "uint8"), routing=routing, reward=float(g), region=HUB))
        task += 1
    return out


async def test_rollout_flood_keeps_the_trainer_bounded(hub: RegionSet, run: str, tmp_path: Path) -> None:
    """5,000 rollouts at once (after a warm-up of 200): the trainer never holds more than max_ack_pending
    (256), trains and acks through 1,280 of them (5 times its bound) with early checkpoints (its interval is
    1000 steps), and its RSS plateaus."""
    s = Subjects(run)
    admin = await _setup(hub, run)
    ckpt = Checkpointer(ActorId(run, HUB, "checkpointer", "hub-checkpointer-0"), await _role_bus(hub, run, "checkpointer"),
                        CheckpointerConfig(keep=2), LIMITS, CheckpointerLaunch(drain_linger_s=0.0))
    settings = {"batch_rollouts": 32, "staleness_versions": 1000, "lr": 1e-4}
    launch = {"checkpoint_interval": 1000, "resume_wait_s": 5.0, "mark_wait_s": 2.0}
    js = admin.jetstream()

    async def acked() -> int:
        info = await js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))
        return int(info.delivered.stream_seq or 0) - int(info.num_ack_pending or 0)

    try:
        with actor_process(hub, run, "trainer", settings, tmp_path / "trainer.log", launch) as proc:
            probe = Probe(proc.pid)
            async with anyio.create_task_group() as tg:
                await tg.start(ckpt.serve)
                tg.start_soon(probe.heartbeats, admin, s.health(HUB, "trainer", "hub-trainer-0"))
                gen = await _role_bus(hub, run, "generator")
                rollouts = _rollouts(FLOOD + WARM_UP)
                await gen.publish_batch([(s.rollouts(HUB), r, r.rollout_id) for r in rollouts[:WARM_UP]])
                await probe.sample(lambda: _at_least(acked, 128), "warm-up: steps and an early checkpoint", 180)
                probe.rss.clear()                 # measure from here: torch's first steps allocate for good
                published = anyio.Event()
                tg.start_soon(_publish, gen, [(s.rollouts(HUB), r, r.rollout_id) for r in rollouts[WARM_UP:]], published)
                await probe.sample(lambda: _both(published, _at_least(acked, 128 + 5 * BOUND), len(probe.rss) >= 30),
                                   "5x the bound acked and 30 samples")
                stored = (await js.stream_info(s.hub_rollouts_stream())).state.messages
                tg.cancel_scope.cancel()
            await gen.close()
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        await ckpt.bus.close()
        await admin.close()
    buffered = [b.gauges.get("buffered", 0.0) for b in probe.beats]
    assert max(buffered) <= BOUND and {b.gauges.get("buffer_bound") for b in probe.beats if b.state == "busy"} <= {BOUND}
    assert max(b.counters.get("state_uploads", 0) for b in probe.beats) >= 2    # early checkpoints, not interval's
    assert stored == FLOOD + WARM_UP
    probe.assert_plateau()


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    """A tiny policy pretrained for one step, on the main thread (outside the event loop): its first AdamW
    imports torch._dynamo, which parses Python, and no AST may be built off the main thread (tests/conftest.py)."""
    out = tmp_path / "pretrained"
    pretrain(PretrainConfig.preset("tiny", eval_n=1, max_new_tokens=4), 1, 0, out, 1)
    return out


async def test_task_flood_keeps_the_generator_bounded(hub: RegionSet, run: str, tmp_path: Path,
                                                      pretrained: Path) -> None:
    """5,000 tasks of ~10 kB at once (after 3 warm-up tasks): the generator holds one at a time (unacked ≤
    concurrent_tasks = 1), finishes tasks meanwhile, and its RSS plateaus while the backlog waits in TASKS."""
    s = Subjects(run)
    admin = await _setup(hub, run)
    out = pretrained
    sandbox = SandboxSupervisor(ActorId(run, HUB, "sandbox", "hub-sandbox-0"), await _role_bus(hub, run, "sandbox"),
                                SandboxConfig(pool_size=1, concurrency=1, wall_seconds=5.0), LIMITS)
    settings = {"weights": f"local:{out / 'pretrain.pt'}", "group_size": 2, "max_tokens": 8,
                "partial_every_tokens": 8, "max_attempts": 1}
    js = admin.jetstream()
    rng = random.Random(0)
    tasks = []
    for i in range(FLOOD + WARM_UP_TASKS):
        task = make_task(rng, f"fl-{i}")
        tasks.append(Task(task_id=task.task_id, prompt=task.prompt + " " * 10_000, verifier=verifier_for(task),
                          group_size=2, region=HUB))
    unacked: list[int] = []

    async def tasks_done(n: int) -> bool:
        info = await js.consumer_info(s.tasks_stream(HUB), s.durable("generator", HUB))
        unacked.append(int(info.num_ack_pending or 0))
        return max((b.counters.get("tasks", 0) for b in probe.beats), default=0) >= n

    try:
        with actor_process(hub, run, "generator", settings, tmp_path / "generator.log", {"torch_threads": 1}) as proc:
            probe = Probe(proc.pid)
            async with anyio.create_task_group() as tg:
                await tg.start(sandbox.serve)
                tg.start_soon(probe.heartbeats, admin, s.health(HUB, "generator", "hub-generator-0"))
                feeder = await _role_bus(hub, run, "feeder")
                await feeder.publish_batch([(s.tasks(HUB), t, t.task_id) for t in tasks[:WARM_UP_TASKS]])
                await probe.sample(lambda: tasks_done(WARM_UP_TASKS), "warm-up tasks done", 180)
                probe.rss.clear()                 # measure from here: the first generations allocate for good
                published = anyio.Event()
                tg.start_soon(_publish, feeder, [(s.tasks(HUB), t, t.task_id) for t in tasks[WARM_UP_TASKS:]],
                              published)
                await probe.sample(lambda: _both(published, tasks_done(WARM_UP_TASKS + 8), len(probe.rss) >= 30),
                                   "the flood published, 8 more tasks done and 30 samples")
                backlog = (await js.stream_info(s.tasks_stream(HUB))).state.messages
                tg.cancel_scope.cancel()
            await feeder.close()
            assert proc.poll() is None, (tmp_path / "generator.log").read_text()[-3000:]
    finally:
        await sandbox.bus.close()
        await admin.close()
    assert max(unacked) <= 1
    assert backlog >= FLOOD // 2                    # most of the flood waits in JetStream, not in the generator
    probe.assert_plateau()


async def _publish(bus: Bus, items: list[tuple[str, Any, str | None]], done: anyio.Event) -> None:
    await bus.publish_batch(items)
    done.set()


async def _both(event: anyio.Event, condition: Any, enough: bool = True) -> bool:
    return bool(await condition) and event.is_set() and enough


async def _true(value: bool) -> bool:
    return value


async def _at_least(count: Callable[[], Any], n: int) -> bool:
    return bool(await count() >= n)

