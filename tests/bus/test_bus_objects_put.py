"""`put_object` pipelines its chunks and writes the object nats-py's object store reads: a replaced object's
old chunks are purged, an upload into a bucket that does not exist is refused, a window smaller than the
object's chunks still stores them in order, and a `new` object (its metadata behind the chunks) reads back."""

from __future__ import annotations

import nats.js.errors
import pytest

from rlbus.messages.bus import Bus
from rlbus.messages.objects import OBJECT_CHUNK, digest, fetch_object, put_object

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
