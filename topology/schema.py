"""The topology file schema: frozen msgspec Structs, one per TOML table, a docstring under every field.

Owns: every key a topology file may hold, its type, range, default and meaning (the README key table
is generated from this module by topology/reference.py), and small pure helpers on the decoded tree
(`Topology.instances()`, `parse_duration`). Does not: read files or report problems (topology/load.py),
check rules that span several keys (`check()` in topology/load.py), or start anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec

_TOKEN_PATTERN: Final = r"^[A-Za-z0-9_-]+$"
_DURATION_PATTERN: Final = r"^[1-9][0-9]*(ms|s|m|h|d)$"
_SYNC_PATTERN: Final = r"^(default|always|[1-9][0-9]*(ms|s|m|h))$"
_URL_PATTERN: Final = r"^(nats|tls|ws|wss)://[^\s]+$"
_ENV_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*$"
_DURATION_RE: Final = re.compile(_DURATION_PATTERN)
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

PATTERN_WORDS: Final[dict[str, str]] = {
    _TOKEN_PATTERN: "a name of letters, digits, '_' or '-' (it becomes a NATS subject token)",
    _DURATION_PATTERN: "a duration: a positive whole number and a unit ms, s, m, h or d, like '90s' or '7d'",
    _SYNC_PATTERN: "'default', 'always', or a duration like '2m' (units ms, s, m, h)",
    _URL_PATTERN: "a server URL like 'nats://host:4222' (schemes nats, tls, ws, wss)",
    _ENV_PATTERN: "an environment variable name (letters, digits, '_'; not starting with a digit)",
}
"""Each string pattern of the schema in words, for messages and the key reference."""

Name = Annotated[str, msgspec.Meta(pattern=_TOKEN_PATTERN, max_length=64)]
Duration = Annotated[str, msgspec.Meta(pattern=_DURATION_PATTERN)]
SyncInterval = Annotated[str, msgspec.Meta(pattern=_SYNC_PATTERN)]
NatsUrl = Annotated[str, msgspec.Meta(pattern=_URL_PATTERN)]
EnvName = Annotated[str, msgspec.Meta(pattern=_ENV_PATTERN)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]

ActorKind = Literal["feeder", "generator", "trainer", "publisher", "checkpointer", "sandbox", "evaluator",
                    "demo_producer", "demo_consumer"]
ACTOR_KINDS: Final[tuple[ActorKind, ...]] = (
    "feeder", "generator", "trainer", "publisher", "checkpointer", "sandbox", "evaluator",
    "demo_producer", "demo_consumer",
)
DEMO_KINDS: Final[frozenset[str]] = frozenset({"demo_producer", "demo_consumer"})
"""The bus demo's actors (actors/demo.py): a topology made only of these is a bus demo, not an RL run."""
TORCH_KINDS: Final[frozenset[str]] = frozenset({"generator", "trainer", "publisher", "evaluator"})
"""Kinds that run torch; only their `torch_threads` count towards a host's cores."""


def parse_duration(text: str) -> float:
    """Seconds in a duration string: '500ms' -> 0.5, '90s' -> 90.0, '2m' -> 120.0, '7d' -> 604800.0."""
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration (use a whole number and ms, s, m, h or d, like '7d')")
    unit = match.group(1)
    return int(text[: -len(unit)]) * _UNIT_SECONDS[unit]


class ActorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One `[[regions.actors]]` entry: `count` instances of one actor kind in the enclosing region."""

    kind: ActorKind
    """Which actor: feeder, generator, trainer, publisher, checkpointer, sandbox or evaluator."""
    count: NonNegativeInt = 1
    """How many instances to start; 0 keeps the entry but starts none."""
    name: Name | None = None
    """Name of this entry, unique within its region; default: the kind. Instances are `<region>-<name>-<i>`."""
    torch_threads: PositiveInt = 1
    """`torch.set_num_threads` for each instance; `validate` warns when a host's torch actors ask for more than its cores."""

    @property
    def label(self) -> str:
        """The entry's name, or its kind when no name is given."""
        return self.name if self.name is not None else self.kind


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One `[[regions]]` entry: a NATS server (or cluster) with its own JetStream domain, and its actors."""

    name: Name
    """Region name; a subject token, the JetStream domain, and the default Ray resource `region:<name>`."""
    role: Literal["hub", "leaf"] = "leaf"
    """'hub' for the one region that runs the trainer side; 'leaf' for every other region (joined to the hub)."""
    nats_urls: list[NatsUrl] = []
    """Existing servers to join; empty: `rlbus up` starts an embedded server for this region on loopback."""
    credentials_file: str | None = None
    """Path of a credentials JSON file for `nats_urls` (`{role: {user, password}}`, like the embedded servers'
    `credentials.json`); credentials are only ever given by reference, never inline."""
    credentials_env: EnvName | None = None
    """Name of an environment variable holding the path of such a credentials file (alternative to credentials_file)."""
    ray_resource: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Ray custom resource that places this region's actors (ray backend); default `region:<name>`."""
    host: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Host this region's actors run on, for the torch-threads warning; default: this machine."""
    cores: PositiveInt | None = None
    """CPU cores of `host`; default: `os.cpu_count()` when the host is this machine, else not checked."""
    actors: list[ActorSpec] = []
    """The actors of this region, one `[[regions.actors]]` table per kind (or per named group)."""

    @property
    def resource(self) -> str:
        """The Ray custom resource label of this region."""
        return self.ray_resource if self.ray_resource is not None else f"region:{self.name}"

    @property
    def embedded(self) -> bool:
        """True when `rlbus up` starts this region's server itself (no `nats_urls`)."""
        return not self.nats_urls


class FeederSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[feeder]`: how tasks are produced and spread over the regions."""

    seed: int = 0
    """Seed of the task sampler; the same seed gives the same task sequence."""
    backlog_per_region: PositiveInt = 256
    """Tasks kept queued in each region's TASKS stream, enough to ride out a cut-off."""
    region_weights: dict[str, NonNegativeFloat] = {}
    """Share of tasks per region name, like `{hub = 1, eu = 2}`; default: proportional to generator counts."""
    max_tasks: PositiveInt | None = None
    """Stop after this many tasks; default: feed forever."""
    tasks_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """A JSONL file of tasks (one object per line: task_id, prompt, entry_point, tests [{args, expected}]) instead of the built-in family."""
    poll_interval_s: PositiveFloat = 1.0
    """How often each region's backlog is checked and topped up, seconds."""
    levels: list[Annotated[int, msgspec.Meta(ge=1, le=3)]] = []
    """Built-in tasks only: feed just the tasks of these difficulty levels (1-3 pipeline steps; if/else "branch"
    tasks are level 1), like `[1, 2]`; empty: every level. A curriculum for a weak policy: groups of tasks it
    never solves have equal rewards and teach nothing. The evaluator's held-out set keeps every level."""
    lockstep: bool = False
    """Benchmark schedule (the synchronous arm of `rlbus bench async`): instead of keeping backlogs full, publish
    exactly `backlog_per_region` tasks to a region each time its LATEST weights key announces a new policy
    version, stamped so that generators start them only with that version. With `trainer.staleness_versions = 0`
    and `backlog_per_region * generator.group_size = trainer.batch_rollouts` this is generate-then-train in
    lockstep. Off (the default): the async pipeline."""


class GeneratorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[generator]`: sampling settings shared by every generator."""

    group_size: PositiveInt = 8
    """Completions sampled per task (G); advantages are relative within a group."""
    max_group_size: NonNegativeInt = 0
    """Grow a group in which no completion passed by G more, until one passes or another G would exceed
    this size (a multiple of group_size, like 32): tasks the policy solves only rarely then give groups
    with a pass instead of all-fail groups that teach nothing; 0: every group has G completions. Each growth
    is another sampling round, so a grown group's first completions age: raise trainer.staleness_versions
    with it. Measured on the default run it did not raise the held-out pass rate (README, "The learning run")."""
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


class LengthPenalty(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[trainer.length_penalty]`: reward -= coef * (max(0, tokens - budget) / budget) ** power."""

    budget: PositiveInt = 256
    """Completion length (tokens) below which there is no penalty."""
    coef: NonNegativeFloat = 0.0
    """Penalty weight; 0 turns the length penalty off."""
    power: PositiveFloat = 2.0
    """Exponent of the overshoot; > 1 forgives small overshoots and punishes long ones."""


class TrainerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
    is_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    """Cap of the truncated importance weight pi/mu for off-policy tokens."""
    length_penalty: LengthPenalty = LengthPenalty()
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
    seed: int = 0
    """Seed of the trainer's RNG (initialisation, shuffling)."""


class CheckpointSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[checkpoint]`: how often trainer state becomes a durable checkpoint."""

    interval_steps: PositiveInt = 10
    """Optimizer steps between checkpoints; rollouts are acked only once a checkpoint covers them."""
    keep: PositiveInt = 3
    """Checkpoints kept in the hub object store; older ones are deleted."""


class SandboxSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[sandbox]`: the pool of isolated executors of each sandbox supervisor, and their limits."""

    pool_size: PositiveInt = 2
    """Pre-started executors per supervisor; a crashed one is replaced."""
    concurrency: PositiveInt = 2
    """Requests one supervisor runs at once (the rest wait in its queue); more than `pool_size` only queues.
    A region's quota is the sum over its sandbox supervisors: one per region in the examples."""
    cpu_seconds: PositiveFloat = 5.0
    """CPU time limit per snippet (RLIMIT_CPU)."""
    wall_seconds: PositiveFloat = 10.0
    """Wall-clock limit per snippet; the snippet is killed past it."""
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 256
    """Address-space limit per snippet, MiB (RLIMIT_AS)."""
    max_processes: PositiveInt = 16
    """Processes a snippet may have (RLIMIT_NPROC, enforced for the non-root sandbox uid)."""
    max_file_mb: NonNegativeInt = 16
    """Largest file a snippet may write, MiB (RLIMIT_FSIZE); 0 forbids writing."""
    max_open_files: Annotated[int, msgspec.Meta(ge=3)] = 64
    """Open file descriptors per snippet (RLIMIT_NOFILE); at least 3 for stdin, stdout, stderr."""
    max_output_kb: PositiveInt = 64
    """Captured stdout plus stderr per snippet, KiB; the snippet is killed past it."""


class EvaluatorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[evaluator]`: periodic held-out evaluation of the policy."""

    every_versions: PositiveInt = 10
    """Evaluate one version in every block of this many (0, k, 2k, ...; a version published while an evaluation
    runs is skipped for the newest, so a block's first evaluated version can be later than its first)."""
    n_tasks: PositiveInt = 64
    """Held-out tasks per evaluation (pass@1 and its interval are over these)."""
    seed: int = 1
    """Seed of the held-out task set; keep it fixed to compare versions."""


class PretrainSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[pretrain]`: the first phase, run by `rlbus up` when the state directory has no pretrained policy."""

    preset: Literal["small", "tiny"] = "small"
    """Model size and schedule (model/pretrain.py): 'small' is the real run (minutes), 'tiny' is for tests."""
    steps: PositiveInt | None = None
    """Optimizer steps; default: the preset's."""
    seed: int = 0
    """Seed of initialisation and training data."""
    threads: PositiveInt = 2
    """Torch threads while pretraining (nothing else runs yet)."""
    eval_n: PositiveInt | None = None
    """Held-out tasks evaluated at the end of pretraining; default: the preset's."""


class WeightsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[weights]`: how policy versions are published to the generators."""

    keep_versions: PositiveInt = 8
    """Versions kept in each region's weight bucket; must reach back to the last full snapshot."""
    full_every: PositiveInt = 4
    """Publish a full snapshot every this many versions, XOR deltas in between; 1 publishes only full snapshots."""
    delta_depth: PositiveInt = 3
    """Deltas written per version: from each of the previous this-many kept versions (v-1 ... v-k -> v), so a
    generator that fell behind catches up with one fetch; plus one from the latest full snapshot, for joiners."""


class DurabilitySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[durability]`: JetStream storage settings; the default favours throughput."""

    sync_interval: SyncInterval = "default"
    """How often servers fsync: 'default' (the server's 2m), 'always' (each write; ~18x slower), or a duration."""
    replicas: PositiveInt = 1
    """Stream replicas; more than 1 needs clustered servers (`nats_urls`), embedded servers are single."""


class RetentionSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[retention]`: how long streams keep messages."""

    rollouts_max_age: Duration = "7d"
    """How long ROLLOUTS keeps rollouts for replay and recording."""
    health_max_age: Duration = "1h"
    """How long HEALTH keeps heartbeats."""
    events_max_age: Duration = "7d"
    """How long EVENTS keeps lifecycle events and incidents."""


class LaunchSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[launch]`: how `rlbus up` starts actor instances."""

    backend: Literal["local", "ray"] = "local"
    """'local': one supervised OS process per instance; 'ray': one Ray actor per instance."""
    ray_address: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Ray cluster to join (like 'auto' or 'ray://host:10001'); default: start a local Ray cluster."""
    oversubscribe: bool = False
    """True: the torch actors of a host are meant to ask for more threads than it has cores (they take
    turns; the shipped examples run a whole RL job on 2 cores), so `validate` does not warn about it."""


class RestartSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[restart]`: restart policy of crashed actors; past it the actor is reported failed, never looped."""

    max_restarts: NonNegativeInt = 5
    """Restarts allowed per actor instance within `window_s`; 0 never restarts."""
    window_s: PositiveFloat = 300.0
    """Sliding window, seconds, over which restarts are counted."""
    backoff_initial_s: PositiveFloat = 0.5
    """Delay before the first restart, seconds; doubled after each restart in the window."""
    backoff_max_s: PositiveFloat = 30.0
    """Longest delay between restarts, seconds."""


class TlsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[tls]`: TLS on every client connection and leaf link; off by default (loopback-only embedded servers)."""

    enabled: bool = False
    """Speak TLS: embedded servers require it on client ports and leaf links, and every actor connects trusting `ca_file`."""
    ca_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """PEM file of the CA that clients and leaf links trust; default with embedded servers: one generated under
    `<state_dir>/nats/tls`; default with `nats_urls`: the system's trust store (use `tls://` URLs)."""
    cert_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """PEM certificate the embedded servers present (with `key_file` and `ca_file`); default: one generated for
    127.0.0.1 and localhost. Ignored with `nats_urls` (those servers have their own)."""
    key_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """PEM private key of `cert_file`; keep it readable by its owner only."""


@dataclass(frozen=True, slots=True)
class ActorInstance:
    """One actor instance to start, expanded from a region's `[[regions.actors]]` entry."""

    region: str
    kind: ActorKind
    name: str
    index: int
    torch_threads: int

    @property
    def actor_id(self) -> str:
        """Run-unique id `<region>-<name>-<index>`; a subject token."""
        return f"{self.region}-{self.name}-{self.index}"


class Topology(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole topology file: the run, its regions and actors, and the settings every actor kind reads."""

    run: Name
    """Run name; every subject of the run lives under `rlbus.<run>.`."""
    state_dir: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Directory of all run state (server stores, checkpoints, logs); default `./.rlbus/<run>`."""
    regions: Annotated[list[Region], msgspec.Meta(min_length=1)]
    """The regions, one `[[regions]]` table each; exactly one has role 'hub'."""
    feeder: FeederSettings = FeederSettings()
    """Settings of the task feeder."""
    generator: GeneratorSettings = GeneratorSettings()
    """Settings of every generator."""
    trainer: TrainerSettings = TrainerSettings()
    """Settings of the trainer."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    """Settings of the checkpointer."""
    sandbox: SandboxSettings = SandboxSettings()
    """Settings of every sandbox supervisor."""
    evaluator: EvaluatorSettings = EvaluatorSettings()
    """Settings of the evaluator."""
    weights: WeightsSettings = WeightsSettings()
    """Settings of the weight publisher."""
    pretrain: PretrainSettings = PretrainSettings()
    """Pretraining before the RL run (when no pretrained policy exists yet)."""
    durability: DurabilitySettings = DurabilitySettings()
    """JetStream durability."""
    retention: RetentionSettings = RetentionSettings()
    """Stream retention."""
    launch: LaunchSettings = LaunchSettings()
    """Launch backend."""
    restart: RestartSettings = RestartSettings()
    """Restart policy of crashed actors."""
    tls: TlsSettings = TlsSettings()
    """TLS between regions and for every client connection."""

    @property
    def state_path(self) -> Path:
        """The state directory: `state_dir`, or `./.rlbus/<run>` relative to the working directory."""
        return Path(self.state_dir) if self.state_dir is not None else Path(".rlbus") / self.run

    @property
    def hub(self) -> Region:
        """The hub region (a checked topology has exactly one)."""
        for region in self.regions:
            if region.role == "hub":
                return region
        raise LookupError(f"topology {self.run!r} has no hub region")

    def region(self, name: str) -> Region:
        """The region called `name`; KeyError if there is none."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)

    def instances(self, region: str | None = None) -> list[ActorInstance]:
        """Every actor instance to start, in file order; only those of `region` when given."""
        out: list[ActorInstance] = []
        for reg in self.regions:
            if region is not None and reg.name != region:
                continue
            for spec in reg.actors:
                out.extend(
                    ActorInstance(region=reg.name, kind=spec.kind, name=spec.label, index=i,
                                  torch_threads=spec.torch_threads)
                    for i in range(spec.count)
                )
        return out
