"""Properties of the per-token NVFP4 forward, each with its counter-case under a per-tensor scale:
batch invariance (a row's codes, and its output from a row-wise fp32 matmul, do not depend on the rows
sharing its batch) and no leak across tokens (a later token changes nothing at an earlier position)."""

from __future__ import annotations

import torch

from rlbus.kernels.nvfp4 import NVFP4, nvfp4_dequantize_torch, nvfp4_quantize_torch

K, N = 40, 24  # ragged: 40 = 2.5 blocks of 16


def _row(q: NVFP4, r: int) -> tuple[torch.Tensor, ...]:
    return q.codes[r], q.block_scales[r], q.token_scales[r].view(1).view(torch.int32)


def _same_row(a: NVFP4, ra: int, b: NVFP4, rb: int) -> bool:
    return all(torch.equal(u, v) for u, v in zip(_row(a, ra), _row(b, rb), strict=True))


def _row_output(q: NVFP4, r: int, w_deq: torch.Tensor) -> torch.Tensor:
    """Row r's layer output from a row-wise fp32 matmul: (1, K) @ (K, N)."""
    row = NVFP4(q.codes[r : r + 1], q.block_scales[r : r + 1], q.token_scales[r : r + 1], q.k)
    return nvfp4_dequantize_torch(row) @ w_deq.T


def _batches(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One target row and batches that hold it at varying positions among varied batch-mates
    (tiny, huge, zero, subnormal rows)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(1, K, generator=g)
    mates = [
        torch.randn(5, K, generator=g) * 1e4,
        torch.randn(3, K, generator=g) * 1e-4,
        torch.zeros(2, K),
        torch.full((1, K), 1e-40),
        torch.randn(7, K, generator=g),
    ]
    batches = [target]
    for i, m in enumerate(mates):
        cut = i % (m.shape[0] + 1)
        batches.append(torch.cat([m[:cut], target, m[cut:]]))
    return target, batches


def _position(batch: torch.Tensor, target: torch.Tensor) -> int:
    return int((batch == target).all(-1).nonzero()[0])


def test_per_token_scale_is_batch_invariant() -> None:
    """The target row's codes, block and token scales, and row-wise layer output are bit-identical in
    every batch (seeds 0-4)."""
    w_deq = nvfp4_dequantize_torch(nvfp4_quantize_torch(torch.randn(N, K) * 0.1))
    for seed in range(5):
        target, batches = _batches(seed)
        alone = nvfp4_quantize_torch(target)
        y_alone = _row_output(alone, 0, w_deq)
        for batch in batches[1:]:
            q, r = nvfp4_quantize_torch(batch), _position(batch, target)
            assert _same_row(q, r, alone, 0)
            assert torch.equal(_row_output(q, r, w_deq), y_alone)


def test_per_tensor_scale_is_not_batch_invariant() -> None:
    """Counter-case: with one scale per tensor, a batch-mate of larger magnitude changes the target's
    scale, codes and layer output."""
    w_deq = nvfp4_dequantize_torch(nvfp4_quantize_torch(torch.randn(N, K) * 0.1, "tensor"))
    for seed in range(5):
        target, batches = _batches(seed)
        alone = nvfp4_quantize_torch(target, "tensor")
        loud = batches[1]  # mates 1e4 times larger
        q, r = nvfp4_quantize_torch(loud, "tensor"), _position(loud, target)
        assert not _same_row(q, r, alone, 0)
        assert not torch.equal(_row_output(q, r, w_deq), _row_output(alone, 0, w_deq))


def _sequence_change(scale: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A (T, K) sequence and a copy whose token t is changed (made 1e3 times louder)."""
    g = torch.Generator().manual_seed(7)
    seq = torch.randn(12, K, generator=g)
    changed = seq.clone()
    t = 8
    changed[t] = torch.randn(K, generator=g) * 1e3
    before = nvfp4_dequantize_torch(nvfp4_quantize_torch(seq, scale))  # type: ignore[arg-type]
    after = nvfp4_dequantize_torch(nvfp4_quantize_torch(changed, scale))  # type: ignore[arg-type]
    return before, after, t


def test_per_token_scale_leaks_nothing_across_tokens() -> None:
    """Changing token 8 leaves every earlier (and later) position's quantised values bit-identical."""
    before, after, t = _sequence_change("token")
    assert torch.equal(before[:t], after[:t]) and torch.equal(before[t + 1 :], after[t + 1 :])
    assert not torch.equal(before[t], after[t])


def test_per_tensor_scale_leaks_a_later_token_into_earlier_ones() -> None:
    """Counter-case: under one scale per tensor, token 8 changes what tokens 0-7 are quantised to."""
    before, after, t = _sequence_change("tensor")
    changed_rows = (before[:t] != after[:t]).any(-1)
    assert bool(changed_rows.all())
