"""`put_object` pipelines its chunks and writes the object nats-py's object store reads: a replaced object's
old chunks are purged, an upload into a bucket that does not exist is refused, a window smaller than the
object's chunks still stores them in order, a `new` object (its metadata behind the chunks) reads back, and a
content-addressed object written again is kept (unless its chunks are gone), an upload whose metadata ack comes
too late leaves the chunks its metadata names; a download whose object is replaced under it reads the new one or is refused, never hangs."""

from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors
import pytest
from helpers import eventually
from nats.js import JetStreamContext
from nats.js.api import PubAck

from rlbus.messages import objects
from rlbus.messages.bus import Bus
from rlbus.messages.errors import DigestMismatch
from rlbus.messages.objects import OBJECT_CHUNK, digest, fetch_object, put_object, stream_object

pytestmark = pytest.mark.anyio


async def test_pipelined_put_replaces_an_object_purges_its_old_chunks_and_reads_back_with_nats_py(
        admin_bus: Bus) -> None:
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    store = await js.create_object_store(bucket)
    first = bytes(range(256)) * (5 * OBJECT_CHUNK // 256 + 3)          # six chunks, the last short
    second = bytes(reversed(range(256))) * (2 * OBJECT_CHUNK // 256)   # exactly two chunks
    assert await put_object(js, bucket, "obj", first, window=2) == digest(first)
    old = await store.get_info("obj")
    assert (old.size, old.chunks) == (len(first), 6)
    assert (await store.get("obj")).data == first                      # nats-py's own reader agrees
    assert await put_object(js, bucket, "obj", second) == digest(second)
    new = await store.get_info("obj")
    assert (new.size, new.chunks) == (len(second), 2) and new.nuid != old.nuid
    assert await fetch_object(js, bucket, "obj", expected_digest=digest(second)) == second
    stream = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    assert stream.state.subjects == {f"$O.{bucket}.C.{new.nuid}": 2}   # the first upload's chunks are gone
    with pytest.raises(nats.js.errors.NotFoundError):
        await put_object(js, "no_such_bucket", "obj", first)


async def test_a_new_object_goes_with_its_metadata_behind_the_chunks_and_reads_back(admin_bus: Bus) -> None:
    """`new=True` (no lookup, the metadata acked with the chunks) stores the same object: both readers agree."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    store = await js.create_object_store(bucket)
    blob = bytes(range(256)) * (3 * OBJECT_CHUNK // 256 + 11)
    assert await put_object(js, bucket, "fresh", blob, new=True, window=2) == digest(blob)
    info = await store.get_info("fresh")
    assert (info.size, info.chunks) == (len(blob), 4)
    assert (await store.get("fresh")).data == blob
    assert await fetch_object(js, bucket, "fresh", expected_digest=digest(blob)) == blob
    assert await fetch_object(js, bucket, "empty", expected_digest=await put_object(
        js, bucket, "empty", b"", new=True)) == b""
    with pytest.raises(nats.js.errors.APIError):              # no stream takes its chunks
        await put_object(js, "no_such_bucket", "fresh", blob, new=True)


async def test_a_content_addressed_object_written_again_with_the_same_bytes_is_kept(admin_bus: Bus) -> None:
    """`keep_same`: the same bytes under the same name leave the stored object (its nuid) as it is; other
    bytes replace it."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    store = await js.create_object_store(bucket)
    blob, other = b"config" * 1000, b"tokenizer" * 1000
    assert await put_object(js, bucket, "file", blob, keep_same=True) == digest(blob)
    first = await store.get_info("file")
    assert await put_object(js, bucket, "file", blob, keep_same=True) == digest(blob)
    assert (await store.get_info("file")).nuid == first.nuid
    assert await put_object(js, bucket, "file", blob) == digest(blob)            # without it: rewritten
    rewritten = await store.get_info("file")
    assert rewritten.nuid != first.nuid
    assert await put_object(js, bucket, "file", other, keep_same=True) == digest(other)
    assert (await store.get_info("file")).nuid != rewritten.nuid
    assert await fetch_object(js, bucket, "file", expected_digest=digest(other)) == other


async def test_a_content_addressed_object_whose_chunks_are_gone_is_written_again(admin_bus: Bus) -> None:
    """`keep_same` keeps an identical object only when the chunks its metadata counts are stored: metadata
    left without them (data lost) is replaced by a whole copy."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    store = await js.create_object_store(bucket)
    blob = bytes(range(256)) * (OBJECT_CHUNK // 256 + 7)                # two chunks
    assert await put_object(js, bucket, "file", blob, keep_same=True) == digest(blob)
    lost = await store.get_info("file")
    await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{lost.nuid}")
    assert await put_object(js, bucket, "file", blob, keep_same=True) == digest(blob)
    info = await store.get_info("file")
    assert info.nuid != lost.nuid
    assert await fetch_object(js, bucket, "file", expected_digest=digest(blob)) == blob


class _MetadataAckLate(JetStreamContext):
    """A context that gives up on the ack of an object's metadata before it can arrive, as a process stalled past
    the request's timeout does: the server stores the metadata, the uploader sees a timeout."""

    async def publish(self, subject: str, payload: bytes = b"", timeout: float | None = None,  # noqa: ASYNC109
                      stream: str | None = None, headers: dict[str, Any] | None = None,
                      msg_ttl: float | None = None) -> PubAck:
        if subject.startswith("$O.") and ".M." in subject:
            timeout = 1e-6
        return await super().publish(subject, payload, timeout=timeout, stream=stream, headers=headers,
                                      msg_ttl=msg_ttl)


@pytest.mark.parametrize("keep_same", [False, True])
async def test_an_upload_whose_metadata_ack_comes_too_late_leaves_the_chunks_its_metadata_names(
        admin_bus: Bus, keep_same: bool) -> None:
    """The metadata's ack comes after the timeout (the uploader stalled) while the server stores it: the upload
    is taken as done when the stored metadata is found to be its own, and its chunks are never purged. Purged,
    they would leave an object that every download waits on for its whole limit and that an upload of the same
    bytes with `keep_same` keeps."""
    bucket = admin_bus.subjects.checkpoint_bucket()
    store = await admin_bus.js.create_object_store(bucket)
    blob = bytes(range(256)) * (OBJECT_CHUNK // 256 + 7)                # two chunks
    try:
        assert await put_object(_MetadataAckLate(admin_bus.nc, timeout=5.0), bucket, "file", blob,
                                keep_same=keep_same) == digest(blob)
    except nats.errors.TimeoutError:
        pass                             # its metadata was not stored yet when the upload looked it up
    info = await eventually(lambda: store.get_info("file"), what="the late metadata stored",
                            ignoring=(nats.js.errors.NotFoundError,))
    chunks = await admin_bus.js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    assert chunks.state.subjects == {f"$O.{bucket}.C.{info.nuid}": 2}
    assert await fetch_object(admin_bus.js, bucket, "file", expected_digest=digest(blob)) == blob
    assert await put_object(admin_bus.js, bucket, "file", blob, keep_same=True) == digest(blob)
    assert await fetch_object(admin_bus.js, bucket, "file", expected_digest=digest(blob)) == blob


async def test_a_download_whose_object_is_replaced_before_its_chunks_arrive_reads_the_new_one(
        admin_bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer replacing the object between the reader's lookup and its pull purges the chunks the reader's
    consumer waits for: the reader looks the object up again and reads the new one, well within its limit."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    await js.create_object_store(bucket)
    await put_object(js, bucket, "file", b"old" * 100)
    read = objects._stream_chunks
    nuids: list[str] = []

    async def replaced_first(js_, store, info, sink, **kwargs):
        nuids.append(info.nuid)
        if len(nuids) == 1:                                # the object changes under the first reader
            await put_object(js, bucket, "file", b"new" * 100)
        return await read(js_, store, info, sink, **kwargs)

    monkeypatch.setattr(objects, "_stream_chunks", replaced_first)
    monkeypatch.setattr(objects, "PULL_S", 0.5)
    assert await fetch_object(js, bucket, "file", timeout_s=20) == b"new" * 100
    assert len(nuids) == 2 and nuids[0] != nuids[1]


async def test_a_download_whose_object_is_replaced_midway_is_refused_by_digest(
        admin_bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced after its first chunk was handed on, the rest of the object is gone: the download is refused
    (DigestMismatch, which every reader treats as an unusable object) instead of hanging until its limit."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    await js.create_object_store(bucket)
    blob = bytes(range(256)) * (3 * OBJECT_CHUNK // 256)
    await put_object(js, bucket, "obj", blob)
    monkeypatch.setattr(objects, "PULL_S", 0.5)
    handed: list[int] = []

    async def replace_after_first(chunk: bytes) -> None:
        handed.append(len(chunk))
        if len(handed) == 1:
            await put_object(js, bucket, "obj", b"other")

    with pytest.raises(DigestMismatch, match="replaced while it was read"):
        await stream_object(js, bucket, "obj", replace_after_first, timeout_s=20, batch=1)
    assert handed == [OBJECT_CHUNK]


async def test_a_message_behind_a_new_object_is_stored_with_it_or_says_why_not(admin_bus: Bus) -> None:
    """`Behind`: a compare-and-set key write sent behind a new object lands with its revision; sent again on
    the old revision it is refused and says so, while the object itself is stored either way."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    await js.create_object_store(bucket)
    kv = await js.create_key_value(bucket="links")
    first = await kv.put("link", b"v0")
    blob = bytes(range(256)) * (2 * OBJECT_CHUNK // 256 + 5)
    cas = {"Nats-Expected-Last-Subject-Sequence": str(first)}
    behind = objects.Behind("$KV.links.link", b"v1", dict(cas))
    assert await put_object(js, bucket, "v1.from0", blob, new=True, behind=behind) == digest(blob)
    assert behind.error is None and behind.seq is not None and behind.seq > first
    entry = await kv.get("link")
    assert (entry.value, entry.revision) == (b"v1", behind.seq)
    stale = objects.Behind("$KV.links.link", b"v2", dict(cas))             # the revision before the last
    assert await put_object(js, bucket, "v2.from1", b"delta", new=True, behind=stale) == digest(b"delta")
    assert stale.seq is None and isinstance(stale.error, nats.js.errors.APIError)
    assert (await kv.get("link")).value == b"v1"
    assert await fetch_object(js, bucket, "v2.from1") == b"delta"
    with pytest.raises(ValueError, match="new object only"):
        await put_object(js, bucket, "v3.from2", b"x", behind=objects.Behind("$KV.links.link", b"v3"))
