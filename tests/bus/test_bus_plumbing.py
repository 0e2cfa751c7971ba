"""The shared bus plumbing against a real nats-server: the one object downloader (digests of the store and
of the announcement, empty and multi-chunk objects, missing ones, best-effort deletes), KV compare-and-set
(create, stale revision, over a delete marker, no lost update between concurrent advances), and stream
history (read as of the start while a writer keeps going, bad messages skipped, the last good message), and
the one retry policy where a call site uses it (a sandbox request nobody answers)."""

from __future__ import annotations

import base64
import json

import anyio
import nats.js.errors
import pytest
from nats.js.api import StreamConfig
from structlog.testing import capture_logs

from rlbus.actors.common.sandbox_client import run_in_sandbox
from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import DigestMismatch, SandboxCrashed
from rlbus.messages.history import last_message, read_all, read_messages, read_raw
from rlbus.messages.kv import KeyEntry, advance, put_at, read_key
from rlbus.messages.objects import OBJECT_CHUNK, delete_object, digest, fetch_object, put_object
from rlbus.messages.schemas import CheckpointMark, SandboxRequest, Task

pytestmark = pytest.mark.anyio


# ---- objects --------------------------------------------------------------------------------------
async def test_fetch_object_round_trips_and_checks_both_digests(admin_bus: Bus) -> None:
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    await js.create_object_store(bucket)
    blob = bytes(range(256)) * (3 * OBJECT_CHUNK // 256 + 7)           # three full chunks and a bit
    d = await put_object(js, bucket, "big", blob)
    assert d == digest(blob)
    assert await fetch_object(js, bucket, "big", expected_digest=d) == blob
    assert await admin_bus.get_object(bucket, "big", expected_digest=d) == blob
    assert await fetch_object(js, bucket, "empty", expected_digest=await put_object(js, bucket, "empty", b"")) == b""
    with pytest.raises(DigestMismatch, match=r"big: digest .* != announced"):
        await fetch_object(js, bucket, "big", expected_digest=digest(b"other"))
    with pytest.raises(nats.js.errors.NotFoundError):
        await fetch_object(js, bucket, "never-written")


async def test_fetch_object_reads_the_chunks_its_metadata_names_and_refuses_a_mismatch(admin_bus: Bus) -> None:
    """A chunk added behind the store's back is not part of the object (the download reads the chunks the
    metadata counts); metadata rewritten to count it makes the bytes disagree with its digest: refused by name."""
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    store = await js.create_object_store(bucket)
    await put_object(js, bucket, "obj", b"x" * 1000)
    info = await store.get_info("obj")
    await js.publish(f"$O.{bucket}.C.{info.nuid}", b"tampered")
    assert await fetch_object(js, bucket, "obj") == b"x" * 1000
    info.size, info.chunks = 1008, 2
    meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(b'obj').decode()}"
    await js.publish(meta, json.dumps(info.as_dict()).encode(), headers={"Nats-Rollup": "sub"})
    with pytest.raises(DigestMismatch, match=r"obj: 1008 bytes .* says 1008 bytes"):
        await fetch_object(js, bucket, "obj")


async def test_delete_object_is_best_effort(admin_bus: Bus) -> None:
    js, bucket = admin_bus.js, admin_bus.subjects.checkpoint_bucket()
    await js.create_object_store(bucket)
    await put_object(js, bucket, "obj", b"abc")
    assert await delete_object(js, bucket, "obj") is True
    assert await delete_object(js, bucket, "obj") is False
    assert await delete_object(js, "no_such_bucket", "obj") is False
    with pytest.raises(nats.js.errors.NotFoundError):
        await fetch_object(js, bucket, "obj")


# ---- KV compare-and-set ---------------------------------------------------------------------------
async def test_put_at_creates_updates_and_refuses_a_stale_revision(admin_bus: Bus) -> None:
    js, bucket = admin_bus.js, admin_bus.subjects.partials_bucket("hub")
    kv = await js.create_key_value(bucket=bucket, history=1)
    assert await read_key(js, bucket, "k.1") == KeyEntry(None, 0)
    first = await put_at(js, bucket, "k.1", b"one", revision=None)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await put_at(js, bucket, "k.1", b"again", revision=None)          # it exists: no create
    second = await put_at(js, bucket, "k.1", b"two", revision=first)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await put_at(js, bucket, "k.1", b"late", revision=first)           # someone wrote since
    assert await read_key(js, bucket, "k.1") == KeyEntry(b"two", second)
    assert (await kv.get("k.1")).value == b"two"
    await kv.delete("k.1")
    deleted = await read_key(js, bucket, "k.1")
    assert deleted.value is None and deleted.revision > second
    third = await put_at(js, bucket, "k.1", b"three", revision=None)       # over the delete marker
    assert (await kv.get("k.1")).value == b"three" and (await kv.get("k.1")).revision == third


async def test_concurrent_advances_lose_no_update(admin_bus: Bus) -> None:
    """Twenty read-increment-write advances at once: every one counts (a lost race reads again)."""
    js, bucket = admin_bus.js, admin_bus.subjects.latest_bucket("hub")
    await js.create_key_value(bucket=bucket, history=1)

    def increment(entry: KeyEntry) -> bytes:
        return str(int(entry.value or b"0") + 1).encode()

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(advance, js, bucket, "latest", increment)
    assert (await read_key(js, bucket, "latest")).value == b"20"
    assert await advance(js, bucket, "latest", lambda entry: None) is None
    assert (await read_key(js, bucket, "latest")).value == b"20"


# ---- stream history -------------------------------------------------------------------------------
def _mark(step: int, **overrides: object) -> CheckpointMark:
    fields: dict[str, object] = {"step": step, "policy_version": step, "objects": [f"s{step}"],
                                 "digests": [digest(b"x")], "consumed_rollout_ids": []}
    return CheckpointMark(**{**fields, **overrides})  # type: ignore[arg-type]


async def test_history_reads_what_was_stored_at_the_start_while_a_writer_keeps_going(admin_bus: Bus) -> None:
    js, s = admin_bus.js, admin_bus.subjects
    await js.add_stream(StreamConfig(name=s.checkpoints_stream(), subjects=[s.checkpoints()]))
    assert await read_raw(js, s.checkpoints_stream(), s.checkpoints()) == []
    await admin_bus.publish_batch([(s.checkpoints(), _mark(i), None) for i in range(600)])
    writing = anyio.Event()

    async def keep_writing() -> None:
        writing.set()
        for i in range(600, 2000):
            await admin_bus.publish(s.checkpoints(), _mark(i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_writing)
        await writing.wait()
        read = await read_all(js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
        tg.cancel_scope.cancel()
    assert [m.step for m in read] == list(range(len(read)))
    assert 600 <= len(read) < 2000


async def test_bad_messages_are_skipped_and_the_last_good_one_is_found(admin_bus: Bus) -> None:
    js, s = admin_bus.js, admin_bus.subjects
    stream, subject = s.checkpoints_stream(), s.checkpoints()
    await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
    assert await last_message(js, stream, subject, CheckpointMark) is None
    await admin_bus.publish(subject, _mark(1))
    await admin_bus.publish(subject, _mark(2))
    await js.publish(subject, b"\xc1 not msgpack")
    bad_digest, _ = codec.encode(_mark(3, digests=["md5:nope"]))        # decodes, fails messages/checks.py
    await js.publish(subject, bad_digest)
    task, _ = codec.encode(Task(task_id="t", prompt="p"))                # another kind
    await js.publish(subject, task)
    read = await read_messages(js, stream, subject, CheckpointMark)
    assert [(seq, m.step) for seq, m in read] == [(1, 1), (2, 2), (4, 3)]
    last = await last_message(js, stream, subject, CheckpointMark)
    assert last is not None and last.step == 2
    await admin_bus.publish(subject, _mark(5))
    last = await last_message(js, stream, subject, CheckpointMark)
    assert last is not None and last.step == 5


async def test_history_of_a_missing_stream_is_an_error(admin_bus: Bus) -> None:
    with pytest.raises(nats.js.errors.NotFoundError):
        await read_raw(admin_bus.js, "NO_SUCH_STREAM", ">")


# ---- the retry policy at a call site --------------------------------------------------------------
async def test_a_sandbox_request_nobody_answers_is_retried_then_refused(admin_bus: Bus) -> None:
    """No supervisor in the region: `attempts` tries, each wait logged, then SandboxCrashed naming it."""
    request = SandboxRequest(request_id="r-1", code="x = 1", tests="assert x == 1")
    with capture_logs() as logs, anyio.fail_after(30), pytest.raises(SandboxCrashed, match="r-1 failed 3 times"):
        await run_in_sandbox(admin_bus, "hub", request, timeout_s=0.5, attempts=3)
    retries = [e for e in logs if e["event"] == "sandbox_request_retry"]
    assert [e["attempt"] for e in retries] == [1, 2]
    assert all(e["request_id"] == "r-1" and e["region"] == "hub" for e in retries)
