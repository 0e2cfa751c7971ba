"""Lossless weight-delta codec: encode a tensor against a base of the same shape and dtype, apply in place.

- Owns: the four encodings (full snapshot, sparse, bitmask, dense XOR) and `encode_tensor`'s choice by size,
  per-tensor and per-version digests, `find_changes` (the torch reference of kernels/delta/device.py's
  Triton kernel), `apply_` and the full-snapshot-or-delta helpers (`snapshot_due`, `delta_base`).
- Guarantee: bit exact for every pattern (NaN payloads, +-Inf, +-0, subnormals); both CPU backends
  (`codec_backend`) write the same bytes.
- Does not: hold the one-blob-per-version format (kernels/delta/state.py) or own object names, chunking or
  upload (actors/publisher/).
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Collection, Sequence
from typing import Final, NamedTuple, TypeAlias

import blake3
import msgspec
import numpy as np
import numpy.ma  # numba's argument typing reads np.ma: imported here, not lazily in a worker thread
import torch
import zstandard
from torch import Tensor

from rlbus.kernels.delta import bitcode
from rlbus.kernels.delta.bitcode import get_varint, put_varint

DIGEST_SIZE: Final = 16
"""Bytes of a tensor or version digest (BLAKE3, truncated)."""
PAYLOAD_DIGEST_SIZE: Final = 8
"""Bytes of a payload digest (BLAKE3, truncated): detects corruption in transit."""
BITS: Final[dict[torch.dtype, torch.dtype]] = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                                               torch.float32: torch.int32}
DTYPES: Final[dict[str, torch.dtype]] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                         "float32": torch.float32}
_BITMASK_FROM: Final = 1 / 16
_DENSE_FROM: Final = 1 / 2
"""Fractions of changed elements from which the bitmask, dense and full candidates are tried too."""
_SCAN_WORDS: Final = 1 << 16
"""64-bit words per step of the fused hash-and-compare scan (512 KiB of each tensor: stays in L2)."""


Finder: TypeAlias = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
Patch: TypeAlias = tuple[np.ndarray, np.ndarray]
"""What a sparse or bitmask payload changed: (K,) int64 ascending positions, (K,) int16/int32 new bits."""


BACKENDS: Final = ("numba", "numpy")
"""CPU codec backends: compiled loops, and the numpy reference (always available)."""
_backend: list[str | None] = [None]
_compiled: list[types.ModuleType | None] = [None]


def codec_backend() -> str:
    """The CPU codec backend in use: "numba" when it imports (resolved on first use), else "numpy".

    The CPU hot loops (change scan, integer coder, sparse apply) run compiled (`kernels/delta/compiled.py`)
    under "numba", else on the numpy reference here and in `kernels/delta/bitcode.py`; both write the same
    bytes.
    """
    if _backend[0] is None:
        try:
            from rlbus.kernels.delta import compiled
        except ImportError:
            _backend[0] = "numpy"
        else:
            _compiled[0] = compiled
            _backend[0] = "numba"
    return _backend[0]


def set_codec_backend(name: str) -> str:
    """Use `name` (one of `BACKENDS`) from now on: -> the previous backend.

    :raises ValueError: an unknown name, or "numba" where numba does not import.
    """
    if name not in BACKENDS:
        raise ValueError(f"codec backend {name!r} is not one of {', '.join(BACKENDS)}")
    previous = codec_backend()
    if name == "numba" and _compiled[0] is None:
        raise ValueError("codec backend 'numba' is unavailable here: numba does not import")
    _backend[0] = name
    return previous


def _fast() -> types.ModuleType | None:
    """The compiled module when it is the backend in use, else None."""
    return _compiled[0] if codec_backend() == "numba" else None


class DeltaCorrupt(ValueError):
    """An encoded tensor or blob whose digest or structure does not check out: do not use it."""


class BaseMismatch(ValueError):
    """A delta encoded against a different base version than the one the target holds."""


class Encoding(enum.IntEnum):
    """How a tensor's payload is encoded."""

    FULL = 0
    """Byte planes of `new`, zstd."""
    SPARSE = 1
    """Count, gaps between changed positions (Rice/Exp-Golomb), ordered-key differences."""
    BITMASK = 2
    """Count, zstd of the changed-elements bitmask, ordered-key differences."""
    DENSE_XOR = 3
    """Byte planes of `old ^ new` over all elements, zstd."""


class TensorHeader(msgspec.Struct, frozen=True, array_like=True):
    """What a reader needs to check and apply one encoded tensor."""

    encoding: int
    dtype: str
    shape: tuple[int, ...]
    changed: int
    """Elements whose bits differ from the base (numel for a full snapshot)."""
    size: int
    """Payload bytes."""
    digest: bytes
    """BLAKE3-16 of the new tensor's raw little-endian bytes."""
    payload_digest: bytes
    """BLAKE3-8 of the payload."""


class EncodedTensor(msgspec.Struct, frozen=True):
    """One tensor encoded against a base (or none): header plus payload bytes."""

    header: TensorHeader
    payload: bytes


def bits_view(t: Tensor) -> Tensor:
    """The same storage reinterpreted as int16 (bf16, fp16) or int32 (fp32), flattened: (N,)."""
    if t.dtype not in BITS:
        raise TypeError(f"delta codec supports {', '.join(DTYPES)}; got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError("delta codec needs a contiguous tensor; call .contiguous() first")
    return t.detach().reshape(-1).view(BITS[t.dtype])


def digest_bytes(data: bytes | memoryview | np.ndarray, size: int = DIGEST_SIZE) -> bytes:
    """BLAKE3 of `data` (bytes, a byte memoryview or a uint8 array), truncated to `size` bytes."""
    return blake3.blake3(data).digest(size)


def tensor_digest(t: Tensor) -> bytes:
    """BLAKE3-16 of the raw little-endian bytes of `t` (contiguous; moved to CPU if needed)."""
    return digest_bytes(bits_view(t).cpu().numpy().view(np.uint8))


def find_changes(new_bits: Tensor, old_bits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Torch reference of the change-finding kernel; any device.

    new_bits, old_bits (N,) int16/int32 -> positions (K,) int64 of elements with new != old
    (ascending), gaps (K,) int64 with gaps[i] = pos[i] - pos[i-1] - 1 (pos[-1] = -1), and
    xor (K,) = new ^ old at those positions.
    """
    x = torch.bitwise_xor(new_bits.reshape(-1), old_bits.reshape(-1))
    pos = torch.nonzero(x).reshape(-1)
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)) - 1
    return pos, gaps, x[pos]


def changed_elements(new: np.ndarray, old: np.ndarray, hasher: blake3.blake3 | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CPU fast path of `find_changes`: (N,) int16/int32 arrays -> positions (K,) ascending int64 where
    they differ, and the new and old bits there (K,).

    Compares 64-bit words (4 or 2 elements at once) in L2-sized steps; the changed words of a step are
    gathered and split into lanes while the step is in cache (no random access over the whole tensor
    afterwards). hasher: also fed `new`'s raw bytes step by step (one pass over memory gives the changes
    and the tensor digest).
    """
    lanes = 8 // new.itemsize
    shift = lanes.bit_length() - 1
    body = new.size - new.size % lanes
    a64, b64 = new[:body].view(np.int64), old[:body].view(np.int64)
    raw = new.view(np.uint8)
    mask = np.empty(min(a64.size, _SCAN_WORDS), dtype=np.bool_)
    pos_parts, new_parts, old_parts = [], [], []
    for s in range(0, a64.size, _SCAN_WORDS):
        e = min(s + _SCAN_WORDS, a64.size)
        if hasher is not None:
            hasher.update(raw[8 * s:8 * e])
        m = mask[:e - s]
        a, b = a64[s:e], b64[s:e]
        np.not_equal(a, b, out=m)
        w = np.flatnonzero(m)
        if w.size:
            na, ob = a[w].view(new.dtype), b[w].view(new.dtype)   # (W * lanes,) the changed words' lanes
            lane = np.flatnonzero(na != ob)
            p = w[lane >> shift]
            p += s
            p <<= shift
            p += lane & (lanes - 1)
            pos_parts.append(p)
            new_parts.append(na[lane])
            old_parts.append(ob[lane])
    if hasher is not None and body < new.size:
        hasher.update(raw[8 * a64.size:])
    if body < new.size:
        tail = np.flatnonzero(new[body:] != old[body:]) + body
        pos_parts.append(tail)
        new_parts.append(new[tail])
        old_parts.append(old[tail])
    if not pos_parts:
        return np.zeros(0, dtype=np.int64), new[:0].copy(), old[:0].copy()
    if len(pos_parts) == 1:
        return pos_parts[0], new_parts[0], old_parts[0]
    return np.concatenate(pos_parts), np.concatenate(new_parts), np.concatenate(old_parts)


def ordered_key(bits: np.ndarray) -> np.ndarray:
    """Map float bit patterns (int16/int32) to integers that sort like the floats; an involution.

    key = b ^ ((b >> (w-1)) & (2**(w-1) - 1)): negative floats get their magnitude bits flipped.
    """
    w = bits.dtype.itemsize * 8
    return bits ^ ((bits >> (w - 1)) & bits.dtype.type((1 << (w - 1)) - 1))


def _unsigned(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"<u{dtype.itemsize}")


def key_diffs(new_vals: np.ndarray, old_vals: np.ndarray) -> np.ndarray:
    """(K,) int16/int32 bits -> (K,) same dtype d = key(new) - key(old) modulo 2**w as a signed value.

    d == 0 iff the bits are equal; one ulp up or down is +1 / -1 for every sign and exponent. Values of
    changed elements are coded as these differences of their *ordered keys* (a bijection of the bit pattern
    that sorts like the float), so a +-1 ulp step costs a sign bit whatever carry chain its XOR has; bit
    exactness holds for every pattern (NaN payloads, +-Inf, +-0, subnormals) because the arithmetic is
    modulo 2**bits. Positions are gaps coded with Rice / Exp-Golomb (`kernels/delta/bitcode.py`).
    """
    u = _unsigned(new_vals.dtype)
    return (ordered_key(new_vals).view(u) - ordered_key(old_vals).view(u)).view(new_vals.dtype)


def apply_key_diffs(old_vals: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Inverse of `key_diffs`: bits whose key is key(old) + d modulo 2**w, same dtype as `old_vals`."""
    u = _unsigned(old_vals.dtype)
    return ordered_key((ordered_key(old_vals).view(u) + d.astype(u)).view(old_vals.dtype))


def _encode_diffs(d: np.ndarray, out: bytearray) -> None:
    """Sign bits; escapes (|d| > 1) as gaps over the K values; escape magnitudes - 2."""
    out += bitcode.pack_flags(d < 0)
    esc = np.flatnonzero((d + d.dtype.type(1)).view(_unsigned(d.dtype)) > 2)  # d+1 in {0, 2} iff |d| == 1
    put_varint(out, esc.size)
    if esc.size:
        bitcode.encode_ints(bitcode.gaps(esc), out)
        bitcode.encode_ints(np.abs(d[esc].astype(np.int64)) - 2, out)


def _decode_diffs(buf: memoryview, off: int, count: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """Inverse of `_encode_diffs`: -> ((count,) d of `dtype`, offset past the code)."""
    neg, off = bitcode.unpack_flags(buf, off, count)
    d = (neg.view(np.uint8).astype(dtype) * dtype.type(-2)) + dtype.type(1)  # -1 where negative, else +1
    n_esc, off = get_varint(buf, off)
    if n_esc:
        if n_esc > count:
            raise ValueError(f"{n_esc} escapes among {count} values")
        gaps, off = bitcode.decode_ints(buf, off, n_esc)
        esc = np.cumsum(gaps + 1) - 1
        if esc[-1] >= count:
            raise ValueError("escape position past the last value")
        mags, off = bitcode.decode_ints(buf, off, n_esc)
        m = mags + 2
        d[esc] = np.where(neg[esc], -m, m).astype(dtype)
    return d, off


def _shuffle(bits: np.ndarray) -> np.ndarray:
    """(N,) int16/int32 -> (itemsize, N) uint8 byte planes: all first bytes, then all second bytes, ...

    One strided copy per plane (several times faster than numpy's transposed copy of all planes at once).
    """
    u8 = bits.view(np.uint8).reshape(-1, bits.itemsize)
    planes = np.empty((bits.itemsize, bits.size), dtype=np.uint8)
    for i in range(bits.itemsize):
        planes[i] = u8[:, i]
    return planes


def _planes(raw: bytes, n: int, itemsize: int) -> np.ndarray:
    """Inverse view of `_shuffle`: decompressed bytes as (itemsize, n) uint8 planes."""
    if len(raw) != n * itemsize:
        raise ValueError(f"decompressed {len(raw)} bytes, tensor holds {n * itemsize}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, n)


def _zstd(data: bytes | np.ndarray, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def _unzstd(data: memoryview, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


class Changes(NamedTuple):
    """What the delta encodings need: changed positions and bits (host arrays), full bits (any device)."""

    n: int
    pos: np.ndarray  # (K,) int64 ascending
    new_vals: np.ndarray  # (K,) int16/int32
    old_vals: np.ndarray
    new_bits: Tensor  # (N,) any device
    old_bits: Tensor


def host_changes(new_bits: Tensor, old_bits: Tensor, hasher: blake3.blake3 | None = None) -> Changes:
    """CPU path: numpy word-wise comparison (`changed_elements`), feeding `hasher` on the way."""
    a, b = new_bits.numpy(), old_bits.numpy()
    fast = _fast()
    pos, new_vals, old_vals = changed_elements(a, b, hasher) if fast is None else \
        fast.changed_elements(a, b, hasher, step_words=_SCAN_WORDS)
    return Changes(a.size, pos, new_vals, old_vals, new_bits, old_bits)


def device_changes(new_bits: Tensor, old_bits: Tensor, finder: Finder = find_changes) -> Changes:
    """Device path: `finder` (the Triton kernel on CUDA) on the device; only K-sized arrays are copied out."""
    pos, _, xor = finder(new_bits, old_bits)
    old_vals = old_bits[pos]
    return Changes(new_bits.numel(), pos.cpu().numpy(), (old_vals ^ xor).cpu().numpy(),
                   old_vals.cpu().numpy(), new_bits, old_bits)


def _find(new_bits: Tensor, old_bits: Tensor, hasher: blake3.blake3 | None) -> Changes:
    if new_bits.device.type == "cpu":
        return host_changes(new_bits, old_bits, hasher)
    if new_bits.is_cuda:
        from rlbus.kernels.delta.device import find_changes as find_on_device
        return device_changes(new_bits, old_bits, find_on_device)
    return device_changes(new_bits, old_bits)


def _payload(enc: Encoding, new_bits: Tensor, ch: Changes | None, level: int) -> bytes:
    if enc is Encoding.FULL:
        return _zstd(_shuffle(new_bits.cpu().numpy()), level)
    assert ch is not None
    if enc is Encoding.DENSE_XOR:
        return _zstd(_shuffle(np.bitwise_xor(ch.new_bits.cpu().numpy(), ch.old_bits.cpu().numpy())), level)
    fast = _fast()
    out = bytearray()
    put_varint(out, ch.pos.size)
    if enc is Encoding.SPARSE:
        if ch.pos.size:
            (bitcode if fast is None else fast).encode_ints(bitcode.gaps(ch.pos), out)
    else:
        mask = np.zeros(ch.n, dtype=np.bool_)
        mask[ch.pos] = True
        zmask = _zstd(bitcode.pack_flags(mask), level)
        put_varint(out, len(zmask))
        out += zmask
    if ch.pos.size:
        d = key_diffs(ch.new_vals, ch.old_vals)
        _encode_diffs(d, out) if fast is None else fast.encode_diffs(d, out)
    return bytes(out)


def merge_positions(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Sorted union of ascending (K_i,) int64 position arrays -> (K,) ascending, no duplicates.

    A stable sort of the concatenation merges the sorted runs (timsort: linear in K for a few runs).
    """
    if len(parts) == 1:
        return parts[0]
    s = np.sort(np.concatenate(parts), kind="stable")
    keep = np.empty(s.size, dtype=np.bool_)
    keep[:1] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def candidate_changes(new_bits: Tensor, old_bits: Tensor, candidates: np.ndarray) -> Changes:
    """`host_changes` when `new` is known to equal `old` outside `candidates` (ascending int64 positions,
    e.g. `merge_positions` of the changes along a chain of versions): only those K' elements are compared."""
    a, b = new_bits.numpy(), old_bits.numpy()
    if candidates.size and (int(candidates[0]) < 0 or int(candidates[-1]) >= a.size):
        raise ValueError(f"candidate positions outside a tensor of {a.size} elements")
    av, bv = a[candidates], b[candidates]
    differ = av != bv
    return Changes(a.size, candidates[differ], av[differ], bv[differ], new_bits, old_bits)


def encode_tensor(new: Tensor, old: Tensor | None = None, *, digest: bytes | None = None,
                  encodings: Collection[Encoding] | None = None, level: int = 1,
                  candidates: np.ndarray | None = None, changed: list[np.ndarray] | None = None
                  ) -> EncodedTensor:
    """Encode `new` against the base `old` (None: a full snapshot), choosing the smallest payload.

    encodings: the candidates to try (default: by the fraction p of changed elements, SPARSE always,
    BITMASK from p > 1/16, DENSE_XOR and FULL from p > 1/2). digest: `tensor_digest(new)` if known.
    level: zstd level of the zstd-coded parts. CUDA tensors: changes are found by the Triton kernel
    and only K-sized arrays leave the device, unless a dense candidate is tried.
    candidates (CPU): ascending positions outside which `new` is known to equal `old`; only they are
    compared (`candidate_changes`). changed: a list that gets the (K,) positions that differ appended.
    """
    nb = bits_view(new)
    if old is not None and (old.shape != new.shape or old.dtype != new.dtype or old.device != new.device):
        raise ValueError(f"base {tuple(old.shape)}/{old.dtype}/{old.device} does not match "
                         f"{tuple(new.shape)}/{new.dtype}/{new.device}")
    if candidates is not None and (old is None or new.device.type != "cpu"):
        raise ValueError("candidate positions need a base on the CPU")
    fused = digest is None and old is not None and new.device.type == "cpu" and candidates is None
    hasher = blake3.blake3() if fused else None
    ch = None if old is None else _find(nb, bits_view(old), hasher) if candidates is None else \
        candidate_changes(nb, bits_view(old), candidates)
    if changed is not None and ch is not None:
        changed.append(ch.pos)
    if encodings is None:
        p = ch.pos.size / max(ch.n, 1) if ch is not None else 1.0
        encodings = (Encoding.FULL,) if ch is None else (Encoding.SPARSE,) + \
            ((Encoding.BITMASK,) if p > _BITMASK_FROM else ()) + \
            ((Encoding.DENSE_XOR, Encoding.FULL) if p > _DENSE_FROM else ())
    if ch is None and set(encodings) != {Encoding.FULL}:
        raise ValueError(f"without a base only a full snapshot is possible, not {sorted(encodings)}")
    best: tuple[int, Encoding, bytes] | None = None
    for enc in sorted(Encoding(e) for e in encodings):
        payload = _payload(enc, nb, ch, level)
        if best is None or len(payload) < best[0]:
            best = (len(payload), enc, payload)
    assert best is not None
    _, enc, payload = best
    header = TensorHeader(
        encoding=int(enc), dtype=str(new.dtype).removeprefix("torch."), shape=tuple(new.shape),
        changed=ch.pos.size if ch is not None and enc is not Encoding.FULL else new.numel(),
        size=len(payload),
        digest=digest if digest is not None else hasher.digest(DIGEST_SIZE) if hasher is not None
        else tensor_digest(new),
        payload_digest=digest_bytes(payload, PAYLOAD_DIGEST_SIZE))
    return EncodedTensor(header, payload)


def check_payload(header: TensorHeader, payload: bytes | memoryview) -> None:
    """Raise DeltaCorrupt unless `payload` has the header's size and digest."""
    if len(payload) != header.size or digest_bytes(payload, PAYLOAD_DIGEST_SIZE) != header.payload_digest:
        raise DeltaCorrupt(f"payload of {len(payload)} bytes fails its digest (header: {header.size} bytes, "
                           f"{header.payload_digest.hex()}); fetch it again or a full snapshot")


def apply_(target: Tensor, encoded: EncodedTensor, *, verify: bool = False) -> Tensor:
    """Apply `encoded` in place: `target` holds the base (any content for FULL) and ends holding `new`.

    The payload digest is always checked before `target` is touched. verify=True also hashes the
    result and compares it with the header's tensor digest (a full pass over the tensor).
    :raises DeltaCorrupt: bad digest or structure; :raises ValueError: shape/dtype mismatch.
    """
    return apply_payload_(target, encoded.header, memoryview(encoded.payload), verify=verify)


def apply_payload_(target: Tensor, header: TensorHeader, payload: memoryview, *, verify: bool = False,
                   check: bool = True) -> Tensor:
    """`apply_` with header and payload apart (sliced from a version blob); check=False: digest checked."""
    decode_payload_(target, header, payload, verify=verify, check=check)
    return target


def decode_payload_(target: Tensor, header: TensorHeader, payload: memoryview, *, verify: bool = False,
                    check: bool = True) -> Patch | None:
    """`apply_payload_` that also says what changed: the `Patch` of a sparse or bitmask payload applied on
    the CPU (writing `patch[1]` at `patch[0]` into another copy of the base gives the same result), None
    where the whole tensor was rewritten (full, dense XOR, or on a device)."""
    if DTYPES.get(header.dtype) != target.dtype or tuple(header.shape) != tuple(target.shape):
        raise ValueError(f"encoded tensor {header.shape}/{header.dtype} does not fit target "
                         f"{tuple(target.shape)}/{target.dtype}")
    if check:
        check_payload(header, payload)
    flat = bits_view(target)
    try:
        patch = _decode_into(flat, header, payload)
    except (ValueError, IndexError, zstandard.ZstdError) as err:
        raise DeltaCorrupt(f"payload passes its digest but does not decode ({err}); encoder bug?") from err
    if verify and tensor_digest(target) != header.digest:
        raise DeltaCorrupt(f"applied tensor's digest differs from {header.digest.hex()}: the target did not "
                           "hold the base version; reload a full snapshot")
    return patch


def _decode_into(flat: Tensor, header: TensorHeader, payload: memoryview) -> Patch | None:
    enc = Encoding(header.encoding)
    n, itemsize = flat.numel(), flat.element_size()
    if enc in (Encoding.FULL, Encoding.DENSE_XOR):
        planes = _planes(_unzstd(payload, n * itemsize), n, itemsize)
        on_host = flat.device.type == "cpu"
        host = flat.numpy() if on_host else flat.cpu().numpy()
        u8 = host.view(np.uint8).reshape(n, itemsize)
        for i in range(itemsize):                # one strided pass per byte plane
            if enc is Encoding.FULL:
                u8[:, i] = planes[i]
            else:
                np.bitwise_xor(u8[:, i], planes[i], out=u8[:, i])
        if not on_host:
            flat.copy_(torch.from_numpy(host))
        return None
    count, off = get_varint(payload, 0)
    if count > n or count != header.changed:
        raise ValueError(f"{count} changed elements in a payload for {n} (header: {header.changed})")
    fast = _fast()
    if fast is not None and flat.device.type == "cpu":
        return _decode_sparse_compiled(fast, flat.numpy(), enc, payload, off, count)
    if enc is Encoding.SPARSE:
        pos, off = bitcode.decode_ints(payload, off, count)  # gaps, turned into positions in place
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
    else:
        pos, off = _bitmask_positions(payload, off, n, count)
    _check_positions(pos, n, count)
    itype = np.dtype(f"<i{itemsize}")
    d, off = _decode_diffs(payload, off, count, itype) if count else (np.zeros(0, itype), off)
    if off != len(payload):
        raise ValueError(f"payload has {len(payload) - off} trailing bytes")
    if flat.device.type == "cpu":
        host = flat.numpy()
        vals = apply_key_diffs(host[pos], d)
        host[pos] = vals       # positions are unique: a gather, then one scatter
        return pos, vals
    dev = flat.device
    d64 = torch.from_numpy(d.astype(np.int64))
    apply_key_diffs_torch_(flat, torch.from_numpy(pos).to(dev), d64.to(dev))
    return None


def _bitmask_positions(payload: memoryview, off: int, n: int, count: int) -> tuple[np.ndarray, int]:
    """The changed positions a zstd bitmask of `n` bits at `off` marks, and the offset after it.

    :raises ValueError: the mask marks other than `count` elements.
    """
    zlen, off = get_varint(payload, off)
    mask = np.unpackbits(np.frombuffer(_unzstd(payload[off:off + zlen], (n + 7) // 8), dtype=np.uint8),
                         count=n, bitorder="little")
    pos = np.flatnonzero(mask.view(np.bool_))
    if pos.size != count:
        raise ValueError(f"bitmask marks {pos.size} elements, count says {count}")
    return pos, off + zlen


def _check_positions(pos: np.ndarray, n: int, count: int) -> None:
    """:raises ValueError: a decoded position lies outside a tensor of `n` elements."""
    if count and (pos[-1] >= n or pos[0] < 0):
        raise ValueError(f"position {int(pos[-1])} outside a tensor of {n} elements")


def _decode_sparse_compiled(fast: types.ModuleType, host: np.ndarray, enc: Encoding, payload: memoryview,
                            off: int, count: int) -> Patch:
    """The sparse and bitmask CPU decode of `_decode_into` on the compiled loops, `host` patched in place."""
    n = host.size
    buf = np.frombuffer(payload, dtype=np.uint8)
    buf.flags.writeable = False                    # one compiled variant, whatever buffer the payload is in
    if enc is Encoding.SPARSE:
        pos, off = fast.decode_ints(buf, off, count)
        fast.positions_(pos)
    else:
        pos, off = _bitmask_positions(payload, off, n, count)
    _check_positions(pos, n, count)
    itype = np.dtype(f"<i{host.itemsize}")
    d, off = fast.decode_diffs(buf, off, count, itype) if count else (np.zeros(0, itype), off)
    if off != len(payload):
        raise ValueError(f"payload has {len(payload) - off} trailing bytes")
    return pos, fast.apply_sparse_(host, pos, d)


def apply_key_diffs_torch_(flat: Tensor, pos: Tensor, d: Tensor) -> None:
    """Device path of the sparse apply: flat[pos] = bits with key(flat[pos]) + d (mod 2**w), in place."""
    w = flat.element_size() * 8
    old = flat[pos].to(torch.int64)
    half, full = 1 << (w - 1), (1 << w) - 1
    key = old ^ ((old >> (w - 1)) & (half - 1))  # sign-extended int64 keeps the ordered-key identity
    new = ((key + d + half) & full) - half
    flat[pos] = (new ^ ((new >> (w - 1)) & (half - 1))).to(flat.dtype)


def snapshot_due(version: int, *, full_every: int) -> bool:
    """Whether the publisher writes a full snapshot of `version`: version 0 and every `full_every`-th."""
    if full_every < 1:
        raise ValueError(f"full_every {full_every} must be >= 1")
    return version % full_every == 0


def delta_base(target: int, held: int | None, *, kept: Collection[int]) -> int | None:
    """Base to encode `target` against for a generator holding `held`; None means a full snapshot.

    A joiner (held None), a generator whose version is no longer kept, or one not behind `target`
    gets a full snapshot; otherwise the multi-version delta held -> target (any base works).
    """
    if held is None or held >= target or held not in kept:
        return None
    return held
