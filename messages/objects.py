"""Object-store transfers: the one uploader and the one downloader of rlbus, both digest-checked.

- Owns: `put_object` (pipelined chunks, then the metadata; returns the `sha256:<hex>` digest an announcing
  message carries), `fetch_object` / `stream_object` (batched pull, hashed on the way), `delete_object`
  (best effort) and the digest forms (`digest`, `store_digest`); used by weight sync, the publisher, the
  checkpointer and the trainer's resume (through `Bus.get_object`).
- Guarantee: every download is checked against the store's own digest and, when given, the announced one; no
  failed upload leaves metadata naming chunks that are gone.
- Does not: create buckets (messages/streams.py) or choose object names (messages/subjects.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, ObjectInfo, ObjectMetaOptions
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)
from nats.nuid import NUID

from rlbus.messages.errors import NO_LEADER_ERRORS, NO_LEADER_S, DigestMismatch
from rlbus.messages.retry import retry_policy

log = structlog.get_logger()

OBJECT_CHUNK: Final = 512 * 1024
"""Object-store chunk size: well under nats-server's default 1 MiB max payload."""
PUT_WINDOW: Final = 32
"""Chunks an upload has in flight before it waits for their acks (16 MiB: twice the bandwidth-delay product of
a 1 Gbit/s link with a 60 ms round trip)."""
FETCH_BATCH: Final = 64
"""Chunks per pull request (up to 32 MiB in flight)."""
_NO_MESSAGE: Final = 10037
"""JetStream's error code for "no message found" (a stream that does not exist is 10059)."""
STALL_S: Final = 30.0
"""A download with no total limit fails once no chunk has arrived for this long."""
_CONSUMER_LOST: Final = (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)
"""What a pull from a consumer that no server leads raises."""
PULL_S: Final = 5.0
"""How long one pull request of a download waits before another is sent for the chunks still missing: a request
the server dropped or answered for an earlier one costs this, not the whole download's limit."""


@dataclass
class Behind:
    """A message `put_object` publishes right behind a new object's metadata, on the same connection, its ack
    read with the object's: one round trip for both (a key naming the object, say). After the put, `seq` is the
    stream sequence it was stored at, or None with `error` saying why (a refusal, or its ack not read because
    the object failed). It may be stored before the object's last chunk is (another stream): whoever it
    names the object to waits for the object's metadata, which its own stream stores behind every chunk."""

    subject: str
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)
    seq: int | None = None
    error: Exception | None = None


def digest(data: bytes | memoryview) -> str:
    """Content digest used in manifests and checkpoint marks: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def store_digest(meta_digest: str) -> str:
    """An object store's `SHA-256=<base64url>` digest as rlbus's `sha256:<hex>` (`digest`); "" if unreadable."""
    try:
        return "sha256:" + base64.urlsafe_b64decode(meta_digest.removeprefix("SHA-256=")).hex()
    except ValueError:
        return ""


async def put_object(js: JetStreamContext, bucket: str, name: str, data: bytes | memoryview, *,
                     window: int = PUT_WINDOW, stall_s: float = STALL_S, new: bool = False,
                     keep_same: bool = False, behind: Behind | None = None) -> str:
    """Upload bytes in `OBJECT_CHUNK` chunks (replacing an object of that name); returns their digest.

    The objects are the ones nats-py's `ObjectStore.put` writes (chunks on a fresh nuid's subject, then the
    metadata as a rollup, then the replaced object's chunks purged), but the chunks go pipelined: at most
    `window` unacked, their acks read from one reply inbox. A failed upload purges the chunks it sent, unless
    its metadata went out: that may be stored whatever its ack says, so the chunks stay, and an upload whose
    metadata is found stored is done (its ack was lost, or came after the timeout on a stalled process).
    nats-py's `ObjectStore.put()` waits for each chunk's ack before sending the next: one round trip per
    512 KiB, which on a link with a 60 ms round trip caps an upload at ~8.7 MB/s whatever the bandwidth.

    `new`: the caller knows no object of this name is in the bucket. The lookup of the one it replaces is
    skipped and the metadata goes right behind the chunks, acked with them: one round trip for the whole
    object. A failure then purges the metadata instead. Only for objects nothing reads before the caller names
    them elsewhere (between the metadata landing and the last chunk's ack, the object reads as corrupt).

    `keep_same`: the name is content-addressed. An object already stored under it with these bytes' size and
    digest, and all the chunks its metadata counts, is kept (nothing sent, nothing purged), so a download in
    the middle of it is not cut off; one whose chunks are missing is written again.

    `behind` (only with `new`): published after the metadata, its ack read with theirs (see `Behind`).

    :raises nats.js.errors.NotFoundError: no such bucket.
    :raises nats.js.errors.APIError: the store refused a chunk or the metadata.
    :raises TimeoutError: no ack arrived for `stall_s`.
    """
    if behind is not None and not new:
        raise ValueError("put_object: a message goes behind a new object only (new=True)")
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())
    old: ObjectInfo | None = None
    if not new:
        try:                               # the object it replaces, if any: one request, no stream info first
            last = await js.get_last_msg(stream, meta_subject)
            old = ObjectInfo.from_response(json.loads(last.data or b"{}"))
        except nats.js.errors.NotFoundError as err:
            if err.err_code != _NO_MESSAGE:
                raise                      # no such bucket
            old = None
    if keep_same and old is not None and not old.deleted and old.size == len(data):
        same = "sha256:" + hashlib.sha256(data).hexdigest()
        if store_digest(old.digest or "") == same and await _chunks_stored(js, stream, bucket, old):
            return same
    nuid = NUID().next().decode()
    chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    nc = js._nc                   # nats-py keeps the context's client private; the acks need its inbox
    inbox = nc.new_inbox()
    view = memoryview(data).cast("B")
    sha = hashlib.sha256()
    sent = acked = 0
    meta_sent = False                     # the metadata may be stored from here on, whatever its ack says
    sub = await nc.subscribe(inbox)
    behind_sub = await nc.subscribe(behind_inbox := nc.new_inbox()) if behind is not None else None
    try:
        for offset in range(0, len(view), OBJECT_CHUNK):
            chunk = view[offset:offset + OBJECT_CHUNK]
            sha.update(chunk)
            await nc.publish(chunk_subject, bytes(chunk), reply=inbox)
            sent += 1
            while sent - acked >= window:
                await _chunk_ack(sub, stall_s, bucket, name)
                acked += 1
        info = ObjectInfo(name=name, bucket=bucket, nuid=nuid, size=len(view), chunks=sent,
                          options=ObjectMetaOptions(max_chunk_size=OBJECT_CHUNK),
                          digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(sha.digest()).decode()))
        meta = json.dumps(info.as_dict()).encode()
        if new:                            # behind the chunks, its ack read with theirs
            meta_sent = True
            await nc.publish(meta_subject, meta, reply=inbox, headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT})
            sent += 1
        if behind is not None and behind_sub is not None:
            await nc.publish(behind.subject, behind.payload, reply=behind_inbox, headers=behind.headers or None)
            behind.error = TimeoutError(f"its ack was not read: the object {bucket}/{name} failed first")
        while acked < sent:
            await _chunk_ack(sub, stall_s, bucket, name)
            acked += 1
        if behind is not None and behind_sub is not None:
            try:
                behind.seq, behind.error = await _stored_at(behind_sub, stall_s, behind.subject), None
            except (nats.errors.Error, TimeoutError) as err:
                behind.error = err
        if not new:
            meta_sent = True
            await js.publish(meta_subject, meta, headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    except BaseException as err:
        stored = False
        with anyio.move_on_after(2.0, shield=True):
            stored = await _undo_put(js, bucket, name, nuid, new=new, meta_sent=meta_sent)
        if not (stored and isinstance(err, Exception)):
            raise
        log.info("object_put_ack_lost", bucket=bucket, object=name, error=repr(err))
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await sub.unsubscribe()
            if behind_sub is not None:
                await behind_sub.unsubscribe()
    if old is not None and not old.deleted and old.nuid:
        await js.purge_stream(stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=old.nuid))
    return "sha256:" + sha.hexdigest()


async def _chunks_stored(js: JetStreamContext, stream: str, bucket: str, info: ObjectInfo) -> bool:
    """Whether the stream holds as many chunks of `info`'s nuid as its metadata counts (one request)."""
    if not info.size:
        return True
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    state = (await js.stream_info(stream, subjects_filter=subject)).state
    return (state.subjects or {}).get(subject, 0) == (info.chunks or 0)


async def _undo_put(js: JetStreamContext, bucket: str, name: str, nuid: str, *, new: bool, meta_sent: bool) -> bool:
    """After a failed upload, clean up without ever leaving metadata that names chunks which are gone. -> True when
    the upload is stored after all: its metadata (sent once every chunk was acked) is the name's metadata now, and
    only its ack was lost or came after the timeout (a stalled process); nothing is purged then.

    Before the metadata was sent, the chunks are purged. Once it was, they are left, since it may still be stored:
    a `new` object's metadata (sent with its chunks) is purged instead. The cost of a failure is then unreferenced
    chunks, never an object every download waits on for its whole limit and a `keep_same` upload keeps."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())
    try:
        if not meta_sent:
            await js.purge_stream(stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid))
        elif new:
            await js.purge_stream(stream, subject=meta_subject)
        else:
            last = await js.get_last_msg(stream, meta_subject)
            return ObjectInfo.from_response(json.loads(last.data or b"{}")).nuid == nuid
    except nats.js.errors.NotFoundError:
        log.info("object_put_metadata_not_stored_yet", bucket=bucket, object=name)
    except (nats.errors.Error, TimeoutError, ValueError, TypeError) as err:
        log.warning("object_put_cleanup_failed", bucket=bucket, object=name, error=repr(err))
    return False


async def _chunk_ack(sub: Subscription, stall_s: float, bucket: str, name: str) -> None:
    """Read one chunk's ack from the upload's inbox. :raises nats.js.errors.APIError: a refusal (or no stream)."""
    await _stored_at(sub, stall_s, f"the chunks of {bucket}/{name}")


async def _stored_at(sub: Subscription, stall_s: float, what: str) -> int:
    """Read one publish ack from `sub`; -> the sequence stored at. :raises nats.js.errors.APIError: a refusal
    (or no stream)."""
    msg: Msg = await sub.next_msg(timeout=stall_s)
    if msg.headers and msg.headers.get("Status") == "503":
        raise nats.js.errors.ServiceUnavailableError(description=f"no stream stores {what}")
    try:
        reply = json.loads(msg.data)
    except ValueError:
        raise nats.js.errors.APIError(description=f"{what}: an ack is not JSON: {msg.data[:80]!r}") from None
    if isinstance(reply, dict) and "error" in reply:
        nats.js.errors.APIError.from_error(reply["error"])
    return int(reply.get("seq", 0)) if isinstance(reply, dict) else 0


async def fetch_object(js: JetStreamContext, bucket: str, name: str, *, expected_digest: str | None = None,
                       timeout_s: float | None = 60.0) -> bytes:
    """An object's bytes, checked against the store's own sha256 and, when given, `expected_digest`.

    `timeout_s` bounds the whole download (None: no bound, but `STALL_S` without a chunk still fails it).

    :raises nats.js.errors.NotFoundError: no such bucket or object.
    :raises DigestMismatch: the bytes do not match a digest.
    :raises TimeoutError: the chunks did not arrive in time.
    """
    parts: list[bytes] = []
    await stream_object(js, bucket, name, parts.append, expected_digest=expected_digest, timeout_s=timeout_s)
    return b"".join(parts)


async def stream_object(js: JetStreamContext, bucket: str, name: str, sink: Callable[[bytes], Awaitable[None] | None],
                        *, expected_digest: str | None = None, timeout_s: float | None = 60.0,
                        batch: int = FETCH_BATCH) -> int:
    """Hand an object's chunks, in order, to `sink` as they arrive (awaited when it returns an awaitable), then
    check the whole against the store's sha256 and `expected_digest`; -> its size. At most `batch` chunks are
    held at once: a consumer that decodes as it goes never holds the object whole. The digests are known only
    at the end: a sink must not use what it built before this returns.

    Every chunk comes through an ephemeral pull consumer fetched in batches, hashed while the next ones
    arrive; an object replaced before its first chunk arrived is read anew; a consumer that lost its leader,
    to an election or a dead node, is replaced by one from the next chunk. nats-py's plain
    `ObjectStore.get()` is quadratic in the object's size, and its `get(writeinto=)` streams through an
    ordered push consumer (3-10x slower here than the batched pull for 8-64 MiB): neither is used.

    :raises nats.js.errors.NotFoundError: no such bucket or object.
    :raises DigestMismatch: the bytes do not match a digest.
    :raises TimeoutError: the chunks did not arrive in time.
    """
    store, info = await _lookup(js, bucket, name)
    with anyio.fail_after(timeout_s):
        while True:
            try:
                got, sha = await _stream_chunks(js, store, info, sink, stall_s=timeout_s or STALL_S, batch=batch)
                break
            except _Replaced as replaced:  # before any chunk was handed on: read the object that replaced it
                info = replaced.info
    size = int(info.size or 0)
    actual = "sha256:" + sha.hexdigest()
    if got != size or actual != store_digest(info.digest or ""):
        raise DigestMismatch(f"object {bucket}/{name}: {got} bytes with digest {actual}, the store's meta "
                             f"says {info.size} bytes, {info.digest}")
    if expected_digest is not None and actual != expected_digest:
        raise DigestMismatch(f"object {bucket}/{name}: digest {actual} != announced {expected_digest}")
    return size


async def _lookup(js: JetStreamContext, bucket: str, name: str) -> tuple[ObjectStore, ObjectInfo]:
    """The bucket and the object's current metadata; asked again while a clustered bucket has no leader.

    :raises nats.js.errors.NotFoundError: no such bucket or object.
    """
    retry = retry_policy("object_lookup_retry", on=NO_LEADER_ERRORS, initial_s=0.2, max_s=1.0,
                         give_up_after_s=NO_LEADER_S, bucket=bucket, object=name)
    async for attempt in retry:
        with attempt:
            store = await js.object_store(bucket)
            return store, await store.get_info(name)
    raise AssertionError("unreachable")


async def _chunk_consumer(js: JetStreamContext, info: ObjectInfo, start_seq: int | None,
                          give_up_after_s: float) -> JetStreamContext.PullSubscription:
    """An ephemeral pull consumer of the chunks of `info`, from stream sequence `start_seq` (None: the first);
    its creation is asked again while the bucket has no leader, for up to `give_up_after_s`."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=10.0,
                            deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
                            opt_start_seq=start_seq)
    retry = retry_policy("object_consumer_retry", on=NO_LEADER_ERRORS, initial_s=0.2, max_s=1.0,
                         give_up_after_s=max(give_up_after_s, 0.0), bucket=info.bucket, object=info.name)
    async for attempt in retry:
        with attempt:
            return await js.pull_subscribe(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=info.bucket, obj=info.nuid),
                                           stream=OBJ_STREAM_TEMPLATE.format(bucket=info.bucket), config=config)
    raise AssertionError("unreachable")


async def _unsubscribe(psub: JetStreamContext.PullSubscription) -> None:
    with anyio.move_on_after(2.0, shield=True):
        try:
            await psub.unsubscribe()
        except nats.errors.Error:        # a connection already closed: nothing left to stop
            pass


class _Replaced(Exception):
    """The object was replaced (a new nuid under its name) before a chunk of it was handed on."""

    def __init__(self, info: ObjectInfo) -> None:
        super().__init__(info.nuid)
        self.info = info


async def _stream_chunks(js: JetStreamContext, store: ObjectStore, info: ObjectInfo,
                         sink: Callable[[bytes], Awaitable[None] | None], *, stall_s: float,
                         batch: int) -> tuple[int, hashlib._Hash]:
    """The chunks of the object `info` names, handed to `sink` in order; -> (bytes, their running sha256).

    A pull that gets nothing looks the object up again: a writer that replaced it (a content-addressed name
    written again) purged the chunks this consumer waits for.
    A pull answered 503 (no server leads the consumer: the bucket electing, or the node holding this R1
    consumer gone) makes a new consumer that starts at the chunk after the last one handed on.

    :raises _Replaced: it was replaced before any chunk was handed on.
    :raises DigestMismatch: it was replaced after some were.
    :raises TimeoutError: no chunk arrived for `stall_s`.
    """
    size = int(info.size or 0)
    got = 0
    sha = hashlib.sha256()
    if not size:
        return got, sha
    psub = await _chunk_consumer(js, info, None, stall_s)
    chunks, seen = int(info.chunks or 0), 0
    next_seq: int | None = None           # stream sequence right after the last chunk handed on
    last_chunk = time.monotonic()
    try:
        while got < size:
            # Never ask for more chunks than remain: a pull request the server holds open for a batch
            # it cannot fill returns only when its expiry passes.
            want = max(1, min(batch, chunks - seen)) if chunks else batch
            try:
                msgs = await psub.fetch(want, timeout=min(PULL_S, stall_s))
            except _CONSUMER_LOST as err:
                # no leader for this consumer: the bucket electing one, or the node that held this (R1,
                # ephemeral) consumer gone; a new one goes on from the chunk after the last handed on
                stalled = time.monotonic() - last_chunk
                if stalled >= stall_s:
                    raise TimeoutError(f"object {info.bucket}/{info.name}: no chunk for {stalled:.0f}s, "
                                       f"its consumer lost ({err!r})") from err
                log.info("object_consumer_lost", bucket=info.bucket, object=info.name, chunks_seen=seen,
                         chunks=chunks, error=repr(err))
                await _unsubscribe(psub)
                await anyio.sleep(0.2)
                psub = await _chunk_consumer(js, info, next_seq, stall_s - stalled)
                continue
            except TimeoutError:
                _, now = await _lookup(js, info.bucket, info.name)
                if now.nuid != info.nuid:
                    log.info("object_replaced_while_read", bucket=info.bucket, object=info.name,
                             chunks_seen=seen, chunks=chunks)
                    if seen:
                        raise DigestMismatch(f"object {info.bucket}/{info.name} was replaced while it was "
                                             f"read ({seen} of {chunks} chunks handed on)") from None
                    raise _Replaced(now) from None
                if time.monotonic() - last_chunk >= stall_s:
                    raise
                log.info("object_pull_again", bucket=info.bucket, object=info.name, chunks_seen=seen,
                         chunks=chunks, stalled_s=round(time.monotonic() - last_chunk, 1))
                continue                  # pull again: chunks already sent stay queued, in order
            last_chunk = time.monotonic()
            for msg in msgs:
                seen += 1
                sha.update(msg.data)
                got += len(msg.data)
                next_seq = int(msg.metadata.sequence.stream) + 1
                done = sink(msg.data)
                if done is not None:
                    await done
    finally:
        await _unsubscribe(psub)
    return got, sha


async def delete_object(js: JetStreamContext, bucket: str, name: str) -> bool:
    """Delete an object, best effort: False when it (or its bucket) was already gone, or when the bus failed
    (logged as `object_delete_failed`; a later prune tries again)."""
    try:
        store = await js.object_store(bucket)
        await store.delete(name)
    except nats.js.errors.NotFoundError:
        return False
    except (nats.errors.Error, TimeoutError) as err:
        log.warning("object_delete_failed", bucket=bucket, object=name, error=repr(err))
        return False
    return True
