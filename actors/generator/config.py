"""The generator's settings: `GeneratorConfig` (the topology's `[generator]`, composed by topology/file/schema.py)
and `GeneratorLaunch` (what the launcher passes beside it).

Owns: those two Structs. Imports only msgspec, so the topology schema can compose it without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rlbus.actors.common.config import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


class AgenticSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[generator.agentic]`: the budgets of an agentic episode (a repository task: model/env/agentic.py
    `AgenticBudgets`, whose fields and defaults these are; a test keeps the two equal) and its tool list."""

    max_turns: PositiveInt = 20
    """Policy turns; the episode is graded after the last one."""
    max_tool_calls: PositiveInt = 100
    """Tool-call blocks over the episode (malformed ones count); the one past it ends the episode."""
    max_tokens: PositiveInt = 8192
    """Tokens of the whole episode (prompt, turns, observations, framing), capped by the policy's context."""
    min_turn_tokens: PositiveInt = 32
    """The episode ends once fewer than this many of `max_tokens` are left for the next turn."""
    wall_s: PositiveFloat = 600.0
    """Seconds from the episode's start; checked before each tool call (a turn that spends it has its remaining
    calls cut off, and a `run` is given at most what is left) and after each turn."""
    observation_chars: PositiveInt = 4000
    """Characters of one tool result shown; longer ones are cut, saying so."""
    observation_tokens: Annotated[int, msgspec.Meta(ge=16)] = 1024
    """Tokens of one observation turn (all the turn's results); longer ones are cut, saying so."""
    run_timeout_s: PositiveFloat = 10.0
    """A `run` call's wall timeout when it names none, and the most it may ask for."""
    summary_tokens: NonNegativeInt = 256
    """Tokens of a self-summary, written once the context leaves fewer than `min_turn_tokens` for the next turn:
    the episode goes on from the task and the summary, in the same workspace, and the summary is trained under
    the history it was written from; 0: no summaries, the token budget ends the episode."""
    partial_credit: bool = False
    """The reward: false, 1.0 when every hidden test passes, else 0.0; true, the fraction of the hidden tests that
    passed (0.0 when the grade is void or timed out)."""
    summary_at_tokens: NonNegativeInt = 0
    """Once the context reaches this many tokens before a turn, a user turn asks the policy to summarise its work;
    its answer (at most `summary_tokens` when that is set) is trained like any turn, and the episode goes on in a
    fresh context holding the task and the summary, in the same workspace; several times an episode. 0: off."""
    tool_list: Literal["auto", "full", "compact"] = "auto"
    """How the tools are given: 'full' (in the policy's chat-template format where its template renders tools:
    the schemas in its system turn, calls in its style; else JSON signatures in the user turn, as Qwen2/Qwen3
    templates word them), 'compact' (one paragraph in the user turn, for short contexts), 'auto' (compact for a
    policy whose context is under 4096 tokens, like the built-in one)."""


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
    speculative: bool = False
    """Sample with the policy's MTP heads drafting and its main head verifying (model/sampling/speculative.py): the
    same distribution and behaviour logprobs as plain sampling, fewer forwards when drafts are accepted. Needs MTP
    heads: a built-in policy with `mtp_heads`, a Hugging Face one with `mtp_heads.safetensors` (a phase's
    `mtp_heads`). A policy without heads, or a routed (MoE) one, samples plainly (one warning). Speculation takes
    precedence over `turn_cache` (the turn engine has no speculative step): with both set, no cache is kept across
    calls. The heartbeat counts mtp_drafted and mtp_accepted; its gauge mtp_acceptance is the held version's rate."""
    turn_cache: bool = True
    """Sample a dense policy with the turn engine (model/sampling/engine.py): each episode's KV cache is kept from
    one sampling call to its next (a turn, a chunk, an attempt), so only what is new in its context is prefilled;
    rows join and leave the decoding batch between steps. Same distribution and behaviour logprobs as plain
    sampling (to float summation order). A routed (MoE) policy always samples with `generate` (the engine records
    no routing); false: every call prefills its whole contexts."""
    continuous_batching: bool = True
    """With `turn_cache`: every task's sampling request joins the engine's running decoding batch at its next step
    and is answered as soon as its own rows ended (actors/generator/stepper.py), so a task whose tool call
    returned does not wait for another task's call to end; false: requests that arrive while a call runs go
    together into the next call, which runs until all of its rows ended (actors/generator/batcher.py)."""
    kv_cache_tokens: NonNegativeInt = 0
    """Cache slots (tokens) the turn engine of one generator holds across all its episodes; episodes that do not
    fit wait for room (resting episodes' caches are evicted first, least recently used), they never fail. 0: room
    for every row a generator samples at once, each at the policy's context (concurrent_tasks x the largest group
    x max_seq_len). `rlbus validate` refuses a cap smaller than one episode's largest context."""
    max_tokens: PositiveInt = 256
    """Longest completion, in tokens."""
    partial_every_tokens: PositiveInt = 64
    """Save an in-progress rollout to the PARTIALS bucket every this many tokens, so a replacement resumes it."""
    concurrent_tasks: PositiveInt = 1
    """Tasks one generator samples at once (their drafts go into one batched call)."""
    tasks_ahead: NonNegativeInt = 0
    """Tasks a generator holds beyond `concurrent_tasks`, each waiting for a sampling place: when a task's drafts
    are complete it gives its place up for grading and publishing, and a waiting task starts sampling at once,
    so the sampler does not idle through a group's grading, its publishing and the fetch of the next task."""

    @property
    def tasks_held(self) -> int:
        """Tasks one generator holds at once: `concurrent_tasks` sampling, `tasks_ahead` waiting to."""
        return self.concurrent_tasks + self.tasks_ahead

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
    agentic: AgenticSettings = AgenticSettings()
    """Budgets of agentic episodes (tasks of the repository kind, such as `[feeder] tasks = "repo"`)."""
    script: Literal["", "reference", "submit", "edits"] = ""
    """Testing and harness knob for agentic episodes: '' samples every policy turn; 'reference' takes the task's
    reference edit, one call a turn, then submits (reward 1); 'submit' submits at once (reward 0); 'edits' changes
    the workspace turn after turn (a new file, a deletion, an edit), makes the reference edit, lists every file's
    sha256 and submits (reward 1; model/env/scripted.py `edits_script`). Scripted turns
    carry the live policy's logprobs of those ids (one forward pass), so their rollouts stay trainable."""
    session_lease_s: PositiveFloat = 120.0
    """Lease of an agentic episode's sandbox session: destroyed this long after its last call (a generator that
    died leaves none behind); capped by the supervisor's `[sandbox] max_lease_s`."""


class GeneratorLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a generator gets beside `[generator]`."""

    torch_threads: NonNegativeInt = 0
    """torch.set_num_threads for sampling (the launcher passes the instance's `torch_threads`); 0 leaves
    torch's default."""
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda)$")] = "cpu"
    """Where the policy runs (topology `[policy] device`): 'auto' is CUDA when this machine has it."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """What the policy samples in (topology `[policy] dtype`). Versions are bf16 and held exactly in either; on a
    CPU without native bf16 matrix units (AVX2 only) float32 samples 2-3x faster."""


__all__ = ["AgenticSettings", "GeneratorConfig", "GeneratorLaunch"]
