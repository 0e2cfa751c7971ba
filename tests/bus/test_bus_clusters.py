"""Regions as JetStream clusters on real nats-servers: `RegionSet.start(nodes=3)` makes the hub and a leaf each a
3-node cluster (routes, one domain, a store per node, `sync_interval` on every node); every stream and bucket is
provisioned at R3; each leaf node links to the hub (through one relay per hub node, which a cut closes together);
rollouts published in the leaf are sourced into the hub; a second start on the same directory keeps the nodes'
ports and stores, and one of the other layout is refused; a bucket whose leader is SIGKILLed is read and written
through the election without an error reaching the caller. The chaos proof (a stream leader SIGKILLed under a
running trainer) is tests/chaos/test_chaos_cluster.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from helpers import eventually, new_run
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rlbus.messages.errors import ServerError, TopologyError
from rlbus.messages.kv import put_at, read_key
from rlbus.messages.objects import OBJECT_CHUNK, put_object, stream_object
from rlbus.messages.streams import StreamSettings, provision_all
from rlbus.messages.subjects import Subjects
from rlbus.topology.network.regions import CLUSTER_PORTS_NAME, RegionSet

pytestmark = pytest.mark.anyio
REGIONS = ("hub", "eu")
BUS_DOWN = (nats.errors.Error, nats.js.errors.Error, TimeoutError)


async def _connect(rs: RegionSet, region: str, role: str) -> NATS:
    return await nats.connect(**rs.connect_options(region, role))


async def _ids(js: JetStreamContext, stream: str) -> Counter[str]:
    """How many times each Nats-Msg-Id is stored in `stream`."""
    state = (await js.stream_info(stream)).state
    return Counter([(await js.get_msg(stream, seq)).headers["Nats-Msg-Id"]
                    for seq in range(state.first_seq, state.last_seq + 1)] if state.messages else [])


async def _replicas(js: JetStreamContext) -> dict[str, tuple[int, int]]:
    """Stream name → (configured replicas, peers besides the leader) of every stream of `js`'s domain."""
    return {info.config.name: (info.config.num_replicas, len(info.cluster.replicas or ()))
            for info in await js.streams_info()}


async def test_clustered_regions_replicate_link_and_reopen_on_their_ports(tmp_path: Path) -> None:
    """Hub and leaf of 3 nodes each: every node fsyncs always, every stream and bucket of both domains is R3 with 2
    followers, each leaf node is linked (a cut of its relays unlinks it, a heal links it again), 2 rollouts
    published in the leaf reach the hub's ROLLOUTS once each; started again, the nodes listen on the same ports
    and hold both rollouts; a single-server start on that directory is refused, as is an even node count."""
    base, run = tmp_path / "state", new_run()
    s = Subjects(run)
    settings = StreamSettings(replicas=3, duplicate_window_s=120.0)
    with RegionSet.start(base, REGIONS, "hub", run=run, nodes=3, relay=True, sync_interval="always") as rs:
        assert {r: len(rs.nodes[r]) for r in REGIONS} == {"hub": 3, "eu": 3} and len(rs.node_relays["eu"]) == 3
        assert all(n.varz()["jetstream"]["config"]["sync_always"] for r in REGIONS for n in rs.nodes[r])
        assert rs.linked() == {"eu"}
        await provision_all(lambda region: _connect(rs, region, "admin"), s, hub="hub", regions=rs.domains,
                            settings=settings)
        admin = await _connect(rs, "hub", "admin")
        gen = await _connect(rs, "eu", "generator")
        try:
            for domain in REGIONS:
                replicas = await _replicas(admin.jetstream(domain=domain))
                assert replicas and set(replicas.values()) == {(3, 2)}, replicas   # KV_ and OBJ_ buckets too
                assert any(name.startswith("KV_") for name in replicas) and any(
                    name.startswith("OBJ_") for name in replicas)
            for rid in ("r1", "r2"):
                ack = await gen.jetstream().publish(s.rollouts("eu"), rid.encode(), headers={"Nats-Msg-Id": rid})
                assert ack.domain == "eu"
            hub_js = admin.jetstream(domain="hub")
            await eventually(lambda: _ids(hub_js, s.hub_rollouts_stream()), lambda ids: ids == Counter(["r1", "r2"]),
                             what="both rollouts sourced into the hub", timeout_s=60)
            rs.cut("eu")
            assert rs.is_cut("eu") and "eu" not in rs.linked()
            rs.heal("eu", timeout_s=30)
            assert rs.linked() == {"eu"}
        finally:
            await gen.close()
            await admin.close()
        urls = {r: rs.urls(r) for r in REGIONS}
    saved = json.loads((base / "hub" / CLUSTER_PORTS_NAME).read_text())
    assert [f"nats://127.0.0.1:{p['client']}" for p in saved] == list(urls["hub"])
    with RegionSet.start(base, REGIONS, "hub", run=run, nodes=3, link_timeout_s=60) as again:
        assert {r: again.urls(r) for r in REGIONS} == urls
        admin = await _connect(again, "hub", "admin")
        try:
            for domain, stream in (("hub", s.hub_rollouts_stream()), ("eu", s.rollouts_stream("eu"))):
                js = admin.jetstream(domain=domain)      # each stream answers once its leader is elected again
                await eventually(lambda js=js, stream=stream: _ids(js, stream),
                                 lambda ids: ids == Counter(["r1", "r2"]), what=f"{stream} after the restart",
                                 timeout_s=60, ignoring=BUS_DOWN)
        finally:
            await admin.close()
    with pytest.raises(ServerError, match="holds a cluster's JetStream store, but this run asks for a single server"):
        RegionSet.start(base, REGIONS, "hub", run=run)
    with pytest.raises(TopologyError, match="1 or odd"):
        RegionSet.start(base, REGIONS, "hub", run=run, nodes=2)


async def test_a_bucket_whose_leader_is_sigkilled_is_read_and_written_through_the_election(tmp_path: Path) -> None:
    """A 3-node hub, a partial stored in the PARTIALS bucket (R3); its leader SIGKILLed, the client on a surviving
    node reads the key (the first read, sent while no node leads, times out and is asked again) and writes it at
    the revision read: the value and revisions are the ones stored, and the write is the next revision."""
    run = new_run()
    s = Subjects(run)
    with RegionSet.start(tmp_path / "state", ("hub",), "hub", run=run, nodes=3) as rs:
        await provision_all(lambda region: _connect(rs, region, "admin"), s, hub="hub", regions=rs.domains,
                            settings=StreamSettings(replicas=3))
        bucket = s.partials_bucket("hub")
        admin = await _connect(rs, "hub", "admin")
        try:
            js = admin.jetstream()
            revision = await put_at(js, bucket, "task-1", b"partial", revision=None)
            leader = (await js.stream_info(f"KV_{bucket}")).cluster.leader
        finally:
            await admin.close()
        survivor = next(n for n in rs.nodes["hub"] if n.name != leader)
        client = await nats.connect(**rs.connect_options("hub", "admin") | {"servers": [survivor.url]})
        try:
            js = client.jetstream()
            rs.kill_node(leader)
            entry = await read_key(js, bucket, "task-1")
            assert (entry.value, entry.revision) == (b"partial", revision)
            assert await put_at(js, bucket, "task-1", b"next", revision=revision) > revision
            assert (await read_key(js, bucket, "task-1")).value == b"next"
        finally:
            await client.close()


async def test_a_download_whose_consumer_node_is_sigkilled_goes_on_from_the_next_chunk(tmp_path: Path) -> None:
    """A 4-chunk object in the CKPT bucket (R3) of a 3-node hub, downloaded a chunk per pull; after the first
    chunk is handed on, the node holding the download's ephemeral (R1) consumer is SIGKILLed. The download goes
    on through a new consumer from the second chunk: every byte once, in order, the digest the upload returned."""
    run = new_run()
    s = Subjects(run)
    data = bytes(range(256)) * (4 * OBJECT_CHUNK // 256 - 10)          # 4 chunks, the last one short
    with RegionSet.start(tmp_path / "state", ("hub",), "hub", run=run, nodes=3) as rs:
        await provision_all(lambda region: _connect(rs, region, "admin"), s, hub="hub", regions=rs.domains,
                            settings=StreamSettings(replicas=3))
        bucket, stream = s.checkpoint_bucket(), f"OBJ_{s.checkpoint_bucket()}"
        client = await _connect(rs, "hub", "admin")
        killed: list[str] = []

        async def sink(chunk: bytes) -> None:
            parts.append(chunk)
            if killed:
                return
            (consumer,) = [c for c in await js.consumers_info(stream) if not c.config.durable_name]
            assert consumer.cluster is not None and consumer.cluster.leader
            killed.append(consumer.cluster.leader)
            rs.kill_node(consumer.cluster.leader)

        try:
            js = client.jetstream()
            digest = await put_object(js, bucket, "state-1", data)
            parts: list[bytes] = []
            size = await stream_object(js, bucket, "state-1", sink, expected_digest=digest, timeout_s=60, batch=1)
        finally:
            await client.close()
    assert len(killed) == 1
    assert size == len(data) and len(parts) == 4 and b"".join(parts) == data
