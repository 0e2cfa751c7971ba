"""A clustered hub loses its stream leader under a running trainer: the tiny run with `[durability] replicas = 3`
and `sync_interval = "always"` (the hub a 3-node JetStream cluster, every stream and bucket at R3, every actor given
all three node URLs) has the node leading the hub's ROLLOUTS stream SIGKILLed mid-run. The run goes on without a
restart of any actor, the trainer keeps stepping on the two surviving nodes, the node restarted on its store (by
the test, as an operator would) rejoins and catches up (its replica of ROLLOUTS is current again), and the ledgers
show no rollout lost, none trained twice and every fed task accounted for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import nats.errors
import nats.js.errors
import pytest
import torch
from helpers import eventually, new_run
from helpers.rl_bus import read_kind

from rlbus.actors.common.ledger import read_all, read_ledger
from rlbus.actors.trainer.core import build_core
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Event, TrainStep
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.training.pretrain import CHECKPOINT_NAME
from rlbus.topology.backends.launch import PRETRAINED_DIR, Launch, read_fed_tasks
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]
BUS_DOWN = (nats.errors.Error, nats.js.errors.Error, TimeoutError)
"""What a read may raise while the client moves off the killed node."""


def _topology(tmp_path: Path) -> Path:
    """The tiny example under its own run name, every stream at R3 and every write fsynced."""
    text = example_path("tiny").read_text().replace('run = "tiny"', f'run = "{new_run()}"')
    path = tmp_path / "tiny_cluster.toml"
    path.write_text(text + '\n[durability]\nreplicas = 3\nsync_interval = "always"\n')
    return path


def _pretrained(state: Path) -> None:
    """A fresh tiny model saved where `rlbus up` would pretrain it (the run only has to produce rollouts)."""
    model = build_core("", lr=1e-3, seed=0).model
    folder = state / PRETRAINED_DIR
    folder.mkdir(parents=True)
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": ByteTokenizer().info(), "meta": {}}, folder / CHECKPOINT_NAME)


async def _steps(admin: Bus, at_least: int, what: str) -> int:
    """Wait (hang guard) until TRAINLOG holds `at_least` steps; returns how many it holds."""
    found = await eventually(lambda: read_kind(admin, TrainStep), lambda steps: len(steps) >= at_least,
                             what=what, timeout_s=120, poll_s=0.3, ignoring=BUS_DOWN)
    return len(found)


async def _cluster(admin: Bus) -> object:
    return (await admin.js.stream_info(admin.subjects.hub_rollouts_stream())).cluster


async def test_sigkilled_stream_leader_loses_nothing_and_rejoins(tmp_path: Path) -> None:
    """SIGKILL of the ROLLOUTS leader of the hub's 3-node cluster after a step: another node leads, a step is
    trained with the node down, the same actor pids throughout, the restarted node's replica is current with
    no lag, then 1 more step; ledger clean (0 lost, 0 trained twice), every fed task accounted for, no
    `restarted` event."""
    state = tmp_path / "state"
    topology = load(_topology(tmp_path))
    _pretrained(state)
    hub = topology.hub.name
    async with Launch.open(topology, state_dir=state) as launch:
        regions, admin = launch.regions, launch.admin
        assert regions is not None and len(regions.nodes[hub]) == 3
        assert all(len(launch.endpoints.urls[r]) == 3 for r in regions.regions)     # every client: all nodes
        assert all(node.varz()["jetstream"]["config"]["sync_always"] for node in regions.nodes[hub])
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: launch.run_actors(heartbeat_s=0.5, task_status=task_status))
            steps = await _steps(admin, 1, "a step before the kill")
            pids = launch.supervisor.pids()
            cluster = await _cluster(admin)
            leader = cluster.leader
            assert leader in {s.name for s in regions.nodes[hub]} and len(cluster.replicas) == 2

            await anyio.to_thread.run_sync(regions.kill_node, leader)
            moved = await eventually(lambda: _cluster(admin), lambda c: c.leader and c.leader != leader,
                                     what="a new ROLLOUTS leader", timeout_s=60, poll_s=0.2, ignoring=BUS_DOWN)
            steps = await _steps(admin, steps + 1, "a step with the leader's node down")

            await anyio.to_thread.run_sync(lambda: regions.restart_node(leader, timeout_s=60))
            await eventually(lambda: _cluster(admin), lambda c: any(
                p.name == leader and p.current and not p.offline and not p.lag for p in c.replicas or ()),
                what=f"{leader}'s ROLLOUTS replica current again", timeout_s=60, poll_s=0.3, ignoring=BUS_DOWN)
            await _steps(admin, steps + 1, "a step after the node rejoined")

            assert launch.supervisor.pids() == pids
            assert all(entry.restarts == 0 for entry in launch.supervisor.actors.values())
            tg.cancel_scope.cancel()                      # the actors drain: what they hold is acked or pending
        book = await eventually(lambda: read_ledger(admin), timeout_s=30, ignoring=BUS_DOWN)
        tasks = await read_fed_tasks(topology, admin)
        restarted = await eventually(lambda: _restarted_events(admin), lambda _: True, timeout_s=30,
                                     ignoring=BUS_DOWN)
    assert moved.leader != leader
    assert book.trained > 0 and book.lost == [] and book.trained_twice == [], (book.lost, book.trained_twice)
    assert tasks is not None and tasks.fed > 0 and tasks.lost == [], tasks
    assert restarted == []


async def _restarted_events(admin: Bus) -> list[str]:
    """Actor ids of every `restarted` event of the run."""
    s = admin.subjects
    return [e.actor_id for e in await read_all(admin.js, s.events_stream(), s.all_events(), Event)
            if e.event == "restarted"]
