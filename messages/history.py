"""Reading a JetStream stream's history (and optionally following it) through an ephemeral consumer.

Owns: `read_stream()`, an async iterator of raw stored messages from a start point (all, a start time,
or the last message per subject) until the reader has caught up with what was stored when it started
(or forever with `follow=True`); and `stream_counts()` for quick stream/consumer numbers.
Does not: decode messages (callers use messages/codec.py) or decide what to read (the ops commands do).

The consumer is an ephemeral pull consumer with `AckPolicy.NONE`, in memory, deleted when the reader
ends (and by the server after `inactive_threshold` if the reader dies): reading history never moves any
durable consumer and needs only the observer role's JetStream API rights.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final, Literal

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

log = structlog.get_logger()

_INACTIVE_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class Start:
    """Where a reader starts: every message, at a time (unix seconds), or the last one per subject."""

    policy: Literal["all", "time", "last_per_subject", "new"] = "all"
    at: float | None = None

    @classmethod
    def since(cls, unix_s: float) -> Start:
        return cls("time", unix_s)


async def read_stream(js: JetStreamContext, stream: str, *, subject: str | None = None, start: Start = Start(),
                      follow: bool = False, batch: int = 256, fetch_timeout_s: float = 1.0) -> AsyncIterator[Msg]:
    """Yield the stored messages of `stream` (filtered by `subject`) in stream order.

    Without `follow` the iteration ends once every message that matched when it began has been yielded;
    with `follow` it goes on with new messages until cancelled.

    :raises nats.js.errors.NotFoundError: the stream does not exist.
    """
    async for msgs in read_batches(js, stream, subject=subject, start=start, follow=follow, batch=batch,
                                   fetch_timeout_s=fetch_timeout_s):
        for msg in msgs:
            yield msg


async def read_batches(js: JetStreamContext, stream: str, *, subject: str | None = None, start: Start = Start(),
                       follow: bool = False, batch: int = 256, fetch_timeout_s: float = 1.0
                       ) -> AsyncIterator[list[Msg]]:
    """As `read_stream`, one list per fetch (never empty), for callers that batch their work."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=_INACTIVE_S, mem_storage=True,
                            num_replicas=1)
    if subject is not None:
        config.filter_subject = subject
    match start.policy:
        case "all":
            config.deliver_policy = DeliverPolicy.ALL
        case "new":
            config.deliver_policy = DeliverPolicy.NEW
        case "last_per_subject":
            config.deliver_policy = DeliverPolicy.LAST_PER_SUBJECT
            if subject is None:
                config.filter_subject = ">"
        case "time":
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.datetime.fromtimestamp(start.at or 0.0, datetime.timezone.utc)
    info = await js.add_consumer(stream, config)
    remaining = int(info.num_pending or 0)
    psub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    try:
        while follow or remaining > 0:
            try:
                msgs = await psub.fetch(batch, timeout=fetch_timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                if not follow:
                    # nothing came: check that nothing is left (the filter may match fewer than counted)
                    remaining = int((await js.consumer_info(stream, info.name)).num_pending or 0)
                continue
            got = [m for m in msgs if m.reply]      # drop status messages (408/404) of the pull request
            if not got:
                continue
            remaining = int(got[-1].metadata.num_pending)
            yield got
    finally:
        with anyio.move_on_after(2.0, shield=True):
            try:
                await psub.unsubscribe()
                await js.delete_consumer(stream, info.name)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as err:
                log.debug("reader_cleanup_failed", stream=stream, error=repr(err))


def stored_at(msg: Msg) -> float:
    """When the stream stored the message (unix seconds, server clock)."""
    return float(msg.metadata.timestamp.timestamp())


@dataclass(frozen=True, slots=True)
class StreamCount:
    """Size of a stream, and of a durable consumer's backlog when asked for one."""

    stream: str
    messages: int
    bytes: int
    last_seq: int
    consumer: str | None = None
    pending: int | None = None
    """Messages not yet delivered to the consumer."""
    ack_pending: int | None = None
    """Messages delivered and not yet acknowledged."""


async def stream_count(js: JetStreamContext, stream: str, consumer: str | None = None) -> StreamCount | None:
    """Counts of `stream` (and `consumer`'s backlog); None when the stream does not exist."""
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return None
    state = info.state
    pending = ack_pending = None
    if consumer is not None:
        try:
            cinfo = await js.consumer_info(stream, consumer)
            pending, ack_pending = int(cinfo.num_pending or 0), int(cinfo.num_ack_pending or 0)
        except nats.js.errors.NotFoundError:
            consumer = None
    return StreamCount(stream=stream, messages=int(state.messages), bytes=int(state.bytes),
                       last_seq=int(state.last_seq), consumer=consumer, pending=pending, ack_pending=ack_pending)
