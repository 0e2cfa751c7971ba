"""`rlbus record` and `rlbus replay` on a real 3-region bus: the recording holds every hub stream and reads
back with plain msgpack + zstandard; filters select what the hand-made table says; JSONL export round-trips;
publishing back onto a new run reproduces the same rollout ids in the same regions, once."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
import zstandard
from helpers import new_run
from helpers.ops import json_in, run_cli

from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.history import read_stream, stream_count
from rlbus.messages.schemas import (
    EvalReport,
    Event,
    Rollout,
    SandboxVerdict,
    TensorBlob,
    TrainStep,
    WeightManifest,
)
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.ops.recording import replay
from rlbus.ops.recording.format import RecordingReader, RecordingWriter
from rlbus.ops.recording.playback import load_jsonl
from rlbus.topology.backends.launch import RUN_FILE, Endpoints, write_run_file
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

REGIONS = ("eu", "us", "hub")


def rollout(i: int) -> Rollout:
    """Rollout i of the table: region eu/us/hub by i % 3, token versions [v, v, v + i % 2] with v = i // 3,
    reward min(1, i / 10), task t{i % 4}."""
    v = i // 3
    return Rollout(rollout_id=f"r{i}", task_id=f"t{i % 4}", group_index=0, group_size=1,
                   prompt_tokens=TensorBlob.of([1, 2, 3], "int32"), completion_tokens=TensorBlob.of([7, 8, 9], "int32"),
                   behaviour_logprobs=TensorBlob.of([-0.5, -0.25, -1.0], "float32"),
                   policy_versions=TensorBlob.of([v, v, v + i % 2], "int32"), reward=min(1.0, i / 10),
                   verdict=SandboxVerdict(passed=i % 2, total=1, status="ok"), region=REGIONS[i % 3])


def read_plain(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[tuple[str, int, float, str, Any]]]:
    """The whole file with nothing but msgpack and zstandard: header, index, records (data unpacked)."""
    blob = path.read_bytes()
    assert blob[:8] == b"RLBUSREC"
    (header_len,) = struct.unpack_from("<I", blob, 8)
    header = msgpack.unpackb(blob[12:12 + header_len])
    index_offset, end_magic = struct.unpack_from("<Q8s", blob, len(blob) - 16)
    assert end_magic == b"RLBUSEND"
    index = msgpack.unpackb(blob[index_offset:len(blob) - 16])
    records = []
    for seg in index["segments"]:
        assert struct.unpack_from("<I", blob, seg["offset"] - 4)[0] == seg["length"]
        frame = blob[seg["offset"]:seg["offset"] + seg["length"]]
        for stream, seq, at, subject, data in msgpack.unpackb(zstandard.ZstdDecompressor().decompress(frame)):
            assert stream == seg["stream"]
            records.append((stream, seq, at, subject, msgpack.unpackb(data)))
    return header, index, records


@pytest.fixture
async def recorded(regions: RegionSet, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A 3-region run with 12 rollouts (4 per region), 3 TrainSteps, 3 manifests, 2 evals, 2 events, recorded."""
    run = new_run()
    admin = regions.credentials("admin")
    state = tmp_path / "state"
    state.mkdir()
    write_run_file(state / RUN_FILE, run, Endpoints(
        urls={r: (regions.url(r),) for r in regions.regions}, domains=regions.domains, hub="hub",
        credentials={r: regions.base_dir / CREDENTIALS_NAME for r in regions.regions}))
    bus = await Bus.connect(regions.url("hub"), run=run, domain="hub",
                            options=ConnectOptions(user=admin.user, password=admin.password))
    try:
        await provision_run(bus.nc, bus.subjects, hub="hub", domains=regions.domains, settings=StreamSettings.tiny())
        s = bus.subjects
        await bus.publish_batch([(s.rollouts(REGIONS[i % 3]), rollout(i), f"r{i}") for i in range(12)])
        others = [(s.trainlog(), TrainStep(step=k, policy_version=k + 1, kl=0.1 * k), None) for k in range(3)]
        others += [(s.weights(), WeightManifest(version=k + 1), None) for k in range(3)]
        others += [(s.evals(), EvalReport(policy_version=v, task_seed=7, n=10, pass_at_1=0.5, ci_low=0.2, ci_high=0.8),
                    None) for v in (1, 3)]
        others += [(s.events(r, "generator"), Event(event="started", actor_id=f"g-{r}", region=r), None)
                   for r in ("eu", "hub")]
        await bus.publish_batch(others)
        with anyio.fail_after(30):                   # the hub's ROLLOUTS sources the three regions' streams
            while (count := await stream_count(bus.js, s.hub_rollouts_stream())) is None or count.messages < 12:
                await anyio.sleep(0.1)
        path = tmp_path / "run.rlrec"
        assert await anyio.to_thread.run_sync(run_cli, ["record", "--state-dir", str(state), "-o", str(path), "-q"]) == 0
        yield {"run": run, "path": path, "state": state, "bus": bus, "regions": regions}
    finally:
        await bus.close()


@pytest.mark.anyio
async def test_recording_reads_with_plain_msgpack_and_zstandard(recorded: dict[str, Any]) -> None:
    """Header, index and every record come back without rlbus; messages are plain maps with their fields."""
    header, index, records = read_plain(recorded["path"])
    assert (header["format"], header["format_version"], header["run"]) == ("rlbus-recording", 1, recorded["run"])
    assert header["record_fields"] == ["stream", "seq", "time", "subject", "data"]
    kinds: dict[str, int] = {}
    for _, _, _, _, message in records:
        kinds[message["kind"]] = kinds.get(message["kind"], 0) + 1
    assert kinds == {"rollout": 12, "train_step": 3, "weight_manifest": 3, "eval_report": 2, "event": 2}
    rollouts = {m["rollout_id"]: (subject, m) for stream, _, _, subject, m in records if stream == "ROLLOUTS"}
    assert set(rollouts) == {f"r{i}" for i in range(12)}
    subject, r7 = rollouts["r7"]
    assert subject.endswith(".rollouts.us") and r7["region"] == "us" and r7["reward"] == 0.7
    assert (r7["policy_versions"]["dtype"], r7["policy_versions"]["shape"]) == ("int32", [3])
    assert struct.unpack("<3i", r7["policy_versions"]["data"]) == (2, 2, 3)
    seg = next(s for s in index["segments"] if s["stream"] == "ROLLOUTS")
    assert (seg["count"], seg["min_version"], seg["max_version"], seg["kinds"]) == (12, 0, 4, {"rollout": 12})


@pytest.mark.anyio
async def test_replay_filters_select_the_table(recorded: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Versions overlap, reward range, region, task id, kind and time window keep exactly the expected messages."""
    ids = lambda rs: {r.rollout_id for r in rs}  # noqa: E731
    with replay.open(recorded["path"]) as pb:
        everything = list(pb.entries())
        assert [e.time for e in everything] == sorted(e.time for e in everything)
        assert all(isinstance(r, Rollout) for r in pb.rollouts()) and ids(pb.rollouts()) == {f"r{i}" for i in range(12)}
        assert ids(pb.rollouts(versions=(2, 3))) == {"r3", "r5", "r6", "r7", "r8", "r9", "r10", "r11"}
        assert ids(pb.rollouts(rewards=(0.5, 0.8))) == {"r5", "r6", "r7", "r8"}
        assert ids(pb.rollouts(regions={"eu"})) == {"r0", "r3", "r6", "r9"}
        assert ids(pb.rollouts(task_ids="t1")) == {"r1", "r5", "r9"}
        assert ids(pb.rollouts(regions={"us"}, versions=(0, 1))) == {"r1", "r4"}
        assert len(list(pb.messages(versions=(2, 3)))) == 8 + 2 + 2 + 1      # rollouts, steps, manifests, evals
        assert [m.step for m in pb.messages(kinds={"train_step"})] == [0, 1, 2]   # type: ignore[attr-defined]
        assert sorted(type(m).__name__ for m in pb.messages(regions={"eu"})) == ["Event"] + ["Rollout"] * 4
        cut = everything[7].time
        assert list(pb.entries(since=cut)) == [e for e in everything if e.time >= cut]
        assert list(pb.entries(until=cut)) == [e for e in everything if e.time <= cut]
    with replay.open(recorded["path"], kinds={"rollout"}, rewards=(None, 0.2)) as pb:
        assert ids(pb) == {"r0", "r1", "r2"}                                   # filters given to open()
    capsys.readouterr()
    assert run_cli(["replay", str(recorded["path"]), "inspect", "--region", "eu", "--json"]) == 0
    summary = json_in(capsys.readouterr().out)
    assert summary["per_kind"] == {"rollout": 4, "event": 1}
    assert summary["reward"]["n"] == 4 and summary["reward"]["mean"] == pytest.approx((0 + 0.3 + 0.6 + 0.9) / 4)
    assert summary["pass_rate"] == 0.5 and summary["versions"] == [0, 4]       # r3, r9 pass; spans 0..4


@pytest.mark.anyio
@pytest.mark.parametrize("tensors", ["lists", "base64"])
async def test_export_jsonl_round_trips(recorded: dict[str, Any], tmp_path: Path, tensors: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every exported line loads back into the same typed message, stream, seq, time and subject."""
    out = tmp_path / f"export-{tensors}.jsonl"
    assert run_cli(["replay", str(recorded["path"]), "export", "--jsonl", str(out), "--tensors", tensors]) == 0
    back = list(load_jsonl(out))
    with replay.open(recorded["path"]) as pb:
        assert back == list(pb.entries())
    first = json_in(next(line for line in out.read_text().splitlines() if '"rollout_id": "r7"' in line))
    if tensors == "lists":
        assert first["message"]["policy_versions"] == {"dtype": "int32", "shape": [3], "values": [2, 2, 3]}
        assert first["message"]["behaviour_logprobs"]["values"] == [-0.5, -0.25, -1.0]
    else:
        assert isinstance(first["message"]["policy_versions"]["data"], str)


@pytest.mark.anyio
async def test_publish_back_reproduces_rollout_ids_on_a_new_run(recorded: dict[str, Any],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Publishing to a new run stores the same ids in the same regions; publishing again stores nothing new."""
    regions: RegionSet = recorded["regions"]
    new = recorded["run"][:-1] + "n"
    where = ["--state-dir", str(recorded["state"]), "--run", new]
    capsys.readouterr()
    publish = ["replay", str(recorded["path"]), "publish", *where]
    assert await anyio.to_thread.run_sync(run_cli, [*publish, "--provision"]) == 0
    assert "published 12 messages" in capsys.readouterr().out
    assert await anyio.to_thread.run_sync(run_cli, [*publish, "--speed", "1000"]) == 0
    assert "(12 already there)" in capsys.readouterr().out
    admin = regions.credentials("admin")
    bus = await Bus.connect(regions.url("hub"), run=new, domain="hub",
                            options=ConnectOptions(user=admin.user, password=admin.password))
    try:
        for region in ("eu", "us", "hub"):
            count = await stream_count(bus.jetstream(region), bus.subjects.rollouts_stream(region))
            assert count is not None and count.messages == 4
        with anyio.fail_after(30):
            while (c := await stream_count(bus.js, bus.subjects.hub_rollouts_stream())) is None or c.messages < 12:
                await anyio.sleep(0.1)
        found = {}
        async for msg in read_stream(bus.js, bus.subjects.hub_rollouts_stream()):
            message = msgpack.unpackb(msg.data)
            found[message["rollout_id"]] = msg.subject.rsplit(".", 1)[-1]
    finally:
        await bus.close()
    assert found == {f"r{i}": REGIONS[i % 3] for i in range(12)}


def test_interrupted_recording_is_scanned(tmp_path: Path) -> None:
    """Without index and trailer the reader walks the segments; a torn last segment is left out."""
    path = tmp_path / "cut.rlrec"
    writer = RecordingWriter(path, run="r")
    for i in range(6):
        writer.add("EVENTS", i + 1, 100.0 + i, "s", msgpack.packb({"kind": "event", "event": "started", "i": i}))
        if i % 2 == 1:
            writer.flush()                           # three segments of two records
    full = path.read_bytes()
    writer.close()
    path.write_bytes(full)
    with RecordingReader(path) as reader:
        assert not reader.complete and len(reader.segments) == 3
        assert [r.seq for r in reader.records()] == [1, 2, 3, 4, 5, 6]
        assert [s.min_time for s in reader.select(since=102.5)] == [102.0, 104.0]
    path.write_bytes(full[:-5])
    with RecordingReader(path) as reader:
        assert [r.seq for r in reader.records()] == [1, 2, 3, 4]
