"""The policy network: a decoder-only transformer (RoPE, RMSNorm, SwiGLU) with a KV cache.

Owns the config presets, optional MoE feed-forward layers with router replay (and its plausibility
check), optional multi-token-prediction (MTP) heads and left-padded batches. Does not own sampling
(`model/sampling/generate.py`), losses (`model/training/loss.py`) or tokenisation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlbus.model.policies.interface import RowKV


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a `Transformer`. Presets: `tiny()` (tests), `small()` (CPU pretraining), `m30()`."""

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 384
    """Hidden width of each SwiGLU feed-forward (also of each MoE expert)."""
    max_seq_len: int = 1024
    """Longest position the RoPE table covers; also the default KV-cache length."""
    rope_theta: float = 10000.0
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers whose feed-forward is a mixture of experts."""
    n_experts: int = 4
    top_k: int = 2
    mtp_heads: int = 0
    """Extra multi-token-prediction heads: head k (1-based) at position t predicts token t+1+k."""
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            problems.append(f"d_model {self.d_model} must split into n_heads {self.n_heads} even-sized heads")
        if any(not 0 <= i < self.n_layers for i in self.moe_layers):
            problems.append(f"moe_layers {self.moe_layers} must be layer indices in [0, {self.n_layers})")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            problems.append(f"moe_layers {self.moe_layers} has duplicates")
        if self.moe_layers and not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.mtp_heads < 0 or self.vocab_size < 2 or self.max_seq_len < 1:
            problems.append("mtp_heads must be >= 0, vocab_size >= 2, max_seq_len >= 1")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @classmethod
    def tiny(cls, **overrides: object) -> ModelConfig:
        """About 115k parameters; for unit tests."""
        base = cls(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=256)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    @classmethod
    def small(cls, **overrides: object) -> ModelConfig:
        """About 3.5M parameters; pretrains in minutes on 2 CPU cores."""
        base = cls(d_model=256, n_layers=4, n_heads=4, d_ff=768, max_seq_len=1024)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    @classmethod
    def m30(cls, **overrides: object) -> ModelConfig:
        """About 34M parameters; for weight-transfer and swap benchmarks."""
        base = cls(d_model=512, n_layers=8, n_heads=8, d_ff=2048, max_seq_len=1024)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


class KVCache:
    """Preallocated keys/values per layer, (B, H, max_len, Dh) each, filled up to `length`.

    All rows share one `length` (slot index). Rows of unequal prompt length are left-padded:
    `key_mask` (B, max_len) marks real tokens, and `next_pos` (B,) holds each row's next RoPE
    position, so a row's first real token sits at position 0 whatever its padding.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(f"cache max_len {max_len} exceeds the model's max_seq_len {config.max_seq_len}")
        head_dim = config.d_model // config.n_heads
        shape = (batch, config.n_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len
        self.has_padding = False

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    def keep_rows(self, rows: Tensor, extra: int) -> None:
        """Keep only batch rows `rows` (int64 indices, in that order) and drop the leading slots no kept
        row has a real token in; room for `extra` more slots after the current length.

        Positions live in `next_pos`, not in slot indices, so dropping shared left padding changes no
        row's attention or RoPE. Used by `generate` to stop computing rows that have finished.
        """
        keys = self.key_mask.index_select(0, rows)[:, : self.length]
        any_real = keys.any(0)
        first = int(any_real.int().argmax()) if bool(any_real.any()) else self.length
        kept = self.length - first
        width = kept + extra
        for store in (self.k, self.v):
            for layer, old in enumerate(store):
                new = old.new_zeros((len(rows), old.shape[1], width, old.shape[3]))
                new[:, :, :kept] = old.index_select(0, rows)[:, :, first : self.length]
                store[layer] = new
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=self.key_mask.device)
        mask[:, :kept] = keys[:, first:]
        self.key_mask = mask
        self.next_pos = self.next_pos.index_select(0, rows)
        self.length = kept
        self.max_len = width
        self.has_padding = self.has_padding and not bool(mask[:, :kept].all())

    def row_kv(self, row: int) -> RowKV:
        """Row `row`'s keys and values of its real slots, (H, n, Dh) per layer, copied out of the batch."""
        real = self.key_mask[row, : self.length].nonzero()[:, 0]
        return RowKV([k[row].index_select(1, real) for k in self.k], [v[row].index_select(1, real) for v in self.v])

    @classmethod
    def from_rows(cls, config: ModelConfig, rows: list[RowKV], extra: int, *, device: torch.device | str,
                  dtype: torch.dtype) -> KVCache:
        """A cache of `rows` (one batch row each, right-aligned: left padding before the shorter ones) with room
        for `extra` more slots; each row's next position is its length."""
        width = max((r.length for r in rows), default=0)
        cache = cls(config, len(rows), width + extra, device=device, dtype=dtype)
        for b, r in enumerate(rows):
            if not (n := r.length):
                continue
            for layer in range(config.n_layers):
                cache.k[layer][b, :, width - n : width] = r.keys[layer]
                cache.v[layer][b, :, width - n : width] = r.values[layer]
            cache.key_mask[b, width - n : width] = True
            cache.next_pos[b] = n
        cache.length = width
        cache.has_padding = any(r.length < width for r in rows)
        return cache

    def truncate(self, length: int) -> None:
        """Forget every slot at or after `length` (speculative-decoding rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.key_mask[:, length:] = False
        self.next_pos = self.key_mask[:, :length].sum(dim=1)
        self.length = length


class ModelOutput(NamedTuple):
    logits: Tensor
    """(B, T, V) next-token logits."""
    routing: Tensor | None
    """(B, T, n_moe_layers, top_k) int64 expert ids, in `moe_layers` order; None without MoE."""
    mtp_logits: list[Tensor]
    """mtp_logits[k-1] (B, T, V): head k's logits for token t+1+k; empty without MTP heads."""
    hidden: Tensor | None = None
    """(B, T, D) last block's output (before the final norm), for `Transformer.mtp_head_logits`."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), statistics in fp32."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin (max_len, head_dim/2) of angle p * theta^(-2i/head_dim) (Su et al. 2021)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x1, x2) of the two halves of x (B, H, T, Dh) by cos/sin (B, 1, T, Dh/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, layer: int
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D); writes k/v into cache slots [length, length+T) if given."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = cache.length
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k, v = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
        if mask is None and cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        else:
            y = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask).to(x.dtype)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """down(silu(gate x) * up x) (Shazeer 2020)."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Shazeer et al. 2017), gates renormalised over the chosen k.

    `replay_threshold` t (0 by default: replay as recorded) makes router replay check plausibility:
    a replayed expert whose router probability is below t times the k-th largest probability (the
    weakest expert of this layer's own top-k) is replaced by the best of its own top-k not already
    chosen, in the same slot. The ids returned are the ones used, so replaced = (returned != forced).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.replay_threshold = 0.0
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(config.d_model, config.d_ff) for _ in range(config.n_experts))

    def forward(self, x: Tensor, ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """x (B, T, D), ids (B, T, k) forced experts or None -> (y (B, T, D), ids used (B, T, k)).

        gate_i = p_i / sum_{j in chosen} p_j with p = softmax(router(x)); with forced ids the gates
        are recomputed from the router for exactly those experts, so the router still gets gradients.
        """
        B, T, D = x.shape
        probs = torch.softmax(self.router(x).float(), dim=-1)
        if ids is None:
            gate, ids = probs.topk(self.top_k, dim=-1)
        else:
            if self.replay_threshold > 0:
                ids = plausible_replay(probs.detach(), ids, self.top_k, self.replay_threshold)
            gate = probs.gather(-1, ids)
        gate = (gate / gate.sum(-1, keepdim=True)).to(x.dtype)
        flat_x, flat_ids, flat_gate = (
            x.reshape(-1, D),
            ids.reshape(-1, self.top_k),
            gate.reshape(-1, self.top_k),
        )
        y = torch.zeros_like(flat_x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(flat_ids == e, as_tuple=True)
            if token.numel():
                y.index_add_(0, token, expert(flat_x[token]) * flat_gate[token, slot, None])
        return y.view(B, T, D), ids


def plausible_replay(probs: Tensor, ids: Tensor, top_k: int, threshold: float) -> Tensor:
    """probs (..., E), replayed ids (..., k) -> ids with every implausible expert replaced.

    Implausible: p[id] < threshold * (k-th largest p). Its slot takes the highest-ranked expert of the
    row's own top-k that the row does not already use. Rows with nothing implausible are untouched.
    """
    own_p, own = probs.topk(top_k, dim=-1)
    bad = probs.gather(-1, ids) < threshold * own_p[..., -1:]
    if not bool(bad.any()):
        return ids
    flat_ids, flat_bad, flat_own = ids.reshape(-1, top_k).clone(), bad.reshape(-1, top_k), own.reshape(-1, top_k)
    for row in flat_bad.any(-1).nonzero().flatten().tolist():
        keep = flat_ids[row][~flat_bad[row]].tolist()
        spare = [e for e in flat_own[row].tolist() if e not in keep]
        for slot in flat_bad[row].nonzero().flatten().tolist():
            flat_ids[row, slot] = spare.pop(0)
    return flat_ids.view(ids.shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn: nn.Module = (
            MoE(config) if layer in config.moe_layers else SwiGLU(config.d_model, config.d_ff)
        )

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        ids: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, self.layer)
        if isinstance(self.ffn, MoE):
            y, ids = self.ffn(self.ffn_norm(x), ids)
            return x + y, ids
        return x + self.ffn(self.ffn_norm(x)), None


class MTPHead(nn.Module):
    """Medusa-style head (Cai et al. 2024): h + silu(W rmsnorm(h)), then the shared output head."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.fc.weight)

    def forward(self, h: Tensor) -> Tensor:
        return h + F.silu(self.fc(self.norm(h)))


class Transformer(nn.Module):
    """Decoder-only transformer; see `forward` for caching, padding and router replay."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = (
            None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.mtp = nn.ModuleList(MTPHead(config.d_model) for _ in range(config.mtp_heads))
        cos, sin = rope_tables(config.d_model // config.n_heads, config.max_seq_len, config.rope_theta)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.moe_index = {layer: i for i, layer in enumerate(sorted(config.moe_layers))}
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2 or name.startswith("mtp."):
                continue
            scale = (
                1 / math.sqrt(2 * self.config.n_layers)
                if name.endswith(("proj.weight", "down.weight"))
                else 1
            )
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        """Keep the RoPE tables fp32 whatever dtype the model is cast to (only their device follows)."""
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32:
            cfg = self.config
            cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache on this model's device; max_len defaults to max_seq_len, dtype to the model's.

        A cache of another dtype makes attention over it run in that dtype: bfloat16 halves the memory
        traffic of decoding, float32 avoids the emulated bf16 matmuls of a CPU without bf16 units.
        """
        p = self.embed.weight
        return KVCache(self.config, batch, max_len or self.config.max_seq_len, device=p.device,
                       dtype=dtype or p.dtype)

    def cache_from_rows(self, rows: list[RowKV], extra: int, dtype: torch.dtype | None = None) -> KVCache:
        """`KVCache.from_rows` on this model's device; dtype defaults to the model's."""
        p = self.embed.weight
        return KVCache.from_rows(self.config, rows, extra, device=p.device, dtype=dtype or p.dtype)

    def head(self, h: Tensor) -> Tensor:
        """Final RMSNorm and output projection: h (B, T, D) -> logits (B, T, V)."""
        h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed.weight)

    def mtp_head_logits(self, hidden: Tensor) -> list[Tensor]:
        """hidden (B, T, D) from ModelOutput.hidden -> one (B, T, V) logits tensor per MTP head."""
        return [self.head(mtp(hidden)) for mtp in self.mtp]

    def forward(
        self,
        tokens: Tensor,
        *,
        cache: KVCache | None = None,
        routing: Tensor | None = None,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        with_mtp: bool = True,
    ) -> ModelOutput:
        """tokens (B, T) int64 -> ModelOutput.

        cache: tokens go into slots [cache.length, cache.length + T) and attend to everything
        before; positions continue from each row's `next_pos`. The cache is updated.
        routing (B, T, n_moe_layers, top_k): the MoE layers use exactly these experts (replay).
        attention_mask (B, T) bool, True = real token: False slots (left padding) are never
        attended to by later tokens and do not advance positions. A padded row's outputs at its
        pad slots are meaningless. Right padding needs no mask (causality hides it).
        positions (B, T) int64 overrides the RoPE positions.
        with_mtp=False skips the MTP heads (mtp_logits empty); `hidden` lets callers run them later.
        """
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} slots; {start} used, {T} more do not fit")
        if cache is None and T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.config.max_seq_len}")
        n_moe = len(self.moe_index)
        if routing is not None and (not n_moe or routing.shape != (B, T, n_moe, self.config.top_k)):
            raise ValueError(
                f"routing shape {tuple(routing.shape)} != {(B, T, n_moe, self.config.top_k)} "
                f"(B, T, n_moe_layers, top_k)"
            )
        real = attention_mask.bool() if attention_mask is not None else None
        if positions is None:
            base = (
                cache.next_pos[:, None]
                if cache is not None
                else torch.zeros(B, 1, dtype=torch.long, device=tokens.device)
            )
            steps = real.long().cumsum(1) - 1 if real is not None else torch.arange(T, device=tokens.device)
            positions = (base + steps).clamp_min(0)
        mask = self._mask(real, cache, T, tokens.device)
        if cache is not None:
            cache.key_mask[:, start : start + T] = real if real is not None else True
            cache.next_pos = cache.next_pos + (real.sum(1) if real is not None else T)
            cache.has_padding = cache.has_padding or (real is not None and not bool(real.all()))
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        x = self.embed(tokens)
        chosen: list[Tensor] = []
        for layer, block in enumerate(self.blocks):
            ids = (
                routing[:, :, self.moe_index[layer]]
                if routing is not None and layer in self.moe_index
                else None
            )
            x, ids = block(x, cos, sin, mask, cache, ids)
            if ids is not None:
                chosen.append(ids)
        if cache is not None:
            cache.length = start + T
        mtp_logits = self.mtp_head_logits(x) if with_mtp else []
        return ModelOutput(self.head(x), torch.stack(chosen, dim=2) if chosen else None, mtp_logits, x)

    def _mask(
        self, real: Tensor | None, cache: KVCache | None, T: int, device: torch.device
    ) -> Tensor | None:
        """Boolean attention mask (B, 1, T, S), True = may attend; None when plain causal suffices."""
        padded = (real is not None and not bool(real.all())) or (cache is not None and cache.has_padding)
        if not padded and (cache is None or T == 1):
            return None
        start = cache.length if cache is not None else 0
        S = start + T
        q_pos = torch.arange(start, S, device=device)[:, None]
        k_pos = torch.arange(S, device=device)[None, :]
        causal = k_pos <= q_pos  # (T, S)
        if not padded:
            return causal
        B = real.shape[0] if real is not None else cache.batch  # type: ignore[union-attr]
        keys = torch.ones(B, S, dtype=torch.bool, device=device)
        if cache is not None:
            keys[:, :start] = cache.key_mask[:, :start]
        if real is not None:
            keys[:, start:] = real
        # A query always sees itself, so a pad query never has an empty (NaN) softmax row.
        return (causal[None] & (keys[:, None, :] | (k_pos == q_pos)[None]))[:, None]
