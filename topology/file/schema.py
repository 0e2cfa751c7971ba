"""The topology file schema: frozen msgspec Structs, one per TOML table, a docstring under every field.

Owns: every key a topology file may hold, its type, range, default and meaning (docs/topology.md
is generated from this tree by topology/file/reference.py), and small pure helpers on the decoded tree
(`Topology.instances()`, `parse_duration`). The sections an actor kind reads are that kind's own Config,
composed here and declared only next to the actor (actors/common/config.py, actors/<kind>/config.py).
Does not: read files or report problems (topology/file/load.py), check rules that span several keys (`check()`
in topology/file/load.py), or start anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec

from rlbus.actors.common.config import (
    CheckpointerConfig,
    EvaluatorConfig,
    FeederConfig,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PublisherConfig,
)
from rlbus.actors.generator.config import GeneratorConfig
from rlbus.actors.sandbox.config import SandboxConfig
from rlbus.actors.trainer.config import TrainerConfig
from rlbus.topology.network.links import (
    PERCENT_PATTERN,
    PERCENT_WORDS,
    RATE_PATTERN,
    RATE_WORDS,
    TIME_PATTERN,
    TIME_WORDS,
    LinkShape,
)

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
    RATE_PATTERN: RATE_WORDS,
    TIME_PATTERN: TIME_WORDS,
    PERCENT_PATTERN: PERCENT_WORDS,
}
"""Each string pattern of the schema in words, for messages and the key reference."""

Name = Annotated[str, msgspec.Meta(pattern=_TOKEN_PATTERN, max_length=64)]
Duration = Annotated[str, msgspec.Meta(pattern=_DURATION_PATTERN)]
SyncInterval = Annotated[str, msgspec.Meta(pattern=_SYNC_PATTERN)]
NatsUrl = Annotated[str, msgspec.Meta(pattern=_URL_PATTERN)]
EnvName = Annotated[str, msgspec.Meta(pattern=_ENV_PATTERN)]
Rate = Annotated[str, msgspec.Meta(pattern=RATE_PATTERN)]
LinkTime = Annotated[str, msgspec.Meta(pattern=TIME_PATTERN)]
Percent = Annotated[str, msgspec.Meta(pattern=PERCENT_PATTERN)]

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


class LinkSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[regions.link]` of a leaf region: run its server and actors in their own network namespace, joined to the
    hub by a shaped link (topology/network/links.py; needs root, ip, tc and nft, else the region runs on loopback)."""

    bandwidth: Rate | None = None
    """Link rate each way (tc tbf on both ends), like '100mbit'; none: unshaped."""
    latency: LinkTime = "0ms"
    """One-way delay added to each direction (in userspace, by the link's relay), like '30ms'; the round trip is twice it."""
    jitter: LinkTime = "0ms"
    """Each chunk's delay varies uniformly by up to this much around `latency` (a stream is never reordered)."""
    loss: Percent = "0%"
    """Packets dropped at random in each direction (nftables), like '0.1%'; below 100%."""


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
    link: LinkSettings | None = None
    """A leaf's shaped link to the hub (`[regions.link]`); none: the region runs on loopback."""

    @property
    def resource(self) -> str:
        """The Ray custom resource label of this region."""
        return self.ray_resource if self.ray_resource is not None else f"region:{self.name}"

    @property
    def embedded(self) -> bool:
        """True when `rlbus up` starts this region's server itself (no `nats_urls`)."""
        return not self.nats_urls









LONG_CONTEXT_FACTOR: Final = 4
"""A long-context phase trains on at least this many times the context of the main phase before it."""
PRETRAIN_CONTEXT: Final = 512
"""The presets' context in tokens (`[pretrain] max_seq_len` when unset)."""


class PretrainPhase(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[[pretrain.phases]]`: one phase of pretraining; phases run in order into one model directory, each
    resumed from the one before it (model/training/phases.py)."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,40}$")]
    """The phase's name (letters, digits, '_', '.', '-'): its marker file and its label on loss.png."""
    kind: Literal["main", "long_context", "sft"] = "main"
    """'main' (task documents and Python source, as a single-phase run), 'long_context' (the context and the
    position encoding extended to `seq_len`, trained on whole repositories of source) or 'sft' (conversations
    of `data`, framed as the agentic generator frames them, the loss on the assistant's tokens)."""
    steps: PositiveInt
    """Optimizer steps of this phase."""
    seq_len: Annotated[int, msgspec.Meta(ge=64)] | None = None
    """Tokens per training document. 'main': at most the model's context (default: the context); 'long_context':
    the new context, required, at least 4 times the main phase's before it; 'sft': not used (a conversation is cut
    at the context)."""
    lr: PositiveFloat | None = None
    """Peak learning rate; default: the preset's ('sft': 1e-4)."""
    warmup_steps: NonNegativeInt | None = None
    """Linear warmup steps, then cosine decay to `lr * min_lr_ratio`; default: the preset's ('sft': 5)."""
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    """Where the cosine ends, as a share of `lr`; default: the preset's (0.1)."""
    batch_size: PositiveInt | None = None
    """Documents (or conversations) per step; default: the preset's."""
    data: str = ""
    """'main': a folder of .py files trained on besides the standard library; 'long_context': a folder whose
    subfolders are repositories (their .py files concatenated, whole, into documents; default: the standard
    library's packages); 'sft': the JSONL file of conversations (required), or "demos": the demonstrations of
    `[pretrain.demos]`, written into the state directory by `rlbus up` before this phase."""
    rope_theta: PositiveFloat | None = None
    """'long_context': the RoPE base after the extension; default: the base scaled NTK-style by the context
    ratio r, `theta * r ** (d / (d - 2))` (d: the head dimension)."""
    mtp_heads: NonNegativeInt = 0
    """After the phase, distil this many MTP heads (the drafters of `[generator] speculative`), from scratch, from
    the phase's model, frozen, on the pretraining corpus (KL to the main head's distribution k tokens on): a Hugging
    Face policy's into `mtp_heads.safetensors` beside the model, the built-in policy's into its own model
    (`mtp_heads` in its config, saved in `pretrain.pt`); not for a routed (MoE) policy. 0: none (heads distilled by
    an earlier phase stay, as drafters of a model that has moved on)."""
    mtp_steps: PositiveInt | None = None
    """Distillation steps of `mtp_heads`; default: the phase's `steps`."""


DEMOS_DATA: Final = "demos"
"""An 'sft' phase's `data` that names the demonstrations of `[pretrain.demos]` instead of a file."""


class PretrainDemos(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[pretrain.demos]`: the demonstrations an 'sft' phase with `data = "demos"` trains on, written by the
    scripted expert in a real sandbox (`rlbus tasks demos`) into the state directory before that phase, once."""

    source: str = "repo:train"
    """The repository task source drawn from: its training split only ('repo:train', 'repo:1:train', or a
    repository task file's train rows); a ':heldout' source is refused."""
    n: PositiveInt = 20
    """Demonstrations to keep (each one passed the hidden tests)."""
    seed: int = 1
    """Seed of the tasks drawn and of the expert."""
    summary_at: NonNegativeInt | None = None
    """Tokens of context past which the expert summarises and goes on in a fresh context (0: never); default:
    `[generator.agentic] summary_at_tokens`, else where the environment summarises."""

    def __post_init__(self) -> None:
        if self.source.endswith(":heldout"):
            raise ValueError(f"source: {self.source!r} is a held-out split; demonstrations are drawn from the "
                             "training split ('repo:train', 'repo:LEVEL:train')")


class PretrainSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[pretrain]`: the first phase, run by `rlbus up` when the state directory has no pretrained policy."""

    preset: Literal["small", "tiny"] = "small"
    """Model size and schedule (model/training/pretrain.py): 'small' is the real run (minutes), 'tiny' is for tests."""
    steps: PositiveInt | None = None
    """Optimizer steps; default: the preset's."""
    seed: int = 0
    """Seed of initialisation and training data."""
    threads: PositiveInt = 2
    """Torch threads while pretraining (nothing else runs yet)."""
    eval_n: PositiveInt | None = None
    """Held-out tasks evaluated at the end of pretraining; default: the preset's."""
    max_seq_len: Annotated[int, msgspec.Meta(ge=64)] | None = None
    """The built-in policy's context, in tokens; default: the preset's (512). Pretraining documents are short, so a
    longer context costs pretraining nothing; agentic episodes (repository tasks) need one of about 2048."""
    phases: list[PretrainPhase] = []
    """Phases run in order (`[[pretrain.phases]]`), each with its own steps, schedule and data, into one model
    directory with a marker per finished phase (a crashed run resumes after the last one); none: a single main
    phase of `steps`."""
    demos: PretrainDemos | None = None
    """The demonstrations of an 'sft' phase whose `data` is "demos" (`[pretrain.demos]`); unset: its defaults."""

    @property
    def context(self) -> int:
        """The policy's context after pretraining: `max_seq_len` (or the presets'), extended by the last
        'long_context' phase."""
        extended = [p.seq_len for p in self.phases if p.kind == "long_context" and p.seq_len is not None]
        return extended[-1] if extended else self.max_seq_len or PRETRAIN_CONTEXT

    def __post_init__(self) -> None:
        if self.demos is not None and not any(p.kind == "sft" and p.data == DEMOS_DATA for p in self.phases):
            raise ValueError(f"demos: no [[pretrain.phases]] of kind 'sft' has data = {DEMOS_DATA!r} to train on them")
        if not self.phases:
            return
        if self.steps is not None:
            raise ValueError("steps: with [[pretrain.phases]] each phase has its own steps; remove it")
        context = self.max_seq_len or PRETRAIN_CONTEXT
        names: set[str] = set()
        for k, phase in enumerate(self.phases):
            key = f"phases[{k}]"
            if phase.name in names:
                raise ValueError(f"{key}.name: {phase.name!r} names an earlier phase too; give each phase its own")
            names.add(phase.name)
            if phase.kind == "sft" and not phase.data:
                raise ValueError(f"{key}.data: an 'sft' phase needs the JSONL file of conversations it trains on")
            if phase.kind == "main" and phase.seq_len is not None:
                if phase.seq_len > context:
                    raise ValueError(f"{key}.seq_len: {phase.seq_len} is past the model's context of {context} "
                                     "tokens at this phase; a 'long_context' phase extends it")
                context = phase.seq_len
            if phase.kind == "long_context":
                need = LONG_CONTEXT_FACTOR * context
                if phase.seq_len is None or phase.seq_len < need:
                    got = "missing" if phase.seq_len is None else str(phase.seq_len)
                    raise ValueError(f"{key}.seq_len: {got}; a 'long_context' phase needs at least "
                                     f"{LONG_CONTEXT_FACTOR} x the main phase's {context} tokens = {need}")
                context = phase.seq_len



class PolicyRecipe(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[policy.recipe]`: how `rlbus up` builds a Hugging Face policy when `policy.path` is empty or missing: a
    fresh model of this architecture and size, a byte-level BPE tokenizer trained on the pretraining corpus,
    then `[pretrain]` steps of pretraining (model/policies/hf_recipe.py, model/training/pretrain.py)."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    """The Hugging Face architecture built: 'qwen2' (Qwen2ForCausalLM) or 'llama' (LlamaForCausalLM)."""
    size: Literal["tiny", "small", "m30"] = "small"
    """'tiny' (tests, seconds), 'small' (a few million parameters, minutes on 2 cores) or 'm30' (about 30M)."""


class PolicySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[policy]`: the one place that names the model every trainer, generator and evaluator runs."""

    kind: Literal["builtin", "hf"] = "builtin"
    """'builtin' (the project's transformer and byte tokenizer, pretrained by `[pretrain]`) or 'hf' (a local
    Hugging Face directory: config.json, safetensors weights, tokenizer.json, loaded through transformers)."""
    path: str = ""
    """kind 'hf': the model directory. Empty (or missing, with a recipe): `rlbus up` builds one by the recipe into
    `<state_dir>/pretrained`."""
    recipe: PolicyRecipe | None = None
    """kind 'hf': how to build the model when `path` is empty or missing; none: `path` must exist."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype generators and the evaluator sample in (versions are published in bfloat16; the trainer's master
    copy is always float32)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where every policy runs: 'auto' is CUDA when the actor's machine has it, else the CPU; 'cuda' fails the
    actor at start (with an Event) where there is none."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """kind 'hf': the transformers attention implementation."""
    router_replay: bool | None = None
    """Replay each rollout's recorded MoE routing in the trainer; default: exactly when the model routes. true
    on a dense model is refused."""


class DurabilitySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[durability]`: JetStream storage settings; the default favours throughput."""

    sync_interval: SyncInterval = "default"
    """How often servers fsync: 'default' (the server's 2m: an OS crash may lose writes acknowledged within it),
    'always' (each write before its ack; ~18x slower), or a duration. Passed to every node of a cluster."""
    replicas: PositiveInt = 1
    """Replicas of every stream and bucket. Embedded servers: 1 (one server per region) or 3 (each region a
    3-node JetStream cluster started by rlbus up; with sync_interval 'always' no acknowledged write is lost
    while 2 of 3 nodes live); not with [regions.link]. With nats_urls: at most the servers of that cluster."""
    redeliver_after: Duration = "60s"
    """How long JetStream waits for an ack before it hands a task or a rollout to another consumer (the ack wait
    of the generators' task consumers and of the trainer's rollout consumer): what a killed generator or trainer
    held comes back after this. Live holders renew it (a third to a quarter of it), so it bounds recovery, not
    the length of a task. At least 1s."""


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


class LoggingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[logging]`: where `rlbus up` writes the run's metrics besides its progress lines and `plots/progress.png`."""

    tensorboard: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Directory of TensorBoard event files (`events.out.tfevents.*`): each optimizer step's figures, each evaluation,
    the generators' throughput and every actor's heartbeat counters and gauges (ops/tensorboard.py). Relative: to
    the state directory. `rlbus up --tensorboard DIR` overrides it. Needs the metrics extra
    (`pip install 'rlbus[metrics]'`); none: no event files."""


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
    feeder: FeederConfig = FeederConfig()
    """Settings of the task feeder."""
    generator: GeneratorConfig = GeneratorConfig()
    """Settings of every generator."""
    trainer: TrainerConfig = TrainerConfig()
    """Settings of the trainer."""
    checkpoint: CheckpointerConfig = CheckpointerConfig()
    """Settings of the checkpointer."""
    sandbox: SandboxConfig = SandboxConfig()
    """Settings of every sandbox supervisor."""
    evaluator: EvaluatorConfig = EvaluatorConfig()
    """Settings of the evaluator."""
    weights: PublisherConfig = PublisherConfig()
    """Settings of the weight publisher."""
    policy: PolicySettings = PolicySettings()
    """The model: built-in or a Hugging Face directory, its device and dtype."""
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
    logging: LoggingSettings = LoggingSettings()
    """Metrics files `rlbus up` writes (TensorBoard)."""

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

    def link_shapes(self) -> dict[str, LinkShape]:
        """Leaf region → the shape of its `[regions.link]` (a checked topology's strings parse)."""
        return {r.name: LinkShape.parse(bandwidth=r.link.bandwidth, latency=r.link.latency, jitter=r.link.jitter,
                                        loss=r.link.loss)
                for r in self.regions if r.link is not None and r.role != "hub"}

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
