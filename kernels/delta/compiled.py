"""Compiled (numba) hot loops of the weight-delta codec, byte for byte the numpy reference's output.

- Owns: the compiled twins of the change scan (`changed_elements`), the integer coder (`encode_ints` /
  `decode_ints`), the value-difference coding (`encode_diffs` / `decode_diffs`) and the sparse apply
  (`apply_sparse_`), plus `warm_up` (compiles them outside any timed region).
- Guarantee: the reference's bytes and `ValueError` messages; no loop reads or writes out of bounds; every
  loop runs without the GIL, so the codec's thread pool over tensors uses every core.
- Does not: own the format, the choice between encodings, digests or zstd (kernels/delta/codec.py and
  kernels/delta/bitcode.py, which pick this module when numba imports).
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from rlbus.kernels.delta import bitcode
from rlbus.kernels.delta.bitcode import _MAX_FIELD, _MAX_K, EXP_GOLOMB, RICE, gaps

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


# ----------------------------------------------------------------------------------------------- change scan

@_jit
def _scan(a64, b64, new, old, lanes, w, w1, t0, t1, pos, nv, ov, k):  # type: ignore[no-untyped-def]
    """Append to pos/nv/ov (from index k) the changed elements of words [w, w1), then of elements [t0, t1).

    Stops early when fewer than `lanes` slots are left: -> (new k, the first word not scanned, or w1 + 1
    once the tail elements are scanned too); the caller grows the arrays and calls again from there.
    """
    cap = pos.size
    words = np.empty(min(w1 - w, 4096), dtype=np.int64)
    while w < w1:
        m = 0                                      # branch-free: indices of the block's changed words
        end = min(w1, w + words.size, w + (cap - k) // lanes)
        if end == w:
            return k, w
        for v in range(w, end):
            words[m] = v
            m += a64[v] != b64[v]
        for c in range(m):                         # branch-free compaction of their lanes
            base = words[c] * lanes
            for j in range(lanes):
                i = base + j
                pos[k] = i
                nv[k] = new[i]
                ov[k] = old[i]
                k += new[i] != old[i]
        w = end
    if cap - k < t1 - t0:
        return k, w1
    for i in range(t0, t1):
        if new[i] != old[i]:
            pos[k] = i
            nv[k] = new[i]
            ov[k] = old[i]
            k += 1
    return k, w1 + 1


def changed_elements(new: np.ndarray, old: np.ndarray, hasher: object | None = None, *, step_words: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`kernels.delta.changed_elements`, compiled: (N,) int16/int32 -> (K,) positions, new and old bits.

    hasher: fed `new`'s raw bytes one step of `step_words` 64-bit words at a time, each step just before it is
    compared (the step is in cache for the comparison).
    """
    lanes = 8 // new.itemsize
    body = new.size - new.size % lanes
    a64, b64 = new[:body].view(np.int64), old[:body].view(np.int64)
    raw = new.view(np.uint8)
    cap = min(new.size, new.size // 16 + 2 * lanes)
    pos = np.empty(cap, dtype=np.int64)
    nv, ov = np.empty(cap, dtype=new.dtype), np.empty(cap, dtype=new.dtype)
    k = 0
    for s in range(0, max(a64.size, 1), step_words):
        e = min(s + step_words, a64.size)
        last = e >= a64.size
        t0, t1 = (body, new.size) if last else (0, 0)
        if hasher is not None:
            hasher.update(raw[8 * s:8 * e] if not last else raw[8 * s:])  # type: ignore[attr-defined]
        w = s
        while w <= e:
            k, w = _scan(a64, b64, new, old, lanes, w, e, t0, t1, pos, nv, ov, k)
            if w <= e:                              # out of room: grow (doubling) and go on
                grown = min(new.size, 2 * pos.size + 2 * lanes)
                pos, nv, ov = (np.concatenate((x[:k], np.empty(grown - k, dtype=x.dtype))) for x in (pos, nv, ov))
    return pos[:k].copy(), nv[:k].copy(), ov[:k].copy()


# ----------------------------------------------------------------------------------------------- integer code

@_jit
def _bit_length(v):  # type: ignore[no-untyped-def]
    """floor(log2 v) + 1 of the float64 nearest v (the reference's float-exponent formula), v >= 1:
    the integer bit length below 2**53, where the float is exact."""
    if v < (1 << 53):
        return 64 - leading_zeros(v)
    return math.frexp(float(v))[1]


@_jit
def _stats(x):  # type: ignore[no-untyped-def]
    """(sum, max) of (K,) int64, K >= 1."""
    s = 0
    m = x[0]
    for i in range(x.size):
        s += x[i]
        m = max(m, x[i])
    return s, m


@_jit
def _cost(x, mode, k):  # type: ignore[no-untyped-def]
    if mode == 0:
        c = x.size * (k + 1)
        for i in range(x.size):
            c += x[i] >> k
        return c
    t = 0
    for i in range(x.size):
        t += _bit_length(x[i] + (1 << k)) - 1
    return 2 * t + x.size * (1 - k)


@_jit
def _put_bits(out, p, v, w):  # type: ignore[no-untyped-def]
    """OR the low w bits of v >= 0 into the zeroed bit stream `out` at bit p. -> p + w."""
    while w > 0:
        sh = p & 7
        take = min(8 - sh, w)
        out[p >> 3] |= ((v & ((1 << take) - 1)) << sh)
        v >>= take
        p += take
        w -= take
    return p


@_jit
def _encode_body(x, modes, ks):  # type: ignore[no-untyped-def]
    """Pick the cheapest (mode, k) of the candidates (ties: the first, as the reference's tuple order) and
    code x with it: -> (uint8 code: head byte, varint unary length, unary stream, fields; widest field)."""
    best = 0
    best_cost = _cost(x, modes[0], ks[0])
    for c in range(1, modes.size):
        cost = _cost(x, modes[c], ks[c])
        if cost < best_cost:
            best, best_cost = c, cost
    mode, k = modes[best], ks[best]
    n_vals = x.size
    ubits = 0
    fbits = 0
    maxw = 0
    for i in range(n_vals):
        if mode == 0:
            ubits += (x[i] >> k) + 1
        else:
            n = _bit_length(x[i] + (1 << k)) - 1
            ubits += n - k + 1
            fbits += n
            maxw = max(maxw, n)
    if mode != 0 and maxw > 57:
        return np.zeros(0, dtype=np.uint8), maxw
    usize = (ubits + 7) // 8
    fsize = n_vals * (k // 8) + (n_vals * (k % 8) + 7) // 8 if mode == 0 else (fbits + 7) // 8
    vlen = 1
    v = usize
    while v >= 0x80:
        v >>= 7
        vlen += 1
    out = np.zeros(1 + vlen + usize + fsize, dtype=np.uint8)
    out[0] = mode << 6 | k
    v = usize
    j = 1
    while v >= 0x80:
        out[j] = (v & 0x7F) | 0x80
        v >>= 7
        j += 1
    out[j] = v
    ustart = 1 + vlen
    unary = out[ustart:ustart + usize]
    fields = out[ustart + usize:]
    p = 0
    last = 0
    cur = 0                                        # the byte being filled, stored every value (no reload)
    if mode == 0:
        for i in range(n_vals):
            p += x[i] >> k
            at = p >> 3
            cur = (cur & -np.int64(at == last)) | (1 << (p & 7))
            unary[at] = cur
            last = at
            p += 1
        nbytes = k // 8
        for b in range(nbytes):
            plane = fields[b * n_vals:(b + 1) * n_vals]
            for i in range(n_vals):
                plane[i] = (x[i] >> (8 * b)) & 0xFF
        bitplanes = fields[nbytes * n_vals:]
        acc = 0                                    # bits of the byte being filled, written once it is full
        nb = 0
        at = 0
        whole = n_vals - n_vals % 8
        for b in range(k % 8):
            sh = 8 * nbytes + b
            for i in range(0, whole, 8):           # 8 values' bits as one byte, then into the stream
                t = 0
                for j in range(8):
                    t |= ((x[i + j] >> sh) & 1) << j
                acc |= t << nb
                bitplanes[at] = acc & 0xFF
                at += 1
                acc >>= 8
            for i in range(whole, n_vals):
                acc |= ((x[i] >> sh) & 1) << nb
                nb += 1
                if nb == 8:
                    bitplanes[at] = acc
                    at += 1
                    acc = 0
                    nb = 0
        if nb:
            bitplanes[at] = acc
    else:
        f = 0
        for i in range(n_vals):
            v = x[i] + (1 << k)
            n = _bit_length(v) - 1
            p += n - k
            at = p >> 3
            cur = (cur & -np.int64(at == last)) | (1 << (p & 7))
            unary[at] = cur
            last = at
            p += 1
            f = _put_bits(fields, f, v - (1 << n), n)
    return out, maxw


def encode_ints(x: np.ndarray, out: bytearray) -> None:
    """`bitcode.encode_ints`, compiled: append the (K,) int64 >= 0 sequence `x` to `out`, same bytes.

    The choice of the integer code stays with the reference: its float formula (`np.log2`) and candidate
    parameters are computed in Python from integer statistics gathered here, and only the exact integer
    costs of the candidates are compared in compiled code, so the chosen (mode, k) is the reference's.
    """
    if x.size == 0:
        return
    x = np.ascontiguousarray(x, dtype=np.int64)
    total, top = _stats(x)
    sample = x[::max(1, x.size // 1024)]
    median = np.partition(sample, sample.size // 2)[sample.size // 2]
    k0 = int(np.log2(float(total) / x.size * 0.69 + 1.0))        # the reference's choose_code, in Python
    cands = [(RICE, k) for k in range(max(0, k0 - 1), min(_MAX_K, k0 + 2))]
    ke = int(np.log2(float(median) + 1.0))
    if int(top) >> ke > 64:
        cands += [(EXP_GOLOMB, k) for k in range(max(0, ke - 1), ke + 1)]
    if not cands:
        raise ValueError(f"no Rice parameter below {_MAX_K} for a mean of {float(total) / x.size:g}")
    code, maxw = _encode_body(x, np.array([m for m, _ in cands], dtype=np.int64),
                              np.array([k for _, k in cands], dtype=np.int64))
    if maxw > _MAX_FIELD:
        raise ValueError(f"bit field of width {maxw} > {_MAX_FIELD}")
    out += code.data


_ERR_END, _ERR_VARINT, _ERR_MODE, _ERR_TAKE, _ERR_UNARY, _ERR_EG, _ERR_FIELD = 1, 2, 3, 4, 5, 6, 7


@_jit
def _varint(buf, off):  # type: ignore[no-untyped-def]
    """-> (value, offset past it, ok)."""
    value = 0
    shift = 0
    while True:
        if off >= buf.size or shift > 63:
            return 0, off, False
        byte = np.int64(buf[off])
        off += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, off, True
        shift += 7


@_jit
def _decode_ints(buf, off, count):  # type: ignore[no-untyped-def]
    """-> ((count,) int64, offset past the code, error code, two error details); count >= 1."""
    values = np.zeros(count, dtype=np.int64)
    if off >= buf.size:
        return values, off, _ERR_END, 0, 0
    head = np.int64(buf[off])
    mode, k = head >> 6, head & 0x3F
    if mode > 1:
        return values, off, _ERR_MODE, mode, 0
    ulen, off, ok = _varint(buf, off + 1)
    if not ok:
        return values, off, _ERR_VARINT, off, 0
    if ulen > buf.size - off:
        return values, off, _ERR_TAKE, ulen, off
    found = 0
    prev = -1
    for word_i in range(0, ulen, 8):               # 64 bits at a time, one loop turn per one bit
        word = np.int64(0)
        for j in range(min(8, ulen - word_i)):
            word |= np.int64(buf[off + word_i + j]) << (8 * j)
        while word != 0 and found < count:
            low = word & -word
            bit = word_i * 8 + trailing_zeros(low)
            values[found] = bit - prev - 1
            prev = bit
            found += 1
            word ^= low
        if found == count:
            break
    if found < count:
        return values, off, _ERR_UNARY, found, 0
    off += ulen
    if mode == 0:
        size = count * (k // 8) + (count * (k % 8) + 7) // 8
        if size > buf.size - off:
            return values, off, _ERR_TAKE, size, off
        nbytes = k // 8
        for i in range(count):
            f = 0
            for b in range(nbytes):
                f |= np.int64(buf[off + b * count + i]) << (8 * b)
            values[i] = (values[i] << k) | f
        base = off + nbytes * count
        whole = count - count % 8
        for b in range(k % 8):
            q = b * count
            sh = 8 * nbytes + b
            lo = q & 7                             # the same bit offset for every group of 8 values
            for i in range(0, whole, 8):           # 8 values' bits from one (unaligned) byte
                at = base + ((q + i) >> 3)
                t = np.int64(buf[at]) >> lo
                if lo:
                    t |= np.int64(buf[at + 1]) << (8 - lo)
                for j in range(8):
                    values[i + j] |= ((t >> j) & 1) << sh
            for i in range(whole, count):
                r = q + i
                values[i] |= ((np.int64(buf[base + (r >> 3)]) >> (r & 7)) & 1) << sh
        return values, off + size, 0, 0, 0
    total = 0
    top = 0
    for i in range(count):
        n = values[i] + k
        total += n
        top = max(top, n)
    if top > 62:
        return values, off, _ERR_EG, top, 0
    if top > 57:
        return values, off, _ERR_FIELD, top, 0
    size = (total + 7) // 8
    if size > buf.size - off:
        return values, off, _ERR_TAKE, size, off
    p = off * 8
    for i in range(count):
        n = values[i] + k
        f = 0
        got = 0
        while got < n:
            sh = p & 7
            take = min(8 - sh, n - got)
            f |= ((np.int64(buf[p >> 3]) >> sh) & ((1 << take) - 1)) << got
            got += take
            p += take
        values[i] = (1 << n) + f - (1 << k)
    return values, off + size, 0, 0, 0



def decode_ints(buf: np.ndarray, offset: int, count: int) -> tuple[np.ndarray, int]:
    """`bitcode.decode_ints`, compiled, on a uint8 array: -> ((count,) int64, offset past the code).
    Malformed input raises `ValueError` with the reference's messages (a decode that fails is handed to the
    reference, which says why)."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), offset
    values, off, err, _, _ = _decode_ints(buf, offset, count)
    if err:                                        # malformed: the reference says why, in its words
        return bitcode.decode_ints(memoryview(buf), offset, count)
    return values, off


# ----------------------------------------------------------------------------------------------- value diffs

@_jit
def _diff_parts(d):  # type: ignore[no-untyped-def]
    """(K,) int16/int32 diffs -> (sign bits packed LSB first, gaps between escapes, escape magnitudes - 2)."""
    flags = np.zeros((d.size + 7) // 8, dtype=np.uint8)
    n_esc = 0
    for i in range(d.size):
        v = np.int64(d[i])
        flags[i >> 3] |= (v < 0) << (i & 7)
        n_esc += (v < -1) | (v > 1)
    gaps = np.empty(n_esc, dtype=np.int64)
    mags = np.empty(n_esc, dtype=np.int64)
    j = 0
    prev = -1
    for i in range(d.size):
        v = np.int64(d[i])
        if v < -1 or v > 1:
            gaps[j] = i - prev - 1
            mags[j] = abs(v) - 2
            prev = i
            j += 1
    return flags, gaps, mags


def encode_diffs(d: np.ndarray, out: bytearray) -> None:
    """`kernels.delta._encode_diffs`, compiled: sign bits, escape count, escape gaps and magnitudes."""
    flags, esc_gaps, mags = _diff_parts(d)
    out += flags.data
    v = esc_gaps.size                                  # put_varint
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    if esc_gaps.size:
        encode_ints(esc_gaps, out)
        encode_ints(mags, out)


@_jit
def _signs(buf, off, count, d):  # type: ignore[no-untyped-def]
    for i in range(count):
        d[i] = 1 - 2 * ((np.int64(buf[off + (i >> 3)]) >> (i & 7)) & 1)


@_jit
def _escapes(buf, off, d, gaps, mags):  # type: ignore[no-untyped-def]
    """d[esc] = +-(mags + 2) with the sign bit of d, esc = positions from gaps. -> False if one is outside d."""
    p = -1
    for j in range(gaps.size):
        p += gaps[j] + 1
        if p < 0 or p >= d.size:
            return False
        m = mags[j] + 2
        d[p] = m * (1 - 2 * ((np.int64(buf[off + (p >> 3)]) >> (p & 7)) & 1))
    return True


def decode_diffs(buf: np.ndarray, off: int, count: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """`kernels.delta._decode_diffs`, compiled: -> ((count,) d of `dtype`, offset past the code)."""
    nbytes = (count + 7) // 8
    if off + nbytes > buf.size:
        raise ValueError(f"need {nbytes} bytes at offset {off}, buffer holds {buf.size}")
    d = np.empty(count, dtype=dtype)
    _signs(buf, off, count, d)
    n_esc, end = bitcode.get_varint(memoryview(buf), off + nbytes)
    if n_esc:
        if not 0 < n_esc <= count:
            raise ValueError(f"{n_esc} escapes among {count} values")
        esc_gaps, end = decode_ints(buf, end, n_esc)
        mags, end = decode_ints(buf, end, n_esc)
        if not _escapes(buf, off, d, esc_gaps, mags):
            raise ValueError("escape position past the last value")
    return d, end


# ----------------------------------------------------------------------------------------------- sparse apply

@_jit
def _positions_(g):  # type: ignore[no-untyped-def]
    """Gaps -> positions in place: p[i] = p[i-1] + g[i] + 1, p[-1] = -1."""
    p = -1
    for i in range(g.size):
        p += g[i] + 1
        g[i] = p


def positions_(gaps: np.ndarray) -> np.ndarray:
    """(K,) int64 gaps turned into ascending positions in place; -> the same array."""
    _positions_(gaps)
    return gaps


@_jit
def _apply(host, pos, d, w):  # type: ignore[no-untyped-def]
    """vals = bits whose ordered key is key(host[pos]) + d (mod 2**w); host[pos] = vals. -> (vals, ok):
    nothing is written unless the positions ascend strictly inside host (then ok)."""
    vals = np.empty(pos.size, dtype=host.dtype)
    prev = -1
    for i in range(pos.size):                      # strictly ascending inside host: unique and in bounds
        if pos[i] <= prev:
            return vals, False
        prev = pos[i]
    if pos.size and prev >= host.size:
        return vals, False
    half = np.int64(1) << (w - 1)
    full = (np.int64(1) << w) - 1
    for i in range(pos.size):                      # unique positions: one read-modify-write pass
        old = np.int64(host[pos[i]])
        key = old ^ ((old >> (w - 1)) & (half - 1))
        new = ((key + np.int64(d[i]) + half) & full) - half
        vals[i] = new ^ ((new >> (w - 1)) & (half - 1))
        host[pos[i]] = vals[i]
    return vals, True


def apply_sparse_(host: np.ndarray, pos: np.ndarray, d: np.ndarray) -> np.ndarray:
    """host[pos] = the bits whose key is key(host[pos]) + d, in place: -> those bits (K,).

    :raises ValueError: positions that do not ascend strictly inside `host` (nothing is written then).
    """
    vals, ok = _apply(host, pos, d, host.itemsize * 8)
    if not ok:
        raise ValueError(f"positions do not ascend strictly inside a tensor of {host.size} elements")
    return vals


# ----------------------------------------------------------------------------------------------- warm-up

def warm_up() -> float:
    """Compile every loop for the codec's dtypes (or load it from numba's cache): -> seconds it took.

    Runs a tiny encode and decode of each path; call it once per process before anything is timed.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for dtype in (np.int16, np.int32):
        old = rng.integers(-1000, 1000, 37).astype(dtype)
        new = old.copy()
        new[::3] += np.array([1, -1, 5], dtype=dtype)[np.arange(new[::3].size) % 3]
        pos, nv, ov = changed_elements(new, old, None, step_words=4)
        out = bytearray()
        encode_ints(gaps(pos), out)
        encode_ints(np.array([0, 1 << 20, 3], dtype=np.int64), out)           # Exp-Golomb too
        dd = (nv - ov).astype(dtype)
        encode_diffs(dd, out)
        buf = np.frombuffer(bytes(out), dtype=np.uint8)      # read-only, as `kernels.delta` passes payloads
        g, off = decode_ints(buf, 0, pos.size)
        _, off = decode_ints(buf, off, 3)
        d, _ = decode_diffs(buf, off, dd.size, np.dtype(dtype))
        apply_sparse_(old.copy(), positions_(g), d)
    return time.perf_counter() - t0
