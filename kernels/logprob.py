"""Per-token log-probability of a target token and entropy, straight from logits.

Owns the Triton kernel (one program per row, online max/sum over vocabulary blocks, so the
(N, V) log-softmax is never materialised), its plain-torch reference with the same signature,
`token_logprob_entropy`, which picks Triton for CUDA tensors and the reference otherwise, and
`token_logprob`, the log-probability alone (what the trainer's loss needs: on the CPU it skips the
entropy's passes over the (N, V) probabilities).
Triton is imported lazily: CPU-only callers never load it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _check(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    if logits.dim() < 2 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"logits (..., V) and targets (...) must agree, got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be int32/int64 token ids, got {targets.dtype}")
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def token_logprob_entropy_torch(
    logits: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Reference. logits (..., V) any float, targets (...) int -> (logprob, entropy), float32 (...).

    z = logits / temperature; logprob = z[target] - logsumexp(z);
    entropy = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, with p = softmax(z).
    Differentiable (autograd through torch.log_softmax).
    """
    flat, tgt = _check(logits, targets)
    logp = torch.log_softmax(flat.float() / temperature, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)  # 0 * -inf-safe, also in grad
    logprob = logp.gather(-1, tgt.long()[:, None])[:, 0]
    return logprob.view(targets.shape), entropy.view(targets.shape)


def _logprob_triton() -> Any:
    from rlbus.kernels import _logprob_triton as module  # imports triton; reads TRITON_INTERPRET

    return module


def token_logprob_entropy_triton(
    logits: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Same contract as `token_logprob_entropy_torch`, forward only, via the Triton kernel."""
    import triton

    flat, tgt = _check(logits, targets)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    N, V = flat.shape
    logprob = torch.empty(N, dtype=torch.float32, device=flat.device)
    entropy = torch.empty(N, dtype=torch.float32, device=flat.device)
    if N:
        block = min(triton.next_power_of_2(V), 4096)
        _logprob_triton().logprob_entropy_kernel[(N,)](
            flat, tgt.contiguous(), logprob, entropy, V, flat.stride(0), 1.0 / temperature, BLOCK_V=block
        )
    return logprob.view(targets.shape), entropy.view(targets.shape)


class _LogprobEntropy(torch.autograd.Function):
    """Triton forward; backward recomputes softmax in torch:
    d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (z - sum_v p_v z_v)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        return token_logprob_entropy_triton(logits, targets, temperature)

    @staticmethod
    def backward(ctx: Any, g_logprob: Tensor, g_entropy: Tensor) -> tuple[Tensor, None, None]:
        logits, targets = ctx.saved_tensors
        z = logits.float() / ctx.temperature
        p = torch.softmax(z, dim=-1)
        onehot = torch.zeros_like(p).scatter_(-1, targets.long()[..., None], 1.0)
        z = torch.where(p > 0, z, torch.zeros_like(z))  # p = 0 where z = -inf: no 0 * inf
        mean_z = (p * z).sum(-1, keepdim=True)
        grad = g_logprob[..., None] * (onehot - p) - g_entropy[..., None] * p * (z - mean_z)
        return (grad / ctx.temperature).to(logits.dtype), None, None


def token_logprob_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Dispatch: Triton (differentiable via a torch backward) on CUDA, the torch reference otherwise."""
    if logits.is_cuda:
        return _LogprobEntropy.apply(logits, targets, temperature)  # type: ignore[no-any-return]
    return token_logprob_entropy_torch(logits, targets, temperature)


def token_logprob(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """logits (..., V) any float, targets (...) int -> float32 (...) log softmax(logits / temperature)[target],
    differentiable: `token_logprob_entropy`'s logprob without the entropy (the Triton kernel on CUDA, where both
    come from one pass; on the CPU a log-softmax and a gather, equal to the reference's logprob)."""
    if logits.is_cuda:
        return _LogprobEntropy.apply(logits, targets, temperature)[0]  # type: ignore[no-any-return]
    flat, tgt = _check(logits, targets)
    z = flat.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tgt.long()[:, None])[:, 0].view(targets.shape)
