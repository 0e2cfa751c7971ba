"""Recording a run: its hub streams, read through ephemeral consumers, into one recording file.

- Owns: `RECORDED` (which hub streams a recording holds, under which label), `record()` (every recorded
  stream from its start into the file, until caught up or, with `follow`, until told to end) and `Progress`.
- Guarantee: segments are flushed every few seconds, so an interrupted recording loses little (the reader
  rebuilds a missing index).
- Does not: define the file format (ops/recording/format.py) or parse arguments (ops/recording/record.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import nats.js.errors
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from nats.aio.msg import Msg

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.history import Start, read_batches, stored_at, stream_count
from rlbus.messages.schemas import MESSAGE_TYPES, SCHEMA_VERSION, AnyMessage, Rollout
from rlbus.messages.subjects import Subjects
from rlbus.ops.recording.format import RecordingWriter

log = structlog.get_logger()

FLUSH_EVERY_S: Final = 5.0
CATCH_UP_S: Final = 60.0
"""After `finish`, the longest a recording waits to hold what the streams stored by then."""


def recorded_streams(subjects: Subjects) -> dict[str, tuple[str, str | None]]:
    """Label → (hub stream name, subject filter or None for all) of everything a recording holds."""
    return {
        "ROLLOUTS": (subjects.hub_rollouts_stream(), None),
        "TRAINLOG": (subjects.trainlog_stream(), subjects.trainlog()),
        "WEIGHTS": (subjects.weights_stream(), subjects.weights()),
        "CHECKPOINTS": (subjects.checkpoints_stream(), subjects.checkpoints()),
        "EVALS": (subjects.evals_stream(), subjects.evals()),
        "EVENTS": (subjects.events_stream(), subjects.all_events()),
    }


@dataclass(slots=True)
class Progress:
    """Counts so far, per stream label; `expected` is what the streams held when recording began."""

    started: float = field(default_factory=time.monotonic)
    counts: dict[str, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    missing: list[str] = field(default_factory=list)
    undecodable: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{label} {n}" + (f"/{self.expected[label]}" if self.expected.get(label) else "")
                 for label, n in sorted(self.counts.items())]
        return (f"recorded {self.total} messages ({', '.join(parts) or 'none yet'}), "
                f"{self.bytes_in / 1e6:.1f} MB, {self.total / elapsed:.0f} msg/s")


def versions_of(message: AnyMessage) -> tuple[int, int] | None:
    """(min, max) policy version a message is about: a rollout's token versions, else its one version."""
    if isinstance(message, Rollout):
        if len(message.policy_versions.data) == 0:
            return None
        array = message.policy_versions.numpy()
        return int(array.min()), int(array.max())
    for name in ("policy_version", "version"):
        value = getattr(message, name, None)
        if isinstance(value, int):
            return value, value
    return None


def _entry(label: str, msg: Msg) -> tuple[str, int, float, str, bytes, str, tuple[int, int] | None]:
    data = codec.unwrap(msg.data, msg.headers)
    try:
        message = codec.decode(data)
        kind, versions = _kind_of(message), versions_of(message)
    except BadMessage:
        kind, versions = "", None           # kept as it was: a recording is an archive, not a judge
    return label, int(msg.metadata.sequence.stream), stored_at(msg), msg.subject, data, kind, versions


def _kind_of(message: AnyMessage) -> str:
    return str(type(message).__struct_config__.tag)


async def record(bus: Bus, path: Path, *, follow: bool = False, duration_s: float | None = None,
                 labels: list[str] | None = None, stop: anyio.Event | None = None,
                 finish: anyio.Event | None = None,
                 on_progress: Callable[[Progress], None] | None = None, progress_every_s: float = 2.0) -> Progress:
    """Record the run's hub streams into `path`; returns the final counts.

    Reads every recorded stream from its start (concurrently), unwraps transport compression, notes each
    message's kind and policy versions for the index, and appends it through one writer task (compression
    and file I/O in a worker thread). Without `follow` it stops once every stream is caught up with what was
    stored when it began; with `follow` it goes on until cancelled (or `duration_s`, or `stop`; or, after
    `finish`, until it holds everything stored by then: how `rlbus up --record` ends), flushing segments
    every few seconds so an interrupted recording loses little (the reader rebuilds a missing index).

    `stop` ends the reading (as `duration_s` does) and lets everything read so far reach the file. `finish`
    ends it once everything the streams hold when it is set has been read (within `CATCH_UP_S`).
    """
    progress = Progress()
    streams = recorded_streams(bus.subjects)
    present: dict[str, tuple[str, str | None]] = {}
    for label, (stream, subject) in streams.items():
        if labels is not None and label not in labels:
            continue
        count = await stream_count(bus.js, stream)
        if count is None:
            progress.missing.append(label)
            log.warning("recorded_stream_missing", stream=stream, label=label)
            continue
        present[label] = (stream, subject)
        progress.expected[label] = count.messages
        progress.counts[label] = 0
    header = {"schema_version": SCHEMA_VERSION, "kinds": [t.__struct_config__.tag for t in MESSAGE_TYPES],
              "streams": {label: stream for label, (stream, _) in present.items()},
              "missing_streams": progress.missing, "follow": follow, "tool": "rlbus record"}
    writer = RecordingWriter(path, run=bus.subjects.run, header=header)
    send, receive = anyio.create_memory_object_stream[list[Any]](max_buffer_size=8)
    readers = anyio.CancelScope()
    try:
        async with anyio.create_task_group() as outer:
            if on_progress is not None:
                outer.start_soon(_report, progress, on_progress, progress_every_s)
            if stop is not None:
                outer.start_soon(_cancel_when, stop, readers)
            seen: dict[str, int] = {}
            if finish is not None:
                outer.start_soon(_cancel_when_caught_up, finish, readers, bus, present, seen)
            async with anyio.create_task_group() as inner:
                inner.start_soon(_write_all, writer, receive, progress)
                with readers, anyio.move_on_after(float("inf") if duration_s is None else duration_s):
                    async with send, anyio.create_task_group() as rtg:
                        for label, (stream, subject) in present.items():
                            rtg.start_soon(_read_one, bus, label, stream, subject, follow, send.clone(), seen)
            outer.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(writer.close)
    if on_progress is not None:
        on_progress(progress)
    return progress


async def _cancel_when(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    await stop.wait()
    scope.cancel()


async def _cancel_when_caught_up(finish: anyio.Event, scope: anyio.CancelScope, bus: Bus,
                                 present: dict[str, tuple[str, str | None]], seen: dict[str, int]) -> None:
    """Once `finish` is set: wait until every reader has passed the last sequence its stream held then, and
    cancel the readers (after `CATCH_UP_S` at most: a filter may skip a stream's last messages)."""
    await finish.wait()
    last: dict[str, int] = {}
    for label, (stream, _) in present.items():
        try:
            info = await bus.js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            continue
        if info.state.messages:
            last[label] = int(info.state.last_seq)
    with anyio.move_on_after(CATCH_UP_S) as bound:
        while behind := [label for label, seq in last.items() if seen.get(label, 0) < seq]:  # noqa: ASYNC110 - `seen` is advanced by the readers' task group; a bounded poll of it
            await anyio.sleep(0.1)
    if bound.cancelled_caught:
        log.warning("recording_catch_up_incomplete", streams=behind, seconds=CATCH_UP_S)
    scope.cancel()


async def _read_one(bus: Bus, label: str, stream: str, subject: str | None, follow: bool,
                    send: MemoryObjectSendStream[list[Any]], seen: dict[str, int]) -> None:
    async with send:
        try:
            async for msgs in read_batches(bus.js, stream, subject=subject, start=Start(), follow=follow):
                await send.send([(label, m) for m in msgs])
                seen[label] = int(msgs[-1].metadata.sequence.stream)
        except nats.js.errors.NotFoundError:
            log.warning("recorded_stream_gone", stream=stream)


def _encode_batch(writer: RecordingWriter, batch: list[Any], progress: Progress) -> None:
    for label, msg in batch:
        label, seq, at, subject, data, kind, versions = _entry(label, msg)
        if not kind:
            progress.undecodable += 1
        writer.add(label, seq, at, subject, data, kind=kind, versions=versions)
        progress.counts[label] = progress.counts.get(label, 0) + 1
        progress.bytes_in += len(data)


async def _write_all(writer: RecordingWriter, receive: MemoryObjectReceiveStream[list[Any]],
                     progress: Progress) -> None:
    """Append batches until every reader is done; flush open segments at least every FLUSH_EVERY_S."""
    last_flush = time.monotonic()
    async with receive:
        while True:
            batch: list[Any] | None = None
            with anyio.move_on_after(FLUSH_EVERY_S):
                try:
                    batch = await receive.receive()
                except anyio.EndOfStream:
                    return
            if batch:
                await anyio.to_thread.run_sync(_encode_batch, writer, batch, progress)
            if time.monotonic() - last_flush > FLUSH_EVERY_S:
                await anyio.to_thread.run_sync(writer.flush)
                last_flush = time.monotonic()


async def _report(progress: Progress, on_progress: Callable[[Progress], None], every_s: float) -> None:
    while True:
        await anyio.sleep(every_s)
        on_progress(progress)
