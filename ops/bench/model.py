"""`rlbus bench model`: KV cache, MTP speculation, in-place weight swap and MXFP8 drift of the policy.

Owns the model benchmark. Each number is a ratio measured against its baseline in the same run:
KV-cached decoding vs re-running the full forward per new token (256 new tokens); speculative
decoding with MTP heads (trained here for a few seconds on strided counting, so acceptance means
something) vs plain greedy; the stall of an in-place weight swap mid-generation vs building the
model and loading the same weights from a file; per-token logprob drift of MXFP8 vs bf16 weights.
`--model-policy hf` runs the Hugging Face policy's bench instead (`ops/bench/hf_model.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rlbus.ops.bench import hf_model

    hf_model.add_arguments(p)
    p.add_argument(
        "--model-threads",
        type=int,
        default=1,
        help="model: torch CPU threads (default 1; CPU timings are process CPU time)",
    )
    p.add_argument(
        "--model-new-tokens",
        type=int,
        default=256,
        help="model: new tokens for the KV-cache comparison (default 256)",
    )
    p.add_argument(
        "--model-train-steps",
        type=int,
        default=250,
        help="model: training steps for the MTP-head model (default 250)",
    )
    p.add_argument("--model-device", default="cpu", help="model: torch device, e.g. cuda (default cpu)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if getattr(args, "model_policy", "builtin") == "hf":
        from rlbus.ops.bench import hf_model

        return hf_model.run(args)

    torch.set_num_threads(args.model_threads)
    device = torch.device(args.model_device)
    quick = bool(getattr(args, "quick", False))
    new_tokens = 64 if quick else args.model_new_tokens
    steps = 60 if quick else args.model_train_steps
    clock = "wall (cuda synchronize)" if device.type == "cuda" else "process CPU time"
    result: dict[str, Any] = {"device": str(device), "threads": args.model_threads, "clock": clock}
    result |= _kv_cache(device, new_tokens)
    model = _train_counting_model(device, steps)
    result |= _speculative(model, 32 if quick else 128) | {"mtp_train_steps": steps}
    result |= _swap_stall(device, "small" if quick else "m30")
    result |= _mxfp8_drift(model)
    return result


def table(result: dict[str, Any]) -> str:
    if result.get("policy") == "hf":
        from rlbus.ops.bench import hf_model

        return hf_model.table(result)
    rows = [
        (
            "kv_cache_speedup",
            f"{result['kv_cache_speedup']:.1f}x",
            "target >= 5",
            (
                f"{result['kv_new_tokens']} new tokens x {result['kv_batch']} prompts, small model: "
                f"{result['kv_cached_s']:.2f}s cached vs "
                f"{result['kv_full_s']:.2f}s full re-forward; same tokens: {result['kv_cache_exact']}"
            ),
        ),
        (
            "mtp_speedup",
            f"{result['mtp_speedup']:.2f}x",
            "",
            (
                f"{result['mtp_spec_s']:.2f}s speculative vs {result['mtp_plain_s']:.2f}s greedy, "
                f"{result['mtp_tokens_per_forward']:.2f} tokens/forward; same tokens: {result['mtp_exact']}"
            ),
        ),
        (
            "mtp_acceptance",
            f"{result['mtp_acceptance']:.2f}",
            "",
            f"{result['mtp_heads']} MTP heads after {result['mtp_train_steps']} training steps",
        ),
        (
            "swap_stall_ratio",
            f"{result['swap_stall_ratio']:.3f}",
            "target <= 0.1",
            (
                f"{result['swap_model']} ({result['swap_params'] / 1e6:.1f}M params): in-place swap "
                f"{result['swap_stall_s'] * 1e3:.1f} ms vs build+load {result['swap_reload_s'] * 1e3:.0f} ms"
            ),
        ),
        (
            "mxfp8_logprob_drift",
            f"{result['mxfp8_logprob_drift']:.4f}",
            "",
            (
                f"mean |logp_mxfp8 - logp_bf16| over {result['mxfp8_tokens']} tokens "
                f"(max {result['mxfp8_logprob_drift_max']:.3f})"
            ),
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'value':>8}  {'target':<13}  detail"]
    lines += [f"{name:<{width}}  {value:>8}  {target:<13}  {detail}" for name, value, target, detail in rows]
    lines.append(f"device {result['device']}, {result['threads']} thread(s), clock: {result['clock']}")
    return "\n".join(lines)


def _clock(device: Any) -> Callable[[], float]:
    """CUDA: wall clock after a synchronize. CPU: this process's CPU time, so that other load on a
    shared machine does not distort the ratios (with 1 thread it is the compute actually spent)."""
    import torch

    if device.type != "cuda":
        return time.process_time

    def wall() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return wall


def _kv_cache(device: Any, new_tokens: int, repeats: int = 2, batch: int = 8) -> dict[str, Any]:
    """Greedy decoding of new_tokens with the KV cache vs a full forward over the sequence per token, for a
    batch of `batch` prompts (a generator samples G completions of a task together; G = 8 by default).

    Both arms run `repeats` times, alternating; the best time of each is reported.
    """
    import torch

    from rlbus.model.policies.transformer import ModelConfig, Transformer
    from rlbus.model.sampling.generate import generate

    torch.manual_seed(0)
    model = Transformer(ModelConfig.small(tie_embeddings=False)).to(device).eval()
    prompts = [torch.randint(0, 512, (16,)).tolist() for _ in range(batch)]
    prompt = prompts[0]
    clock = _clock(device)
    generate(model, prompts, max_new_tokens=4, temperature=0)  # warm-up
    cached_t, full_t = [], []
    for _ in range(repeats):
        t0 = clock()
        cached = generate(model, prompts, max_new_tokens=new_tokens, temperature=0)[0].tokens.tolist()
        t1 = clock()
        seq = torch.tensor(prompts, device=device)
        with torch.no_grad():
            for _ in range(new_tokens):
                nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        t2 = clock()
        cached_t.append(t1 - t0)
        full_t.append(t2 - t1)
    return {
        "kv_cache_speedup": min(full_t) / min(cached_t),
        "kv_cached_s": min(cached_t),
        "kv_full_s": min(full_t),
        "kv_new_tokens": new_tokens,
        "kv_batch": batch,
        "kv_cache_exact": cached == seq[0, len(prompt) :].tolist(),
    }


def _counting_batch(batch: int, length: int, vocab: int, device: Any) -> Any:
    """Sequences start + stride * t (mod vocab), stride in 1..3: predictable once stride is seen."""
    import torch

    start = torch.randint(0, vocab, (batch, 1))
    stride = torch.randint(1, 4, (batch, 1))
    return ((start + stride * torch.arange(length)) % vocab).to(device)


def _train_counting_model(device: Any, steps: int) -> Any:
    """A 2-layer model with 3 MTP heads trained on strided counting (main and MTP losses)."""
    import torch

    from rlbus.model.policies.transformer import ModelConfig, Transformer
    from rlbus.model.training.loss import lm_loss

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(d_model=128, n_layers=2, n_heads=4, d_ff=384, max_seq_len=256, mtp_heads=3)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        seq = _counting_batch(16, 48, model.config.vocab_size, device)
        out = model(seq)
        loss = lm_loss(out.logits, out.mtp_logits, seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def _speculative(model: Any, new_tokens: int) -> dict[str, Any]:
    """Per-prompt (batch 1) greedy vs MTP speculative decoding, best of three timings each."""
    import torch

    from rlbus.model.sampling.generate import SpeculativeStats, generate, speculative_generate

    torch.manual_seed(1)
    prompts = [_counting_batch(1, 6, model.config.vocab_size, "cpu")[0].tolist() for _ in range(4)]
    plain_t, spec_t = [], []
    stats = SpeculativeStats()
    exact = True
    clock = _clock(model.embed.weight.device)
    for _ in range(3):
        t0 = clock()
        plain = [generate(model, [p], max_new_tokens=new_tokens, temperature=0)[0] for p in prompts]
        t1 = clock()
        runs = [speculative_generate(model, [p], max_new_tokens=new_tokens) for p in prompts]
        t2 = clock()
        plain_t.append(t1 - t0)
        spec_t.append(t2 - t1)
        exact &= all(a.tokens.tolist() == b[0][0].tokens.tolist() for a, b in zip(plain, runs, strict=True))
        stats = SpeculativeStats(
            sum(r[1].drafted for r in runs),
            sum(r[1].accepted for r in runs),
            sum(r[1].forward_passes for r in runs),
            sum(r[1].generated for r in runs),
        )
    return {
        "mtp_speedup": min(plain_t) / min(spec_t),
        "mtp_acceptance": stats.acceptance_rate,
        "mtp_plain_s": min(plain_t),
        "mtp_spec_s": min(spec_t),
        "mtp_exact": exact,
        "mtp_tokens_per_forward": stats.generated / stats.forward_passes,
        "mtp_heads": model.config.mtp_heads,
    }


def _swap_stall(device: Any, preset: str) -> dict[str, Any]:
    """Stall of copying a new state into the live model between decoding steps, vs a cold reload."""
    import tempfile
    from pathlib import Path

    import torch

    from rlbus.model.policies.transformer import ModelConfig, Transformer
    from rlbus.model.sampling.generate import generate

    config = getattr(ModelConfig, preset)()
    torch.manual_seed(0)
    model = Transformer(config).to(device).eval()
    new_state = {k: v + 0.001 for k, v in Transformer(config).state_dict().items()}
    stalls: list[float] = []
    clock = _clock(device)
    params = [p for _, p in model.named_parameters()]
    sources = [new_state[name] for name, _ in model.named_parameters()]

    def on_step(step: int) -> int | None:
        if step not in (2, 4, 6):
            return None
        t0 = clock()
        with torch.no_grad():
            torch._foreach_copy_(params, sources)
        stalls.append(clock() - t0)
        return step

    out = generate(model, [[1, 2, 3, 4]], max_new_tokens=8, temperature=0, on_step=on_step)[0]
    if out.versions.tolist() != [0, 0, 2, 2, 4, 4, 6, 6]:
        raise RuntimeError(f"swap versions came out as {out.versions.tolist()}")
    reloads = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-model-") as tmp:
        path = Path(tmp) / "weights.pt"
        torch.save(new_state, path)
        for _ in range(2):
            t0 = clock()
            fresh = Transformer(config).to(device)
            fresh.load_state_dict(torch.load(path, map_location=device, weights_only=True))
            fresh.eval()
            reloads.append(clock() - t0)
    stall, reload = statistics.median(stalls), min(reloads)
    return {
        "swap_stall_ratio": stall / reload,
        "swap_stall_s": stall,
        "swap_reload_s": reload,
        "swap_model": preset,
        "swap_params": sum(p.numel() for p in model.parameters()),
    }


def _mxfp8_drift(model: Any) -> dict[str, Any]:
    """Mean |logprob| difference of the same sampled tokens under MXFP8 vs bf16 weights."""
    import copy

    import torch

    from rlbus.model.policies.quant import quantized_copy
    from rlbus.model.sampling.generate import generate

    bf16 = copy.deepcopy(model)
    with torch.no_grad():
        for p in bf16.parameters():
            p.copy_(p.to(torch.bfloat16))  # the published weights, held in fp32
    mx = quantized_copy(bf16, "mxfp8")
    torch.manual_seed(2)
    prompts = [_counting_batch(1, 6, model.config.vocab_size, "cpu")[0].tolist() for _ in range(8)]
    g = torch.Generator(device=model.embed.weight.device).manual_seed(0)
    samples = generate(bf16, prompts, max_new_tokens=64, temperature=1.0, generator=g)
    diffs = []
    with torch.no_grad():
        for s in samples:
            seq = torch.cat([s.prompt, s.tokens])[None].to(model.embed.weight.device)
            target = seq[:, 1:]
            lp = [
                torch.log_softmax(m(seq).logits[:, :-1].float(), -1).gather(-1, target[..., None])[..., 0]
                for m in (bf16, mx)
            ]
            diffs.append((lp[1] - lp[0]).abs()[0, len(s.prompt) - 1 :])
    drift = torch.cat(diffs)
    return {
        "mxfp8_logprob_drift": float(drift.mean()),
        "mxfp8_logprob_drift_max": float(drift.max()),
        "mxfp8_tokens": int(drift.numel()),
    }
