"""The feeder's lockstep schedule (the synchronous arm of `rlbus bench async`) on a real one-region bus:
one batch of `backlog_per_region` tasks per new version in the region's LATEST key, each stamped with
that version as `Task.min_version`; a version seen again feeds nothing; the fed version is saved."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import nats
import nats.js.errors
import pytest
from helpers import eventually, new_run

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import FeederConfig, FeederLaunch
from rlbus.actors.common.feed import POSITION_KEY, Position
from rlbus.actors.feeder import Feeder
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.schemas import WeightManifest
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import LATEST_KEY, Subjects
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
HUB = "hub"


async def _bus(rs: RegionSet, run: str, role: str) -> Bus:
    cred = rs.credentials(role)
    return await Bus.connect(rs.url(HUB), run=run, domain=HUB,
                             options=ConnectOptions(user=cred.user, password=cred.password))


async def _queued(bus: Bus) -> list[TaskMessage]:
    """The tasks in the hub's TASKS, in stream order, read without consuming them."""
    stream = bus.subjects.tasks_stream(HUB)
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1 if info.state.messages else 1):
        try:
            msg = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue
        out.append(codec.decode_as(msg.data, msg.headers, TaskMessage))
    return out


async def test_lockstep_feeds_one_batch_per_new_version(tmp_path: Path) -> None:
    """LATEST v0 → 3 tasks with min_version 0; v0 again → none; v1 → 3 more with min_version 1; saved."""
    run = new_run()
    rs = RegionSet.start(tmp_path / "regions", [HUB], HUB, run=run)
    try:
        admin = await _bus(rs, run, "admin")
        feeder_bus = await _bus(rs, run, "feeder")
        try:
            s = Subjects(run)
            await provision_run(admin.nc, s, hub=HUB, domains=rs.domains, settings=StreamSettings.tiny())
            await wait_routable(admin.nc, s.tasks(HUB))
            latest = await admin.js.key_value(s.latest_bucket(HUB))
            partials = await admin.js.key_value(s.partials_bucket(HUB))
            config = FeederConfig(lockstep=True, backlog_per_region=3, poll_interval_s=0.1)
            feeder = Feeder(ActorId(run, HUB, "feeder", "f1"), feeder_bus, config,
                            ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=2.0),
                            FeederLaunch(regions=[HUB], group_size=2))

            async def announce(version: int) -> None:
                await latest.put(LATEST_KEY, codec.encode(WeightManifest(version=version))[0])

            async def saved_versions() -> dict[str, int]:
                try:
                    entry = await partials.get(POSITION_KEY)
                except nats.js.errors.KeyNotFoundError:
                    return {}
                return msgspec.json.decode(entry.value or b"", type=Position).versions

            async with anyio.create_task_group() as tg:
                await tg.start(feeder.serve)
                await announce(0)
                await eventually(lambda: _count_at_least(admin, 3))
                await announce(0)                  # the same version again: no second batch
                await announce(1)
                await eventually(lambda: _count_at_least(admin, 6))
                await eventually(lambda: _versions_are(saved_versions, {HUB: 1}))
                tasks = await _queued(admin)
                tg.cancel_scope.cancel()
            assert [t.min_version for t in tasks] == [0, 0, 0, 1, 1, 1]
            assert len({t.task_id for t in tasks}) == 6
            assert feeder.counters["tasks"] == 6
        finally:
            await feeder_bus.close()
            await admin.close()
    finally:
        rs.stop()


async def _count_at_least(bus: Bus, n: int) -> bool:
    return len(await _queued(bus)) >= n


async def _versions_are(read: Callable[[], Awaitable[dict[str, int]]], expected: dict[str, int]) -> bool:
    return await read() == expected
