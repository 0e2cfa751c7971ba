"""The generator's settings: `GeneratorConfig` (the topology's `[generator]`, composed by topology/schema.py)
and `GeneratorLaunch` (what the launcher passes beside it).

Owns: those two Structs. Imports only msgspec, so the topology schema can compose it without torch.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from rlbus.actors.common.config import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


class GeneratorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[generator]`: sampling settings shared by every generator."""

    group_size: PositiveInt = 8
    """Completions sampled per task (G); advantages are relative within a group."""
    max_group_size: NonNegativeInt = 0
    """Grow a group in which no completion passed by G more, until one passes or another G would exceed
    this size (a multiple of group_size, like 32): tasks the policy solves only rarely then give groups
    with a pass instead of all-fail groups that teach nothing; 0: every group has G completions. Each growth
    is another sampling round, so a grown group's first completions age: raise trainer.staleness_versions
    with it. Measured on the default run it did not raise the held-out pass rate (docs/experiments.md)."""
    grown_subsample: bool = False
    """Publish a grown group as G completions: every pass (at most G - 1) and failures drawn at random, so a
    batch holds as many groups as without growth; false: all of its completions."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature; 0 is greedy."""
    max_tokens: PositiveInt = 256
    """Longest completion, in tokens."""
    partial_every_tokens: PositiveInt = 64
    """Save an in-progress rollout to the PARTIALS bucket every this many tokens, so a replacement resumes it."""
    concurrent_tasks: PositiveInt = 1
    """Tasks one generator works on at once."""
    weights: Annotated[str, msgspec.Meta(pattern=r"^(sync|local:.+)$")] = "sync"
    """Where the policy comes from: 'sync' (the versions the publisher announces) or 'local:<path to pretrain.pt>' (fixed)."""
    local_version: NonNegativeInt = 0
    """Policy version a 'local:' model reports in its rollouts."""
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=8)] = 3
    """Attempts per episode; a failed attempt is followed by its test feedback as an observation."""
    context_budget: NonNegativeInt = 0
    """Summarise an episode whose next context is longer than this many tokens; 0: max_seq_len - max_tokens."""
    sandbox_timeout_s: PositiveFloat = 15.0
    """Seconds a generator waits for a sandbox verdict (two tries); no verdict grades the attempt as failed."""
    partial_credit: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    """Reward of a failed final attempt: this times the fraction of hidden tests it passed (a full pass
    is always 1.0); 0 gives plain pass/fail rewards."""


class GeneratorLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a generator gets beside `[generator]`."""

    torch_threads: NonNegativeInt = 0
    """torch.set_num_threads for sampling (the launcher passes the instance's `torch_threads`); 0 leaves
    torch's default."""
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda)$")] = "cpu"
    """Where the policy runs (topology `[policy] device`): 'auto' is CUDA when this machine has it."""


__all__ = ["GeneratorConfig", "GeneratorLaunch"]
