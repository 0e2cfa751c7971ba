"""Vectorised entropy-coding primitives for the weight-delta codec: numpy only, no per-element Python.

Owns: LEB128 varints, packing of fixed- and variable-width bit fields, unary streams, and
Rice / Exp-Golomb coding of non-negative integer sequences with the parameter chosen by exact size.
Does not own: what the integers mean (`kernels/delta/codec.py`), digests, or tensors.
Bits are packed least-significant first (`np.packbits(..., bitorder="little")`).
Malformed input raises `ValueError`; callers turn it into their own corruption error.
"""

from __future__ import annotations

from typing import Final

import numpy as np

RICE: Final = 0
EXP_GOLOMB: Final = 1
_MAX_K: Final = 62
_MAX_FIELD: Final = 57
_FIELD_CHUNK: Final = 1 << 16
"""Widest per-value field: a 64-bit window read at any bit offset holds it."""


def put_varint(out: bytearray, value: int) -> None:
    """Append `value` >= 0 as an LEB128 varint (7 bits per byte, high bit = more bytes follow)."""
    if value < 0:
        raise ValueError(f"varint value {value} must be >= 0")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def get_varint(buf: bytes | memoryview, offset: int) -> tuple[int, int]:
    """Read an LEB128 varint at `offset`: -> (value, offset just past it)."""
    value = shift = 0
    while True:
        if offset >= len(buf) or shift > 63:
            raise ValueError(f"varint runs past the end of its buffer at byte {offset}")
        byte = buf[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7


def pack_flags(flags: np.ndarray) -> bytes:
    """(K,) bool -> ceil(K/8) bytes, one bit per flag."""
    return np.packbits(flags.astype(np.bool_, copy=False), bitorder="little").tobytes()


def unpack_flags(buf: bytes | memoryview, offset: int, count: int) -> tuple[np.ndarray, int]:
    """Inverse of `pack_flags`: -> ((count,) bool, offset just past the flags)."""
    nbytes = (count + 7) // 8
    raw = _take(buf, offset, nbytes)
    return np.unpackbits(raw, count=count, bitorder="little").view(np.bool_), offset + nbytes


def _fixed_size(count: int, w: int) -> int:
    return count * (w // 8) + (count * (w % 8) + 7) // 8


def _pack_fixed(values: np.ndarray, w: int) -> bytes:
    """(n,) int64 -> the low w bits as w // 8 byte planes then w % 8 bit planes (all vectorised)."""
    parts = [(values >> (8 * i)).astype(np.uint8).tobytes() for i in range(w // 8)]
    if w % 8:
        low = (values >> (8 * (w // 8))).astype(np.uint8)
        planes = (low[None, :] >> np.arange(w % 8, dtype=np.uint8)[:, None]) & np.uint8(1)  # (b, n)
        parts.append(np.packbits(planes.reshape(-1), bitorder="little").tobytes())
    return b"".join(parts)


def _unpack_fixed(raw: np.ndarray, count: int, w: int) -> np.ndarray:
    """Inverse of `_pack_fixed` on exactly `_fixed_size(count, w)` bytes."""
    nbytes = w // 8
    values = raw[:count].astype(np.int64) if nbytes else np.zeros(count, dtype=np.int64)
    for i in range(1, nbytes):
        values |= raw[i * count:(i + 1) * count].astype(np.int64) << (8 * i)
    if w % 8:
        planes = np.unpackbits(raw[nbytes * count:], count=(w % 8) * count, bitorder="little")
        planes = planes.reshape(-1, count)
        low = planes[0].copy()
        for j in range(1, w % 8):
            low |= planes[j] << np.uint8(j)
        if nbytes:
            values |= low.astype(np.int64) << (8 * nbytes)
        else:
            values = low.astype(np.int64)
    return values


def pack_fields(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    """The low `widths[i]` bits of each `values[i]` (K,) int64 >= 0.

    A scalar width w stores w // 8 byte planes then w % 8 bit planes. Per-value widths (at most 57)
    store the fields back to back in order, least significant bit first.
    """
    if values.size == 0:
        return b""
    if np.isscalar(widths):
        return _pack_fixed(values, int(widths))
    w_arr = np.asarray(widths, dtype=np.int64)
    if int(w_arr.max()) > _MAX_FIELD:
        raise ValueError(f"bit field of width {int(w_arr.max())} > {_MAX_FIELD}")
    maxw = int(w_arr.max())
    cols = np.arange(maxw)
    bits = []
    for s in range(0, values.size, _FIELD_CHUNK):  # (chunk, maxw) bit matrix, keep each row's first w bits
        v = np.ascontiguousarray(values[s:s + _FIELD_CHUNK], dtype="<i8")
        mat = np.unpackbits(v.view(np.uint8), bitorder="little").reshape(-1, 64)[:, :maxw]
        bits.append(mat[cols < w_arr[s:s + _FIELD_CHUNK, None]])
    return np.packbits(np.concatenate(bits), bitorder="little").tobytes()


def unpack_fields(buf: bytes | memoryview, offset: int, widths: np.ndarray | int, count: int
                  ) -> tuple[np.ndarray, int]:
    """Inverse of `pack_fields`: -> ((count,) int64, offset just past the fields)."""
    if np.isscalar(widths):
        w = int(widths)
        if not 0 <= w <= 63:
            raise ValueError(f"bit field width {w} outside 0..63")
        size = _fixed_size(count, w)
        return _unpack_fixed(_take(buf, offset, size), count, w), offset + size
    w_arr = np.asarray(widths, dtype=np.int64)
    if count and (int(w_arr.max()) > _MAX_FIELD or int(w_arr.min()) < 0):
        raise ValueError(f"bit field widths outside 0..{_MAX_FIELD} (max {int(w_arr.max())})")
    total = int(w_arr.sum())
    size = (total + 7) // 8
    padded = np.zeros(size + 8, dtype=np.uint8)
    padded[:size] = _take(buf, offset, size)
    window = np.ndarray((size + 1,), dtype="<u8", buffer=padded, strides=(1,))  # 8 bytes from every byte
    starts = (np.cumsum(w_arr) - w_arr).astype(np.uint64)
    masks = (np.uint64(1) << w_arr.astype(np.uint64)) - np.uint64(1)
    values = (window[starts >> np.uint64(3)] >> (starts & np.uint64(7))) & masks
    return values.astype(np.int64), offset + size


def _unary_encode(q: np.ndarray) -> bytes:
    """Each q[i] >= 0 as q[i] zero bits then a one bit."""
    ends = np.cumsum(q + 1)
    bits = np.zeros(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def _unary_decode(raw: np.ndarray, count: int) -> np.ndarray:
    ends = np.flatnonzero(np.unpackbits(raw, bitorder="little").view(np.bool_))  # bool: numpy's fast nonzero
    if ends.size < count:
        raise ValueError(f"unary stream holds {ends.size} codes, {count} expected")
    return gaps(ends[:count])


def _bit_length(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) + 1 for 1 <= v < 2**53, from the float64 exponent field."""
    return (v.astype(np.float64).view(np.int64) >> 52) - 1022


def code_cost(x: np.ndarray, mode: int, k: int) -> int:
    """Exact size in bits of `x` (K,) int64 >= 0 under Rice(k) or Exp-Golomb(k).

    Rice(k): unary(x >> k) then k low bits: K*(k+1) + sum(x >> k).
    Exp-Golomb(k): v = x + 2**k, n = floor(log2 v): unary(n - k) then n low bits of v: sum(2n - k + 1).
    """
    if mode == RICE:
        return x.size * (k + 1) + int((x >> k).sum())
    n = _bit_length(x + (1 << k)) - 1
    return 2 * int(n.sum()) + x.size * (1 - k)


def choose_code(x: np.ndarray) -> tuple[int, int]:
    """(mode, k) minimising `code_cost` over Rice k around log2(0.69 * mean) (optimal for geometric
    data) and, when the largest value would take over 64 unary bits at the median's scale (heavy
    tails), Exp-Golomb k around log2(median)."""
    k0 = int(np.log2(float(x.sum()) / x.size * 0.69 + 1.0))
    best = min((code_cost(x, RICE, k), RICE, k) for k in range(max(0, k0 - 1), min(_MAX_K, k0 + 2)))
    sample = x[:: max(1, x.size // 1024)]  # the median of <= ~1k evenly spaced values is enough here
    ke = int(np.log2(float(np.partition(sample, sample.size // 2)[sample.size // 2]) + 1.0))
    if int(x.max()) >> ke > 64:
        best = min(best, *((code_cost(x, EXP_GOLOMB, k), EXP_GOLOMB, k)
                           for k in range(max(0, ke - 1), ke + 1)))
    return best[1], best[2]


def gaps(pos: np.ndarray) -> np.ndarray:
    """(K,) ascending int64 -> (K,) gaps: g[0] = pos[0], g[i] = pos[i] - pos[i-1] - 1."""
    g = np.empty(pos.size, dtype=np.int64)
    if pos.size:
        g[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=g[1:])
        g[1:] -= 1
    return g


def encode_ints(x: np.ndarray, out: bytearray) -> None:
    """Append the (K,) int64 >= 0 sequence `x` (K known to the reader) to `out`.

    Layout: one byte mode << 6 | k; varint length of the unary stream; unary stream; bit fields.
    """
    if x.size == 0:
        return
    mode, k = choose_code(x)
    if mode == RICE:
        q = x >> k
        fields, widths = x & ((1 << k) - 1), k
    else:
        v = x + (1 << k)
        n = _bit_length(v) - 1
        q = n - k
        fields, widths = v - (np.int64(1) << n), n
    unary = _unary_encode(q)
    out.append(mode << 6 | k)
    put_varint(out, len(unary))
    out += unary
    out += pack_fields(fields, widths)


def decode_ints(buf: bytes | memoryview, offset: int, count: int) -> tuple[np.ndarray, int]:
    """Inverse of `encode_ints`: -> ((count,) int64, offset just past the code)."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), offset
    if offset >= len(buf):
        raise ValueError("integer code runs past the end of its buffer")
    head = buf[offset]
    mode, k = head >> 6, head & 0x3F
    if mode not in (RICE, EXP_GOLOMB):
        raise ValueError(f"unknown integer code mode {mode}")
    ulen, offset = get_varint(buf, offset + 1)
    q = _unary_decode(_take(buf, offset, ulen), count)
    offset += ulen
    if mode == RICE:
        fields, offset = unpack_fields(buf, offset, k, count)
        q <<= k
        q |= fields
        return q, offset
    n = q + k
    if n.size and int(n.max()) > 62:
        raise ValueError(f"Exp-Golomb field of {int(n.max())} bits")
    fields, offset = unpack_fields(buf, offset, n, count)
    return (np.int64(1) << n) + fields - (1 << k), offset


def _take(buf: bytes | memoryview, offset: int, nbytes: int) -> np.ndarray:
    if nbytes < 0 or offset + nbytes > len(buf):
        raise ValueError(f"need {nbytes} bytes at offset {offset}, buffer holds {len(buf)}")
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
