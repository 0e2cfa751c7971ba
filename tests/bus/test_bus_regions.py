"""Regions on real nats-servers: a hub and leaves with their own JetStream domains, joined as leaf nodes.

What crosses the leaf links (core messages, publishes into the other side's streams, sourcing), what a
cut-off leaf keeps doing, and that a leaf killed or partitioned while holding rollouts loses none and
duplicates none at the hub. Raw nats-py with `Nats-Msg-Id` headers; streams from messages/streams.py.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from helpers import eventually, new_run
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from structlog.testing import capture_logs

from rlbus.messages.streams import StreamSettings, provision_all, provision_run, wait_routable
from rlbus.messages.subjects import Subjects
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

pytestmark = pytest.mark.anyio

CUT_S = 12.0
"""How long the partition test keeps a leaf cut off (the README names the guarantee with it)."""
CUT_ROUNDS = 5
"""Rollouts stored and tasks served in eu while it is cut off: at least this many, however slow the machine."""
CATCH_UP_S = 90.0
"""Hang guard for the hub to catch up after a heal: sourcing resumes at the server's next retry,
whose backoff grows with the outage (measured 17-31 s after 3-30 s cuts)."""


async def _quiet(err: Exception) -> None:
    """error_cb for clients whose server is killed on purpose."""


async def _connect(rs: RegionSet, region: str, role: str, **options: Any) -> NATS:
    return await nats.connect(**rs.connect_options(region, role), error_cb=_quiet, **options)


async def _provisioned(rs: RegionSet) -> Subjects:
    """A fresh run with every region's and the hub's streams, provisioned through the hub, once their
    subjects route across the links (each stream's interest reaches the other side a few ms later)."""
    s = Subjects(new_run())
    admin = await _connect(rs, rs.hub, "admin")
    try:
        await provision_run(admin, s, hub=rs.hub, domains=rs.domains, settings=StreamSettings.tiny())
        for leaf in rs.leaves:
            await wait_routable(admin, s.tasks(leaf))
            leaf_admin = await _connect(rs, leaf, "admin")
            try:
                for subject in (s.health(leaf, "probe", "p"), s.events(leaf, "probe"),
                                s.dead_letter("probe")):
                    await wait_routable(leaf_admin, subject)
            finally:
                await leaf_admin.close()
    finally:
        await admin.close()
    return s


async def _msg_ids(js: JetStreamContext, stream: str) -> Counter[str]:
    """How many times each Nats-Msg-Id is stored in `stream`."""
    state = (await js.stream_info(stream)).state
    ids: Counter[str] = Counter()
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        ids[(msg.headers or {}).get("Nats-Msg-Id", "")] += 1
    return ids


async def _wait_messages(js: JetStreamContext, stream: str, count: int, timeout_s: float) -> None:
    await eventually(lambda: js.stream_info(stream), lambda info: info.state.messages >= count,
                     what=f"{count} messages in {stream}", timeout_s=timeout_s)


async def _publish_rollouts(nc: NATS, s: Subjects, region: str, ids: list[str]) -> None:
    js = nc.jetstream()
    for rid in ids:
        ack = await js.publish(s.rollouts(region), rid.encode(), headers={"Nats-Msg-Id": rid})
        assert ack.domain == region and ack.stream == s.rollouts_stream(region)


async def test_leaf_core_message_reaches_hub_subscriber_and_back(regions: RegionSet) -> None:
    """A core publish in either leaf reaches a hub subscriber, and a hub publish reaches a leaf subscriber."""
    s = Subjects(new_run())
    observer = await _connect(regions, "hub", "observer")
    gen_eu = await _connect(regions, "eu", "generator")
    gen_us = await _connect(regions, "us", "generator")
    publisher = await _connect(regions, "hub", "publisher")
    try:
        at_hub = await observer.subscribe(s.all_health())
        at_eu = await gen_eu.subscribe(s.weights())
        for nc in (observer, gen_eu):
            await nc.flush()
        got: set[bytes] = set()
        with anyio.fail_after(10):  # interest crosses the links asynchronously: publish until all arrived
            while got != {b"eu", b"us", b"v1"}:
                await gen_eu.publish(s.health("eu", "generator", "g1"), b"eu")
                await gen_us.publish(s.health("us", "generator", "g2"), b"us")
                await publisher.publish(s.weights(), b"v1")
                for sub in (at_hub, at_eu):
                    with contextlib.suppress(nats.errors.TimeoutError):
                        while True:
                            got.add((await sub.next_msg(0.2)).data)
        assert got == {b"eu", b"us", b"v1"}  # every direction delivered (else fail_after fired)
    finally:
        for nc in (observer, gen_eu, gen_us, publisher):
            await nc.close()


async def test_hub_feeder_publish_is_stored_in_leaf_tasks_and_served_there(regions: RegionSet) -> None:
    """`js.publish(tasks.eu)` from the hub is acked by eu's TASKS stream; eu's generator consumer gets it."""
    s = await _provisioned(regions)
    feeder = await _connect(regions, "hub", "feeder")
    generator = await _connect(regions, "eu", "generator")
    try:
        ack = await feeder.jetstream().publish(s.tasks("eu"), b"task-1", headers={"Nats-Msg-Id": "task-1"})
        assert (ack.domain, ack.stream) == ("eu", s.tasks_stream("eu"))
        psub = await generator.jetstream().pull_subscribe_bind(durable=s.durable("generator", "eu"),
                                                               stream=s.tasks_stream("eu"))
        [msg] = await psub.fetch(1, timeout=5)
        await msg.ack_sync()
        assert msg.data == b"task-1"
        left = (await generator.jetstream().stream_info(s.tasks_stream("eu"))).state.messages
        assert left == 0  # work queue: an acked task is removed
        await psub.unsubscribe()
    finally:
        await feeder.close()
        await generator.close()


async def test_hub_rollouts_source_every_region_once(regions: RegionSet) -> None:
    """The hub's ROLLOUTS holds every region's rollouts once, even an id published in two leaves."""
    s = await _provisioned(regions)
    conns = {r: await _connect(regions, r, "generator") for r in regions.regions}
    hub_js = conns["hub"].jetstream()
    try:
        expected = [f"{r}-{i}" for r in regions.regions for i in range(5)]
        for r in regions.regions:
            await _publish_rollouts(conns[r], s, r, [f"{r}-{i}" for i in range(5)])
        await _publish_rollouts(conns["eu"], s, "eu", ["same-id"])
        await _publish_rollouts(conns["us"], s, "us", ["same-id"])
        await _wait_messages(hub_js, s.hub_rollouts_stream(), len(expected) + 1, timeout_s=20)
        ids = await _msg_ids(hub_js, s.hub_rollouts_stream())
        assert ids == Counter([*expected, "same-id"])
        info = await hub_js.stream_info(s.hub_rollouts_stream())
        sources = sorted(src.name for src in info.sources or ())
        assert sources == sorted(s.rollouts_stream(r) for r in regions.regions)
    finally:
        for nc in conns.values():
            await nc.close()


async def test_hub_streams_capture_leaf_publishes(regions: RegionSet) -> None:
    """Heartbeats, events and dead letters published in leaves are stored in the hub's HEALTH/EVENTS/DLQ."""
    s = await _provisioned(regions)
    gen = await _connect(regions, "eu", "generator")
    sandbox = await _connect(regions, "us", "sandbox")
    try:
        await gen.publish(s.health("eu", "generator", "g1"), b"hb")  # core: stored by interest
        ev = await gen.jetstream().publish(s.events("eu", "generator"), b"started")
        dl = await sandbox.jetstream().publish(s.dead_letter(s.rollouts_stream("us")), b"garbage")
        assert (ev.domain, ev.stream, dl.domain, dl.stream) == ("hub", s.events_stream(), "hub",
                                                                s.dead_letter_stream())
        hub_js = gen.jetstream(domain="hub")  # a leaf client reads hub streams through the hub's domain
        await _wait_messages(hub_js, s.health_stream(), 1, timeout_s=10)
        msg = await hub_js.get_msg(s.health_stream(), 1)
        assert (msg.subject, msg.data) == (s.health("eu", "generator", "g1"), b"hb")
    finally:
        await gen.close()
        await sandbox.close()


async def test_hub_fills_a_leaf_weights_bucket_through_its_domain(regions: RegionSet) -> None:
    """A hub client writes eu's WEIGHTS object store via domain eu; eu's generator reads it locally."""
    s = await _provisioned(regions)
    publisher = await _connect(regions, "hub", "admin")  # the publisher role: see test_bus_permissions
    generator = await _connect(regions, "eu", "generator")
    blob = os.urandom(300_000)  # spans several object-store chunks
    try:
        store = await publisher.jetstream(domain="eu").object_store(s.weights_bucket("eu"))
        await store.put("v1", blob)
        local = await generator.jetstream().object_store(s.weights_bucket("eu"))
        assert (await local.get("v1")).data == blob
    finally:
        await publisher.close()
        await generator.close()


async def test_provisioning_twice_changes_nothing_and_a_new_setting_updates(regions: RegionSet) -> None:
    """A second provisioning creates and updates nothing; a changed ack wait updates only the consumers."""
    s = Subjects(new_run())

    async def connect(region: str) -> NATS:
        return await _connect(regions, region, "admin")

    tiny = StreamSettings.tiny()
    with capture_logs() as first:
        await provision_all(connect, s, hub="hub", regions=regions.domains, settings=tiny)
    with capture_logs() as second:
        await provision_all(connect, s, hub="hub", regions=regions.domains, settings=tiny)
        admin = await connect("hub")
        await provision_run(admin, s, hub="hub", domains=regions.domains, settings=tiny)
    with capture_logs() as changed:
        await provision_run(admin, s, hub="hub", domains=regions.domains,
                            settings=StreamSettings(**{**_fields(tiny), "ack_wait_s": 3.0}))
    try:
        created = Counter(e["event"] for e in first)
        assert created == {"stream_created": 2 * 3 + 9, "consumer_created": 3 + 1, "kv_bucket_created": 2 * 3,
                           "object_store_created": 3 + 1 + 3}       # WEIGHTS per region, CKPT, WORKSPACES per region
        assert second == []
        assert sorted((e["event"], e["consumer"]) for e in changed) == sorted(
            ("consumer_updated", s.durable("generator", r)) for r in regions.regions)
        info = await admin.jetstream(domain="us").consumer_info(s.tasks_stream("us"),
                                                                s.durable("generator", "us"))
        assert info.config.ack_wait == 3.0
    finally:
        await admin.close()


def _fields(settings: StreamSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}


async def test_reopened_regions_keep_credentials_and_stores(tmp_path: Path) -> None:
    """Starting again on the same base dir reuses the 0600 credentials file and every stored rollout."""
    base = tmp_path / "state"
    with RegionSet.start(base, ["hub", "eu"], "hub") as rs:
        s = await _provisioned(rs)
        gen = await _connect(rs, "eu", "generator")
        await _publish_rollouts(gen, s, "eu", ["r1", "r2"])
        await gen.close()
        creds = {role: rs.credentials(role) for role in rs.users}
    assert stat.S_IMODE((base / CREDENTIALS_NAME).stat().st_mode) == 0o600
    with RegionSet.start(base, ["hub", "eu"], "hub") as again:
        assert {role: again.credentials(role) for role in again.users} == creds
        admin = await _connect(again, "hub", "admin")
        try:
            await _wait_messages(admin.jetstream(), s.hub_rollouts_stream(), 2, timeout_s=90)   # sourcing resumes on the server's own retry backoff
            in_leaf = await _msg_ids(admin.jetstream(domain="eu"), s.rollouts_stream("eu"))
            assert in_leaf == Counter(["r1", "r2"])
        finally:
            await admin.close()


@pytest.mark.chaos
async def test_killed_leaf_delivers_its_buffered_rollouts_once(tmp_path: Path) -> None:
    """A leaf SIGKILLed holding rollouts the hub never saw, restarted on its store, delivers each once."""
    with RegionSet.start(tmp_path / "regions", ["hub", "eu"], "hub", relay=True) as rs:
        s = await _provisioned(rs)
        hub = await _connect(rs, "hub", "observer")
        hub_js = hub.jetstream()
        try:
            gen = await _connect(rs, "eu", "generator")
            linked = [f"a{i}" for i in range(10)]
            await _publish_rollouts(gen, s, "eu", linked)
            await _wait_messages(hub_js, s.hub_rollouts_stream(), len(linked), timeout_s=20)
            rs.cut("eu")
            buffered = [f"b{i}" for i in range(20)]
            await _publish_rollouts(gen, s, "eu", buffered)  # acked by eu alone
            await gen.close()
            pid = rs.servers["eu"].pid
            assert pid is not None
            rs.kill("eu")
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
            assert (await hub_js.stream_info(s.hub_rollouts_stream())).state.messages == len(linked)
            rs.restart("eu")
            gen = await _connect(rs, "eu", "generator")
            await _publish_rollouts(gen, s, "eu", buffered[-3:])  # a generator retrying after the crash
            assert await _msg_ids(gen.jetstream(), s.rollouts_stream("eu")) == Counter(linked + buffered)
            await gen.close()
            rs.heal("eu")
            await _wait_messages(hub_js, s.hub_rollouts_stream(), len(linked) + len(buffered), CATCH_UP_S)
            assert await _msg_ids(hub_js, s.hub_rollouts_stream()) == Counter(linked + buffered)
        finally:
            await hub.close()


async def test_partitioned_leaf_keeps_serving_and_catches_up_exactly_once(regions: RegionSet) -> None:
    """Cut off for 12 s, eu still stores rollouts and serves its own tasks; healed, the hub gets each once."""
    s = await _provisioned(regions)
    gen = await _connect(regions, "eu", "generator")
    local_feeder = await _connect(regions, "eu", "feeder")
    hub_feeder = await _connect(regions, "hub", "feeder")
    hub_js = hub_feeder.jetstream()
    rollouts = [f"before-{i}" for i in range(5)]
    try:
        await _publish_rollouts(gen, s, "eu", rollouts)
        await _wait_messages(hub_js, s.hub_rollouts_stream(), len(rollouts), timeout_s=20)
        psub = await gen.jetstream().pull_subscribe_bind(durable=s.durable("generator", "eu"),
                                                         stream=s.tasks_stream("eu"))
        regions.cut("eu")
        cut_until = time.monotonic() + CUT_S
        # the hub cannot reach eu's TASKS now: no responders, or (racing the drop) no ack
        with pytest.raises((nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError)):
            await hub_feeder.jetstream().publish(s.tasks("eu"), b"lost", timeout=2)
        served, i = [], 0
        while i < CUT_ROUNDS or time.monotonic() < cut_until:   # rounds, not a count reached in the time
            await _publish_rollouts(gen, s, "eu", [f"cut-{i}"])
            rollouts.append(f"cut-{i}")
            await local_feeder.jetstream().publish(s.tasks("eu"), f"task-{i}".encode(),
                                                   headers={"Nats-Msg-Id": f"task-{i}"})
            [task] = await psub.fetch(1, timeout=5)
            await task.ack_sync()
            served.append(task.data.decode())
            i += 1
            await anyio.sleep(1.0)
        assert served == [f"task-{k}" for k in range(i)]
        assert (await hub_js.stream_info(s.hub_rollouts_stream())).state.messages == 5  # nothing crossed
        regions.heal("eu")
        await _publish_rollouts(gen, s, "eu", ["cut-0"])  # a retried publish stays one rollout
        await _wait_messages(hub_js, s.hub_rollouts_stream(), len(rollouts), CATCH_UP_S)
        assert await _msg_ids(hub_js, s.hub_rollouts_stream()) == Counter(rollouts)
        await psub.unsubscribe()
    finally:
        for nc in (gen, local_feeder, hub_feeder):
            await nc.close()
