"""`rlbus events`: lifecycle events read back from the EVENTS stream, filtered by kind, actor and region, and
from a start time (an ephemeral consumer by start time)."""

from __future__ import annotations

import anyio
import pytest
from helpers.ops import json_lines, provision_single, run_cli, target_of, url_args

from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Event
from rlbus.ops.events import read_events
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio

EVENTS = [("started", "a1", "eu", ""), ("crashed", "a1", "eu", "RuntimeError('kaput')"),
          ("restarted", "a1", "eu", "after SIGKILL"), ("crashed", "a2", "us", "OSError('disk')"),
          ("dead_letter", "a3", "hub", "bad schema")]


async def _publish(bus: Bus) -> None:
    await provision_single(bus)
    for kind, actor, region, detail in EVENTS:
        await bus.publish(bus.subjects.events(region, "generator"),
                          Event(event=kind, actor_id=actor, actor_kind="generator", region=region, detail=detail))


async def test_kind_actor_and_region_filters(admin_bus: Bus, nats_server: EmbeddedServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--kind crashed lists both crashes in order; --actor and --region narrow further; text lines carry details."""
    await _publish(admin_bus)
    where = url_args(nats_server, admin_bus.subjects.run)

    async def cli(*extra: str) -> str:
        capsys.readouterr()
        assert await anyio.to_thread.run_sync(run_cli, ["events", *where, "--since", "10m", *extra]) == 0
        return capsys.readouterr().out

    crashed = json_lines(await cli("--kind", "crashed", "--json"))
    assert [(e["actor_id"], e["detail"]) for e in crashed] == [("a1", "RuntimeError('kaput')"), ("a2", "OSError('disk')")]
    assert all(e["event"] == "crashed" and e["seq"] > 0 and e["time"] > 0 for e in crashed)
    assert [e["event"] for e in json_lines(await cli("--actor", "a1", "--json"))] == ["started", "crashed", "restarted"]
    assert [e["event"] for e in json_lines(await cli("--kind", "crashed,dead_letter", "--region", "hub", "--json"))
            ] == ["dead_letter"]
    text = [line for line in (await cli("--kind", "restarted")).splitlines() if "restarted" in line]
    assert len(text) == 1 and "eu  generator  a1  restarted  after SIGKILL" in text[0]


async def test_since_starts_at_a_stored_time(admin_bus: Bus, nats_server: EmbeddedServer) -> None:
    """Reading from a start time returns exactly the events stored at or after it."""
    await _publish(admin_bus)
    await anyio.sleep(0.3)
    await admin_bus.publish(admin_bus.subjects.events("hub", "launcher"), Event(event="stopped", actor_id="late"))
    target = target_of(nats_server, admin_bus.subjects.run)
    async with await target.connect() as bus:
        everything = [(at, e.event, e.actor_id) async for at, _, _, e in read_events(bus, since=None)]
        cut = (everything[-2][0] + everything[-1][0]) / 2
        later = [(at, e.event, e.actor_id) async for at, _, _, e in read_events(bus, since=cut)]
    assert [(k, a) for _, k, a in everything] == [(k, a) for k, a, _, _ in EVENTS] + [("stopped", "late")]
    assert later == everything[-1:]
