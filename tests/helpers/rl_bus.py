"""Bus helpers for trainer/checkpointer tests: a provisioned one-region run on its own embedded server
(bucket rights granted for the run), role connections, and readers that wait for stream contents."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import nats

from helpers.waiting import eventually
from rlbus.actors.common.ledger import read_all
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import CheckpointMark, Message, Rollout, TrainStep, VersionReady
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.messages.subjects import Subjects
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

M = TypeVar("M", bound=Message)
HUB = "hub"


def credentials_file(rs: RegionSet) -> Path:
    return rs.base_dir / CREDENTIALS_NAME


async def provision(rs: RegionSet, run: str) -> None:
    """Create the run's streams, consumers and buckets (test-sized settings: trainer ack wait 5 s)."""
    nc = await nats.connect(**rs.connect_options(HUB, "admin"))
    try:
        await provision_run(nc, Subjects(run), hub=HUB, domains={HUB: HUB}, settings=StreamSettings.tiny())
    finally:
        await nc.close()


async def connect(rs: RegionSet, run: str, role: str, actor_id: str | None = None) -> Bus:
    cred = rs.credentials(role)
    return await Bus.connect(rs.url(HUB), run=run, identity=Identity(actor_id or f"test-{role}", role, HUB),
                             domain=HUB, options=ConnectOptions(user=cred.user, password=cred.password))


async def publish_rollouts(bus: Bus, rollouts: list[Rollout]) -> None:
    """As a generator does: the whole batch pipelined, msg_id = rollout id."""
    await bus.publish_batch([(bus.subjects.rollouts(HUB), r, r.rollout_id) for r in rollouts])


async def read_kind(bus: Bus, kind: type[M]) -> list[M]:
    s = bus.subjects
    match kind:
        case t if t is TrainStep:
            return await read_all(bus.js, s.trainlog_stream(), s.trainlog(), kind)
        case t if t is CheckpointMark:
            return await read_all(bus.js, s.checkpoints_stream(), s.checkpoints(), kind)
        case t if t is VersionReady:
            return await read_all(bus.js, s.state_stream(), s.version_ready(), kind)
    raise TypeError(kind)


async def wait_for(bus: Bus, kind: type[M], until: Callable[[list[M]], bool], timeout_s: float = 60) -> list[M]:
    """Re-read the stream of `kind` until `until(messages)` holds (hang guard `timeout_s`)."""
    return await eventually(lambda: read_kind(bus, kind), until, what=f"{kind.__name__} messages",
                            timeout_s=timeout_s, poll_s=0.3)


async def until_acked(bus: Bus, pending: int, timeout_s: float = 30) -> None:
    """Wait until the trainer's consumer has exactly `pending` unacked rollouts (acks are asynchronous)."""
    await eventually(lambda: ack_pending(bus), lambda n: n == pending, what=f"{pending} rollouts pending",
                     timeout_s=timeout_s)


async def ack_pending(bus: Bus) -> int:
    """Rollouts delivered to the trainer's durable consumer and not yet acked."""
    s = bus.subjects
    info = await bus.js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))
    return int(info.num_ack_pending or 0)
