"""Reading a JetStream stream's history (and optionally following it) through an ephemeral consumer.

- Owns: `read_stream()` / `read_batches()` (raw stored messages from a `Start`, until what was stored at the
  start is read, or forever with `follow=True`), the decoding readers `read_raw()`, `read_messages()`,
  `read_all()` and `last_message()`, and `stream_count()` for quick stream/consumer numbers.
- Guarantee: reading history never moves any durable consumer and needs only the observer role's JetStream
  API rights.
- Does not: decide what to read (the ledger, the actors' resume and the ops commands do).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlbus.messages import checks, codec
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import Message

log = structlog.get_logger()

M = TypeVar("M", bound=Message)

_INACTIVE_S: Final = 30.0
_UNAVAILABLE_S: Final = 30.0
"""How long a reader waits out 503s (a clustered consumer not answering yet) before it raises."""


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

    The consumer is an ephemeral pull consumer with `AckPolicy.NONE`, in memory, deleted when the reader
    ends (and by the server after `inactive_threshold` if the reader dies): reading history never moves any
    durable consumer and needs only the observer role's JetStream API rights.

    :raises nats.js.errors.NotFoundError: the stream does not exist.
    """
    async for msgs in read_batches(js, stream, subject=subject, start=start, follow=follow, batch=batch,
                                   fetch_timeout_s=fetch_timeout_s):
        for msg in msgs:
            yield msg


async def read_batches(js: JetStreamContext, stream: str, *, subject: str | None = None, start: Start = Start(),
                       follow: bool = False, batch: int = 256, fetch_timeout_s: float = 1.0
                       ) -> AsyncIterator[list[Msg]]:
    """As `read_stream`, one list per fetch (never empty), for callers that batch their work.

    Without `follow` it stops at the stream's last sequence as of the start, so writers that keep up with
    the reader cannot keep it reading."""
    last_seq: int | None = None
    if not follow:
        state = (await js.stream_info(stream)).state
        if not state.messages:
            return
        last_seq = int(state.last_seq)
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
            config.opt_start_time = datetime.datetime.fromtimestamp(start.at or 0.0, datetime.UTC)
    info = await js.add_consumer(stream, config)
    remaining = int(info.num_pending or 0)
    psub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    unavailable_since: float | None = None
    try:
        while follow or remaining > 0:
            try:
                msgs = await psub.fetch(batch, timeout=fetch_timeout_s)
                unavailable_since = None
            except nats.js.errors.ServiceUnavailableError:
                # 503: on a clustered stream a new consumer answers once its assignment has reached the
                # server; given up on after _UNAVAILABLE_S
                unavailable_since = unavailable_since or anyio.current_time()
                if anyio.current_time() - unavailable_since > _UNAVAILABLE_S:
                    raise
                await anyio.sleep(fetch_timeout_s / 4)
                continue
            except (nats.errors.TimeoutError, TimeoutError):
                if not follow:
                    # nothing came: check that nothing is left (the filter may match fewer than counted)
                    remaining = int((await js.consumer_info(stream, info.name)).num_pending or 0)
                continue
            got = [m for m in msgs if m.reply]      # drop status messages (408/404) of the pull request
            if not got:
                continue
            if last_seq is not None and got[-1].metadata.sequence.stream >= last_seq:
                got = [m for m in got if m.metadata.sequence.stream <= last_seq]
                remaining = 0                        # read what was stored at the start
            else:
                remaining = int(got[-1].metadata.num_pending)
            if got:
                yield got
    finally:
        with anyio.move_on_after(2.0, shield=True):
            try:
                await psub.unsubscribe()
                await js.delete_consumer(stream, info.name)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as err:
                log.debug("reader_cleanup_failed", stream=stream, error=repr(err))


async def read_raw(js: JetStreamContext, stream: str, subject: str | None = None, *,
                   timeout_s: float = 60.0) -> list[Msg]:
    """Every message on `subject` in `stream` as stored when the call began, undecoded, in stream order.

    :raises nats.js.errors.NotFoundError: the stream does not exist.
    :raises TimeoutError: reading took longer than `timeout_s`.
    """
    out: list[Msg] = []
    with anyio.fail_after(timeout_s):
        async with aclosing(read_batches(js, stream, subject=subject)) as batches:
            async for msgs in batches:
                out += msgs
    return out


async def read_messages(js: JetStreamContext, stream: str, subject: str | None, kind: type[M], *,
                        timeout_s: float = 60.0) -> list[tuple[int, M]]:
    """`read_raw` decoded as `kind`, each with its stream sequence; messages that do not decode are skipped
    (logged)."""
    out: list[tuple[int, M]] = []
    for msg in await read_raw(js, stream, subject, timeout_s=timeout_s):
        try:
            out.append((int(msg.metadata.sequence.stream), codec.decode_as(msg.data, msg.headers, kind)))
        except BadMessage as err:
            log.warning("history_message_skipped", stream=stream, error=str(err))
    return out


async def read_all(js: JetStreamContext, stream: str, subject: str | None, kind: type[M], *,
                   timeout_s: float = 60.0) -> list[M]:
    """Every message of `kind` on `subject` in `stream` as stored when the call began, in stream order.

    Messages that do not decode as `kind` are skipped (logged).
    """
    return [message for _, message in await read_messages(js, stream, subject, kind, timeout_s=timeout_s)]


async def last_message(js: JetStreamContext, stream: str, subject: str, kind: type[M]) -> M | None:
    """The last good message on `subject` in `stream`: decoded as `kind` and passing messages/checks.py;
    None when there is none. A bad last message is passed over (logged) and the subject read back for the
    last good one, so one bad message cannot stop an actor's start."""
    try:
        raw = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    try:
        message = codec.decode_as(raw.data or b"", raw.headers, kind)
        checks.check(message)
        return message
    except BadMessage as err:
        log.warning("last_message_bad", stream=stream, subject=subject, seq=raw.seq, error=str(err))
    good = None
    for candidate in await read_all(js, stream, subject, kind):
        try:
            checks.check(candidate)
        except BadMessage:
            continue
        good = candidate
    return good


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
