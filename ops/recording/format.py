"""The recording file: one self-describing file of a run's messages, readable with msgpack + zstandard.

- Owns: the on-disk format (layout in `RecordingWriter`, also in docs/recording.md), `RecordingWriter`
  (header, segments, index, trailer) and `RecordingReader` (index-driven reads that skip segments by stream,
  time and policy version; a sequential scan when the trailer is missing, e.g. after a crash).
- Does not: talk to a bus (ops/recording/recorder.py) or decode typed messages (ops/recording/playback.py).
"""

from __future__ import annotations

import io
import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final, NamedTuple

import msgpack
import zstandard

from rlbus.messages.errors import RlbusError

MAGIC: Final = b"RLBUSREC"
END_MAGIC: Final = b"RLBUSEND"
FORMAT: Final = "rlbus-recording"
FORMAT_VERSION: Final = 1
RECORD_FIELDS: Final = ("stream", "seq", "time", "subject", "data")
SEGMENT_RECORDS: Final = 1024
"""A segment is closed after this many records..."""
SEGMENT_BYTES: Final = 8 * 1024 * 1024
"""...or this many bytes of messages, whichever comes first."""
ZSTD_LEVEL: Final = 3
_U32: Final = struct.Struct("<I")
_TRAILER: Final = struct.Struct("<Q8s")


class RecordingError(RlbusError):
    """A file that is not a readable rlbus recording; the text says where it broke."""


class Record(NamedTuple):
    """One recorded message: stream label, stream sequence, stored time (unix s), subject, MessagePack bytes."""

    stream: str
    seq: int
    time: float
    subject: str
    data: bytes


@dataclass(slots=True)
class SegmentInfo:
    """One index entry: where a segment's zstd frame is and what it holds."""

    offset: int
    length: int
    count: int
    stream: str
    kinds: dict[str, int] = field(default_factory=dict)
    min_time: float = 0.0
    max_time: float = 0.0
    min_seq: int = 0
    max_seq: int = 0
    min_version: int | None = None
    max_version: int | None = None

    def as_map(self) -> dict[str, Any]:
        return {"offset": self.offset, "length": self.length, "count": self.count, "stream": self.stream,
                "kinds": self.kinds, "min_time": self.min_time, "max_time": self.max_time, "min_seq": self.min_seq,
                "max_seq": self.max_seq, "min_version": self.min_version, "max_version": self.max_version}


@dataclass(slots=True)
class _Pending:
    records: list[list[Any]] = field(default_factory=list)
    nbytes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)


class RecordingWriter:
    """Appends records to a new recording; `close()` writes the index and trailer (use it as a context manager).

    Not thread-safe: feed it from one task or thread. Records are plain tuples
    `Record(stream, seq, time, subject, data)`; `data` is the message's MessagePack map with the transport
    compression removed.

    Layout (integers little-endian):
      magic     8 bytes  b"RLBUSREC"
      header    u32 length H, then H bytes: a MessagePack map (format, format_version, run, created, ...)
      segments  each: u32 length L, then L bytes: one zstd frame whose content is a MessagePack array of
                records [stream, seq, time, subject, data] (str, int, float, str, bin), all of one stream
      index     a MessagePack map {"segments": [{offset, length, count, stream, kinds, min_time, max_time,
                min_seq, max_seq, min_version, max_version}, ...]}; offset/length locate the zstd frame
      trailer   16 bytes: u64 offset of the index, then b"RLBUSEND"
    """

    def __init__(self, path: str | os.PathLike[str], *, run: str, header: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.header: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "run": run,
                                       "created": time.time(), "record_fields": list(RECORD_FIELDS),
                                       "compression": "zstd", **(header or {})}
        self._file: BinaryIO = open(self.path, "wb")
        raw = msgpack.packb(self.header, use_bin_type=True)
        self._file.write(MAGIC + _U32.pack(len(raw)) + raw)
        self._zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        self._pending: dict[str, _Pending] = {}
        self.segments: list[SegmentInfo] = []
        self.count = 0
        self.closed = False

    def add(self, stream: str, seq: int, at: float, subject: str, data: bytes, *, kind: str = "",
            versions: tuple[int, int] | None = None) -> None:
        """Append one record; `kind` and `versions` (min, max policy version) feed the segment's index entry."""
        pending = self._pending.setdefault(stream, _Pending())
        pending.records.append([stream, int(seq), float(at), subject, bytes(data)])
        pending.nbytes += len(data) + len(subject) + 32
        if kind:
            pending.kinds[kind] = pending.kinds.get(kind, 0) + 1
        if versions is not None:
            pending.versions.extend(versions)
        self.count += 1
        if len(pending.records) >= SEGMENT_RECORDS or pending.nbytes >= SEGMENT_BYTES:
            self._write_segment(stream)

    def flush(self) -> None:
        """Close every open segment and push the bytes to the OS (a follow-mode checkpoint)."""
        for stream in list(self._pending):
            self._write_segment(stream)
        self._file.flush()

    def _write_segment(self, stream: str) -> None:
        pending = self._pending.pop(stream, None)
        if pending is None or not pending.records:
            return
        frame = self._zstd.compress(msgpack.packb(pending.records, use_bin_type=True))
        self._file.write(_U32.pack(len(frame)))
        offset = self._file.tell()
        self._file.write(frame)
        times = [r[2] for r in pending.records]
        seqs = [r[1] for r in pending.records]
        self.segments.append(SegmentInfo(
            offset=offset, length=len(frame), count=len(pending.records), stream=stream, kinds=pending.kinds,
            min_time=min(times), max_time=max(times), min_seq=min(seqs), max_seq=max(seqs),
            min_version=min(pending.versions) if pending.versions else None,
            max_version=max(pending.versions) if pending.versions else None))

    def close(self) -> None:
        """Write the last segments, the index and the trailer. Idempotent."""
        if self.closed:
            return
        self.flush()
        index_offset = self._file.tell()
        self._file.write(msgpack.packb({"segments": [s.as_map() for s in self.segments]}, use_bin_type=True))
        self._file.write(_TRAILER.pack(index_offset, END_MAGIC))
        self._file.close()
        self.closed = True

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordingReader:
    """Reads a recording: `header`, `segments` (the index) and `records(...)`, skipping segments by the index.

    :raises RecordingError: not a recording, or a newer format version than this build reads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: BinaryIO = open(self.path, "rb")
        try:
            self.header, self._data_start = self._read_header()
            self.complete = True
            self.segments = self._read_index()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[dict[str, Any], int]:
        head = self._file.read(len(MAGIC) + _U32.size)
        if len(head) < len(MAGIC) + _U32.size or head[:len(MAGIC)] != MAGIC:
            raise RecordingError(f"{self.path}: not an rlbus recording (no {MAGIC!r} magic at the start)")
        (size,) = _U32.unpack(head[len(MAGIC):])
        try:
            header = msgpack.unpackb(self._file.read(size), raw=False)
        except (ValueError, msgpack.UnpackException) as err:
            raise RecordingError(f"{self.path}: header does not unpack: {err}") from None
        if header.get("format") != FORMAT:
            raise RecordingError(f"{self.path}: header format {header.get('format')!r} is not {FORMAT!r}")
        if int(header.get("format_version", 0)) > FORMAT_VERSION:
            raise RecordingError(f"{self.path}: format version {header['format_version']}; this build reads up to "
                                 f"{FORMAT_VERSION} (upgrade rlbus)")
        return header, len(MAGIC) + _U32.size + size

    def _read_index(self) -> list[SegmentInfo]:
        size = self._file.seek(0, io.SEEK_END)
        if size >= self._data_start + _TRAILER.size:
            self._file.seek(size - _TRAILER.size)
            index_offset, magic = _TRAILER.unpack(self._file.read(_TRAILER.size))
            if magic == END_MAGIC and self._data_start <= index_offset < size:
                self._file.seek(index_offset)
                index = msgpack.unpackb(self._file.read(size - _TRAILER.size - index_offset), raw=False)
                return [SegmentInfo(**entry) for entry in index["segments"]]
        self.complete = False           # interrupted recording: rebuild the index by walking the segments
        return self._scan(size)

    def _scan(self, size: int) -> list[SegmentInfo]:
        found: list[SegmentInfo] = []
        pos = self._data_start
        while pos + _U32.size <= size:
            self._file.seek(pos)
            (length,) = _U32.unpack(self._file.read(_U32.size))
            if pos + _U32.size + length > size:
                break                    # a torn last segment
            try:
                records = self._segment_records(pos + _U32.size, length)
            except RecordingError:
                break
            times, seqs = [r[2] for r in records], [r[1] for r in records]
            found.append(SegmentInfo(offset=pos + _U32.size, length=length, count=len(records), stream=records[0][0],
                                     min_time=min(times), max_time=max(times), min_seq=min(seqs), max_seq=max(seqs)))
            pos += _U32.size + length
        return found

    def _segment_records(self, offset: int, length: int) -> list[list[Any]]:
        self._file.seek(offset)
        try:
            raw = zstandard.ZstdDecompressor().decompress(self._file.read(length))
            records = msgpack.unpackb(raw, raw=False)
        except (zstandard.ZstdError, ValueError, msgpack.UnpackException) as err:
            raise RecordingError(f"{self.path}: segment at offset {offset} does not decode: {err}") from None
        if not isinstance(records, list) or not records:
            raise RecordingError(f"{self.path}: segment at offset {offset} holds no records")
        return records

    @property
    def streams(self) -> list[str]:
        return sorted({s.stream for s in self.segments})

    def select(self, *, streams: Iterable[str] | None = None, since: float | None = None, until: float | None = None,
               versions: tuple[int | None, int | None] | None = None) -> list[SegmentInfo]:
        """Index entries that may hold matching records (a segment without versions is kept)."""
        wanted = set(streams) if streams is not None else None
        lo, hi = versions or (None, None)
        out = []
        for s in self.segments:
            if wanted is not None and s.stream not in wanted:
                continue
            if (since is not None and s.max_time < since) or (until is not None and s.min_time > until):
                continue
            if s.min_version is not None and s.max_version is not None and (
                    (lo is not None and s.max_version < lo) or (hi is not None and s.min_version > hi)):
                continue
            out.append(s)
        return out

    def read_segment(self, segment: SegmentInfo) -> Iterator[Record]:
        for stream, seq, at, subject, data in self._segment_records(segment.offset, segment.length):
            yield Record(stream, seq, at, subject, data)

    def records(self, **select: Any) -> Iterator[Record]:
        """Records in file order from the segments `select(**select)` keeps (callers filter records further)."""
        for segment in self.select(**select):
            yield from self.read_segment(segment)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
