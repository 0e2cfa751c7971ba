"""The sharded trainer's step and checkpoint format, apart from the process group's lifecycle.

Owns: which rollouts each rank trains (`share`), the whole batch's numbers every rank computes alike
(`WholeBatch`: rewards, advantages, global loss normaliser), one rank's part of a step (`local_step`: the
same forwards on every rank, its share's loss normalised globally, stats summed across ranks), and the
checkpoint files of `torch.distributed.checkpoint` (`stored_name` / `dcp_name`, `is_sharded`,
`shards_to_payload`: the one-rank `read_state` payload of a sharded checkpoint, without a process group).
Does not: join, leave or command the ranks (actors/trainer/ranks.py), talk to the bus or decide when to step.
"""

from __future__ import annotations

import io
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rlbus.actors.common.errors import CheckpointError
from rlbus.actors.trainer.core import (
    STATE_FORMAT,
    Objective,
    RolloutBatch,
    StepStats,
    batch_rows,
    rollout_batch,
    shaped_rewards,
    shared_prompt_logprobs,
)
from rlbus.kernels.logprob import token_logprob
from rlbus.messages.schemas import Rollout
from rlbus.model.policies.interface import Policy
from rlbus.model.sampling.generate import distinct_prompts
from rlbus.model.training.loss import (
    global_denominator,
    group_relative_advantages,
    rl_loss,
    truncated_importance_weights,
)

LEADER_FILE: Final = "trainer-state.pt"
"""The leader's small extra file of a sharded checkpoint: format, world size, rng, spec, policy files, meta and
the names of the published tensors (torch.save bytes, weights_only-readable)."""
METADATA_FILE: Final = "dcp.metadata"
SHARDED_FORMAT: Final = 1
_DCP_PREFIX: Final = "dcp"
_RANK_FILE: Final = re.compile(r"dcp__(\d+)_\d+\.distcp")


# ---- rows -----------------------------------------------------------------------------------------------
def share(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi): rank's contiguous share of n rollouts (sizes differ by at most one; the first ranks get more)."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


@dataclass(frozen=True, slots=True)
class WholeBatch:
    """What every rank computes alike from the whole list of a step's rollouts."""

    advantages: Tensor
    """(N,) float32 group-relative advantages of the shaped rewards, one per rollout."""
    rewards: Tensor
    """(N,) float32 raw rewards (the stats' reward_mean and reward_std)."""
    tokens: int
    """Masked (trained) completion tokens of the whole batch."""
    denominator: float
    """The whole batch's loss normaliser (`model.loss.global_denominator`)."""


def whole_batch(rollouts: Sequence[Rollout], objective: Objective) -> WholeBatch:
    """Rewards, advantages and the loss normaliser of the batch `rollout_batch(rollouts)` would make, without
    padding it: a rollout's length counts all its rows (`per_rollout`), a sequence is a rollout."""
    rows = batch_rows(rollouts)
    groups: dict[str, int] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, len(groups))
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    lengths = torch.zeros(len(rollouts), dtype=torch.long)
    trained = [0] * len(rollouts)
    width = 0
    for part, i in rows:
        T = len(part.completion_tokens)
        lengths[i] += T
        keep = part.loss_mask.numpy()
        trained[i] += T if keep.size == 0 else int(np.count_nonzero(keep[:T]))
        width = max(width, len(part.prompt_tokens) + T)
    group_ids = torch.tensor([groups[r.task_id] for r in rollouts], dtype=torch.long)
    shaped = shaped_rewards(rewards, lengths, rollouts, objective.length_penalty)
    advantages = group_relative_advantages(shaped, group_ids, scale_by_std=objective.scale_by_std)
    tokens = sum(trained)
    denominator = global_denominator(objective.aggregation, tokens=tokens, sequences=sum(t > 0 for t in trained),
                                     elements=len(rows) * max(width - 1, 0))
    return WholeBatch(advantages=advantages, rewards=rewards, tokens=tokens, denominator=denominator)


def can_share_prompts(batch: RolloutBatch, max_seq_len: int) -> bool:
    """Whether `shared_prompt_logprobs` runs on `batch` (returns a tensor, not None): the same test as its own,
    asked before any forward so that every rank can agree on the number of forwards."""
    if batch.routing is not None:
        return False
    P, T = batch.prompt_lengths.tolist(), batch.lengths.tolist()
    first, _ = distinct_prompts([batch.tokens[b, :P[b]].tolist() for b in range(len(P))])
    width = max(T, default=0)
    return not (len(first) == len(P) or width == 0 or min(P) == 0 or max(P) + width > max_seq_len)


def logprobs(net: Policy, batch: RolloutBatch, temperature: float, shared: bool) -> Tensor:
    """`TrainerCore.logprobs` with the choice of forward made by the caller (`shared`: one run per distinct
    prompt; else the full forward, routing replayed)."""
    if shared:
        out = shared_prompt_logprobs(net, batch, temperature)
        assert out is not None, "can_share_prompts said the shared forward applies"
        return out
    logits = net(batch.tokens, routing=batch.routing).logits
    return token_logprob(logits[:, :-1], batch.tokens[:, 1:], temperature)


def local_step(policy: Policy, reference: Policy, optimizer: torch.optim.Optimizer,
               rollouts: Sequence[Rollout], objective: Objective, *, lr: float | None, rank: int,
               world_size: int) -> StepStats:
    """This rank's part of one AdamW step on the whole batch `rollouts` (every rank holds all of them).

    The rank trains rollouts `share(...)`; a rank without any runs the first rollout at weight 0, so that every
    rank runs the same forwards and backward (FSDP2's collectives must match). The prompt-sharing forward is
    taken only when every rank can take it. Each rank's loss is its share's part of the whole batch's (global
    normaliser), gradients are summed by the reduce-scatter, so the step is the one-rank step of the same batch
    up to floating-point order. Every stat is global and equal on every rank.
    """
    lo, hi = share(len(rollouts), world_size, rank)
    mine = list(rollouts[lo:hi])
    weight = 1.0 if mine else 0.0
    local = mine or list(rollouts[:1])
    whole = whole_batch(rollouts, objective)
    device = policy.device
    batch = rollout_batch(local, moe=policy.moe, device=device)
    flag = torch.tensor([int(can_share_prompts(batch, policy.max_seq_len))], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    shared = bool(flag.item())
    policy.train()
    logp = logprobs(policy, batch, objective.temperature, shared)
    with torch.no_grad():
        ref = logprobs(reference, batch, objective.temperature, shared)
    advantages = (whole.advantages[lo:hi] if mine else whole.advantages[:1]).to(device)
    terms = rl_loss(logp, batch.behaviour, ref, advantages.index_select(0, batch.owner), batch.mask,
                    is_cap=objective.is_cap, kl_coef=objective.kl_coef, mode=objective.aggregation,
                    sequences=batch.owner, denominator=whole.denominator)
    optimizer.zero_grad(set_to_none=True)
    (terms.loss * weight).backward()
    _reshard(policy, reference)
    m = batch.mask
    with torch.no_grad():
        w = truncated_importance_weights(logp, batch.behaviour, objective.is_cap)
        ratio = torch.exp(logp.detach() - batch.behaviour)
        sums = torch.stack([terms.loss.detach().double(), terms.kl.double(), w[m].double().sum(),
                            (ratio[m] > objective.is_cap).double().sum()]).cpu() * weight
    dist.all_reduce(sums)
    model = policy.module
    params = [p for p in model.parameters() if p.grad is not None]
    clip = objective.grad_clip if objective.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
    loss = float(sums[0])
    applied = math.isfinite(loss) and math.isfinite(grad_norm)
    if applied:
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = max(whole.tokens, 1)
    return StepStats(loss=loss, kl=float(sums[1]), reward_mean=float(whole.rewards.mean()),
                     reward_std=float(whole.rewards.std(unbiased=False)), mean_weight=float(sums[2]) / n,
                     truncated_fraction=float(sums[3]) / n, grad_norm=grad_norm, tokens=whole.tokens,
                     replayed=batch.routing is not None, applied=applied)


def _reshard(*nets: Policy) -> None:
    """Free the roots' gathered parameters: FSDP2 keeps a root unsharded from its forward on (the policy's
    through the backward, the reference's past its no-grad forward), so the embedding would stay whole."""
    from torch.distributed.fsdp import FSDPModule

    for net in nets:
        if isinstance(net.module, FSDPModule):
            net.module.reshard()


# ---- checkpoint files ---------------------------------------------------------------------------------------
def stored_name(dcp_file: str) -> str:
    """The name a file `torch.distributed.checkpoint` wrote is saved under (".metadata" -> "dcp.metadata",
    "__1_0.distcp" -> "dcp__1_0.distcp")."""
    return _DCP_PREFIX + dcp_file


def dcp_name(stored: str) -> str:
    """Inverse of `stored_name`."""
    if not stored.startswith(_DCP_PREFIX):
        raise CheckpointError(f"sharded checkpoint file {stored!r}: expected a name starting with {_DCP_PREFIX!r}")
    return stored[len(_DCP_PREFIX):]


def file_rank(stored: str) -> int:
    """The rank that wrote a stored checkpoint file (0 for the metadata and the leader's file)."""
    found = _RANK_FILE.fullmatch(stored)
    return int(found.group(1)) if found else 0


def is_sharded(names: Sequence[str]) -> bool:
    """Whether these file or object names make a sharded checkpoint (they include its DCP metadata)."""
    return any(name.endswith(METADATA_FILE) for name in names)


def write_dcp_dir(files: Mapping[str, bytes], root: Path) -> None:
    """The DCP files of a sharded checkpoint (stored names) written into `root` under DCP's own names."""
    for name, data in files.items():
        if name != LEADER_FILE:
            (root / dcp_name(name)).write_bytes(data)


def leader_blob(payload: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(payload), buffer)
    return buffer.getvalue()


def read_leader(files: Mapping[str, bytes]) -> dict[str, Any]:
    """The leader's file of a sharded checkpoint.

    :raises CheckpointError: it is missing, unreadable, or of another format.
    """
    missing = [name for name in (LEADER_FILE, METADATA_FILE) if name not in files]
    if missing:
        raise CheckpointError(f"sharded checkpoint lacks {', '.join(missing)} (has {', '.join(sorted(files))[:200]})")
    try:
        leader = torch.load(io.BytesIO(files[LEADER_FILE]), map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many kinds on a corrupt file
        raise CheckpointError(f"sharded checkpoint file {LEADER_FILE}: unreadable ({type(err).__name__})") from None
    if not isinstance(leader, dict) or leader.get("sharded_format") != SHARDED_FORMAT:
        found = leader.get("sharded_format") if isinstance(leader, dict) else type(leader).__name__
        raise CheckpointError(f"sharded checkpoint file {LEADER_FILE}: format {found!r}, expected {SHARDED_FORMAT}")
    return leader


def fqn_optimizer_to_index(optim: Mapping[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (`get_optimizer_state_dict`, full tensors) in `torch.optim`'s own
    index-keyed layout (a parameter's index: its place in the param groups' lists, in order)."""
    index: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    state = {index[fqn]: dict(values) for fqn, values in optim["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def index_optimizer_to_fqn(optim: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    """Inverse of `fqn_optimizer_to_index`: `fqns[i]` names parameter index i (`module.named_parameters()`
    order, which is the order `TrainerCore` gives AdamW its parameters in)."""
    groups = [{**group, "params": [fqns[i] for i in group["params"]]} for group in optim["param_groups"]]
    return {"state": {fqns[int(i)]: dict(values) for i, values in optim["state"].items()}, "param_groups": groups}


def shards_to_payload(files: Mapping[str, bytes]) -> dict[str, Any]:
    """A sharded checkpoint (stored file names -> bytes, as `ShardedCore.save_shards` wrote them) as the
    format-1 payload of `read_state`: full tensors by `named_tensors` name, the optimizer state dict in
    `TrainerCore`'s index-keyed layout, rng, model_config, policy_files and meta. Needs no process group.

    :raises CheckpointError: files missing, or not a sharded trainer checkpoint.
    """
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    leader = read_leader(files)
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-shards-") as tmp:
        write_dcp_dir(files, Path(tmp))
        try:
            _load_state_dict(state, storage_reader=FileSystemReader(tmp), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"sharded checkpoint does not load ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:300]})") from None
    model = state["model"]
    names = list(leader["names"])
    absent = [n for n in names if n not in model]
    if absent:
        raise CheckpointError(f"sharded checkpoint lacks tensors {absent[:5]}")
    return {"format": STATE_FORMAT, "model": {n: model[n] for n in names},
            "optimizer": fqn_optimizer_to_index(state["optim"]), "rng": leader["rng"],
            "model_config": leader["model_config"], "policy_files": leader["policy_files"],
            "meta": dict(leader["meta"])}
