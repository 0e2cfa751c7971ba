"""Vectorised entropy-coding primitives for the weight-delta codec: numpy only, no per-element Python.

Owns: LEB128 varints, packing of fixed- and variable-width bit fields, unary streams, and
Rice / Exp-Golomb coding of non-negative integer sequences with the parameter chosen by exact size.
Does not own: what the integers mean (`kernels/delta.py`), digests, or tensors.
Bits are packed least-significant first (`np.packbits(..., bitorder="little")`).
Malformed input raises `ValueError`; callers turn it into their own corruption error.
"""

from __future__ import annotations

from typing import Final

import numpy as np

RICE: Final = 0
EXP_GOLOMB: Final = 1
_MAX_K: Final = 62
_U64: Final = np.uint64


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


def pack_fields(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    """Concatenate the low `widths[i]` bits of each `values[i]` (K,) uint64 into a byte string."""
    if values.size == 0:
        return b""
    maxw = int(widths) if np.isscalar(widths) else int(np.max(widths))
    if maxw == 0:
        return b""
    if maxw <= 8 and np.isscalar(widths):  # fast path: one byte per value, then drop the unused bits
        bits = np.unpackbits(values.astype(np.uint8)[:, None], axis=1, count=maxw, bitorder="little")
        return np.packbits(bits, bitorder="little").tobytes()
    bits = ((values[:, None] >> np.arange(maxw, dtype=_U64)) & _U64(1)).astype(np.uint8)
    if not np.isscalar(widths):
        bits = bits[np.arange(maxw) < np.asarray(widths)[:, None]]
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_fields(buf: bytes | memoryview, offset: int, widths: np.ndarray | int, count: int
                  ) -> tuple[np.ndarray, int]:
    """Inverse of `pack_fields`: -> ((count,) int64, offset just past the fields)."""
    fixed = np.isscalar(widths)
    w_arr = None if fixed else np.asarray(widths, dtype=np.int64)
    w = int(widths) if fixed else (int(w_arr.max()) if count else 0)  # type: ignore[union-attr]
    total = w * count if fixed else int(w_arr.sum())  # type: ignore[union-attr]
    nbytes = (total + 7) // 8
    if w == 0 or count == 0:
        return np.zeros(count, dtype=np.int64), offset + nbytes
    if w > 63:
        raise ValueError(f"bit field of width {w} > 63")
    raw = _take(buf, offset, nbytes)
    if fixed and w == 8:
        return raw.astype(np.int64), offset + nbytes
    bits = np.unpackbits(raw, count=total, bitorder="little")
    if fixed:
        mat = bits.reshape(count, w)
    else:
        starts = np.cumsum(w_arr) - w_arr
        cols = np.arange(w)
        mat = bits[np.minimum(starts[:, None] + cols, total - 1)]
        mat[cols >= w_arr[:, None]] = 0  # type: ignore[index]
    packed = np.packbits(mat, axis=1, bitorder="little")  # (count, ceil(w/8)) little-endian bytes
    if packed.shape[1] == 1:
        return packed[:, 0].astype(np.int64), offset + nbytes
    width = 2 if packed.shape[1] == 2 else 4 if packed.shape[1] <= 4 else 8
    wide = np.zeros((count, width), dtype=np.uint8)
    wide[:, : packed.shape[1]] = packed
    return wide.view(f"<u{width}").reshape(count).astype(np.int64), offset + nbytes


def _unary_encode(q: np.ndarray) -> bytes:
    """Each q[i] >= 0 as q[i] zero bits then a one bit."""
    ends = np.cumsum(q + 1)
    bits = np.zeros(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def _unary_decode(raw: np.ndarray, count: int) -> np.ndarray:
    ends = np.flatnonzero(np.unpackbits(raw, bitorder="little"))
    if ends.size < count:
        raise ValueError(f"unary stream holds {ends.size} codes, {count} expected")
    return gaps(ends[:count])


_POW2: Final = np.int64(1) << np.arange(63, dtype=np.int64)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) + 1 for 1 <= v < 2**62 (0 for v = 0)."""
    return np.searchsorted(_POW2, v, side="right")


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
    data) and, when some value would take over 64 unary bits, Exp-Golomb k just below."""
    k0 = int(np.log2(float(x.sum()) / x.size * 0.69 + 1.0))
    best = min((code_cost(x, RICE, k), RICE, k) for k in range(max(0, k0 - 1), min(_MAX_K, k0 + 2)))
    if int(x.max()) >> k0 > 64:
        best = min(best, *((code_cost(x, EXP_GOLOMB, k), EXP_GOLOMB, k) for k in range(max(0, k0 - 2), k0)),
                   (code_cost(x, EXP_GOLOMB, 0), EXP_GOLOMB, 0))
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
    out += pack_fields(fields.astype(_U64), widths)


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
        return (q << k) | fields, offset
    n = q + k
    if n.size and int(n.max()) > 62:
        raise ValueError(f"Exp-Golomb field of {int(n.max())} bits")
    fields, offset = unpack_fields(buf, offset, n, count)
    return (np.int64(1) << n) + fields - (1 << k), offset


def _take(buf: bytes | memoryview, offset: int, nbytes: int) -> np.ndarray:
    if nbytes < 0 or offset + nbytes > len(buf):
        raise ValueError(f"need {nbytes} bytes at offset {offset}, buffer holds {len(buf)}")
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
