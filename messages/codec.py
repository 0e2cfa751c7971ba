"""Bytes ↔ typed messages: MessagePack maps via msgspec, zstd above a threshold, tensors as raw bytes.

Owns: the wire encoding (compression is flagged by the `Rlbus-Encoding` NATS header, never guessed),
decoding with validation (`BadMessage` names the field path), schema-version refusal, and tensor ↔
`TensorBlob` conversion. Does not: route or publish (messages/bus.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgspec
import zstandard

from rlbus.messages.errors import BadMessage, UnsupportedSchema
from rlbus.messages.schemas import SCHEMA_VERSION, AnyMessage, Message, TensorBlob

if TYPE_CHECKING:
    import torch

ENCODING_HEADER: Final = "Rlbus-Encoding"
"""NATS header naming the payload encoding; absent means plain MessagePack."""
ZSTD: Final = "zstd"
COMPRESS_ABOVE: Final = 64 * 1024
"""Payloads larger than this many bytes are zstd-compressed. On loopback, compressing a ~50 KB Rollout
costs more CPU (~0.1-0.2 ms each way) than the bytes it saves; `rlbus bench bus` reports both."""
MAX_DECOMPRESSED: Final = 64 * 1024 * 1024
"""A compressed payload may not expand past this (guards against decompression bombs)."""

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(AnyMessage)

M = TypeVar("M", bound=Message)


class _Envelope(msgspec.Struct):
    """The two fields every message has; read when typed decoding fails, to tell old from broken."""

    kind: str = ""
    schema: int = 0


_ENVELOPE_DECODER: Final = msgspec.msgpack.Decoder(_Envelope)


def encode(message: Message, *, compress_above: int = COMPRESS_ABOVE) -> tuple[bytes, dict[str, str]]:
    """Encode a message; returns (payload, headers). Large payloads are zstd-compressed and flagged."""
    data = _ENCODER.encode(message)
    if len(data) > compress_above:
        packed = zstandard.ZstdCompressor(level=1).compress(data)
        if len(packed) < len(data) * 0.9:          # incompressible payloads travel plain: cheaper to read
            return packed, {ENCODING_HEADER: ZSTD}
    return data, {}


def unwrap(data: bytes, headers: Mapping[str, str] | None) -> bytes:
    """Undo the transport encoding named in `headers`; `BadMessage` for unknown or corrupt encodings."""
    encoding = (headers or {}).get(ENCODING_HEADER)
    if encoding is None:
        return data
    if encoding != ZSTD:
        raise BadMessage(f"unknown payload encoding {encoding!r} in header {ENCODING_HEADER}")
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_DECOMPRESSED)
    except zstandard.ZstdError as err:
        raise BadMessage(f"payload flagged {ZSTD} does not decompress: {err}") from None


def decode(data: bytes, headers: Mapping[str, str] | None = None) -> AnyMessage:
    """Decode any message. Raises `BadMessage` (with msgspec's `$.field` path) or `UnsupportedSchema`."""
    raw = unwrap(data, headers)
    try:
        message: AnyMessage = _DECODER.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as err:   # invalid UTF-8 escapes msgspec as the latter
        _refuse_newer_schema(raw)
        raise BadMessage(str(err)) from None
    if message.schema > SCHEMA_VERSION:
        raise UnsupportedSchema(
            f"{type(message).__name__} has schema {message.schema}; this build reads up to {SCHEMA_VERSION}"
        )
    return message


def decode_as(data: bytes, headers: Mapping[str, str] | None, kind: type[M]) -> M:
    """Decode and require one message type; any other kind is a `BadMessage` naming both."""
    message = decode(data, headers)
    if not isinstance(message, kind):
        raise BadMessage(f"expected a {kind.__name__} message, got {type(message).__name__}")
    return message


def _refuse_newer_schema(raw: bytes) -> None:
    try:
        envelope = _ENVELOPE_DECODER.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return
    if envelope.schema > SCHEMA_VERSION:
        raise UnsupportedSchema(
            f"message kind {envelope.kind!r} has schema {envelope.schema}; "
            f"this build reads up to {SCHEMA_VERSION}"
        )


def tensor_to_blob(tensor: torch.Tensor) -> TensorBlob:
    """A tensor as dtype name, shape and raw little-endian bytes (contiguous CPU copy)."""
    import torch  # heavy: only when tensors are actually sent

    t = tensor.detach().to("cpu").contiguous()
    width = t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if width > 1 and not _little_endian():
        raise BadMessage("big-endian hosts are not supported for tensor payloads")
    return TensorBlob(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), data=raw)


def blob_to_tensor(blob: TensorBlob) -> torch.Tensor:
    """Inverse of `tensor_to_blob`; `BadMessage` if the dtype is unknown or the byte count is wrong."""
    import torch

    dtype = getattr(torch, blob.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise BadMessage(f"unknown tensor dtype {blob.dtype!r}")
    count = 1
    for dim in blob.shape:
        if dim < 0:
            raise BadMessage(f"negative dimension in tensor shape {blob.shape}")
        count *= dim
    width = torch.empty((), dtype=dtype).element_size()
    if len(blob.data) != count * width:
        raise BadMessage(f"tensor {blob.dtype}{list(blob.shape)} needs {count * width} bytes, got {len(blob.data)}")
    if count == 0:
        return torch.empty(blob.shape, dtype=dtype)
    return torch.frombuffer(bytearray(blob.data), dtype=torch.uint8).view(dtype).reshape(blob.shape)


def _little_endian() -> bool:
    import sys

    return sys.byteorder == "little"


def to_builtins(message: Message) -> Any:
    """A message as plain dicts/lists (for JSON export and `rlbus replay`)."""
    return msgspec.to_builtins(message)
