"""Codec: round trips, schema evolution, plain-msgpack readability, and garbage never escapes as anything
but BadMessage."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import msgspec
import pytest
import torch
from helpers.samples import samples
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.messages import codec
from rlbus.messages.errors import BadMessage, UnsupportedSchema
from rlbus.messages.schemas import MESSAGE_TYPES, Rollout, Task, TensorBlob

FIXTURES = Path(__file__).parent / "fixtures"


def test_every_message_kind_has_a_sample() -> None:
    """The sample list covers the whole union, so the round-trip test covers every kind."""
    assert {type(m) for m in samples()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_round_trip(message: msgspec.Struct) -> None:
    """encode → decode gives back an equal message of the same type."""
    data, headers = codec.encode(message)
    assert codec.decode(data, headers) == message


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_committed_v1_fixtures_still_decode(message: msgspec.Struct) -> None:
    """Bytes written by schema v1 (committed files) decode to the same message today."""
    path = FIXTURES / f"{type(message).__name__}.v1.msgpack"
    assert codec.decode(path.read_bytes()) == message


def test_wire_format_is_a_named_map_readable_by_plain_msgpack() -> None:
    """Any MessagePack reader sees a map with the tag and named fields."""
    data = (FIXTURES / "Rollout.v1.msgpack").read_bytes()
    plain = msgpack.unpackb(data, raw=False)
    assert plain["kind"] == "rollout"
    assert plain["rollout_id"] == "r1"
    logprobs = plain["behaviour_logprobs"]
    assert logprobs["dtype"] == "float32" and logprobs["shape"] == [2]
    assert struct.unpack("<2f", logprobs["data"]) == (-0.5, -1.25)


def test_unknown_extra_field_is_skipped() -> None:
    """A newer producer's extra field does not break an older consumer."""
    plain = msgpack.unpackb((FIXTURES / "Task.v1.msgpack").read_bytes(), raw=False)
    plain["difficulty"] = "hard"
    decoded = codec.decode(msgpack.packb(plain))
    assert isinstance(decoded, Task) and decoded.task_id == "t1"


def test_newer_schema_is_refused() -> None:
    """A schema version above ours is UnsupportedSchema (dead-lettered), even when fields changed type."""
    plain = msgpack.unpackb((FIXTURES / "Task.v1.msgpack").read_bytes(), raw=False)
    plain["schema"] = 99
    with pytest.raises(UnsupportedSchema, match="schema 99"):
        codec.decode(msgpack.packb(plain))
    plain["group_size"] = "many"
    with pytest.raises(UnsupportedSchema):
        codec.decode(msgpack.packb(plain))


def test_bad_field_names_its_path() -> None:
    """A wrong type is a BadMessage naming the field."""
    plain = msgpack.unpackb((FIXTURES / "Rollout.v1.msgpack").read_bytes(), raw=False)
    plain["group_index"] = "two"
    with pytest.raises(BadMessage, match=r"\$\.group_index"):
        codec.decode(msgpack.packb(plain))


def test_large_payloads_are_compressed_and_flagged() -> None:
    """Above the threshold the payload is zstd and the header says so; below it stays plain."""
    big = Rollout(rollout_id="r", task_id="t", group_index=0, group_size=1,
                  prompt_tokens=TensorBlob.of([1] * 10_000, "int32"), completion_tokens=TensorBlob.of([2] * 10_000, "int32"),
                  behaviour_logprobs=TensorBlob.of([-0.1] * 10_000, "float32"),
                  policy_versions=TensorBlob.of([0] * 10_000, "int32"))
    data, headers = codec.encode(big)
    assert headers == {codec.ENCODING_HEADER: codec.ZSTD}
    assert len(data) < len(msgspec.msgpack.encode(big)) // 5
    assert codec.decode(data, headers) == big
    small, small_headers = codec.encode(samples()[0])
    assert small_headers == {}
    with pytest.raises(BadMessage, match="does not decompress"):
        codec.decode(small, {codec.ENCODING_HEADER: codec.ZSTD})
    with pytest.raises(BadMessage, match="unknown payload encoding"):
        codec.decode(small, {codec.ENCODING_HEADER: "gzip"})


def test_decode_as_refuses_other_kinds() -> None:
    """A consumer that wants Rollouts gets a BadMessage for a Task."""
    data, headers = codec.encode(samples()[0])
    with pytest.raises(BadMessage, match="expected a Rollout message, got Task"):
        codec.decode_as(data, headers, Rollout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
def test_tensor_blob_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    """Tensors travel as dtype/shape/raw bytes and come back bit-identical."""
    t = (torch.arange(24, dtype=torch.float32) - 7.5).reshape(2, 3, 4).to(dtype)
    back = codec.blob_to_tensor(codec.tensor_to_blob(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_per_token_arrays_read_back_as_lists() -> None:
    """TensorBlob.of / tolist round-trip per-token arrays exactly (float32 values that are exact)."""
    blob = TensorBlob.of([-0.5, 0.25, -8.0], "float32")
    assert blob.tolist() == [-0.5, 0.25, -8.0] and len(blob) == 3
    assert TensorBlob.of([], "int32").tolist() == []


def test_tensor_blob_with_wrong_size_is_bad() -> None:
    """A blob whose byte count does not fit its shape is refused."""
    blob = codec.tensor_to_blob(torch.zeros(4))
    with pytest.raises(BadMessage, match="needs 16 bytes"):
        codec.blob_to_tensor(msgspec.structs.replace(blob, data=blob.data[:-1]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_bad_message(data: bytes) -> None:
    """Garbage never raises anything but BadMessage."""
    try:
        codec.decode(data)
    except BadMessage:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([codec.encode(m)[0] for m in samples()]), st.data())
def test_mutated_messages_only_raise_bad_message(data: bytes, draw: st.DataObject) -> None:
    """Flipped, truncated or spliced valid messages decode or raise BadMessage, nothing else."""
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        op = draw.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= draw.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[pos:]
        else:
            buf[pos:pos] = draw.draw(st.binary(min_size=1, max_size=8))
    try:
        codec.decode(bytes(buf))
    except BadMessage:
        pass
