"""Whole-model weight versions as one blob: encode a state dict against any base version, apply in place.

Owns: the blob layout (magic, index digest, zstd-compressed index, payloads concatenated in index
order), the per-version digest, and the thread pool over tensors. Does not own the per-tensor
encodings (`kernels/delta/codec.py`), object names or chunking (the publisher chunks the blob as bytes).

Blob: b"RLWD" | u8 format 2 | u32 LE index length | BLAKE3-16 of the index | index | payloads.
The index is `StateIndex` as a zstd-compressed MessagePack array. Format 1 (blake2b digests) is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

import blake3
import msgspec
import numpy as np
import zstandard
from torch import Tensor

from rlbus.kernels.delta.codec import (
    DIGEST_SIZE,
    BaseMismatch,
    DeltaCorrupt,
    Encoding,
    Patch,
    TensorHeader,
    check_payload,
    decode_payload_,
    digest_bytes,
    encode_tensor,
    tensor_digest,
)

MAGIC: Final = b"RLWD"
FORMAT: Final = 2
_PREFIX: Final = struct.Struct("<4sBI16s")
_INDEX_LEVEL: Final = 9
_POOL_FROM: Final = 1 << 16
"""Payload bytes from which a blob is decoded on the thread pool (the compiled decode releases the GIL)."""
_T = TypeVar("_T")
_R = TypeVar("_R")


class StateIndex(msgspec.Struct, frozen=True, array_like=True):
    """The index of a version blob: which tensors, how each is encoded, and the digests to check."""

    version_digest: bytes
    """`state_digest` of the new version's tensor digests."""
    base_digest: bytes | None
    """`state_digest` of the base version (None for a full snapshot)."""
    names: tuple[str, ...]
    headers: tuple[TensorHeader, ...]

    @property
    def digests(self) -> dict[str, bytes]:
        """Tensor digests of the new version by name."""
        return {n: h.digest for n, h in zip(self.names, self.headers, strict=True)}

    def count(self, encoding: Encoding) -> int:
        """Number of tensors stored with `encoding`."""
        return sum(h.encoding == encoding for h in self.headers)


def state_digest(digests: Mapping[str, bytes]) -> bytes:
    """BLAKE3-16 over the (name, tensor digest) pairs sorted by name, each name length-prefixed."""
    h = blake3.blake3()
    for name in sorted(digests):
        raw = name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + digests[name])
    return h.digest(DIGEST_SIZE)


def _pool_map(fn: Callable[[_T], _R], items: Sequence[_T], threads: int) -> list[_R]:
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, items))


def tensor_digests(tensors: Mapping[str, Tensor], *, threads: int = 2) -> dict[str, bytes]:
    """`tensor_digest` of every tensor, hashed on `threads` threads (BLAKE3 releases the GIL)."""
    names = sorted(tensors, key=lambda n: -tensors[n].numel())
    return dict(zip(names, _pool_map(lambda n: tensor_digest(tensors[n]), names, threads), strict=True))


def encode_state(new: Mapping[str, Tensor], old: Mapping[str, Tensor] | None = None, *,
                 digests: Mapping[str, bytes] | None = None, base_digest: bytes | None = None,
                 encodings: Collection[Encoding] | None = None, level: int = 1, threads: int = 2,
                 candidates: Mapping[str, np.ndarray] | None = None,
                 changed: MutableMapping[str, np.ndarray] | None = None) -> tuple[StateIndex, bytes]:
    """Encode the version `new` against the base version `old` (None: a full snapshot) as one blob.

    Any base works (v-k -> v is `encode_state(v, v_minus_k)`). digests: the new version's tensor
    digests if already known (a version is hashed once, whatever it is encoded against);
    base_digest: the base's `state_digest` if known (else it is computed from `old`).
    candidates: per tensor, positions outside which new equals old (the union of the `changed` of every
    step between them: `merge_positions`); only those are compared. changed: filled per tensor with
    the positions that differ. -> (index, blob); the index is also inside the blob.
    """
    if old is not None and set(old) != set(new):
        raise ValueError(f"base and new version differ in tensors: only in new {sorted(set(new) - set(old))}"
                         f", only in base {sorted(set(old) - set(new))}")
    names = sorted(new)
    order = sorted(names, key=lambda n: -new[n].numel())  # big tensors first balance the pool
    found: dict[str, list[np.ndarray]] = {n: [] for n in names}
    encoded = dict(zip(order, _pool_map(
        lambda n: encode_tensor(new[n], None if old is None else old[n],
                                digest=None if digests is None else digests[n],
                                encodings=encodings if old is not None else None, level=level,
                                candidates=None if candidates is None else candidates[n], changed=found[n]),
        order, threads), strict=True))
    if changed is not None:
        changed.update((n, pos[0]) for n, pos in found.items() if pos)
    if old is not None and base_digest is None:
        base_digest = state_digest(tensor_digests(old, threads=threads))
    headers = tuple(encoded[n].header for n in names)
    index = StateIndex(version_digest=state_digest({n: encoded[n].header.digest for n in names}),
                       base_digest=base_digest if old is not None else None, names=tuple(names),
                       headers=headers)
    raw_index = zstandard.ZstdCompressor(level=_INDEX_LEVEL).compress(msgspec.msgpack.encode(index))
    parts = [_PREFIX.pack(MAGIC, FORMAT, len(raw_index), digest_bytes(raw_index)),
             raw_index, *(encoded[n].payload for n in names)]
    return index, b"".join(parts)


def _parse_index(view: bytes | memoryview) -> StateIndex:
    """The index of a blob starting with its prefix and index (payloads may follow or not yet have arrived).

    :raises DeltaCorrupt: wrong magic or format, index digest mismatch, or an index that does not decode.
    """
    view = memoryview(view)
    if len(view) < _PREFIX.size:
        raise DeltaCorrupt(f"blob of {len(view)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, fmt, ilen, idigest = _PREFIX.unpack_from(view)
    if magic != MAGIC or fmt != FORMAT:
        raise DeltaCorrupt(f"not a weight blob of format {FORMAT} (magic {bytes(magic)!r}, format {fmt})")
    raw_index = view[_PREFIX.size:_PREFIX.size + ilen]
    if len(raw_index) < ilen or digest_bytes(raw_index) != idigest:
        raise DeltaCorrupt("blob index fails its digest; fetch the blob again or a full snapshot")
    try:
        index = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(raw_index), type=StateIndex)
    except (msgspec.DecodeError, zstandard.ZstdError) as err:
        raise DeltaCorrupt(f"blob index passes its digest but does not decode: {err}") from err
    if len(index.names) != len(index.headers):
        raise DeltaCorrupt(f"blob index lists {len(index.names)} names and {len(index.headers)} headers")
    return index


def read_index(blob: bytes | memoryview) -> tuple[StateIndex, int]:
    """Parse and check a blob's index: -> (index, offset of the first payload).

    :raises DeltaCorrupt: wrong magic or format, index digest mismatch, or sizes that do not add up.
    """
    view = memoryview(blob)
    index = _parse_index(view)
    start = _PREFIX.size + _PREFIX.unpack_from(view)[2]
    if len(index.names) != len(index.headers) or start + sum(h.size for h in index.headers) != len(view):
        raise DeltaCorrupt(f"blob holds {len(view) - start} payload bytes, its index lists "
                           f"{sum(h.size for h in index.headers)}")
    return index, start


def apply_state_(target: MutableMapping[str, Tensor], blob: bytes | memoryview, *,
                 expect_base: bytes | None = None, verify: bool = False, threads: int = 2,
                 patches: MutableMapping[str, Patch | None] | None = None) -> StateIndex:
    """Apply a version blob in place: `target` holds the base version and ends holding the new one.

    patches: filled per tensor with what changed (`decode_payload_`): a `Patch` for sparse and bitmask
    payloads, None where the tensor was rewritten whole; replaying them brings another copy of the base
    to the new version without decoding again (a live model next to its staging buffers).
    Every payload digest is checked before any tensor is touched. expect_base: the `state_digest`
    of the version `target` holds; a delta against another base raises BaseMismatch. verify=True
    also hashes every applied tensor against its digest (a full pass over the model).
    :raises DeltaCorrupt: a digest or structure check fails; :raises BaseMismatch;
    :raises ValueError: the target's tensors do not match the index.
    """
    index, off = read_index(blob)
    if expect_base is not None and index.base_digest is not None and index.base_digest != expect_base:
        raise BaseMismatch(f"delta is against base {index.base_digest.hex()}, target holds "
                           f"{expect_base.hex()}; fetch the delta from the held version or a full snapshot")
    if set(target) != set(index.names):
        missing, extra = sorted(set(index.names) - set(target)), sorted(set(target) - set(index.names))
        raise ValueError(f"target and blob differ in tensors: missing {missing}, extra {extra}")
    view = memoryview(blob)
    jobs = []
    for name, header in zip(index.names, index.headers, strict=True):
        payload = view[off:off + header.size]
        check_payload(header, payload)
        jobs.append((name, header, payload))
        off += header.size
    jobs.sort(key=lambda j: -j[1].size)
    done = _pool_map(lambda j: decode_payload_(target[j[0]], j[1], j[2], verify=verify, check=False), jobs,
                     threads if sum(h.size for h in index.headers) > _POOL_FROM or verify else 1)
    if patches is not None:
        patches.update((j[0], patch) for j, patch in zip(jobs, done, strict=True))
    return index


class StreamApplier:
    """`apply_state_` of a blob that arrives in pieces: `feed` each piece in order, then `finish`.

    Each payload is checked and decoded into `target` as soon as its last byte arrives, so at most one payload
    (the largest tensor's) is held besides the piece fed: a full snapshot streams into staging buffers without
    the whole blob in memory. `make_target(index)` is called once, when the index is read, and returns the
    mapping to write into (the staging buffers, allocated or reused for the index's shapes).
    `target` is partly written when a later check fails: use it only after `finish` returned.

    :raises DeltaCorrupt: a digest or structure check fails (from `feed` or `finish`); :raises BaseMismatch;
    :raises ValueError: the target's tensors do not match the index.
    """

    def __init__(self, make_target: Callable[[StateIndex], MutableMapping[str, Tensor]], *,
                 expect_base: bytes | None = None, verify: bool = False,
                 patches: MutableMapping[str, Patch | None] | None = None) -> None:
        self._make_target = make_target
        self._expect_base = expect_base
        self._verify = verify
        self._patches = patches
        self._head = bytearray()
        self._index: StateIndex | None = None
        self._target: MutableMapping[str, Tensor] | None = None
        self._next = 0
        self._buffer = bytearray()
        self.received = 0
        self.peak_buffer = 0
        """Largest number of bytes held at once (the head or one payload's pieces), for benchmarks."""

    @property
    def index(self) -> StateIndex | None:
        return self._index

    def feed(self, piece: bytes | memoryview) -> None:
        """The next bytes of the blob."""
        view = memoryview(piece)
        self.received += len(view)
        while self._index is None and len(view):
            want = _PREFIX.size if len(self._head) < _PREFIX.size else _PREFIX.size + _PREFIX.unpack_from(self._head)[2]
            take = max(0, want - len(self._head))
            self._head += view[:take]
            view = view[take:]
            self.peak_buffer = max(self.peak_buffer, len(self._head))
            if len(self._head) >= _PREFIX.size and len(self._head) == _PREFIX.size + _PREFIX.unpack_from(self._head)[2]:
                self._read_head()
        while len(view):
            view = self._take(view)

    def _read_head(self) -> None:
        head = bytes(self._head)
        index = _parse_index(head)
        if self._expect_base is not None and index.base_digest is not None and index.base_digest != self._expect_base:
            raise BaseMismatch(f"delta is against base {index.base_digest.hex()}, target holds "
                               f"{self._expect_base.hex()}; fetch the delta from the held version or a full snapshot")
        target = self._make_target(index)
        if set(target) != set(index.names):
            missing, extra = sorted(set(index.names) - set(target)), sorted(set(target) - set(index.names))
            raise ValueError(f"target and blob differ in tensors: missing {missing}, extra {extra}")
        self._index, self._target = index, target
        self._head = bytearray()

    def _take(self, view: memoryview) -> memoryview:
        """Consume bytes of the current payload from `view`; decode it once complete. -> the rest of `view`."""
        index, target = self._index, self._target
        assert index is not None and target is not None
        if self._next >= len(index.headers):
            raise DeltaCorrupt(f"blob holds more than the {sum(h.size for h in index.headers)} payload bytes its "
                               f"index lists")
        header = index.headers[self._next]
        need = header.size - len(self._buffer)
        if not self._buffer and len(view) >= header.size:
            payload, rest = view[:header.size], view[header.size:]      # the whole payload in this piece
        else:
            self._buffer += view[:need]
            self.peak_buffer = max(self.peak_buffer, len(self._buffer))
            rest = view[need:]
            if len(self._buffer) < header.size:
                return rest
            payload = memoryview(self._buffer)
        name = index.names[self._next]
        patch = decode_payload_(target[name], header, payload, verify=self._verify)
        if self._patches is not None:
            self._patches[name] = patch
        self._buffer = bytearray()
        self._next += 1
        return rest

    def finish(self) -> StateIndex:
        """After the last piece: -> the index. :raises DeltaCorrupt: the blob ended early."""
        while (self._index is not None and self._next < len(self._index.headers)
               and self._index.headers[self._next].size == 0 and not self._buffer):
            self._take(memoryview(b""))                  # empty tensors at the end have no bytes to wait for
        if self._index is None or self._next != len(self._index.headers) or self._buffer:
            listed = sum(h.size for h in self._index.headers) if self._index is not None else "?"
            raise DeltaCorrupt(f"blob ended after {self.received} bytes, before its index's {listed} payload bytes")
        return self._index
