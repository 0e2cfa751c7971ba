"""Typed access to a recording: filtered, time-ordered messages, a summary, and JSONL export/import.

- Owns: `Filters` and their meaning, `Playback` (iterate `Entry`s / typed messages / `Rollout`s in
  recorded-time order across streams, skipping segments through the index), `summarize()` (what
  `rlbus replay inspect` prints) and `export_jsonl()` / `load_jsonl()`;
  `rlbus.ops.recording.replay.open(path)` returns a `Playback`.
- Does not: publish (ops/recording/republish.py) or know the byte layout (ops/recording/format.py).
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from rlbus.messages import codec
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import AnyMessage, Event, Rollout, TensorBlob
from rlbus.ops.recording.format import Record, RecordingReader
from rlbus.ops.recording.recorder import versions_of

_STREAM_OF_KIND: Final = {"rollout": "ROLLOUTS", "train_step": "TRAINLOG", "weight_manifest": "WEIGHTS",
                          "checkpoint_mark": "CHECKPOINTS", "eval_report": "EVALS", "event": "EVENTS"}


@dataclass(frozen=True, slots=True)
class Filters:
    """Which recorded messages to keep: kind, policy-version range, reward range, region, task id, time window.

    Every filter given must hold; a filter on a field a message kind does not have excludes that message
    (e.g. `task_ids` keeps only rollouts). Versions: a rollout matches when the span [min, max] of its
    per-token policy versions overlaps the range; TrainStep, EvalReport and CheckpointMark use
    `policy_version`, WeightManifest `version`. Ranges are inclusive; None leaves that end open. Region: a
    rollout's `region` (else the last token of its subject), an Event's `region`.
    """

    kinds: frozenset[str] | None = None
    """Message kind tags: rollout, train_step, weight_manifest, checkpoint_mark, eval_report, event."""
    versions: tuple[int | None, int | None] | None = None
    rewards: tuple[float | None, float | None] | None = None
    regions: frozenset[str] | None = None
    task_ids: frozenset[str] | None = None
    since: float | None = None
    """Recorded (stream-stored) time, unix seconds, inclusive."""
    until: float | None = None

    @classmethod
    def of(cls, **kw: Any) -> Filters:
        """Filters from keyword arguments; sets accept any iterable or a single string."""
        for name in ("kinds", "regions", "task_ids"):
            value = kw.get(name)
            if value is not None:
                kw[name] = frozenset([value] if isinstance(value, str) else value)
        return cls(**kw)

    def streams(self) -> set[str] | None:
        """Stream labels that can hold matching messages (None: all)."""
        kinds = set(self.kinds) if self.kinds is not None else None
        if self.rewards is not None or self.task_ids is not None:
            kinds = (kinds or {"rollout"}) & {"rollout"}
        if kinds is None:
            return None
        return {_STREAM_OF_KIND[k] for k in kinds if k in _STREAM_OF_KIND}

    def keep(self, record: Record, message: AnyMessage) -> bool:
        if (self.since is not None and record.time < self.since) or (self.until is not None and record.time > self.until):
            return False
        if self.kinds is not None and kind_of(message) not in self.kinds:
            return False
        if self.versions is not None:
            span = versions_of(message)
            lo, hi = self.versions
            if span is None or (lo is not None and span[1] < lo) or (hi is not None and span[0] > hi):
                return False
        if self.rewards is not None:
            lo_r, hi_r = self.rewards
            if not isinstance(message, Rollout) or (lo_r is not None and message.reward < lo_r) or (
                    hi_r is not None and message.reward > hi_r):
                return False
        if self.task_ids is not None and not (isinstance(message, Rollout) and message.task_id in self.task_ids):
            return False
        if self.regions is not None and region_of(record, message) not in self.regions:
            return False
        return True


def kind_of(message: AnyMessage) -> str:
    """The wire tag of a message (`rollout`, `train_step`, ...)."""
    return str(type(message).__struct_config__.tag)


def region_of(record: Record, message: AnyMessage) -> str | None:
    """A rollout's region (else its subject's last token) or an event's region; None for other kinds."""
    if isinstance(message, Rollout):
        return message.region or record.subject.rsplit(".", 1)[-1]
    if isinstance(message, Event):
        return message.region or None
    return None


@dataclass(frozen=True, slots=True)
class Entry:
    """One recorded message with where and when it was stored."""

    stream: str
    seq: int
    time: float
    subject: str
    message: AnyMessage

    @property
    def kind(self) -> str:
        return kind_of(self.message)


@dataclass(slots=True)
class Playback:
    """A recording opened for reading; iterate it for typed messages in recorded-time order."""

    path: Path
    filters: Filters = field(default_factory=Filters)
    reader: RecordingReader = field(init=False)
    undecodable: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.reader = RecordingReader(self.path)

    @property
    def header(self) -> dict[str, Any]:
        return self.reader.header

    @property
    def run(self) -> str:
        return str(self.reader.header.get("run", ""))

    def entries(self, **filters: Any) -> Iterator[Entry]:
        """Matching entries of every stream merged by recorded time (the `Playback`'s filters, then these)."""
        f = _merge(self.filters, filters)
        segments = self.reader.select(streams=f.streams(), since=f.since, until=f.until, versions=f.versions)
        per_stream: dict[str, list[Any]] = {}
        for seg in segments:
            per_stream.setdefault(seg.stream, []).append(seg)
        iters = [self._stream_entries(segs, f) for segs in per_stream.values()]
        yield from heapq.merge(*iters, key=lambda e: (e.time, e.stream, e.seq))

    def _stream_entries(self, segments: list[Any], f: Filters) -> Iterator[Entry]:
        for seg in segments:
            for record in self.reader.read_segment(seg):
                try:
                    message = codec.decode(record.data)
                except BadMessage:
                    self.undecodable += 1
                    continue
                if f.keep(record, message):
                    yield Entry(record.stream, record.seq, record.time, record.subject, message)

    def __iter__(self) -> Iterator[AnyMessage]:
        return (e.message for e in self.entries())

    def messages(self, **filters: Any) -> Iterator[AnyMessage]:
        return (e.message for e in self.entries(**filters))

    def rollouts(self, **filters: Any) -> Iterator[Rollout]:
        """Typed `Rollout`s only, in recorded order (accepts the same filters)."""
        for entry in self.entries(**{**filters, "kinds": {"rollout"}}):
            assert isinstance(entry.message, Rollout)
            yield entry.message

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Playback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merge(base: Filters, extra: dict[str, Any]) -> Filters:
    if not extra:
        return base
    more = Filters.of(**extra)
    kw = {name: getattr(base, name) for name in Filters.__dataclass_fields__}
    for name in Filters.__dataclass_fields__:
        value = getattr(more, name)
        if value is not None:
            kw[name] = value
    return Filters(**kw)


def open_playback(path: str | os.PathLike[str], filters: Filters | None = None, **kw: Any) -> Playback:
    """Open a recording; `kw` are `Filters` fields (kinds, versions, rewards, regions, task_ids, since, until)."""
    return Playback(Path(path), _merge(filters or Filters(), kw))


# ---- summary ----------------------------------------------------------------------------------------
def summarize(entries: Iterator[Entry]) -> dict[str, Any]:
    """Counts per kind and region, reward and pass-rate stats, version and time ranges (plain values)."""
    per_kind: dict[str, int] = {}
    per_region: dict[str, dict[str, int]] = {}
    events: dict[str, int] = {}
    rewards: list[float] = []
    passed = graded = tokens = 0
    tasks: set[str] = set()
    vmin: int | None = None
    vmax: int | None = None
    tmin = tmax = None
    for e in entries:
        kind = e.kind
        per_kind[kind] = per_kind.get(kind, 0) + 1
        region = region_of(Record(e.stream, e.seq, e.time, e.subject, b""), e.message) or "-"
        per_region.setdefault(region, {})
        per_region[region][kind] = per_region[region].get(kind, 0) + 1
        tmin = e.time if tmin is None else min(tmin, e.time)
        tmax = e.time if tmax is None else max(tmax, e.time)
        span = versions_of(e.message)
        if span is not None:
            vmin = span[0] if vmin is None else min(vmin, span[0])
            vmax = span[1] if vmax is None else max(vmax, span[1])
        if isinstance(e.message, Rollout):
            rewards.append(e.message.reward)
            tasks.add(e.message.task_id)
            tokens += len(e.message.completion_tokens)
            if e.message.verdict.total > 0:
                graded += 1
                passed += int(e.message.verdict.passed == e.message.verdict.total)
        elif isinstance(e.message, Event):
            events[e.message.event] = events.get(e.message.event, 0) + 1
    reward: dict[str, float | int | None] = {"n": len(rewards)}
    if rewards:
        mean = sum(rewards) / len(rewards)
        reward |= {"mean": mean, "std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                   "min": min(rewards), "max": max(rewards)}
    return {"messages": sum(per_kind.values()), "per_kind": per_kind, "per_region": per_region, "events": events,
            "reward": reward, "pass_rate": passed / graded if graded else None, "graded": graded,
            "completion_tokens": tokens, "tasks": len(tasks), "versions": [vmin, vmax], "time": [tmin, tmax]}


# ---- JSONL ------------------------------------------------------------------------------------------
def _lists(value: TensorBlob) -> dict[str, Any]:
    try:
        return {"dtype": value.dtype, "shape": list(value.shape), "values": value.tolist()}
    except TypeError:                            # not a numpy dtype (e.g. bfloat16): keep the bytes
        return {"dtype": value.dtype, "shape": list(value.shape), "data": base64.b64encode(value.data).decode()}


def to_json_obj(entry: Entry, *, tensors: str = "lists") -> dict[str, Any]:
    """One export line: stream, seq, time, subject, kind and the message (tensors as lists or base64)."""
    message = _to_builtins_lists(entry.message) if tensors == "lists" else msgspec.to_builtins(entry.message)
    return {"stream": entry.stream, "seq": entry.seq, "time": entry.time, "subject": entry.subject,
            "kind": entry.kind, "message": message}


def _to_builtins_lists(message: AnyMessage) -> Any:
    out = msgspec.to_builtins(message)
    for name in message.__struct_fields__:
        value = getattr(message, name)
        if isinstance(value, TensorBlob):
            out[name] = _lists(value)
    return out


def export_jsonl(entries: Iterator[Entry], out: IO[str], *, tensors: str = "lists") -> int:
    """Write one JSON object per entry; returns how many."""
    n = 0
    for entry in entries:
        out.write(json.dumps(to_json_obj(entry, tensors=tensors)) + "\n")
        n += 1
    return n


def _blob_from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"dtype", "shape", "values"}:
        import numpy as np

        array = np.asarray(value["values"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        blob = TensorBlob.of(array, value["dtype"])
        return {"dtype": blob.dtype, "shape": list(blob.shape), "data": base64.b64encode(blob.data).decode()}
    return value


_JSON_DECODER: Final = msgspec.json.Decoder(AnyMessage)


def from_json_obj(obj: dict[str, Any]) -> Entry:
    """Inverse of `to_json_obj` (either tensor form).

    :raises BadMessage: the line is not an exported message.
    """
    try:
        message = {k: _blob_from_json(v) for k, v in obj["message"].items()}
        typed = _JSON_DECODER.decode(json.dumps(message))
        return Entry(str(obj["stream"]), int(obj["seq"]), float(obj["time"]), str(obj["subject"]), typed)
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as err:
        raise BadMessage(f"not an exported rlbus message: {err}") from None


def load_jsonl(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """Entries back from an `export_jsonl` file."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield from_json_obj(json.loads(line))
