"""The bus client: one NATS connection per actor, typed JetStream publish/consume, KV and object store.

Owns: connecting (bounded, logged retry; deliberate ping settings), typed publish with `Nats-Msg-Id`
dedupe that waits for the stream's ack, typed pull consumption as an async iterator of `Delivery`
(ack / in-progress / nak / term), dead-lettering of anything that does not decode, and object-store
transfers in the connection's domains (through messages/objects.py, digest-checked). Does not: create
streams (messages/streams.py) or name subjects (messages/subjects.py).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

import anyio
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from rlbus.messages import checks, codec, objects
from rlbus.messages.errors import BadMessage, BusUnavailable, PermissionDenied, SubjectError
from rlbus.messages.objects import digest  # noqa: F401  (re-exported: the digest of manifests and marks)
from rlbus.messages.retry import retry_policy
from rlbus.messages.schemas import Event, Message
from rlbus.messages.subjects import Subjects, connection_inbox

log = structlog.get_logger()

M = TypeVar("M", bound=Message)

MSG_ID_HEADER: Final = "Nats-Msg-Id"
REASON_HEADER: Final = "Rlbus-Dead-Letter-Reason"
SOURCE_HEADER: Final = "Rlbus-Dead-Letter-Subject"

_CONNECT_ERRORS: Final = (OSError, nats.errors.NoServersError, nats.errors.TimeoutError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is on the other end of a connection: stamped on the events the bus raises itself."""

    actor_id: str = "client"
    kind: str = "client"
    region: str = "local"


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """Connection settings, chosen deliberately (nats-py's defaults see a hung server after ~4 min)."""

    user: str | None = None
    password: str | None = None
    connect_timeout_s: float = 2.0
    retry_for_s: float = 20.0
    ping_interval_s: float = 5.0
    max_outstanding_pings: int = 3
    reconnect_wait_s: float = 0.5
    publish_timeout_s: float = 5.0
    tls_ca_file: str | None = None
    """PEM file of the CA to trust for `tls://` servers (a region set started with TLS: `<base>/tls/ca.pem`)."""
    role: str | None = None
    """The role connected as; names the connection's private inbox prefix `_INBOX.<role>.<random>`
    (servers let a role subscribe only under `_INBOX.<role>.>`). None: `user`, which is the role's name on
    the embedded servers."""

    def inbox_prefix(self) -> str:
        """A fresh private inbox prefix for one connection (`subjects.connection_inbox`)."""
        role = self.role or self.user or "client"
        try:
            return connection_inbox(role)
        except SubjectError:
            if self.role is not None:
                raise
            return connection_inbox("client")   # a user name that is no subject token: not a role of ours


@dataclass(slots=True)
class Delivery(Generic[M]):
    """One decoded message from a pull consumer, with its JetStream acknowledgement verbs."""

    message: M
    raw: Msg = field(repr=False)

    @property
    def num_delivered(self) -> int:
        """How many times JetStream has delivered this message (1 on first delivery)."""
        return int(self.raw.metadata.num_delivered)

    @property
    def stream_seq(self) -> int:
        return int(self.raw.metadata.sequence.stream)

    async def ack(self) -> None:
        """Acknowledge (fire-and-forget: a lost ack means a redelivery, which consumers must tolerate)."""
        await self.raw.ack()

    async def ack_sync(self, give_up_after_s: float = 30.0) -> None:
        """Acknowledge and wait for the server to confirm it. A confirmation that does not come (a clustered
        consumer electing its next leader, the client moving to another server) is asked for again (an ack is
        idempotent) for up to `give_up_after_s`, then the timeout is raised."""
        retry = retry_policy("ack_retry", on=(nats.errors.TimeoutError, nats.errors.NoRespondersError),
                             initial_s=0.2, max_s=2.0, give_up_after_s=give_up_after_s)
        async for attempt in retry:
            with attempt:
                await self.raw.ack_sync()

    async def in_progress(self) -> None:
        """Hold the message: resets its ack wait while long work goes on."""
        await self.raw.in_progress()

    async def nak(self, delay_s: float | None = None) -> None:
        """Give the message back for redelivery, optionally after a delay."""
        await self.raw.nak(delay=delay_s)

    async def term(self) -> None:
        """Never deliver this message again."""
        await self.raw.term()


class Bus:
    """A connection to one NATS server (one region), bound to a run's subjects."""

    def __init__(self, nc: NATS, subjects: Subjects, *, identity: Identity, domain: str | None,
                 options: ConnectOptions) -> None:
        self.nc = nc
        self.subjects = subjects
        self.identity = identity
        self.domain = domain
        self.options = options
        self.js: JetStreamContext = nc.jetstream(domain=domain, timeout=options.publish_timeout_s)
        self.dead_lettered = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def connect(cls, servers: str | Sequence[str], *, run: str, identity: Identity | None = None,
                      domain: str | None = None, options: ConnectOptions | None = None) -> Bus:
        """Connect with a bounded, logged retry. `domain` picks the JetStream domain (region) to use.

        :raises BusUnavailable: when no server answered within `options.retry_for_s`.
        """
        opts = options or ConnectOptions()
        ident = identity or Identity()
        urls = [servers] if isinstance(servers, str) else list(servers)

        async def on_error(err: Exception) -> None:
            log.warning("bus_error", error=repr(err), actor=ident.actor_id)

        async def on_disconnect() -> None:
            log.info("bus_disconnected", actor=ident.actor_id)

        async def on_reconnect() -> None:
            log.info("bus_reconnected", actor=ident.actor_id)

        retry = retry_policy("bus_connect_retry", on=_CONNECT_ERRORS, initial_s=0.2, max_s=2.0,
                             give_up_after_s=opts.retry_for_s, servers=urls)
        try:
            async for attempt in retry:
                with attempt:
                    await _probe(urls, opts.connect_timeout_s)   # nats-py's own first connect never gives
                    nc = await nats.connect(                     # up when reconnects are unlimited
                        urls, name=f"{ident.kind}:{ident.actor_id}", user=opts.user, password=opts.password,
                        connect_timeout=opts.connect_timeout_s, ping_interval=opts.ping_interval_s,
                        max_outstanding_pings=opts.max_outstanding_pings, allow_reconnect=True,
                        max_reconnect_attempts=-1, reconnect_time_wait=opts.reconnect_wait_s,
                        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                        tls=_tls_context(opts.tls_ca_file), inbox_prefix=opts.inbox_prefix(),
                    )
        except nats.errors.Error as err:
            if "authorization" in str(err).lower():
                raise PermissionDenied(f"{urls}: the server refused user {opts.user!r}: {err}") from err
            raise BusUnavailable(f"no NATS server answered at {urls} within {opts.retry_for_s}s; "
                                 f"start one with `rlbus up` or set regions.<name>.nats_urls") from err
        except OSError as err:
            raise BusUnavailable(f"no NATS server answered at {urls} within {opts.retry_for_s}s; "
                                 f"start one with `rlbus up` or set regions.<name>.nats_urls") from err
        log.debug("bus_connected", servers=urls, run=run, domain=domain)
        return cls(nc, Subjects(run), identity=ident, domain=domain, options=opts)

    async def close(self) -> None:
        """Flush and close; bounded so a dead server never hangs shutdown."""
        if self.nc.is_closed:
            return
        with anyio.move_on_after(3.0, shield=True):
            try:
                await self.nc.drain()
            except (nats.errors.Error, TimeoutError) as err:
                log.debug("bus_drain_failed", error=repr(err))
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def jetstream(self, domain: str | None) -> JetStreamContext:
        """A JetStream context for another region's domain (e.g. the hub's, from a leaf)."""
        if domain == self.domain:
            return self.js
        return self.nc.jetstream(domain=domain, timeout=self.options.publish_timeout_s)

    # ---- publishing -----------------------------------------------------------------------------
    async def publish(self, subject: str, message: Message, *, msg_id: str | None = None,
                      timeout_s: float | None = None) -> PubAck:
        """Publish to a stream and wait for its ack. With `msg_id`, a repeat within the stream's
        duplicate window is stored once (the ack then says `duplicate=True`)."""
        data, headers = codec.encode(message)
        if msg_id is not None:
            headers[MSG_ID_HEADER] = msg_id
        return await self.js.publish(subject, data, timeout=timeout_s or self.options.publish_timeout_s,
                                     headers=headers or None)

    async def publish_once(self, subject: str, message: Message, *, msg_id: str,
                           give_up_after_s: float = 60.0) -> PubAck:
        """`publish` with `msg_id`, asked again while the stream does not answer (a clustered stream electing its
        next leader, the client moving to another server) for up to `give_up_after_s`: a try that was stored
        but not acked is stored once (the stream's duplicate window is longer)."""
        retry = retry_policy("publish_retry", on=(nats.errors.Error, TimeoutError), initial_s=0.2, max_s=2.0,
                             give_up_after_s=give_up_after_s, msg_id=msg_id)
        async for attempt in retry:
            with attempt:
                return await self.publish(subject, message, msg_id=msg_id)
        raise AssertionError("unreachable")

    async def publish_batch(self, items: Sequence[tuple[str, Message, str | None]], *,
                            window: int = 256, compress_above: int = codec.COMPRESS_ABOVE) -> list[PubAck]:
        """Publish many (subject, message, msg_id) pipelined, at most `window` unacked at once, and wait
        for every ack. Acks come back in order; any refusal raises after the earlier ones are stored."""
        acks: list[PubAck] = []
        pending: list[Any] = []
        for subject, message, msg_id in items:
            data, headers = codec.encode(message, compress_above=compress_above)
            if msg_id is not None:
                headers[MSG_ID_HEADER] = msg_id
            # no wait_stall: with one, nats-py wraps every call in asyncio.wait_for (a task per message)
            pending.append(await self.js.publish_async(subject, data, headers=headers or None))
            if len(pending) >= window:
                acks += await self._collect(pending)
                pending = []
        return acks + await self._collect(pending)

    async def _collect(self, futures: list[Any]) -> list[PubAck]:
        try:
            with anyio.fail_after(self.options.publish_timeout_s * 2):
                return [await future for future in futures]
        finally:
            # after a refusal or a timeout the later acks are not awaited: cancel those still pending and take
            # the errors of those already failed, so none is left as an "exception never retrieved"
            for future in futures:
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()

    async def publish_core(self, subject: str, message: Message) -> None:
        """Fire-and-forget core NATS publish (heartbeats): no stream ack is awaited."""
        data, headers = codec.encode(message)
        await self.nc.publish(subject, data, headers=headers or None)

    async def event(self, event: Event) -> None:
        """Publish a lifecycle event to the events stream; a missing stream is logged, not fatal."""
        subject = self.subjects.events(event.region or self.identity.region, event.actor_kind or self.identity.kind)
        try:
            await self.publish(subject, event, timeout_s=2.0)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("event_not_stored", event_kind=event.event, error=repr(err))

    # ---- consuming ------------------------------------------------------------------------------
    async def follow(self, subject: str, kind: type[M]) -> AsyncIterator[M]:
        """Core (non-JetStream) messages on `subject` as they arrive, decoded as `kind`; anything that does
        not decode is skipped (a live view, not a consumer: nothing is acked or dead-lettered)."""
        sub = await self.nc.subscribe(subject)
        try:
            async for msg in sub.messages:
                try:
                    yield codec.decode_as(msg.data, msg.headers, kind)
                except BadMessage:
                    continue
        finally:
            with anyio.move_on_after(1.0, shield=True):
                await sub.unsubscribe()

    async def consume(self, stream: str, durable: str, kind: type[M], *, batch: int = 8,
                      fetch_timeout_s: float = 1.0, domain: str | None = None) -> AsyncIterator[Delivery[M]]:
        """Pull from an existing durable consumer forever, yielding decoded messages of `kind`.

        Anything that does not decode as `kind`, or breaks its invariants (messages/checks.py), is
        dead-lettered with its reason and terminated; the iteration goes on. The caller acks each delivery.
        """
        js = self.jetstream(domain) if domain is not None else self.js
        psub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch, timeout=fetch_timeout_s)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue                      # idle; the next fetch is the cancel point
                except nats.js.errors.ServiceUnavailableError:   # 503: a clustered consumer has no leader yet
                    await anyio.sleep(fetch_timeout_s / 4)
                    continue
                for msg in msgs:
                    try:
                        message = codec.decode_as(msg.data, msg.headers, kind)
                        checks.check(message)
                    except BadMessage as err:
                        await self.dead_letter(msg, reason=str(err), source=stream)
                        continue
                    yield Delivery(message=message, raw=msg)
        finally:
            with anyio.move_on_after(1.0, shield=True):
                await psub.unsubscribe()

    async def dead_letter(self, msg: Msg, *, reason: str, source: str, settle: bool = True,
                          key: str | None = None) -> bool:
        """Store the raw bytes with the reason on the dead-letter stream, then `term` the original.

        If the dead-letter stream cannot take it, the original is nak'ed (kept) instead: nothing is lost.
        `settle=False`: leave the original alone (a copy read by a non-acking reader).
        The dead letter's message id is `dlq-<source>-<key>`, `key` defaulting to the original's stream
        sequence: a message dead-lettered again (a lost term, several readers) is stored once.
        """
        if key is None and msg.reply:
            try:
                key = str(msg.metadata.sequence.stream)
            except nats.errors.NotJSMessageError:    # a core message: no stream sequence to dedupe by
                pass
        stored = await self.store_dead_letter(msg.data, reason=reason, source=source, subject=msg.subject,
                                              headers=msg.headers, key=key)
        if settle and msg.reply:
            if stored:
                await msg.term()
            else:
                await msg.nak(delay=5.0)
        return stored

    async def store_dead_letter(self, data: bytes, *, reason: str, source: str, subject: str,
                                headers: Mapping[str, str] | None = None, key: str | None = None) -> bool:
        """Publish `data` to `dlq.<source>` with the reason and original subject in headers, log it and
        emit `Event(dead_letter)`; with `key`, deduplicated as `dlq-<source>-<key>`. -> False when the
        dead-letter stream did not take it."""
        out = {REASON_HEADER: reason[:1000], SOURCE_HEADER: subject}
        for name, value in (headers or {}).items():
            if name.lower().startswith("nats-"):   # JetStream's own (Nats-Stream-Source of a sourced stream is
                name = "Rlbus-Original-" + name   # refused on publish): kept under another name
            out.setdefault(name, value)
        if key is not None:
            out[MSG_ID_HEADER] = f"dlq-{source}-{key}"
        try:
            ack = await self.js.publish(self.subjects.dead_letter(source), data, headers=out,
                                        timeout=self.options.publish_timeout_s)
        except (nats.errors.Error, TimeoutError) as err:
            log.error("dead_letter_failed", source=source, reason=reason, error=repr(err))
            return False
        if ack.duplicate:                         # dead-lettered before (by us or another reader)
            return True
        self.dead_lettered += 1
        log.warning("message_dead_lettered", source=source, subject=subject, reason=reason)
        await self.event(Event(event="dead_letter", actor_id=self.identity.actor_id,
                               actor_kind=self.identity.kind, region=self.identity.region,
                               detail=reason[:500], data={"source": source, "subject": subject}))
        return True

    # ---- object store ---------------------------------------------------------------------------
    async def put_object(self, bucket: str, name: str, data: bytes | memoryview, *,
                         domain: str | None = None, new: bool = False, keep_same: bool = False,
                         behind: objects.Behind | None = None) -> str:
        """Upload bytes in chunks; returns their `sha256:<hex>` digest for the announcing message. `new`: no
        object of that name is there (`objects.put_object`: one round trip for the whole object). `keep_same`:
        a content-addressed name, kept as it is when these bytes are already stored under it. `behind`: a
        message sent right behind a new object, in the same round trip (`objects.Behind`)."""
        return await objects.put_object(self.jetstream(domain), bucket, name, data, new=new, keep_same=keep_same,
                                        behind=behind)

    async def get_object(self, bucket: str, name: str, *, expected_digest: str | None = None,
                         domain: str | None = None, timeout_s: float | None = None) -> bytes:
        """Download an object (`objects.fetch_object`: batched, never nats-py's quadratic plain `get()`),
        checking the store's digest and `expected_digest`. `timeout_s`: bound on the whole download (None:
        none, but a stall of `objects.STALL_S` fails it).

        :raises nats.js.errors.NotFoundError: no such bucket or object.
        :raises DigestMismatch: when the bytes differ from the store's digest or `expected_digest`.
        :raises TimeoutError: the chunks stopped arriving.
        """
        return await objects.fetch_object(self.jetstream(domain), bucket, name, expected_digest=expected_digest,
                                          timeout_s=timeout_s)


async def _probe(urls: Sequence[str], timeout_s: float) -> None:
    """Raise OSError unless some server accepts a TCP connection."""
    from urllib.parse import urlsplit

    errors = []
    for url in urls:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        try:
            with anyio.fail_after(timeout_s):
                stream = await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 4222)
            await stream.aclose()
            return
        except (OSError, TimeoutError) as err:
            errors.append(f"{url}: {err!r}")
    raise OSError("no server accepted a connection: " + "; ".join(errors))


def _tls_context(ca_file: str | None) -> ssl.SSLContext | None:
    """A client context trusting only `ca_file` (None: no TLS unless the URL asks for the system's CAs)."""
    if ca_file is None:
        return None
    return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)


def headers_of(msg: Msg) -> Mapping[str, str]:
    return msg.headers or {}
