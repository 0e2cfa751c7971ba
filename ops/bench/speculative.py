"""MTP speculative sampling measured for `rlbus bench agentic`: tokens per second with the MTP heads drafting over
plain decoding, at equal outputs, and how many drafts the main head accepts, for a built-in policy and a Qwen2.

- Owns: `measure` (the `spec_speedup` and `mtp_acceptance` keys and their detail) and `lines` (their table rows).
- Does not: assert anything about the figures; train anything but the two small models it measures.

Both policies first learn strided counting (start + stride * t, stride 1..3: predictable once the stride is seen,
as in `rlbus bench model`): the built-in one with its own MTP heads under `lm_loss`, the Qwen2 with the LM loss
alone, then its heads distilled from it (model/training/mtp.py, the model frozen) on what they will draft: the
Qwen2's own greedy continuations of counting prompts, as long as the measured decoding (the measured prompts left
out). So acceptance describes an easy, regular stream, not code. Greedy decoding, one prompt a call; outputs
compared token for token.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Final

_SEED: Final = 0


def _counting(batch: int, length: int, vocab: int, offset: int = 0) -> Any:
    import torch

    start = torch.randint(0, vocab, (batch, 1))
    stride = torch.randint(1, 4, (batch, 1))
    return (start + stride * torch.arange(length)) % vocab + offset


def _builtin(quick: bool, steps: int) -> Any:
    """A built-in policy of the small preset (the one `rlbus up` pretrains; quick: the tiny one) with 3 MTP heads,
    trained on counting (main and MTP losses)."""
    import torch

    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.policies.transformer import ModelConfig, Transformer
    from rlbus.model.training.loss import lm_loss

    torch.manual_seed(_SEED)
    config = (ModelConfig.tiny(vocab_size=128, mtp_heads=3) if quick else
              ModelConfig.small(max_seq_len=256, mtp_heads=3))
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        seq = _counting(8 if quick else 16, 48, model.config.vocab_size)
        out = model(seq)
        loss = lm_loss(out.logits, out.mtp_logits, seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return BuiltinPolicy(model.eval())


def _qwen2(quick: bool, steps: int, distill_steps: int, new_tokens: int, measured: list[list[int]]
           ) -> tuple[Any, dict[str, Any]]:
    """The recipe's tiny (quick) or small Qwen2, trained on counting, then 3 heads distilled from it on its own
    greedy continuations (`new_tokens`) of counting prompts other than `measured`."""
    import torch
    import torch.nn.functional as F

    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.policies.hf_checks import inspect_dir
    from rlbus.model.policies.hf_recipe import build_hf_dir
    from rlbus.model.policies.interface import PolicyError
    from rlbus.model.sampling.generate import generate
    from rlbus.model.training.mtp import distill_mtp_heads, summary
    from rlbus.ops.bench.hf_model import CACHE_ROOT

    size = "tiny" if quick else "small"
    out = CACHE_ROOT / f"speculative-qwen2-{size}"
    try:
        inspect_dir(out)
    except PolicyError:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        texts = [" ".join(str(i * s) for i in range(40)) for s in range(1, 30)]
        build_hf_dir(out, architecture="qwen2", texts=texts, vocab_size=512, size=size, tie_embeddings=False,
                     max_seq_len=256, seed=_SEED)
    policy = HFPolicy.load(out, dtype=torch.float32)
    torch.manual_seed(_SEED)
    opt = torch.optim.AdamW(policy.module.parameters(), lr=3e-3, weight_decay=0.0)
    policy.train()
    for _ in range(steps):
        seq = _counting(8 if quick else 16, 48, 256, offset=8)
        logits = policy.forward(seq[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    policy.eval()

    # Heads distilled on training windows (48 tokens of exact counting) agree with the main head there but not on
    # the longer, less regular text it decodes: they learn from that text itself.
    prompt_len = len(measured[0])
    texts: list[list[int]] = []
    for _ in range(1 if quick else 4):
        prompts = [p for p in _counting(8 if quick else 64, prompt_len, 256, offset=8).tolist() if p not in measured]
        texts += [p + s.tokens.tolist() for p, s in
                  zip(prompts, generate(policy, prompts, max_new_tokens=new_tokens, temperature=0), strict=True)]

    def documents() -> Any:
        while True:
            for row in texts:
                yield row, [1.0] * len(row)

    result = distill_mtp_heads(policy, documents(), n_heads=3, steps=distill_steps, batch_size=8,
                               seq_len=prompt_len + new_tokens, lr=1e-2)
    policy.set_mtp_heads(result.heads)
    return policy, summary(result)


def _race(policy: Any, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict[str, Any]:
    """Greedy plain vs speculative decoding of each prompt alone, CPU seconds (this process), the best of `rounds`
    (the modes alternating; on a shared machine the best is the least disturbed)."""
    from rlbus.model.sampling.generate import SpeculativeStats, generate
    from rlbus.model.sampling.speculative import speculative_sample

    speculative_sample(policy, prompts[:1], max_new_tokens=4, temperature=0)   # warm-up
    plain_t: list[float] = []
    spec_t: list[float] = []
    exact = True
    stats = SpeculativeStats()
    for r in range(rounds):
        for mode in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            t0 = time.process_time()
            if mode == "plain":
                plain = [generate(policy, [p], max_new_tokens=new_tokens, temperature=0)[0] for p in prompts]
                plain_t.append(time.process_time() - t0)
            else:
                runs = [speculative_sample(policy, [p], max_new_tokens=new_tokens, temperature=0) for p in prompts]
                spec_t.append(time.process_time() - t0)
        exact &= all(a.tokens.tolist() == b[0][0].tokens.tolist() for a, b in zip(plain, runs, strict=True))
        stats = SpeculativeStats()
        for _, s in runs:
            stats = stats.add(s)
    tokens = stats.generated
    return {"plain_tokens_per_s": tokens / min(plain_t),
            "spec_tokens_per_s": tokens / min(spec_t),
            "speedup": min(plain_t) / min(spec_t),
            "spread": {"plain": statistics.pstdev(plain_t) / statistics.mean(plain_t),
                       "spec": statistics.pstdev(spec_t) / statistics.mean(spec_t)},
            "acceptance": stats.acceptance_rate, "tokens_per_forward": tokens / stats.forward_passes,
            "exact": exact, "tokens": tokens}


def measure(quick: bool, rounds: int) -> dict[str, Any]:
    """`spec_speedup` and `mtp_acceptance` {"builtin", "hf"} and `speculative` (the detail). Call it with torch at
    1 thread."""
    import torch

    steps, distill, new_tokens = (10, 5, 12) if quick else (250, 400, 128)
    builtin = _builtin(quick, steps)
    torch.manual_seed(_SEED + 1)
    prompts = {"builtin": [_counting(1, 6, builtin.vocab_size)[0].tolist() for _ in range(4)],
               "hf": [_counting(1, 6, 256, offset=8)[0].tolist() for _ in range(4)]}
    hf, distilled = _qwen2(quick, steps, distill, new_tokens, prompts["hf"])
    race = {"builtin": _race(builtin, prompts["builtin"], new_tokens, rounds),
            "hf": _race(hf, prompts["hf"], new_tokens, rounds)}
    return {
        "spec_speedup": {p: race[p]["speedup"] for p in ("builtin", "hf")},
        "mtp_acceptance": {p: race[p]["acceptance"] for p in ("builtin", "hf")},
        "speculative": {"race": race, "train_steps": steps, "new_tokens": new_tokens, "heads": 3,
                        "hf_distill": distilled, "clock": "process CPU time",
                        "policies": {"builtin": builtin.describe(), "hf": hf.describe()}},
    }


def lines(result: dict[str, Any]) -> list[str]:
    """The table rows of `measure`'s keys."""
    d = result["speculative"]
    out = [f"MTP speculative sampling (greedy, one prompt a call, {d['new_tokens']} tokens, best CPU time; trained "
           f"{d['train_steps']} steps on strided counting, the hf heads distilled {d['hf_distill']['steps']} steps "
           f"on its greedy continuations):"]
    for p in ("builtin", "hf"):
        r = d["race"][p]
        out.append(f"  {p:<8} {r['spec_tokens_per_s']:>9.1f}/s vs {r['plain_tokens_per_s']:>9.1f}/s  spec_speedup "
                   f"{result['spec_speedup'][p]:.2f}x  mtp_acceptance {result['mtp_acceptance'][p]:.2f}  "
                   f"{r['tokens_per_forward']:.2f} tokens/forward  same tokens: {r['exact']}")
    return out
