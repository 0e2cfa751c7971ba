"""The trainer's math and state, apart from the bus: which rollouts go into a step, one RL optimizer step,
and the bytes of a checkpoint.

- Owns: `plan_step` (whole groups into a batch, stale or unusable ones dropped with a reason), `rollout_batch`,
  the reward's length penalty (`shaped_rewards`, over an episode's `effort_counts`),
  `Core` (what the trainer actor drives), `TrainerCore` (the one-process `Core`: fp32 master policy, frozen
  reference, AdamW), `build_core` and `state_policy` (the policy a checkpoint holds).
- Works on any `Policy`, never on an implementation directly.
- Does not: talk to the bus, ack, publish or decide when to checkpoint (actors/trainer/actor.py).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np
import torch

# torch imports torch._dynamo when it builds its first optimizer, and that import runs ast.parse (inspect.signature
# of builtins). `TrainerCore` builds AdamW in a worker thread (the trainer's `anyio.to_thread.run_sync`), so the
# import happens here instead, on the thread that imports this module: CPython 3.11 before gh-106905 keeps the AST
# builder's recursion depth in interpreter-global state, and two threads parsing at once fail with
# "SystemError: AST constructor recursion depth mismatch".
import torch._dynamo
from torch import Tensor

from rlbus.actors.common.errors import CheckpointError
from rlbus.actors.trainer.config import LengthPenaltyConfig
from rlbus.kernels.delta.state import encode_state
from rlbus.kernels.logprob import token_logprob
from rlbus.messages.schemas import Rollout, Segment
from rlbus.messages.subjects import Subjects
from rlbus.model.policies.interface import (
    Policy,
    PolicyError,
    fresh_builtin,
    load_policy,
    policy_from_spec,
    reference_dtype,
    resolve_device,
    set_policy_numerics,
)
from rlbus.model.sampling.generate import distinct_prompts, left_pad
from rlbus.model.training.loss import (
    Aggregation,
    effort_penalty,
    group_relative_advantages,
    rl_loss,
    shape_rewards,
)

STATE_FORMAT: Final = 1
"""Layout version of `TrainerCore.state_blob` (the `policy_files` entry, absent from older blobs, reads as none)."""
STATE_FILE: Final = "trainer-state.pt"
"""The file name a one-process `TrainerCore.save` hands its one blob to `upload` under."""

Upload = Callable[[str, bytes], tuple[str, str]]
"""(file name, bytes) -> (object name, digest): how a core stores one checkpoint file (from a worker thread)."""


# ---- which rollouts go into the next step ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """The next step's groups (task ids, in arrival order) and the groups to drop with their reason."""

    train: tuple[str, ...] = ()
    drop: tuple[tuple[str, str], ...] = ()


def versions_behind(rollout: Rollout, version: int) -> int:
    """version - min(per-token policy versions, its segments' included), at least 0; a rollout without tokens
    is 0 behind."""
    oldest = [int(v.min()) for part in (*rollout.segments, rollout) if (v := part.policy_versions.numpy()).size]
    return max(0, version - min(oldest)) if oldest else 0


def plan_step(groups: Mapping[str, Sequence[Rollout]], *, version: int, staleness_versions: int,
              batch_rollouts: int, check: Callable[[Rollout], str | None] = lambda _: None,
              drop_flat: bool = False) -> Plan:
    """Decide the next step from buffered groups (task id → members so far, in arrival order).

    A group is dropped whole when a member's sandbox failed (`Rollout.timings["sandbox_error"]`, reason
    "sandbox_error: ...": an outcome the policy did not cause is never trained), when a member is unusable
    (`check` returns a reason) or when its oldest
    token is more than `staleness_versions` behind `version` (reason "stale: ..."). A group is ready
    when it holds `group_size` members; with `drop_flat`, a complete group whose rewards are all equal
    is dropped instead (reason "flat: ...": its group-relative advantages are all 0, so it carries no
    policy-gradient signal — DAPO's dynamic sampling, Yu et al. 2025). Once the ready groups hold at least `batch_rollouts` rollouts,
    `train` takes ready groups in order while they fit in `batch_rollouts` (at least one group);
    otherwise `train` is empty (wait for more).
    """
    drop: list[tuple[str, str]] = []
    ready: list[tuple[str, int]] = []
    for task_id, members in groups.items():
        if not members:
            continue
        reason = next((f"sandbox_error: episode {m.group_index}'s sandbox failed, not the policy" for m in members
                       if m.timings.get("sandbox_error")), None)
        reason = reason or next((r for m in members if (r := check(m)) is not None), None)
        if reason is None and len({m.group_size for m in members}) > 1:
            reason = "invalid: members disagree on group_size"
        if reason is None:
            behind = max(versions_behind(m, version) for m in members)
            if behind > staleness_versions:
                reason = f"stale: {behind} versions behind (bound {staleness_versions})"
        complete = len(members) >= members[0].group_size
        if reason is None and drop_flat and complete and len({m.reward for m in members}) == 1:
            reason = f"flat: all {len(members)} rewards {members[0].reward:g} (no learning signal)"
        if reason is not None:
            drop.append((task_id, reason))
        elif complete:
            ready.append((task_id, len(members)))
    train: list[str] = []
    if sum(n for _, n in ready) >= batch_rollouts:
        taken = 0
        for task_id, n in ready:
            if train and taken + n > batch_rollouts:
                break
            train.append(task_id)
            taken += n
            if taken >= batch_rollouts:
                break
    return Plan(train=tuple(train), drop=tuple(drop))


# ---- the padded batch --------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutBatch:
    """B rows right-padded to L = max(P_b + T_b) tokens; position j of the (B, L-1) arrays is the
    prediction of token j+1 from logits[:, j], so completion token t of row b sits at j = P_b - 1 + t.
    A row is a rollout, or one of its earlier segments (each under its own context, `Rollout.segments`):
    a rollout's segments come first, then the rollout itself, and `owner` says whose each row is."""

    tokens: Tensor
    """(B, L) int64 prompt + completion ids, right-padded with 0."""
    mask: Tensor
    """(B, L-1) bool: True where the predicted token is a completion token the policy produced."""
    behaviour: Tensor
    """(B, L-1) float32 behaviour logprob of the predicted token (0 off the mask)."""
    routing: Tensor | None
    """(B, L, n_moe_layers, top_k) int64 recorded experts to replay; None when not every row has them."""
    rewards: Tensor
    """(B,) float32 rewards as the generator reported them."""
    lengths: Tensor
    """(B,) int64 completion lengths T_b."""
    prompt_lengths: Tensor
    """(B,) int64 prompt lengths P_b."""
    group_ids: Tensor
    """(B,) int64 group index (rows of one task share it)."""
    owner: Tensor
    """(B,) int64: the index of the rollout each row belongs to (0..N-1; the identity without segments)."""
    segmented: bool = False
    """Some rollout has earlier segments (then B > N)."""


def batch_rows(rollouts: Sequence[Rollout]) -> list[tuple[Rollout | Segment, int]]:
    """Every row a batch of `rollouts` trains, with the index of its rollout: each rollout's segments, oldest
    first, then the rollout itself."""
    return [(part, i) for i, r in enumerate(rollouts) for part in (*r.segments, r)]


def rollout_batch(rollouts: Sequence[Rollout], *, moe: tuple[int, int] | None = None,
                  device: torch.device | str = "cpu") -> RolloutBatch:
    """Pad `rollouts` (their segments as rows of their own, `batch_rows`) into a `RolloutBatch`. moe =
    (n_moe_layers, top_k) of the model, None without MoE; routing is replayed when every row carries a
    (P + T, n_moe_layers, top_k) record."""
    if not rollouts:
        raise ValueError("a batch needs at least one rollout")
    rows = batch_rows(rollouts)
    owners = [i for _, i in rows]
    parts = [part for part, _ in rows]
    prompts = [r.prompt_tokens.numpy().astype(np.int64) for r in parts]
    completions = [r.completion_tokens.numpy().astype(np.int64) for r in parts]
    B = len(parts)
    L = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, max(L - 1, 0), dtype=torch.bool)
    behaviour = torch.zeros(B, max(L - 1, 0), dtype=torch.float32)
    groups: dict[str, int] = {}
    for b, (r, p, c) in enumerate(zip(parts, prompts, completions, strict=True)):
        owner = rollouts[owners[b]]
        P, T = len(p), len(c)
        tokens[b, :P] = torch.from_numpy(p)
        tokens[b, P:P + T] = torch.from_numpy(c)
        if T:
            if P < 1:
                raise ValueError(f"rollout {owner.rollout_id}: a completion needs at least one prompt token")
            keep = r.loss_mask.numpy()
            trained = torch.ones(T, dtype=torch.bool) if keep.size == 0 else torch.from_numpy(keep != 0)
            mask[b, P - 1:P - 1 + T] = trained
            behaviour[b, P - 1:P - 1 + T] = torch.from_numpy(r.behaviour_logprobs.numpy().astype(np.float32))
        groups.setdefault(owner.task_id, len(groups))
    routing = None
    if moe is not None and all(r.routing is not None for r in parts):
        n_moe, top_k = moe
        routing = torch.arange(top_k, dtype=torch.long).expand(B, L, n_moe, top_k).clone()
        for b, r in enumerate(parts):
            assert r.routing is not None
            record = torch.from_numpy(r.routing.numpy().astype(np.int64))
            routing[b, :record.shape[0]] = record
    return RolloutBatch(
        tokens=tokens.to(device), mask=mask.to(device), behaviour=behaviour.to(device),
        routing=None if routing is None else routing.to(device),
        rewards=torch.tensor([rollouts[i].reward for i in owners], dtype=torch.float32, device=device),
        lengths=torch.tensor([len(c) for c in completions], dtype=torch.long, device=device),
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device),
        group_ids=torch.tensor([groups[rollouts[i].task_id] for i in owners], dtype=torch.long, device=device),
        owner=torch.tensor(owners, dtype=torch.long, device=device), segmented=B > len(rollouts),
    )


def shared_prompt_logprobs(net: Policy, batch: RolloutBatch, temperature: float = 1.0) -> Tensor | None:
    """`TrainerCore.logprobs` of the completion tokens with each distinct prompt run once: its keys and
    values are copied to the rows that share it (differentiably), then all completions run together.

    A group's G rollouts share one prompt, so this skips (G-1)/G of the prompt positions (most of a
    batch's tokens). Returns (B, L-1) with the completion positions filled and 0 elsewhere, or None
    when no two rows share a prompt, no row has a completion, a row has no prompt, or the longest prompt
    and the longest completion together exceed the policy's `max_seq_len` (a segment's long context beside
    another row's long completion): the full forward handles those.
    """
    P = batch.prompt_lengths.tolist()
    T = batch.lengths.tolist()
    B, L = batch.tokens.shape
    width = max(T, default=0)
    prompt_ids = [batch.tokens[b, :P[b]].tolist() for b in range(B)]
    first, copies = distinct_prompts(prompt_ids)
    if len(first) == B or width == 0 or min(P) == 0 or max(P) + width > net.max_seq_len:
        return None       # the longest prompt and the longest completion (of other rows) may not fit one cache
    device = batch.tokens.device
    copy_of = torch.tensor(copies, dtype=torch.long, device=device)
    # left-padded: every distinct prompt's last token in the last column
    prompts, real = left_pad([prompt_ids[b] for b in first], 0, device)
    completions = torch.zeros(B, width, dtype=torch.long, device=device)
    for b in range(B):
        completions[b, :T[b]] = batch.tokens[b, P[b]:P[b] + T[b]]
    cache = net.new_cache(len(first), prompts.shape[1] + width)
    head = net(prompts, cache=cache, attention_mask=real).logits[:, -1:]
    cache.keep_rows(copy_of, width)
    rest = net(completions, cache=cache).logits[:, :-1]  # right padding: causality hides it
    logits = torch.cat([head.index_select(0, copy_of), rest], dim=1)  # (B, width, V): predicts completion t
    logp = token_logprob(logits, completions, temperature)
    logp = logp.masked_fill(torch.arange(width, device=device)[None] >= batch.lengths[:, None], 0.0)
    # completion token t of row b is position P_b - 1 + t of the (B, L-1) layout; padded rows land past it
    at = batch.prompt_lengths[:, None] - 1 + torch.arange(width, device=device)[None]
    return torch.zeros(B, L - 1 + width, dtype=logp.dtype, device=device).scatter(1, at, logp)[:, :L - 1]


def per_rollout(batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(rewards, completion lengths, group ids), each (N,) per rollout: a rollout's length counts the
    completion tokens of all its rows. The batch's own tensors when it has no segments."""
    if not batch.segmented:
        return batch.rewards, batch.lengths, batch.group_ids
    n = int(batch.owner.max()) + 1
    first = torch.full((n,), batch.owner.numel(), dtype=torch.long, device=batch.owner.device)
    first = first.scatter_reduce(0, batch.owner, torch.arange(batch.owner.numel(), device=batch.owner.device),
                                 reduce="amin")
    lengths = torch.zeros(n, dtype=batch.lengths.dtype, device=batch.lengths.device).index_add_(
        0, batch.owner, batch.lengths)
    return batch.rewards.index_select(0, first), lengths, batch.group_ids.index_select(0, first)


EFFORT_KEYS: Final = ("policy_tokens", "tool_call_tokens", "tool_output_tokens", "final_tokens", "tool_calls", "turns")
"""The columns of `effort_counts`, in the order of `[trainer.length_penalty] weights` (actors/trainer/config.py
`EffortWeights`)."""


def effort_counts(rollout: Rollout) -> tuple[float, ...]:
    """The episode's counts in `EFFORT_KEYS` order, its segments included:

    policy_tokens: completion tokens with loss mask 1 (every token when the mask is empty);
    tool_call_tokens: `Rollout.tool_call_tokens`, 0 when not recorded (generators do not record it yet);
    tool_output_tokens: completion tokens with loss mask 0 (tool outputs, test feedback and their framing);
    final_tokens: `Rollout.final_tokens`, else the last run of policy tokens of the rollout's own completion;
    tool_calls: `timings["tool_calls"]`, else 0; turns: `timings["turns"]`, else `timings["attempts"]`, else 1.
    """
    policy = observed = 0
    last_run = 0
    for part in (*rollout.segments, rollout):
        T = len(part.completion_tokens)
        keep = part.loss_mask.numpy()
        mine = np.ones(T, dtype=bool) if keep.size == 0 else keep[:T] != 0
        policy += int(mine.sum())
        observed += T - int(mine.sum())
        if part is rollout:
            not_mine = np.flatnonzero(~mine)
            end = int(np.flatnonzero(mine)[-1]) + 1 if mine.any() else 0
            start = int(not_mine[not_mine < end][-1]) + 1 if (not_mine < end).any() else 0
            last_run = end - start
    timings = rollout.timings
    turns = timings.get("turns", timings.get("attempts", 1.0))
    return (float(policy), float(rollout.tool_call_tokens or 0), float(observed),
            float(last_run if rollout.final_tokens is None else rollout.final_tokens),
            float(timings.get("tool_calls", 0.0)), float(turns))


def shaped_rewards(rewards: Tensor, lengths: Tensor, rollouts: Sequence[Rollout],
                   penalty: LengthPenaltyConfig) -> Tensor:
    """The rewards (N,) less the `[trainer.length_penalty]` of each rollout: convex in its completion `lengths`
    (N,) (`model.loss.shape_rewards`), or concave in its weighted effort (`effort_counts`,
    `model.loss.effort_penalty`); unchanged when `penalty.coef` is 0."""
    if penalty.coef <= 0:
        return rewards
    if penalty.form == "convex":
        return shape_rewards(rewards, lengths, penalty.budget, coef=penalty.coef, power=penalty.power)
    counts = torch.tensor([effort_counts(r) for r in rollouts], dtype=torch.float64)
    w = penalty.weights
    weights = torch.tensor([getattr(w, key) for key in EFFORT_KEYS], dtype=torch.float64)
    cost = effort_penalty(counts, weights, coef=penalty.coef, k=penalty.k, q=penalty.q)
    return rewards - cost.to(device=rewards.device, dtype=rewards.dtype)


def mtp_distill_problem(policy: Policy) -> str | None:
    """Why `[trainer] mtp_distill` > 0 cannot train `policy`'s MTP heads (None: it can)."""
    if policy.kind != "builtin":
        return (f"a {policy.kind} policy's MTP heads are a file sent to generators once (mtp_heads.safetensors), "
                "not part of a version, so they cannot follow the policy during RL; set it to 0")
    if not getattr(policy.module, "mtp", None):
        return ("the built-in policy has no MTP heads (ModelConfig.mtp_heads = 0): there is nothing to distil; "
                "set it to 0 or start from a pretrain.pt with mtp_heads")
    return None


@contextlib.contextmanager
def hidden_states(policy: Policy) -> Iterator[list[Tensor]]:
    """While open, every hidden state the built-in policy's output head reads (the last block's output, the input of
    its final norm), detached, in call order: one (B, L, D) for a full forward of a batch, or (distinct prompts,
    P, D) then (B, width, D) for `shared_prompt_logprobs`."""
    seen: list[Tensor] = []
    handle = policy.module.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        yield seen
    finally:
        handle.remove()


def completion_windows(batch: RolloutBatch, seen: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The hidden states `hidden_states` saw, at each row's last prompt token and completion tokens: (B, 1 + W, D)
    with W the longest completion, and which of them are real (B, 1 + W) (1 + T_b per row). These are the positions
    a generator drafts from."""
    width = int(batch.lengths.max()) if batch.lengths.numel() else 0
    device = batch.tokens.device
    offsets = torch.arange(width + 1, device=device)[None]
    real = offsets <= batch.lengths[:, None]
    if len(seen) == 1:                      # the full forward: row b's window starts at P_b - 1
        hidden = seen[0]
        at = (batch.prompt_lengths[:, None] - 1 + offsets).clamp_max(hidden.shape[1] - 1)
        return hidden.gather(1, at[:, :, None].expand(-1, -1, hidden.shape[2])), real
    prompts, completions = seen               # shared prompts: left-padded, each one's last token in the last column
    _, copies = distinct_prompts([batch.tokens[b, :P].tolist() for b, P in enumerate(batch.prompt_lengths.tolist())])
    last = prompts[:, -1].index_select(0, torch.tensor(copies, dtype=torch.long, device=device))
    return torch.cat([last[:, None], completions[:, :width]], dim=1), real


def distill_heads(policy: Policy, batch: RolloutBatch, seen: Sequence[Tensor], weight: float, clip: float) -> float:
    """Put `weight` x the gradient of the built-in policy's MTP heads' `distill_loss` into the heads' `.grad`,
    clipped to norm `clip`; returns the loss. It is taken at the positions generators draft from
    (`completion_windows` of the hidden states the RL forward computed, `seen`): each row's last prompt token and
    its completion tokens.

    The main head's logits come from those detached states, and the gradient is taken with respect to the heads'
    parameters alone, so the trunk, the embedding and the output head (which the heads share) get nothing from
    it: the RL gradient is as without the heads.
    """
    from rlbus.model.training.mtp import distill_loss

    model = policy.module
    heads = list(model.mtp.parameters())
    hidden, real = completion_windows(batch, seen)
    with torch.no_grad():
        logits = model.head(hidden)
    loss, _ = distill_loss(logits, model.mtp_head_logits(hidden), real)
    grads = torch.autograd.grad(weight * loss, heads)
    for p, g in zip(heads, grads, strict=True):
        p.grad = g if p.grad is None else p.grad + g
    torch.nn.utils.clip_grad_norm_(heads, clip)
    return float(loss.detach())


NO_LENGTH_PENALTY: Final = LengthPenaltyConfig()
"""`[trainer.length_penalty]` as it defaults: coef 0, no penalty."""


# ---- one optimizer step ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Objective:
    """The RL objective's constants (from the trainer settings)."""

    kl_coef: float = 0.001
    is_cap: float = 2.0
    length_penalty: LengthPenaltyConfig = NO_LENGTH_PENALTY
    """The reward's length penalty (`shaped_rewards`); off by default."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this; 0 turns clipping off."""
    temperature: float = 1.0
    """Logits are divided by this before the policy and reference logprobs (the generators' sampling
    temperature, whose distribution the behaviour logprobs are of)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become the step's loss (`model.loss.aggregate`): "token_mean" weights each
    token alike (long completions dominate), "sequence_mean" each completion alike."""
    scale_by_std: bool = False
    """Group advantages divided by the group's reward std (GRPO) instead of only mean-centred."""
    mtp_distill: float = 0.0
    """Weight of the MTP heads' self-distillation loss on the step's rollouts (`distill_heads`); 0: the heads
    get no gradient."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step measured (all plain floats)."""

    loss: float
    kl: float
    reward_mean: float
    reward_std: float
    mean_weight: float
    truncated_fraction: float
    grad_norm: float
    tokens: int
    replayed: bool
    """True when the MoE routing record was replayed."""
    applied: bool
    """False when the loss or gradient was not finite and the weights were left unchanged."""
    replaced_experts: int = 0
    """Replayed experts the plausibility check replaced (`[trainer] router_replay_threshold`), over real tokens."""
    mtp_distill_loss: float | None = None
    """The MTP heads' self-distillation loss on this batch before the step (None: `mtp_distill` is 0)."""


class Core(Protocol):
    """What the trainer actor drives, whatever the world size: `TrainerCore` in one process, `ShardedCore`
    (actors/trainer/ranks.py) as the leader of a group of ranks. Not thread-safe: one caller at a time."""

    policy: Policy

    @property
    def world_size(self) -> int:
        """Processes the policy is spread over (1: this one)."""
        ...

    def check(self, rollout: Rollout) -> str | None:
        """Why this model cannot train on `rollout` (None: it can)."""
        ...

    def train_step(self, rollouts: Sequence[Rollout], objective: Objective, *,
                   lr: float | None = None) -> StepStats:
        """One optimizer step on `rollouts` (the whole batch's stats)."""
        ...

    def published_version(self) -> tuple[bytes, str, int]:
        """(full-snapshot blob of the bf16 version, its version digest as hex, raw tensor bytes)."""
        ...

    def model_config_dict(self) -> dict[str, Any]:
        """The policy's spec, as VersionReady and every WeightManifest carry it."""
        ...

    def policy_files(self) -> dict[str, bytes]:
        """The files a joiner needs besides the tensors."""
        ...

    def save(self, meta: Mapping[str, Any], upload: Upload) -> tuple[list[str], list[str]]:
        """Store the full state with `meta` through `upload`. -> (object names, digests), the first one the
        object a CheckpointMark names."""
        ...

    def load(self, state: Mapping[str, bytes]) -> dict[str, Any]:
        """Load a checkpoint's objects (name -> bytes) saved at any world size. -> its meta.

        :raises CheckpointError: not a trainer state, or one of another architecture.
        """
        ...

    def ping(self) -> None:
        """Check that every rank still answers (nothing to do in one process).

        :raises RlbusError: a rank is gone (`RankError`).
        """
        ...

    def stop(self) -> None:
        """Release the other ranks (nothing to do in one process)."""
        ...


class TrainerCore:
    """The fp32 master policy, its frozen reference and AdamW, on the policy's device. Not thread-safe: one
    caller at a time."""

    def __init__(self, policy: Policy, reference: Policy, *, lr: float, seed: int = 0,
                 reference_dtype: torch.dtype = torch.float32, numerics: Mapping[str, Any] | None = None) -> None:
        self.numerics = dict(numerics or {})
        """What `model_config_dict` adds to the policy's spec: its forward precision (`numerics_spec`)."""
        self.policy = policy.to_(dtype=torch.float32).train()
        self.reference = reference.to_(device=policy.device, dtype=reference_dtype).eval()
        self.reference.module.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.module.parameters(), lr=lr, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        torch.manual_seed(seed)

    @property
    def model(self) -> torch.nn.Module:
        """The trained torch module (its parameters are the optimizer's)."""
        return self.policy.module

    @property
    def moe(self) -> tuple[int, int] | None:
        """(n_moe_layers, top_k), or None for a dense model."""
        return self.policy.moe

    def check(self, rollout: Rollout) -> str | None:
        """Why this model cannot train on `rollout` or one of its segments (None: it can)."""
        for i, segment in enumerate(rollout.segments):
            if (why := self._check_part(segment)) is not None:
                return f"{why} (segment {i})"
        return self._check_part(rollout)

    def _check_part(self, rollout: Rollout | Segment) -> str | None:
        P, T = len(rollout.prompt_tokens), len(rollout.completion_tokens)
        max_seq_len, vocab_size = self.policy.max_seq_len, self.policy.vocab_size
        if P + T > max_seq_len:
            return f"too_long: {P + T} tokens > max_seq_len {max_seq_len}"
        if len(rollout.behaviour_logprobs) != T or len(rollout.policy_versions) != T:
            return "invalid: per-token arrays differ in length from the completion"
        if len(rollout.loss_mask) not in (0, T):
            return "invalid: loss_mask length differs from the completion"
        if T and P == 0:
            return "invalid: empty prompt"
        ids = np.concatenate([rollout.prompt_tokens.numpy(), rollout.completion_tokens.numpy()])
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            return f"invalid: token id outside the vocabulary of {vocab_size}"
        shape = (P + T, *self.moe) if self.moe is not None else None
        if rollout.routing is not None and shape is not None and tuple(rollout.routing.shape) != shape:
            return f"invalid: routing shape {tuple(rollout.routing.shape)} != {shape}"
        return None

    def logprobs(self, net: Policy, batch: RolloutBatch, temperature: float = 1.0) -> Tensor:
        """(B, L-1) log-probability under `net` of each next token, with the batch's routing replayed:
        log softmax(logits / temperature)[next token].

        Rows that share a prompt (a group) run it once (`shared_prompt_logprobs`) unless routing is
        replayed; off the completions (where `batch.mask` is False) the values are then 0.
        """
        return self.logprobs_replaced(net, batch, temperature)[0]

    def logprobs_replaced(self, net: Policy, batch: RolloutBatch, temperature: float = 1.0) -> tuple[Tensor, int]:
        """`logprobs` and how many replayed experts the plausibility check replaced on real tokens (0 when
        nothing is replayed)."""
        if batch.routing is None:
            shared = shared_prompt_logprobs(net, batch, temperature)
            if shared is not None:
                return shared, 0
        out = net(batch.tokens, routing=batch.routing)
        replaced = 0
        if batch.routing is not None and out.routing is not None:
            real = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :] < (
                batch.prompt_lengths + batch.lengths)[:, None]
            replaced = int(((out.routing != batch.routing) & real[:, :, None, None]).sum())
        return token_logprob(out.logits[:, :-1], batch.tokens[:, 1:], temperature), replaced

    def train_step(self, rollouts: Sequence[Rollout], objective: Objective, *,
                   lr: float | None = None) -> StepStats:
        """One AdamW step on the RL loss of `rollouts` (whole groups), at learning rate `lr` (None: the
        optimizer's current one).

        rewards r → r - length penalty (`shaped_rewards`) → group-relative advantages → `model.loss.rl_loss` with
        truncated IS weights vs the behaviour logprobs and the k1 KL vs the reference. A non-finite loss
        or gradient leaves the weights as they were (`applied=False`).
        """
        batch = rollout_batch(rollouts, moe=self.moe, device=self.policy.device)
        self.policy.train()
        with hidden_states(self.policy) if objective.mtp_distill > 0 else contextlib.nullcontext([]) as seen:
            logp, replaced = self.logprobs_replaced(self.policy, batch, objective.temperature)
        with torch.no_grad():
            ref = self.logprobs(self.reference, batch, objective.temperature)
        rewards, lengths, group_ids = per_rollout(batch)
        rewards = shaped_rewards(rewards, lengths, rollouts, objective.length_penalty)
        advantages = group_relative_advantages(rewards, group_ids, scale_by_std=objective.scale_by_std)
        if batch.segmented:
            advantages = advantages.index_select(0, batch.owner)
        terms = rl_loss(logp, batch.behaviour, ref, advantages, batch.mask, is_cap=objective.is_cap,
                        kl_coef=objective.kl_coef, mode=objective.aggregation,
                        sequences=batch.owner if batch.segmented else None)
        self.optimizer.zero_grad(set_to_none=True)
        terms.loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = objective.grad_clip if objective.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
        loss = float(terms.loss.detach())
        applied = math.isfinite(loss) and math.isfinite(grad_norm)
        distilled = None
        if objective.mtp_distill > 0:
            distilled = distill_heads(self.policy, batch, seen, objective.mtp_distill, clip)
            applied = applied and math.isfinite(distilled)
        if applied:
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        raw, _, _ = per_rollout(batch)
        return StepStats(
            loss=loss, kl=float(terms.kl), reward_mean=float(raw.mean()),
            reward_std=float(raw.std(unbiased=False)), mean_weight=float(terms.mean_weight),
            truncated_fraction=float(terms.truncated_fraction), grad_norm=grad_norm,
            tokens=int(batch.mask.sum()), replayed=batch.routing is not None, applied=applied,
            replaced_experts=replaced, mtp_distill_loss=distilled)

    # ---- versions and checkpoints --------------------------------------------------------------
    def bf16_state(self) -> dict[str, Tensor]:
        """The published version: every tensor of the fp32 master's `named_tensors` cast to bfloat16, on the CPU."""
        return self.policy.published_state(torch.bfloat16)

    def published_version(self) -> tuple[bytes, str, int]:
        """What a version is published as: (the full-snapshot `encode_state` blob of `bf16_state`, its
        version digest as hex, raw tensor bytes). The trainer announces it; `rlbus replay train` compares it."""
        state = self.bf16_state()
        index, blob = encode_state(state, None)
        return blob, index.version_digest.hex(), sum(t.numel() * t.element_size() for t in state.values())

    def model_config_dict(self) -> dict[str, Any]:
        """The policy's spec (`Policy.spec`) with its forward precision (`numerics`): what VersionReady and every
        WeightManifest carry as `model_config`, so generators build the same forward."""
        return {**self.policy.spec(), **self.numerics}

    def policy_files(self) -> dict[str, bytes]:
        """The files a joiner needs besides the tensors (`Policy.files`; none for the built-in policy)."""
        return self.policy.files()

    def state_blob(self, meta: Mapping[str, Any]) -> bytes:
        """Everything to resume: fp32 weights, AdamW state, RNG state, the policy's spec and files and `meta`
        (plain values), as `torch.save` bytes that `torch.load(weights_only=True)` reads back."""
        payload = {"format": STATE_FORMAT, "model": self.policy.named_tensors(),
                   "optimizer": self.optimizer.state_dict(), "rng": {"torch": torch.get_rng_state()},
                   "model_config": self.model_config_dict(), "policy_files": self.policy_files(),
                   "meta": dict(meta)}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue()

    def save(self, meta: Mapping[str, Any], upload: Upload) -> tuple[list[str], list[str]]:
        """`Core.save`: the one `state_blob`, handed to `upload` as `STATE_FILE`."""
        name, digest = upload(STATE_FILE, self.state_blob(meta))
        return [name], [digest]

    def load(self, state: Mapping[str, bytes]) -> dict[str, Any]:
        """`Core.load`: one `state_blob`, or the shards of a multi-rank trainer gathered (`state_payload`)."""
        return self.load_payload(state_payload(state))

    @property
    def world_size(self) -> int:
        return 1

    def ping(self) -> None:
        """Nothing to ping: one process."""

    def stop(self) -> None:
        """Nothing to stop: one process."""

    def load_state_blob(self, blob: bytes) -> dict[str, Any]:
        """Restore weights, optimizer and RNG from `state_blob` bytes; returns its `meta`.

        :raises CheckpointError: another layout or architecture than this core's.
        """
        return self.load_payload(read_state(blob))

    def load_payload(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """`load_state_blob` of a payload already read (`read_state`, or a sharded checkpoint's `state_payload`)."""
        if payload["model_config"] != self.model_config_dict():
            raise CheckpointError(f"trainer state is for architecture {payload['model_config']}, this trainer "
                                  f"runs {self.model_config_dict()}")
        try:
            self.policy.load_tensors_(payload["model"])
        except PolicyError as err:
            raise CheckpointError(f"trainer state does not fit this trainer's policy: {err}") from None
        self.optimizer.load_state_dict(payload["optimizer"])
        torch.set_rng_state(payload["rng"]["torch"])
        return dict(payload["meta"])


def read_state(blob: bytes) -> dict[str, Any]:
    """The payload of a `state_blob` (weights_only load on the CPU).

    :raises CheckpointError: another layout than `STATE_FORMAT`.
    """
    payload = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != STATE_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"trainer state of format {found!r}, expected {STATE_FORMAT}")
    return payload


def shard_files(state: Mapping[str, bytes]) -> dict[str, bytes] | None:
    """A checkpoint's objects (name -> bytes) as the files of a sharded state (`Subjects.shard_object` names),
    or None when they are one trainer state blob (a one-rank trainer's)."""
    files = {Subjects.shard_filename(name): data for name, data in state.items()}
    if None in files:
        return None
    return {name: data for name, data in files.items() if name is not None}


def state_payload(state: bytes | Mapping[str, bytes]) -> dict[str, Any]:
    """The `read_state` payload of a checkpoint: one `state_blob`, or the objects of a sharded one (gathered
    into the same one-rank layout: full tensors, index-keyed optimizer state), so any world size reads it.

    :raises CheckpointError: neither a trainer state nor a complete sharded one.
    """
    if isinstance(state, bytes | bytearray | memoryview):
        return read_state(bytes(state))
    files = shard_files(state)
    if files is None:
        if len(state) != 1:
            raise CheckpointError(f"{len(state)} checkpoint objects that are not the shards of one state: "
                                  f"{', '.join(sorted(state))[:200]}")
        return read_state(next(iter(state.values())))
    from rlbus.actors.trainer.ranks import shards_to_payload

    return shards_to_payload(files)


def state_policy(state: bytes | Mapping[str, bytes], *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> Policy:
    """The policy a checkpoint holds (a `state_blob`, or a checkpoint's objects by name: one blob or the shards
    of a multi-rank trainer), in `dtype` (bfloat16: as its version is published), eval mode.

    :raises CheckpointError: not a trainer state, or one whose policy cannot be built.
    """
    payload = state_payload(state)
    try:
        policy = policy_from_spec(payload["model_config"], payload.get("policy_files") or {}, device=device,
                                  dtype=torch.float32)
        policy.load_tensors_(payload["model"])
    except PolicyError as err:
        raise CheckpointError(f"trainer state holds no usable policy: {err}") from None
    return policy.to_(dtype=dtype).eval()


def build_core(pretrained: str, *, lr: float, seed: int, device: str = "auto",
               reference: str = "float32", precision: str = "bf16", precision_scope: str = "experts",
               router_replay_threshold: float = 0.0) -> TrainerCore:
    """A core from a `pretrain.pt` (file or folder) or a Hugging Face directory (also the frozen reference),
    or, with `pretrained` empty, from a fresh tiny built-in policy initialised with `seed`; on `device`
    ("auto": CUDA when present), the reference held in `reference` (`[trainer] reference_dtype`); the policy and
    the reference run the forward `precision` on `precision_scope`, replay checked at `router_replay_threshold`.

    :raises FileNotFoundError: `pretrained` names nothing.
    :raises PolicyError: it names something that is not a policy, or `device` cannot be had here.
    """
    where = resolve_device(device)
    if pretrained:
        path = Path(pretrained)
        if not path.exists():
            raise FileNotFoundError(f"pretrained checkpoint {path} does not exist; run `rlbus pretrain` or "
                                    f"let `rlbus up` pretrain first")
        policy = load_policy(path, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        policy = fresh_builtin()
    policy.to_(device=where, dtype=torch.float32)
    numerics = set_policy_numerics(policy, precision, precision_scope, router_replay_threshold)
    return TrainerCore(policy, policy.clone(), lr=lr, seed=seed, reference_dtype=reference_dtype(reference, where),
                       numerics=numerics)
