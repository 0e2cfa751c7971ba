"""A trainer process lives through a SIGKILL and restart of the hub's nats-server: its mark watcher follows
CHECKPOINTS again after a logged, bounded backoff (`trainer_mark_watch_retry`), so rollouts published after
the restart are trained, marked and acked — by the same trainer process (same PID, no restart)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import msgspec
import nats.errors
import pytest
import torch
from helpers import new_run
from helpers.rl_bus import HUB, connect
from helpers.rollouts import sample_rollouts

from rlbus.actors.trainer.core import build_core
from rlbus.messages.bus import Bus
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.training.pretrain import CHECKPOINT_NAME
from rlbus.topology.backends.launch import PRETRAINED_DIR, Launch
from rlbus.topology.file.schema import Topology

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]
TRAINER = "hub-trainer-0"


def _topology(state: Path) -> Topology:
    """Only the trainer side in one hub region (the test plays the generator): 4 rollouts a step, a checkpoint
    every step, restarts allowed (so a crash would show as a new PID, not a hung test)."""
    return msgspec.convert({
        "run": new_run(), "state_dir": str(state),
        "regions": [{"name": HUB, "role": "hub", "actors": [{"kind": "trainer"}, {"kind": "checkpointer"}]}],
        "trainer": {"lr": 1e-3, "batch_rollouts": 4, "staleness_versions": 8},
        "checkpoint": {"interval_steps": 1, "keep": 2},
        "restart": {"max_restarts": 3, "backoff_initial_s": 0.2, "backoff_max_s": 1.0},
    }, type=Topology)


def _pretrained(state: Path) -> torch.nn.Module:
    """The fresh tiny model saved where `rlbus up` would pretrain it, so the trainer process loads it."""
    model = build_core("", lr=1e-3, seed=0).model
    folder = state / PRETRAINED_DIR
    folder.mkdir(parents=True)
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": ByteTokenizer().info(), "meta": {}}, folder / CHECKPOINT_NAME)
    return model


async def _acked_through(admin: Bus, seq: int, timeout_s: float = 90) -> None:
    """Wait until the trainer's durable has acked every rollout up to stream sequence `seq` (hang guard)."""
    s = admin.subjects
    with anyio.fail_after(timeout_s):
        while True:
            try:
                info = await admin.js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))
                if info.ack_floor.stream_seq >= seq and not info.num_ack_pending:
                    return
            except (nats.errors.Error, TimeoutError):
                pass                                   # the hub is coming back
            await anyio.sleep(0.3)


def _stored_ack_floor(store: Path, stream: str, durable: str) -> int:
    """The ack floor (a stream sequence) nats-server last wrote to its store for a durable: its `o.dat` is a magic
    byte (22), a version, then uvarints (ack floor consumer and stream sequence, delivered, ...); 0 before the
    first write."""
    try:
        data = (store / "jetstream" / "$G" / "streams" / stream / "obs" / durable / "o.dat").read_bytes()
    except FileNotFoundError:
        return 0
    if len(data) < 2 or data[0] != 22:
        return 0
    values, value, shift = [], 0, 0
    for byte in data[2:]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            values.append(value)
            value, shift = 0, 0
            if len(values) == 2:
                return values[1]
    return 0


async def _settled(admin: Bus, store: Path, timeout_s: float = 90) -> None:
    """Wait until the checkpointer has acked every StateUploaded it was given, then until the server wrote the
    trainer's and the checkpointer's acks to its store (its flusher does, milliseconds after an ack; read back from
    the store): the hub is killed at a quiet moment. An ack the SIGKILL catches in memory is redelivered only after
    the 60 s ack wait (and the checkpointer takes one upload at a time), which would test a lost ack, not the
    restart."""
    s = admin.subjects
    with anyio.fail_after(timeout_s):
        while True:
            info = await admin.js.consumer_info(s.state_stream(), s.durable("checkpointer"))
            if info.delivered.stream_seq and info.ack_floor.stream_seq >= info.delivered.stream_seq \
                    and not info.num_ack_pending:
                break
            await anyio.sleep(0.1)
        for stream, durable in ((s.state_stream(), s.durable("checkpointer")),
                                (s.hub_rollouts_stream(), s.durable("trainer"))):
            acked = (await admin.js.consumer_info(stream, durable)).ack_floor.stream_seq
            while _stored_ack_floor(store, stream, durable) < acked:
                await anyio.sleep(0.05)


async def _publish(gen: Bus, rollouts: list, timeout_s: float = 30) -> None:  # type: ignore[type-arg]
    """As a generator: publish the batch, again until the (restarted) hub stores it (deduped by id)."""
    with anyio.fail_after(timeout_s):
        while True:
            try:
                await gen.publish_batch([(gen.subjects.rollouts(HUB), r, r.rollout_id) for r in rollouts])
                return
            except (nats.errors.Error, TimeoutError):
                await anyio.sleep(0.3)


async def test_trainer_keeps_its_pid_through_a_hub_restart(tmp_path: Path) -> None:
    """Hub SIGKILLed under a running trainer, down ~2 s, restarted on its store: the trainer process keeps its
    PID, logs a mark-watch retry, and the rollouts published afterwards are trained, marked and acked."""
    state = tmp_path / "state"
    topology = _topology(state)
    model = _pretrained(state)
    first = sample_rollouts(model, tasks=2, group_size=2, seed=1, tag="before")
    second = sample_rollouts(model, tasks=2, group_size=2, seed=2, tag="after")
    async with Launch.open(topology, state_dir=state) as launch, anyio.create_task_group() as tg:
        regions = launch.regions
        assert regions is not None
        await tg.start(lambda task_status: launch.run_actors(heartbeat_s=0.5, task_status=task_status))
        gen = await connect(regions, topology.run, "generator")
        try:
            await _publish(gen, first)
            await _acked_through(launch.admin, len(first))      # step 1 trained, marked, acked
            await _settled(launch.admin, regions.servers[HUB].store_dir)
            before = launch.supervisor.pids()
            await anyio.to_thread.run_sync(regions.kill, HUB)
            await anyio.sleep(2.0)
            await anyio.to_thread.run_sync(regions.restart, HUB)
            await _publish(gen, second)
            await _acked_through(launch.admin, len(first) + len(second))
            assert launch.supervisor.pids()[TRAINER] == before[TRAINER]
            assert launch.supervisor.actors[TRAINER].restarts == 0
        finally:
            await gen.close()
        tg.cancel_scope.cancel()
    log = (state / "logs" / f"{TRAINER}.log").read_text()
    assert "trainer_mark_watch_retry" in log
