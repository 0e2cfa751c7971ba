"""10,000 hostile messages on every subject an actor consumes, against the real actors of a small RL run
served in this process on a real embedded hub: no actor dies or stalls, and every bad message is accounted
for — a dead letter with its reason per stream (counts equal), or, for what only the model can judge, a
drop with a reason in the trainer's next TrainStep. Afterwards the run still works end to end: a valid task
is generated, graded, trained on, published and staged, and the step is checkpointed."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import structlog
from helpers import eventually, hosted, new_run
from helpers.fuzz_payloads import Payload, Target, build, recipes, valid
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlbus.actors.base import Actor, ActorId, ActorLimits, State
from rlbus.actors.checkpointer import Checkpointer
from rlbus.actors.common.config import (
    CheckpointerConfig,
    CheckpointerLaunch,
    PublisherConfig,
    PublisherLaunch,
)
from rlbus.actors.common.ledger import read_all
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.common.weight_sync import WeightSync
from rlbus.actors.generator.actor import Generator, GeneratorConfig
from rlbus.actors.publisher import Publisher
from rlbus.actors.sandbox.supervisor import SandboxConfig, SandboxSupervisor
from rlbus.actors.trainer.actor import Trainer
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
from rlbus.messages import codec
from rlbus.messages.bus import REASON_HEADER, Bus, ConnectOptions, Identity
from rlbus.messages.schemas import CheckpointMark, Heartbeat, TrainStep
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.messages.subjects import Subjects
from rlbus.model.policies.builtin import fresh_config
from rlbus.model.policies.transformer import Transformer
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
HUB = "hub"
LIMITS = ActorLimits(heartbeat_interval_s=0.25, drain_timeout_s=5.0)
COUNTS: dict[Target, int] = {"tasks": 2000, "rollouts": 2500, "version_ready": 700, "state_upload": 700,
                             "checkpoints": 1300, "latest": 1300, "sandbox": 1500}
"""Hostile messages per target: 10,000 in all."""


def _payloads() -> dict[Target, list[Payload]]:
    """Every target's payloads, from one hypothesis draw of 10,000 recipes (fixed seed)."""
    drawn = recipes(sum(COUNTS.values()))
    out: dict[Target, list[Payload]] = {}
    start = 0
    for target, n in COUNTS.items():
        out[target] = [build(target, recipe, start + i) for i, recipe in enumerate(drawn[start:start + n])]
        start += n
    return out


async def _role_bus(rs: RegionSet, run: str, role: str, actor_id: str) -> Bus:
    cred = rs.credentials(role)
    return await Bus.connect(rs.url(HUB), run=run, identity=Identity(actor_id, role, HUB), domain=HUB,
                             options=ConnectOptions(user=cred.user, password=cred.password))


async def _pipelined(nc: NATS, subject: str, items: list[Payload], window: int = 256) -> None:
    """JetStream publishes `window` at a time, raw bytes and headers as given; every one must be stored."""
    js = nc.jetstream(timeout=30)
    pending = []
    for p in items:
        pending.append(await js.publish_async(subject, p.data, headers=p.headers))
        if len(pending) >= window:
            for future in pending:
                await future
            pending = []
    for future in pending:
        await future


async def _dead_letters(js: Any, s: Subjects) -> dict[str, int]:
    """DLQ messages per source (the last token of `dlq.<source>`)."""
    info = await js.stream_info(s.dead_letter_stream(), subjects_filter=s.all_dead_letters())
    return {subject.rsplit(".", 1)[1]: n for subject, n in (info.state.subjects or {}).items()}


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 120,
                 poll_s: float = 0.1) -> None:
    await eventually(check, what=what, timeout_s=timeout_s, poll_s=poll_s)


async def test_ten_thousand_hostile_messages_are_dead_lettered_and_every_actor_lives(tmp_path: Path) -> None:
    """10k bad messages over TASKS, ROLLOUTS, STATE (versions, uploads), CHECKPOINTS, LATEST and sandbox
    requests: per stream, dead letters (each with a reason) == bad messages sent; model-judged rollouts are
    TrainStep drops with reasons; heartbeats never stop; then a valid task goes all the way through."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))  # 10k warnings
    run = new_run()
    s = Subjects(run)
    payloads = _payloads()
    assert sum(map(len, payloads.values())) == 10_000
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(tmp_path / "nats", [HUB], HUB, run=run))
    async with AsyncExitStack() as stack:
        stack.callback(rs.stop)
        admin = await nats.connect(**rs.connect_options(HUB, "admin"))
        stack.push_async_callback(admin.close)
        settings = dataclasses.replace(StreamSettings.tiny(), storage="memory")
        await provision_run(admin, s, hub=HUB, domains={HUB: HUB}, settings=settings)
        buses: list[Bus] = []

        async def bus(role: str, actor_id: str) -> Bus:
            buses.append(b := await _role_bus(rs, run, role, actor_id))
            return b

        def ident(kind: str) -> ActorId:
            return ActorId(run, HUB, kind, f"{HUB}-{kind}-0")

        model = Transformer(fresh_config())
        sandbox = SandboxSupervisor(ident("sandbox"), await bus("sandbox", "hub-sandbox-0"),
                                    SandboxConfig(pool_size=1, concurrency=1, wall_seconds=5.0), LIMITS)
        generator = Generator(ident("generator"), await bus("generator", "hub-generator-0"),
                              GeneratorConfig(group_size=2, max_tokens=8, partial_every_tokens=8, max_attempts=1,
                                              sandbox_timeout_s=20.0), LIMITS, weights=LocalWeights(model))
        trainer = Trainer(ident("trainer"), await bus("trainer", "hub-trainer-0"),
                          TrainerConfig(lr=1e-3, batch_rollouts=2, staleness_versions=100), LIMITS,
                          TrainerLaunch(checkpoint_interval=1, resume_wait_s=5.0, mark_wait_s=2.0))
        checkpointer = Checkpointer(ident("checkpointer"), await bus("checkpointer", "hub-checkpointer-0"),
                                    CheckpointerConfig(keep=2), LIMITS,
                                    CheckpointerLaunch(state_dir=str(tmp_path / "state"), drain_linger_s=0.0))
        publisher = Publisher(ident("publisher"), await bus("publisher", "hub-publisher-0"),
                              PublisherConfig(), LIMITS,
                              PublisherLaunch(regions=[HUB], hub=HUB, download_attempts=1, retry_initial_s=0.05,
                                              retry_max_s=0.2, region_wait_s=1.0))
        actors: list[Actor] = [sandbox, generator, trainer, checkpointer, publisher]
        for b in buses:
            stack.push_async_callback(b.close)

        beats: Counter[str] = Counter()
        states: dict[str, str] = {}
        health = await admin.subscribe(s.all_health())

        async def watch_health() -> None:
            async for msg in health.messages:
                beat = codec.decode_as(msg.data, msg.headers, Heartbeat)
                beats[beat.actor_id] += 1
                states[beat.actor_id] = beat.state

        replies: list[Msg] = []
        inbox = await admin.subscribe(f"_INBOX.fuzz-{run}.*")

        async def collect_replies() -> None:
            async for msg in inbox.messages:
                replies.append(msg)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_health)
            tg.start_soon(collect_replies)
            sync_bus = await bus("generator", "hub-weights-0")
            async with WeightSync.open(sync_bus, HUB) as sync, hosted(*actors):
                with anyio.fail_after(60):
                    await sync.wait_for_staged(0)            # the trainer's version 0, published and staged
                before = Counter(beats)

                async def send_latest(items: list[Payload]) -> None:
                    """KV keeps one revision: each bad manifest waits until the watcher refused it."""
                    subject = f"$KV.{s.latest_bucket(HUB)}.latest"
                    for p in items:
                        seen = sync.rejected
                        await admin.jetstream().publish(subject, p.data, headers=p.headers)
                        await _until("the weight sync refused a manifest", lambda seen=seen: _gt(sync.rejected, seen), 20,
                                     poll_s=0.002)

                async def send_sandbox(items: list[Payload]) -> None:
                    """Core request/reply: at most 64 unanswered (a supervisor reads a bounded queue; past it
                    NATS drops requests, as it should, and requesters retry)."""
                    for i, p in enumerate(items):
                        await _until("sandbox replies keep up", lambda i=i: _true(i - len(replies) < 64), 30,
                                     poll_s=0.01)
                        await admin.publish(s.sandbox(HUB), p.data, reply=f"_INBOX.fuzz-{run}.{i}", headers=p.headers)
                    await admin.flush()

                async with anyio.create_task_group() as senders:
                    senders.start_soon(_pipelined, admin, s.tasks(HUB), payloads["tasks"])
                    senders.start_soon(_pipelined, admin, s.rollouts(HUB), payloads["rollouts"])
                    senders.start_soon(_pipelined, admin, s.version_ready(), payloads["version_ready"])
                    senders.start_soon(_pipelined, admin, s.state_uploads(), payloads["state_upload"])
                    senders.start_soon(_pipelined, admin, s.checkpoints(), payloads["checkpoints"])
                    senders.start_soon(send_latest, payloads["latest"])
                    senders.start_soon(send_sandbox, payloads["sandbox"])

                def dlq(target: Target) -> int:
                    return sum(p.expect == "dlq" for p in payloads[target])

                expected = {s.tasks_stream(HUB): dlq("tasks"), s.hub_rollouts_stream(): dlq("rollouts"),
                            s.state_stream(): dlq("version_ready") + dlq("state_upload"),
                            s.checkpoints_stream(): dlq("checkpoints"), s.latest_bucket(HUB): dlq("latest"),
                            "sandbox": dlq("sandbox")}
                js = admin.jetstream()

                async def all_dead_lettered() -> bool:
                    counts = await _dead_letters(js, s)
                    return all(counts.get(k, 0) >= n for k, n in expected.items())

                await _until("every bad message dead-lettered", all_dead_lettered)
                await _until("every bad sandbox request answered",
                             lambda: _true(len(replies) >= len(payloads["sandbox"])), 30)
                during = Counter(beats) - before
                live = {a.ident.actor_id: a.state for a in actors}
                reported = {actor_id: states.get(actor_id) for actor_id in live}

                # the run still works: a valid task → rollouts → a step that also records the model's drops
                task = valid("tasks", "after-fuzz")
                await admin.jetstream().publish(s.tasks(HUB), codec.encode(task)[0])
                await _until("a step after the fuzz", lambda: _steps(js, s, 1), 120)
                await _until("its checkpoint mark", lambda: _marks(js, s, 1), 60)
                with anyio.fail_after(60):
                    await sync.wait_for_staged(1)

            tg.cancel_scope.cancel()

        counts = await _dead_letters(js, s)
        steps = await read_all(js, s.trainlog_stream(), s.trainlog(), TrainStep)
        reasons = await _dlq_reasons(js, s)
        events = await _event_kinds(js, s)

    assert counts == expected                                # exactly one dead letter per bad message
    assert reasons and all(reasons)                          # each with its reason
    assert events["dead_letter"] == sum(expected.values())
    assert len(replies) == len(payloads["sandbox"]) and all(b"bad sandbox request" in r.data for r in replies)
    assert all(state in (State.READY, State.BUSY) for state in live.values()), live
    assert all(during[actor_id] >= 4 for actor_id in live), during   # heartbeats went on throughout
    assert all(state in ("ready", "busy") for state in reported.values()), reported
    drops = [p for p in payloads["rollouts"] if p.expect == "drop"]
    dropped = {d.rollout_id: d.reason for step in steps for d in step.dropped}
    assert len(dropped) == len(drops) and drops
    assert Counter(reason.split(":")[0] for reason in dropped.values()) == {
        "too_long": sum(p.category == "absurd_huge_tokens" for p in drops),
        "invalid": sum(p.category == "absurd_vocab" for p in drops)}
    assert steps[0].rollout_ids == ["fz-after-fuzz-0", "fz-after-fuzz-1"] and len(steps) == 1
    assert trainer.counters.get("dropped") == len(drops)


def _gt(a: int, b: int) -> Awaitable[bool]:
    return _true(a > b)


async def _true(value: bool) -> bool:
    return value


async def _steps(js: Any, s: Subjects, n: int) -> bool:
    return len(await read_all(js, s.trainlog_stream(), s.trainlog(), TrainStep)) >= n


async def _marks(js: Any, s: Subjects, n: int) -> bool:
    marks = await read_all(js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
    return sum(1 for m in marks if m.step >= 1) >= n


async def _dlq_reasons(js: Any, s: Subjects) -> list[str]:
    """The reason header of every dead letter (one ephemeral consumer, read in batches)."""
    out: list[str] = []
    total = (await js.stream_info(s.dead_letter_stream())).state.messages
    psub = await js.pull_subscribe(s.all_dead_letters(), stream=s.dead_letter_stream(),
                                   config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                                         inactive_threshold=10.0))
    try:
        while len(out) < total:
            for msg in await psub.fetch(512, timeout=5):
                out.append((msg.headers or {}).get(REASON_HEADER, ""))
    finally:
        await psub.unsubscribe()
    return out


async def _event_kinds(js: Any, s: Subjects) -> Counter[str]:
    from rlbus.messages.schemas import Event

    return Counter(e.event for e in await read_all(js, s.events_stream(), s.all_events(), Event))
