"""The trainer's settings: `TrainerConfig` (the topology's `[trainer]`, composed by topology/file/schema.py) and
`TrainerLaunch` (what the launcher passes beside it).

Owns: those Structs, the learning-rate schedule (`TrainerConfig.lr_at`) and the flat settings record of a
trainer's `started` event (`settings_record` / `from_record`, read back by `rlbus replay FILE train`).
Also the names of a trainer rank's environment. Imports only msgspec, so the topology schema and the launchers
can use it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from rlbus.actors.common.config import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

RANK_ENV: Final = "RLBUS_RANK"
WORLD_ENV: Final = "RLBUS_WORLD_SIZE"
RENDEZVOUS_ENV: Final = "RLBUS_RENDEZVOUS"
"""`host:port` where a trainer group's ranks meet (rank 0 hosts it); the launcher picks a new one per start."""
TIMEOUT_ENV: Final = "RLBUS_COLLECTIVE_TIMEOUT_S"
"""The environment a trainer rank reads its place from (`actors/trainer/ranks.py` `RankSpec.from_env`), set by
the launcher (topology/backends/launch.py, topology/backends/local.py, topology/backends/ray_cluster.py)."""


class EffortWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[trainer.length_penalty] weights`: the concave penalty's effort x = the sum of these times an episode's
    counts (actors/trainer/core.py `effort_counts` says where each count comes from)."""

    policy_tokens: NonNegativeFloat = 1.0
    """Per token the policy produced (its loss-mask tokens, every segment included)."""
    tool_call_tokens: NonNegativeFloat = 0.0
    """Per policy token inside a tool call: `Rollout.tool_call_tokens`, which generators do not record yet, so it
    counts 0 until they do."""
    tool_output_tokens: NonNegativeFloat = 0.0
    """Per completion token the policy did not produce: tool outputs and test feedback with their framing."""
    final_tokens: NonNegativeFloat = 0.0
    """Per token of the final message: `Rollout.final_tokens`, else the last run of policy tokens."""
    tool_calls: NonNegativeFloat = 0.0
    """Per tool call (`Rollout.timings["tool_calls"]`; 0 for episodes without tools)."""
    turns: NonNegativeFloat = 0.0
    """Per policy turn (`timings["turns"]`, else `timings["attempts"]`, else 1)."""


class LengthPenaltyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[trainer.length_penalty]`: a cost of the episode's length, subtracted from its reward.

    The convex form costs coef * (max(0, tokens - budget) / budget) ** power over every completion token. The
    concave form costs coef * C(x) of the `weights`-weighted effort x, C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))
    (log(1 + k x) / k at q = 1): effort costs most on short episodes and little more on long ones."""

    form: Literal["convex", "concave"] = "convex"
    """Which penalty: 'convex' (free up to `budget`, then growing as `power`) or 'concave' (`k`, `q`, `weights`)."""
    coef: NonNegativeFloat = 0.0
    """Penalty weight of either form; 0 turns the length penalty off."""
    budget: PositiveInt = 256
    """Convex: completion length (tokens) below which there is no penalty."""
    power: PositiveFloat = 2.0
    """Convex: exponent of the overshoot; > 1 forgives small overshoots and punishes long ones."""
    k: PositiveFloat = 0.01
    """Concave: the scale of effort, > 0; C'(x) = (1 + k x)^(-q) halves (q = 1) once k x = 1."""
    q: NonNegativeFloat = 0.5
    """Concave: the curvature, >= 0; 0 is linear (C(x) = x), 1 logarithmic, > 1 bounded by 1 / (k (q - 1))."""
    weights: EffortWeights = EffortWeights()
    """Concave: what one unit of each count adds to the effort x."""


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[trainer]`: the optimizer and the RL objective."""

    lr: PositiveFloat = 1e-5
    """Learning rate (AdamW)."""
    lr_decay_steps: NonNegativeInt = 0
    """Lower the learning rate linearly from `lr` to `lr * lr_final_ratio` over this many optimizer steps,
    then hold it there (a run of known length ends at a low-noise point); 0 keeps `lr` throughout."""
    lr_final_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.1
    """Where `lr_decay_steps` ends, as a fraction of `lr`."""
    batch_rollouts: PositiveInt = 64
    """Rollouts per optimizer step; should be a multiple of `generator.group_size`."""
    staleness_versions: NonNegativeInt = 4
    """Drop rollouts whose oldest token is more than this many policy versions old."""
    kl_coef: NonNegativeFloat = 0.001
    """Weight of the k1 KL estimator (-log r) against the reference policy."""
    reference_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """What the frozen reference's weights and logprob forward run in: 'auto' is bfloat16 where the trainer's
    device multiplies bf16 in hardware (a CUDA GPU; a CPU with AMX-BF16 or AVX512-BF16), where that forward
    takes about half the time of float32, and float32 elsewhere (emulated bf16 would be slower). The policy
    itself always trains in float32."""
    is_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    """Cap of the truncated importance weight pi/mu for off-policy tokens."""
    length_penalty: LengthPenaltyConfig = LengthPenaltyConfig()
    """Nonlinear length penalty applied to rewards."""
    aggregation: Literal["token_mean", "sequence_mean", "token_sum_norm"] = "token_mean"
    """How per-token losses are averaged: 'token_mean' (every token alike; long completions weigh
    more), 'sequence_mean' (every completion alike), 'token_sum_norm' (sum / fixed B*T, Dr. GRPO)."""
    scale_by_std: bool = False
    """Divide each group's advantages by the std of its rewards (GRPO): a group with one pass in eight
    weighs ~2.8x more than with the default mean-centred advantages (Dr. GRPO)."""
    drop_flat_groups: bool = False
    """Drop complete groups whose rewards are all equal (no learning signal; recorded as dropped
    with reason 'flat') instead of training on them (DAPO dynamic sampling)."""
    mtp_distill: NonNegativeFloat = 0.0
    """Keep the policy's MTP heads (the drafters of `[generator] speculative`) following it during RL: each step
    adds this weight times their self-distillation loss on the step's rollouts (model/training/mtp.py
    `distill_loss`: KL from the main head's distribution, detached, to each head's, at each row's last prompt token
    and completion tokens, where generators draft from; read off the RL forward), whose gradient reaches the heads
    only. Their only gradient is this one, and AdamW normalises its scale, so the weight acts as a switch (it still
    scales the gradient before the `grad_clip` of the heads); they step at the trainer's learning rate. 0: the
    heads stay as pretrained (the RL loss never reaches them). A built-in
    policy with `mtp_heads` and a one-rank trainer only: a policy without heads, a Hugging Face one (its heads are a
    file sent once, not part of a version) or `world_size` > 1 is refused."""
    seed: int = 0
    """Seed of the trainer's RNG (initialisation, shuffling)."""
    world_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    """Trainer ranks (processes) sharing each step: rank 0 owns the bus work, the others compute their share of
    the batch; the policy is sharded across them (FSDP2 over `torch.distributed`, gloo on CPU, NCCL on CUDA)."""
    collective_timeout_s: Annotated[float, msgspec.Meta(ge=1)] = 60.0
    """Every collective of a multi-rank trainer, and the rendezvous, give up after this long: a dead or stuck
    rank tears the group down (and the launcher restarts it from the newest mark) instead of hanging it."""
    precision: Literal["bf16", "mxfp8", "nvfp4"] = "bf16"
    """Forward precision of the policy's MoE expert layers: 'nvfp4' (E2M1 values, an E4M3 scale per 16 and an
    FP32 scale per token, so a token's numbers never depend on its batch-mates), 'mxfp8' (E4M3 values, an E8M0
    scale per 32), or 'bf16' (the plain product). Under nvfp4/mxfp8 the backward multiplies MXFP8 gradients, and
    generators sample with the same forward, so behaviour logprobs are those of the quantised forward. Products
    are emulated (quantise, dequantise, multiply in fp32; kernels/quantmm.py). A dense policy is refused unless
    `precision_scope = "all"`."""
    precision_scope: Literal["experts", "all"] = "experts"
    """Which Linear layers `precision` applies to: 'experts' (the MoE experts only) or 'all' (every Linear layer
    but the routers and the output head; the only way to quantise a dense policy)."""
    router_replay_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Plausibility check of router replay: a replayed expert whose router probability at the trainer is below
    this times the k-th largest (the weakest of the trainer's own top-k) is replaced by the trainer's best
    unused expert; each TrainStep counts the replacements. 0 replays as recorded."""

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1 = the first): `lr` at step 1, falling linearly to
        `lr * lr_final_ratio` at step `lr_decay_steps + 1` and held there; `lr` when there is no decay."""
        if self.lr_decay_steps <= 0:
            return self.lr
        done = min(1.0, max(0, step - 1) / self.lr_decay_steps)
        return self.lr * (1.0 - done * (1.0 - self.lr_final_ratio))


class TrainerLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the trainer gets beside `[trainer]`: where the run's files are, the settings of other sections it
    must agree with (topology/backends/launch.py derives them), and timing knobs for tests."""

    pretrained: str = ""
    """`pretrain.pt` (or its folder), or a Hugging Face directory, to start from and to use as the KL reference;
    empty: a fresh tiny built-in model."""
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda)$")] = "cpu"
    """Where the policy runs (topology `[policy] device`): 'auto' is CUDA when this machine has it."""
    state_dir: str = ""
    """The run's state directory: the checkpointer's durable copies are read from here if CKPT lost one."""
    checkpoint_interval: PositiveInt = 10
    """Upload the full state every this many steps (topology `[checkpoint] interval_steps`)."""
    keep_version_objects: PositiveInt = 16
    """bf16 version objects kept in CKPT for the publisher (it re-reads delta bases from them after a restart);
    older ones are deleted. The launcher passes max(16, 2 * weights.keep_versions)."""
    sampling_temperature: PositiveFloat = 1.0
    """The generators' sampling temperature (topology `[generator] temperature`, passed by the launcher):
    the policy and reference logprobs are taken at it, so pi/mu compares like with like; greedy (0) → 1."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the gradient norm to this; 0: no clipping."""
    resume_wait_s: NonNegativeFloat = 300.0
    """On start, wait this long for the checkpointer to handle every uploaded state before picking a mark."""
    mark_wait_s: NonNegativeFloat = 5.0
    """On drain, wait this long for the mark of the final upload (then its rollouts are acked)."""


def settings_record(config: TrainerConfig, launch: TrainerLaunch) -> dict[str, Any]:
    """`config` and `launch` as one flat object: the trainer's `started` event data (one key space; the two
    Structs share no field name)."""
    return {**msgspec.to_builtins(config), **msgspec.to_builtins(launch)}


def from_record(record: Mapping[str, Any]) -> tuple[TrainerConfig, TrainerLaunch]:
    """The (config, launch) of a flat `settings_record`; keys of neither are an error.

    :raises msgspec.ValidationError: a key belongs to neither, or a value does not fit.
    """
    launch_keys = set(TrainerLaunch.__struct_fields__)
    config = msgspec.convert({k: v for k, v in record.items() if k not in launch_keys}, TrainerConfig)
    launch = msgspec.convert({k: v for k, v in record.items() if k in launch_keys}, TrainerLaunch)
    return config, launch


__all__ = ["RANK_ENV", "RENDEZVOUS_ENV", "TIMEOUT_ENV", "WORLD_ENV", "EffortWeights", "LengthPenaltyConfig",
           "TrainerConfig", "TrainerLaunch", "from_record", "settings_record"]
