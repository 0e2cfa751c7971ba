"""The bus client against a real nats-server: dedupe by rollout id, dead-lettering that keeps the
consumer going, acknowledgement verbs, and object-store transfers checked by digest."""

from __future__ import annotations

import asyncio
import gc
from contextlib import aclosing

import anyio
import msgpack
import pytest
from helpers import eventually
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NoStreamResponseError

from rlbus.actors.demo import synthetic_rollout
from rlbus.messages import codec
from rlbus.messages.bus import REASON_HEADER, Bus, digest
from rlbus.messages.errors import DigestMismatch
from rlbus.messages.schemas import Rollout, Task

pytestmark = pytest.mark.anyio


async def _rollout_stream(bus: Bus, ack_wait_s: float = 2.0) -> tuple[str, str]:
    s = bus.subjects
    stream = s.rollouts_stream("hub")
    await bus.js.add_stream(StreamConfig(name=stream, subjects=[s.rollouts("hub")], duplicate_window=60))
    await bus.js.add_stream(StreamConfig(name=s.dead_letter_stream(), subjects=[s.all_dead_letters()]))
    await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))
    await bus.js.add_consumer(stream, ConsumerConfig(durable_name="trainer", ack_policy=AckPolicy.EXPLICIT,
                                                     ack_wait=ack_wait_s))
    return stream, s.rollouts("hub")


def _rollout(rid: str) -> Rollout:
    import random

    return synthetic_rollout(rid, "hub", "g1", 50, random.Random(rid))


async def test_same_rollout_id_is_stored_once(admin_bus: Bus) -> None:
    """Publishing the same rollout id twice stores it once; the second ack says duplicate."""
    stream, subject = await _rollout_stream(admin_bus)
    first = await admin_bus.publish(subject, _rollout("r1"), msg_id="r1")
    second = await admin_bus.publish(subject, _rollout("r1"), msg_id="r1")
    acks = await admin_bus.publish_batch([(subject, _rollout("r2"), "r2"), (subject, _rollout("r1"), "r1")])
    assert not first.duplicate and second.duplicate and acks[1].duplicate and not acks[0].duplicate
    assert (await admin_bus.js.stream_info(stream)).state.messages == 2


async def test_a_refused_batch_raises_once_and_leaves_no_unretrieved_error(admin_bus: Bus) -> None:
    """A batch to a subject no stream holds raises NoStreamResponseError; the refusals of the later messages,
    whose acks are never awaited, are taken too, so the loop reports no "exception never retrieved". A probe
    published after the batch is refused after every refusal of the batch (one connection, in order); a future
    failed on purpose and dropped is reported, so the handler does catch what it looks for."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    nowhere = admin_bus.subjects.rollouts("nowhere")
    try:
        with pytest.raises(NoStreamResponseError):
            await admin_bus.publish_batch([(nowhere, _rollout(f"r{i}"), f"r{i}") for i in range(4)])
        probe = await admin_bus.js.publish_async(nowhere, b"probe")
        with pytest.raises(NoStreamResponseError):
            await probe                  # the batch's later refusals were handled before this one
        gc.collect()                     # an unretrieved future's error is reported when it is collected
        assert reported == []
        control = loop.create_future()
        control.set_exception(RuntimeError("dropped on purpose"))
        del control
        gc.collect()
    finally:
        loop.set_exception_handler(before)
    assert [str(c.get("exception")) for c in reported] == ["dropped on purpose"]


async def test_garbage_is_dead_lettered_and_the_consumer_goes_on(admin_bus: Bus) -> None:
    """Garbage and a wrong kind between two good rollouts are dead-lettered with reasons; both good ones arrive."""
    stream, subject = await _rollout_stream(admin_bus)
    await admin_bus.publish(subject, _rollout("good-1"), msg_id="good-1")
    await admin_bus.js.publish(subject, b"\xc1 not msgpack")
    task_bytes, _ = codec.encode(Task(task_id="x", prompt="p"))
    await admin_bus.js.publish(subject, task_bytes)
    await admin_bus.publish(subject, _rollout("good-2"), msg_id="good-2")
    got = []
    with anyio.fail_after(20):
        async for delivery in admin_bus.consume(stream, "trainer", Rollout, batch=4):
            got.append(delivery.message.rollout_id)
            await delivery.ack()
            if len(got) == 2:
                break
    assert got == ["good-1", "good-2"]
    assert admin_bus.dead_lettered == 2
    dlq = await admin_bus.js.pull_subscribe(admin_bus.subjects.all_dead_letters(), durable="inspect",
                                            stream=admin_bus.subjects.dead_letter_stream())
    letters = await dlq.fetch(2, timeout=5)
    assert letters[0].data == b"\xc1 not msgpack"
    reasons = [m.headers[REASON_HEADER] for m in letters]
    assert "expected a Rollout message, got Task" in reasons[1]
    assert reasons[0]
    events = await admin_bus.js.pull_subscribe(admin_bus.subjects.all_events(), durable="ev",
                                               stream=admin_bus.subjects.events_stream())
    kinds = [msgpack.unpackb(m.data)["event"] for m in await events.fetch(2, timeout=5)]
    assert kinds == ["dead_letter", "dead_letter"]
    info = await admin_bus.js.consumer_info(stream, "trainer")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_unacked_rollout_is_redelivered_and_in_progress_holds_it(admin_bus: Bus) -> None:
    """A delivery nobody acks comes back after ack_wait; nak gives it back at once."""
    stream, subject = await _rollout_stream(admin_bus, ack_wait_s=1.0)
    await admin_bus.publish(subject, _rollout("r1"), msg_id="r1")
    deliveries = []
    with anyio.fail_after(20):
        async for delivery in admin_bus.consume(stream, "trainer", Rollout, batch=1, fetch_timeout_s=0.5):
            deliveries.append(delivery.num_delivered)
            if len(deliveries) == 1:
                continue                       # dropped without ack: redelivered after ack_wait
            if len(deliveries) == 2:
                await delivery.nak()
                continue
            await delivery.ack_sync()
            break
    assert deliveries == [1, 2, 3]


async def test_object_store_round_trip_and_digest_check(admin_bus: Bus) -> None:
    """Multi-chunk objects come back intact; a wrong announced digest is refused."""
    bucket = admin_bus.subjects.checkpoint_bucket()
    await admin_bus.js.create_object_store(bucket)
    blob = bytes(range(256)) * 5000          # 1.28 MB: several chunks
    d = await admin_bus.put_object(bucket, "state-1", blob)
    assert d == digest(blob)
    assert await admin_bus.get_object(bucket, "state-1", expected_digest=d) == blob
    with pytest.raises(DigestMismatch, match="state-1"):
        await admin_bus.get_object(bucket, "state-1", expected_digest=digest(b"other"))


async def test_no_server_is_a_clear_bounded_error() -> None:
    """Connecting where no server listens ends in BusUnavailable naming the URL and what to do."""
    from rlbus.messages.bus import ConnectOptions
    from rlbus.messages.errors import BusUnavailable

    with anyio.fail_after(30), pytest.raises(BusUnavailable, match=r"127\.0\.0\.1:1\b.*rlbus up"):
        await Bus.connect("nats://127.0.0.1:1", run="x", options=ConnectOptions(retry_for_s=1.0))


async def test_follow_yields_live_messages_of_its_kind_and_skips_the_rest(admin_bus: Bus) -> None:
    """follow(): a Rollout arrives decoded; raw garbage and a Task on the same subject are skipped."""
    subject = admin_bus.subjects.health("hub", "demo", "probe")
    got: list[Rollout] = []
    arrived = anyio.Event()

    async def take() -> None:
        async with aclosing(admin_bus.follow(subject, Rollout)) as rollouts:
            async for rollout in rollouts:
                got.append(rollout)
                if rollout.rollout_id == "live":
                    arrived.set()
                    return

    async def subscribed() -> bool:
        """Core NATS drops what is published before the subscription reaches the server: probe until one
        comes back (one connection's messages arrive in order, so everything after it is seen)."""
        await admin_bus.nc.publish(subject, codec.encode(_rollout("probe"))[0])
        await admin_bus.nc.flush()
        return bool(got)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await eventually(subscribed, what="the follower's subscription", timeout_s=10, poll_s=0.05)
        await admin_bus.nc.publish(subject, b"\xc1 not msgpack")
        await admin_bus.nc.publish(subject, codec.encode(Task(task_id="t", prompt="p"))[0])
        await admin_bus.nc.publish(subject, codec.encode(_rollout("live"))[0])
        with anyio.fail_after(10):              # hang guard only
            await arrived.wait()
    assert {r.rollout_id for r in got[:-1]} == {"probe"} and got[-1].rollout_id == "live"
