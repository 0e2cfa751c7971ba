"""MTP heads distilled from a policy itself: the drafters of speculative sampling.

- Owns: `MTPHeads` (K Medusa-style heads over the final norm's output of a Hugging Face policy, each then read out
  by its output embedding), their file `mtp_heads.safetensors` beside the model (`heads_to_bytes`,
  `heads_from_files`), the self-distillation loss of any policy's heads (`distill_loss`), and `distill_mtp_heads`:
  heads initialised from scratch and trained by it on pretraining documents, the policy frozen; a Hugging Face
  policy's in a new `MTPHeads`, the built-in transformer's in its own model (`Transformer.mtp`,
  `ModelConfig.mtp_heads`), which its `pretrain.pt` then saves.
- Does not: sample (model/sampling/speculative.py), run phases (model/training/phases.py calls
  `distill_mtp_heads` after a phase with `mtp_heads`), or step the built-in transformer's heads during RL (the
  trainer keeps them following the policy with `distill_loss` under `[trainer] mtp_distill`,
  actors/trainer/core.py; `lm_loss` trains them with the main head where a bench does).

The file sits beside config.json; plain `transformers` never reads it, so the directory still loads as it is.
`HFPolicy` lists it among `files()` when present, so a joiner built from the spec gets the heads with the config
and tokenizer (uploaded once, beside version 0: a Hugging Face policy's heads do not train during RL and are not
part of a version). The built-in policy's heads are weights of its model, published with every version.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor, nn

from rlbus.model.policies.interface import Policy, PolicyError
from rlbus.model.policies.transformer import MTPHead

MTP_FILE: Final = "mtp_heads.safetensors"
_FORMAT: Final = "rlbus-mtp-heads-1"


class MTPHeads(nn.Module):
    """K heads, head k (1-based) at position t drafting token t+1+k: h + silu(W rmsnorm(h)) (W zero at init, so a
    fresh head drafts what the main head predicts for t+1), h being the input of the output embedding."""

    def __init__(self, n_heads: int, hidden_size: int) -> None:
        super().__init__()
        if n_heads < 1 or hidden_size < 1:
            raise ValueError(f"MTP heads need n_heads >= 1 and hidden_size >= 1, got {n_heads}, {hidden_size}")
        self.hidden_size = hidden_size
        self.heads = nn.ModuleList(MTPHead(hidden_size) for _ in range(n_heads))

    def __len__(self) -> int:
        return len(self.heads)


def heads_to_bytes(heads: MTPHeads) -> bytes:
    """The heads as a safetensors file: float32 tensors, the format named in the metadata (one key, so the bytes
    of equal heads are equal: the file's sha256 is in the policy's spec)."""
    from safetensors.torch import save

    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in heads.state_dict().items()}
    return save(state, metadata={"format": _FORMAT})


def heads_from_bytes(data: bytes) -> MTPHeads:
    """Inverse of `heads_to_bytes`.

    :raises PolicyError: not a heads file of this format.
    """
    from safetensors.torch import load

    try:
        state = load(data)
        meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"metadata format {meta.get('format')!r}")
        n = len({name.split(".")[1] for name in state})
        heads = MTPHeads(n, int(state["heads.0.fc.weight"].shape[0]))
        heads.load_state_dict(state)
    except Exception as err:  # safetensors raises its own SafetensorError
        raise PolicyError(f"{MTP_FILE}: not MTP heads rlbus wrote ({type(err).__name__}: {str(err)[:120]}); "
                          f"expected the file `distill_mtp_heads` saves (delete it to run without drafting)") from None
    return heads


def heads_from_files(files: Mapping[str, bytes], model: nn.Module) -> MTPHeads | None:
    """The heads among a policy's files, on `model`'s device and in its dtype; None when there are none.

    :raises PolicyError: a heads file that does not parse or does not fit the model's width.
    """
    data = files.get(MTP_FILE)
    if data is None:
        return None
    heads = heads_from_bytes(data)
    width = int(getattr(model.config, "hidden_size", heads.hidden_size))
    if heads.hidden_size != width:
        raise PolicyError(f"{MTP_FILE}: heads of width {heads.hidden_size}, the model's hidden_size is {width}; "
                          f"distil them again for this model")
    p = next(model.parameters())
    return heads.to(device=p.device, dtype=p.dtype).eval()


# ---- self-distillation --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DistillResult:
    heads: nn.Module
    """A Hugging Face policy's new `MTPHeads`; the built-in policy's own `Transformer.mtp` (a list of `MTPHead`)."""
    losses: list[float]
    """Mean KL (nats per position, over heads) of each step."""
    acceptance: list[float]
    """Per head, the greedy agreement of its draft with the main head's argmax on the last step's batch."""
    seconds: float


def _windows(documents: Iterator[tuple[list[int], Any]], batch: int, length: int, pad_id: int
             ) -> tuple[Tensor, Tensor]:
    """(ids (B, T), real (B, T) bool) of `batch` documents cut at `length`, right-padded."""
    docs = [next(documents)[0][:length] for _ in range(batch)]
    width = max(len(d) for d in docs)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    real = torch.zeros(batch, width, dtype=torch.bool)
    for r, d in enumerate(docs):
        ids[r, : len(d)] = torch.tensor(d, dtype=torch.long)
        real[r, : len(d)] = True
    return ids, real


def distill_loss(logits: Tensor, head_logits: Sequence[Tensor], real: Tensor) -> tuple[Tensor, list[float]]:
    """The self-distillation loss of MTP heads: head k (1-based) at position t is pulled to the main head's full
    distribution at position t + k (its prediction of token t+1+k), KL(p_main || q_k) averaged over the positions
    where both t and t + k are real, then over heads.

    logits (B, T, V): the main head's (the target: detached here); head_logits[k-1] (B, >= T-k, V): head k's at
    positions 0.. (only the first T-k count; a head with none is skipped); real (B, T) bool. -> (the loss, with
    grad through `head_logits` only; per head, the share of those positions where its argmax is the main head's).

    :raises ValueError: no head has a position to learn from (T <= 1, or no heads).
    """
    target = torch.log_softmax(logits.detach().float(), dim=-1)                # (B, T, V)
    width = logits.shape[1]
    terms: list[Tensor] = []
    agree: list[float] = []
    for k, head in enumerate(head_logits, start=1):
        T = width - k
        if T <= 0:
            continue
        q = torch.log_softmax(head[:, :T].float(), dim=-1)
        p = target[:, k:]
        mask = real[:, k:] & real[:, :T]
        n = mask.sum().clamp_min(1)
        kl = (p.exp() * (p - q)).sum(-1)
        terms.append((kl * mask).sum() / n)
        agree.append(float(((q.argmax(-1) == p.argmax(-1)) & mask).sum() / n))
    if not terms:
        raise ValueError(f"{len(head_logits)} MTP heads over {width} positions: nothing to distil")
    return torch.stack(terms).mean(), agree


def distill_mtp_heads(policy: Policy, documents: Iterator[tuple[list[int], Any]], *, n_heads: int, steps: int,
                      batch_size: int = 8, seq_len: int = 256, lr: float = 3e-3, seed: int = 0,
                      report: Callable[[int, float], None] | None = None) -> DistillResult:
    """Fresh MTP heads trained on `documents` ((ids, weights) pairs, the pretraining corpus) for `steps` AdamW
    steps of `distill_loss`. The policy is frozen: its forward runs without gradients, so the model saved beside
    (or with) the heads is the one the phase trained.

    A Hugging Face policy's heads are a new `MTPHeads` over the input of its output embedding, returned for the
    caller to set (`HFPolicy.set_mtp_heads`). The built-in policy's are its transformer's own: `n_heads` fresh
    `MTPHead`s replace `Transformer.mtp` (and `ModelConfig.mtp_heads`) in place, over the last block's output, read
    out by its final norm and output head as `Transformer.mtp_head_logits` reads them; saving the model saves them.

    :raises PolicyError: a policy with no output head to read the heads out through.
    """
    from rlbus.model.policies.builtin import BuiltinPolicy

    torch.manual_seed(seed)
    random.seed(seed)
    started = time.monotonic()
    p0 = next(policy.module.parameters())
    forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    if isinstance(policy, BuiltinPolicy):
        model = policy.transformer
        model.config = dataclasses.replace(model.config, mtp_heads=n_heads)
        model.mtp = nn.ModuleList(MTPHead(model.config.d_model) for _ in range(n_heads)).to(device=p0.device,
                                                                                           dtype=p0.dtype)
        trained: nn.Module = model.mtp
        heads: list[nn.Module] = list(model.mtp)
        project: Callable[[Tensor], Tensor] = model.head

        def forward(ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
            out = model(ids, attention_mask=real, with_mtp=False)
            return out.logits.float(), out.hidden
    else:
        from rlbus.model.sampling.speculative import _captured_input

        get = getattr(policy.module, "get_output_embeddings", None)
        out_embed = get() if callable(get) else None
        if out_embed is None:
            raise PolicyError(f"{policy.kind} policy: no output embedding to read MTP heads out through")
        fresh = MTPHeads(n_heads, int(policy.module.config.hidden_size)).to(device=policy.device)
        trained, heads, project = fresh, list(fresh.heads), out_embed

        def forward(ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
            with _captured_input(out_embed) as seen:
                logits = policy.forward(ids, attention_mask=real).logits.float()
            return logits, seen[0].to(next(fresh.parameters()).dtype)
    own = {id(p) for p in trained.parameters()}
    opt = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.0)
    pad = getattr(policy.tokenizer, "pad_id", 0)
    length = min(seq_len, policy.max_seq_len)
    was_training = policy.module.training
    policy.eval()
    frozen = [(p, p.requires_grad) for p in policy.module.parameters() if id(p) not in own]
    for p, _ in frozen:
        p.requires_grad_(False)
    losses: list[float] = []
    agree: list[float] = []
    try:
        for step in range(steps):
            ids, real = _windows(documents, batch_size, length, pad)
            ids, real = ids.to(policy.device), real.to(policy.device)
            if ids.shape[1] < 2:
                raise PolicyError(f"documents of one token cannot train MTP heads (seq_len {length})")
            with torch.no_grad():
                logits, hidden = forward(ids, real)
            width = ids.shape[1]
            loss, agree = distill_loss(logits, [project(head(hidden[:, : width - k]))
                                                for k, head in enumerate(heads, start=1) if k < width], real)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if report is not None:
                report(step + 1, losses[-1])
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        policy.train(was_training)
    return DistillResult(trained.to(dtype=p0.dtype).eval(), losses, agree, time.monotonic() - started)


def summary(result: DistillResult) -> dict[str, Any]:
    """What a phase's record says of a distillation."""
    return {"heads": len(result.heads), "steps": len(result.losses), "first_kl": result.losses[0],
            "final_kl": sum(result.losses[-5:]) / len(result.losses[-5:]),
            "greedy_agreement": [round(a, 4) for a in result.acceptance], "seconds": round(result.seconds, 2),
            "file": MTP_FILE}
