"""`rlbus bench delta`: lossless weight-delta compression of real AdamW updates of the rlbus policy.

- Owns: the delta benchmark (`run`): trains the policy with AdamW, takes published versions around the
  1st and 20th step after a warm-up, and reports each delta's size against raw bf16, index + value
  and the order-0 entropy bound, and its encode / decode+apply throughput on the CPU codec backend.
- Does not: implement the codec (kernels/delta/).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

LRS = (1e-6, 1e-5, 1e-4)
STEPS = (1, 20)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delta-warmup", type=int, default=50, help="delta: AdamW warm-up steps (default 50)")
    p.add_argument("--delta-warmup-lr", type=float, default=3e-4, help="delta: warm-up lr (default 3e-4)")
    p.add_argument("--delta-batch", type=int, default=4, help="delta: sequences per step (default 4)")
    p.add_argument("--delta-seq", type=int, default=64, help="delta: tokens per sequence (default 64)")
    p.add_argument("--delta-repeats", type=int, default=5,
                   help="delta: timed repeats of each encode/decode; the median is reported (default 5)")
    p.add_argument("--delta-threads", type=int, default=2, help="delta: codec and torch threads (default 2)")
    p.add_argument("--delta-runs", type=int, default=3,
                   help="delta: runs of every throughput measurement, each printed; the median is reported "
                        "(default 3)")
    p.add_argument("--delta-profile", action="store_true",
                   help="delta: also time the encode's and decode's stages (CPU ms on one thread, each backend) "
                        "at lr 1e-6")
    p.add_argument("--delta-codec", choices=("numba", "numpy"), default=None,
                   help="delta: CPU codec backend (default: numba where it imports, else the numpy reference)")


def _corpus(tokens: int) -> Any:
    """(n,) int64 byte-token stream of task prompts and canonical solutions, bos/eos framed."""
    import itertools

    import torch

    from rlbus.model.policies.tokenizer import ByteTokenizer
    from rlbus.model.tasks.builtin import train_tasks

    tok = ByteTokenizer()
    ids: list[int] = []
    for task in itertools.islice(train_tasks(0), 100_000):
        ids += [tok.bos_id, *tok.encode(task.prompt + "\n" + task.solution), tok.eos_id]
        if len(ids) >= tokens:
            break
    return torch.tensor(ids, dtype=torch.long)


def _delta_stats(old: dict[str, Any], new: dict[str, Any]) -> dict[str, float]:
    """N, K and the order-0 bound in bytes of the model-wide delta (XORs concatenated over tensors)."""
    import math

    import numpy as np

    from rlbus.kernels.delta.codec import bits_view

    xors = []
    n = 0
    for name in new:
        a, b = bits_view(new[name]).numpy(), bits_view(old[name]).numpy()
        x = np.bitwise_xor(a, b)
        xors.append(x[x != 0].astype(np.int64) & 0xFFFF)  # the 16-bit XOR values (bf16 models)
        n += a.size
    x = np.concatenate(xors)
    k = x.size
    p = k / n
    h2 = 0.0 if k in (0, n) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    counts = np.bincount(x, minlength=65536).astype(np.float64)
    q = counts[counts > 0] / max(k, 1)
    hx = float(-(q * np.log2(q)).sum()) if k else 0.0
    return {"n": n, "k": k, "p": p, "xor_entropy_bits": hx, "bound_bytes": (n * h2 + k * hx) / 8}


def _xor_zstd_bytes(old: dict[str, Any], new: dict[str, Any]) -> int:
    """A plain sparse format, for comparison: per tensor u32 gaps and XOR values as byte planes,
    zstd level 1."""
    import numpy as np
    import zstandard

    from rlbus.kernels.delta.codec import bits_view

    total = 0
    for name in new:
        a, b = bits_view(new[name]).numpy(), bits_view(old[name]).numpy()
        pos = np.flatnonzero(a != b)
        gaps = np.diff(pos, prepend=-1).astype(np.uint32) - 1
        planes = gaps.view(np.uint8).reshape(-1, 4).T.tobytes() + \
            np.bitwise_xor(a[pos], b[pos]).view(np.uint8).reshape(-1, a.itemsize).T.tobytes()
        total += len(zstandard.ZstdCompressor(level=1).compress(planes))
    return total


def _median_time(fn: Any, repeats: int, reset: Any = None, budget_s: float = 4.0) -> tuple[float, float]:
    """(median, best) wall time of up to `repeats` runs, stopping once `budget_s` is spent (slow cases)."""
    import statistics
    import time

    times: list[float] = []
    while len(times) < repeats and sum(times) < budget_s:
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _stages(old: dict[str, Any], new: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    """CPU ms (`process_time`, one thread, best of `repeats`) of each stage of the encode and the decode of
    old -> new, per available backend: where the time goes."""
    import time

    import blake3
    import numpy as np

    from rlbus.kernels.delta import bitcode, codec
    from rlbus.kernels.delta.codec import bits_view, changed_elements, key_diffs
    from rlbus.kernels.delta.state import apply_state_, encode_state

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return round(1e3 * min(times), 2)

    arrays = [(bits_view(new[n]).numpy(), bits_view(old[n]).numpy()) for n in sorted(new)]
    found = [changed_elements(a, b) for a, b in arrays]
    gaps = [bitcode.gaps(p) for p, _, _ in found if p.size]
    diffs = [key_diffs(nv, ov) for p, nv, ov in found if p.size]

    def stages(fast: Any) -> dict[str, float]:
        scan = changed_elements if fast is None else \
            (lambda a, b, h=None: fast.changed_elements(a, b, h, step_words=codec._SCAN_WORDS))
        ints = bitcode.encode_ints if fast is None else fast.encode_ints
        code_diffs = codec._encode_diffs if fast is None else fast.encode_diffs
        _, blob = encode_state(new, old, base_digest=bytes(16), threads=1)
        target = {k: v.clone() for k, v in old.items()}
        return {
            "hash": best(lambda: [blake3.blake3(a.view(np.uint8)).digest(16) for a, _ in arrays]),
            "scan": best(lambda: [scan(a, b) for a, b in arrays]),
            "scan_and_hash": best(lambda: [scan(a, b, blake3.blake3()) for a, b in arrays]),
            "key_diffs": best(lambda: [key_diffs(nv, ov) for _, nv, ov in found]),
            "gap_code": best(lambda: [ints(g, bytearray()) for g in gaps]),
            "diff_code": best(lambda: [code_diffs(d, bytearray()) for d in diffs]),
            "encode_state": best(lambda: encode_state(new, old, base_digest=bytes(16), threads=1)),
            "apply_state": best(lambda: apply_state_(target, blob, threads=1)),
        }

    previous = codec.codec_backend()
    out: dict[str, dict[str, float]] = {}
    for backend in ("numpy", "numba"):
        try:
            codec.set_codec_backend(backend)
        except ValueError:
            continue
        out[backend] = stages(codec._fast())
    codec.set_codec_backend(previous)
    return out


RUN_KEYS = ("encode_mb_s", "encode_codec_mb_s", "decode_mb_s")
"""Throughputs measured once per run: each gets `<key>_runs` (every run) and `<key>_median`."""


def _measure(old: dict[str, Any], new: dict[str, Any], base: dict[str, Any], repeats: int, threads: int,
             runs: int = 1, label: str = "", profile: bool = False) -> dict[str, Any]:
    """Sizes and throughputs of one delta old -> new (plus the multi-version delta base -> new); the
    throughputs `runs` times (each run the median of its timed repeats), reported as their median."""
    import statistics

    import torch

    from rlbus.kernels.delta.codec import Encoding, bits_view
    from rlbus.kernels.delta.state import apply_state_, encode_state, state_digest, tensor_digests

    stats = _delta_stats(old, new)
    mb = 2 * stats["n"] / 1e6  # raw bf16 model bytes, in MB
    base_digest = state_digest(tensor_digests(old, threads=threads))  # known: hashed when `old` was published
    digests = tensor_digests(new, threads=threads)
    index, blob = encode_state(new, old, base_digest=base_digest, threads=threads)
    target = {k: v.clone() for k, v in old.items()}

    def reset() -> None:
        for k, v in old.items():
            target[k].copy_(v)

    def apply(verify: bool) -> None:
        apply_state_(target, blob, expect_base=base_digest, verify=verify, threads=threads)

    per_run: dict[str, list[float]] = {k: [] for k in RUN_KEYS}
    best = dict.fromkeys(RUN_KEYS, 0.0)
    for r in range(runs):
        t_enc = _median_time(lambda: encode_state(new, old, base_digest=base_digest, threads=threads), repeats)
        t_codec = _median_time(lambda: encode_state(new, old, digests=digests, base_digest=base_digest,
                                                    threads=threads), repeats)
        t_dec = _median_time(lambda: apply(False), repeats, reset)
        if not all(torch.equal(bits_view(target[k]), bits_view(new[k])) for k in new):
            raise AssertionError("decoded weights differ from the published version")
        for key, (median, fastest) in zip(RUN_KEYS, (t_enc, t_codec, t_dec), strict=True):
            per_run[key].append(mb / median)
            best[key] = max(best[key], mb / fastest)
        print(f"bench delta: {label} run {r + 1}/{runs}: encode {mb / t_enc[0]:.0f} MB/s (digests given "
              f"{mb / t_codec[0]:.0f}), decode+apply {mb / t_dec[0]:.0f} MB/s", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in per_run.items()}
    t_digest, _ = _median_time(lambda: tensor_digests(new, threads=threads), repeats)
    t_ver, _ = _median_time(lambda: apply(True), max(1, repeats // 2), reset)
    size = len(blob)
    _, multi = encode_state(new, base, threads=threads)
    return {
        "changed_fraction": stats["p"], "changed": stats["k"], "elements": stats["n"], "blob_bytes": size,
        "bound_bytes": round(stats["bound_bytes"]), "xor_entropy_bits": round(stats["xor_entropy_bits"], 3),
        "ratio_vs_bf16": 2 * stats["n"] / size, "ratio_vs_index_value": 6 * stats["k"] / size,
        "bound_efficiency": stats["bound_bytes"] / size,
        "bits_per_changed": 8 * size / max(stats["k"], 1),
        **medians, "digest_mb_s": mb / t_digest, "decode_verified_mb_s": mb / t_ver,
        **{f"{k}_best": v for k, v in best.items()},
        **{f"{k}_runs": [round(x, 1) for x in v] for k, v in per_run.items()},
        **{f"{k}_median": v for k, v in medians.items()},
        "xor_zstd_efficiency": stats["bound_bytes"] / _xor_zstd_bytes(old, new),
        "multi_version_ratio_vs_bf16": 2 * stats["n"] / len(multi),
        "encodings": {e.name.lower(): index.count(e) for e in Encoding if index.count(e)},
        **({"stages_cpu_ms": _stages(old, new, repeats)} if profile else {}),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the deltas and return their numbers.

    Trains `ModelConfig.m30()` (`--quick`: `tiny()`) with AdamW on byte tokens of the task corpus
    (`rlbus.model.tasks.builtin`, prompt + canonical solution) for the warm-up steps, forks model and
    optimizer state per measured lr, and takes the published versions (bf16 casts of the fp32 master
    weights) around the 1st and 20th step after the warm-up. Per delta it reports the blob size against raw
    bf16, against int32 index + bf16 value (6 B per changed element) and against the order-0 entropy bound
    (N*H2(p) + sum over changed elements of the empirical entropy of their 16-bit XOR values) / 8, and
    encode / decode+apply throughput in MB/s of raw bf16 model bytes, measured `--delta-runs` times in one
    invocation (each run printed, the median reported), on the CPU codec backend named in the output
    (compiled once before anything is timed; the first-call cost is reported).
    """
    import copy
    import time

    import torch
    import torch.nn.functional as F

    from rlbus.kernels.delta import codec
    from rlbus.kernels.delta.state import encode_state
    from rlbus.model.policies.transformer import ModelConfig, Transformer

    t_start = time.perf_counter()
    backend = codec.codec_backend() if args.delta_codec is None else args.delta_codec
    codec.set_codec_backend(backend)
    first_call_s = 0.0
    if backend == "numba":
        from rlbus.kernels.delta import compiled

        first_call_s = compiled.warm_up()        # compile or load from numba's cache, outside every timing
    print(f"bench delta: codec backend {backend} (first call {first_call_s:.2f} s)", file=sys.stderr)
    runs = 1 if args.quick else args.delta_runs
    threads = args.delta_threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = ModelConfig.tiny() if args.quick else ModelConfig.m30()
    warmup = 5 if args.quick else args.delta_warmup
    steps = (1, 3) if args.quick else STEPS
    repeats = 2 if args.quick else args.delta_repeats
    B, T = args.delta_batch, args.delta_seq
    n_batches = warmup + steps[-1]
    corpus = _corpus(n_batches * B * (T + 1))
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, corpus.numel() - T - 1, (n_batches, B), generator=gen)

    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.delta_warmup_lr, betas=(0.9, 0.95), weight_decay=0.1)

    def step(m: Transformer, o: torch.optim.Optimizer, i: int) -> float:
        seqs = torch.stack([corpus[s:s + T + 1] for s in starts[i].tolist()])
        logits = m(seqs[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()
        return loss.item()

    def published(m: Transformer) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in m.named_parameters()}

    print(f"bench delta: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{warmup} warm-up steps", file=sys.stderr)
    losses = [step(model, opt, i) for i in range(warmup)]
    t_warm = time.perf_counter() - t_start
    v0 = published(model)
    results: list[dict[str, Any]] = []
    for lr in LRS:
        m, o = copy.deepcopy((model, opt))
        for group in o.param_groups:
            group["lr"] = lr
        prev = v0
        for s in range(1, steps[-1] + 1):
            step(m, o, warmup + s - 1)
            cur = published(m)
            if s in steps:
                results.append({"lr": lr, "step": s, **_measure(prev, cur, v0, repeats, threads, runs,
                                                                 f"lr {lr:g} step {s}",
                                                                 args.delta_profile and lr == LRS[0])})
                print(f"bench delta: lr {lr:g} step {s}: x{results[-1]['ratio_vs_bf16']:.1f} vs bf16 "
                      f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
            prev = cur
    _, full = encode_state(v0, threads=threads)
    n_params = sum(t.numel() for t in v0.values())
    return {
        "results": results,
        "model": "tiny" if args.quick else "m30", "parameters": n_params, "tensors": len(v0),
        "warmup_steps": warmup, "warmup_lr": args.delta_warmup_lr, "batch": B, "seq_len": T,
        "warmup_loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
        "full_snapshot_ratio_vs_bf16": 2 * n_params / len(full), "threads": threads,
        "codec_backend": backend, "codec_first_call_s": round(first_call_s, 3), "runs": runs,
        "load_avg_1m": os.getloadavg()[0], "warmup_s": round(t_warm, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
    }


def table(result: dict[str, Any]) -> str:
    head = ("lr", "step", "changed", "x bf16", "x idx+val", "bound eff", "bits/chg", "enc MB/s", "codec MB/s",
            "dec MB/s", "dec+verify", "xor+zstd eff", "v0->v x bf16")
    rows = [head]
    for r in result["results"]:
        rows.append((
            f"{r['lr']:.0e}", str(r["step"]), f"{100 * r['changed_fraction']:.2f}%",
            f"{r['ratio_vs_bf16']:.1f}", f"{r['ratio_vs_index_value']:.2f}", f"{r['bound_efficiency']:.3f}",
            f"{r['bits_per_changed']:.2f}",
            f"{r['encode_mb_s']:.0f}/{r['encode_mb_s_best']:.0f}",
            f"{r['encode_codec_mb_s']:.0f}/{r['encode_codec_mb_s_best']:.0f}",
            f"{r['decode_mb_s']:.0f}/{r['decode_mb_s_best']:.0f}", f"{r['decode_verified_mb_s']:.0f}",
            f"{r['xor_zstd_efficiency']:.3f}", f"{r['multi_version_ratio_vs_bf16']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    r = result
    lines += [
        "",
        f"{r['model']}: {r['parameters'] / 1e6:.1f}M parameters in {r['tensors']} tensors; "
        f"{r['warmup_steps']} AdamW warm-up steps at lr {r['warmup_lr']:g} (batch {r['batch']} x "
        f"{r['seq_len']} tokens of the task corpus); full snapshot x{r['full_snapshot_ratio_vs_bf16']:.2f}.",
        f"Codec backend {r['codec_backend']} (first call {r['codec_first_call_s']:.2f} s, before any timing). "
        f"MB/s: median of {r['runs']} runs (each the median of its timed repeats) / best repeat, in MB of raw "
        "bf16 model bytes. enc: encode including the BLAKE3 digests of the new version;",
        "codec: encode given those digests (a version is hashed once); dec: decode+apply checking payload "
        "digests; dec+verify: also re-hashes every tensor.",
        "xor+zstd eff: bound efficiency of the literal gaps+XOR byte-plane zstd-1 format; v0->v: the "
        "multi-version delta from the end of the warm-up.",
        "Targets: bound eff >= 0.9 and x idx+val >= 4 at every lr; at 1e-6 x bf16 >= 25, enc >= 1000 and "
        f"dec >= 2000 MB/s on {r['threads']} threads (1-min load average at the end: "
        f"{r['load_avg_1m']:.1f}; the cores are shared).",
    ]
    for x in result["results"]:
        for backend, ms in x.get("stages_cpu_ms", {}).items():
            lines.append(f"stages at lr {x['lr']:g} step {x['step']}, {backend}, CPU ms on one thread: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    return "\n".join(lines)
