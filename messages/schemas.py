"""The wire vocabulary of rlbus: every message kind as a frozen, tagged msgspec Struct.

Owns: message fields, their defaults and the schema version. Each message is encoded as a
MessagePack *map* with named fields (never array_like) and a `kind` tag, so any MessagePack reader can
read it. Evolution: new fields get defaults and go last; unknown fields from newer producers are
skipped; a `schema` above `SCHEMA_VERSION` is refused by the codec and dead-lettered.
Does not: encode, compress or route (messages/codec.py, messages/subjects.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Final, Literal, TypeAlias

import msgspec
import numpy as np

SCHEMA_VERSION: Final = 1
"""Highest schema version this build reads. Bump only with a migration note in the README."""


class Message(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True):
    """Base of every bus message; `kind` is the wire tag and `schema` the version of its fields."""

    schema: int = SCHEMA_VERSION


class TensorBlob(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor on the wire: dtype name (torch spelling, e.g. "bfloat16"), shape, raw little-endian bytes.

    Per-token arrays of a Rollout travel this way too: decoding them costs a byte copy, not one Python
    object per token, and any MessagePack reader gets plain `bin` data it can reinterpret.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray, dtype: str) -> TensorBlob:
        """A 1-D or n-D array (numpy dtype names: int32, int64, float32, uint8, ...) as a blob."""
        array = np.ascontiguousarray(np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")))
        return cls(dtype=dtype, shape=tuple(int(d) for d in array.shape), data=array.tobytes())

    def numpy(self) -> np.ndarray[Any, Any]:
        """A read-only numpy view of the data (numpy dtypes only; bfloat16 needs codec.blob_to_tensor)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return list(self.numpy().tolist())

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


def _empty(dtype: str) -> TensorBlob:
    return TensorBlob(dtype=dtype, shape=(0,), data=b"")


class Task(Message, tag="task"):
    """One coding task. Produced by actors/feeder.py; consumed by a region's generators (TASKS)."""

    task_id: str
    prompt: str
    verifier: dict[str, str] = {}
    """Verifier spec: e.g. {"kind": "python_tests", "tests": "...", "entry": "f"}."""
    group_size: int = 4
    region: str = ""
    seed: int = 0
    created_at: float = msgspec.field(default_factory=time.time)
    min_version: int = 0
    """Generators start the task only once they hold this policy version or newer (0: any). Set by the
    feeder's lockstep schedule (`feeder.lockstep`, the synchronous arm of `rlbus bench async`)."""


class SandboxVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of running a completion against its tests."""

    passed: int = 0
    total: int = 0
    exit_code: int | None = None
    status: Literal["ok", "failed", "timeout", "crashed", "oom", "output_limit", "error"] = "error"


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """An earlier stretch of a rollout, with the context it was sampled under (which the rollout's own prompt no
    longer holds once the episode summarised its history). Same per-token layout as a Rollout's fields."""

    prompt_tokens: TensorBlob
    """int32 (P,): what the policy read before the segment's first token."""
    completion_tokens: TensorBlob
    """int32 (T,)."""
    behaviour_logprobs: TensorBlob
    """float32 (T,)."""
    policy_versions: TensorBlob
    """int32 (T,)."""
    loss_mask: TensorBlob
    """uint8 (T,): 1 where the policy produced the token."""
    routing: TensorBlob | None = None
    """MoE routing record over prompt + completion (int64 (P + T, n_moe_layers, top_k))."""


class Rollout(Message, tag="rollout"):
    """One sampled completion with everything the trainer needs.

    Produced by actors/generator/actor.py; consumed by actors/trainer/actor.py (ROLLOUTS, durable) and recorders.
    """

    rollout_id: str
    task_id: str
    group_index: int
    group_size: int
    prompt_tokens: TensorBlob
    """int32 (P,) prompt token ids."""
    completion_tokens: TensorBlob
    """int32 (T,) completion token ids (all turns, observations included)."""
    behaviour_logprobs: TensorBlob
    """float32 (T,): per completion token, log-probability under the weights that sampled it."""
    policy_versions: TensorBlob
    """int32 (T,): per completion token, which policy version produced it (changes at an in-flight update)."""
    loss_mask: TensorBlob = msgspec.field(default_factory=lambda: _empty("uint8"))
    """uint8 (T,): 1 where the policy produced the token (trained on), 0 for observations; empty = all 1."""
    routing: TensorBlob | None = None
    """MoE routing record (int64 (T, n_moe_layers, top_k)), replayed by the trainer."""
    reward: float = 0.0
    verdict: SandboxVerdict = SandboxVerdict()
    timings: dict[str, float] = {}
    region: str = ""
    generator_id: str = ""
    created_at: float = msgspec.field(default_factory=time.time)
    segments: list[Segment] = []
    """Earlier segments, oldest first, each trained under its own context (an episode that summarised: the
    turns before each summary, and the summary itself under what the policy read when it wrote it). The
    rollout's own fields are its last segment. Empty for an episode that never summarised."""
    tool_call_tokens: int | None = None
    """Policy tokens inside tool calls, over every segment; None: not recorded (the generators do not count them
    yet; the trainer's concave length penalty then counts 0)."""
    final_tokens: int | None = None
    """Tokens of the final message; None: not recorded (the trainer then takes the last run of policy tokens)."""


class WeightManifest(Message, tag="weight_manifest"):
    """A published policy version. Produced by actors/publisher/; consumed by generators and relays."""

    version: int
    base_version: int | None = None
    """The version a delta applies to; None for a full snapshot."""
    encoding: Literal["full", "delta"] = "full"
    objects: list[str] = []
    """Object-store names holding the encoded version, in order."""
    digests: list[str] = []
    sizes: list[int] = []
    version_digest: str = ""
    """Digest over every tensor of the decoded version; generators check it after applying."""
    raw_bytes: int = 0
    regions_ready: list[str] = []
    created_at: float = msgspec.field(default_factory=time.time)
    model_config: dict[str, Any] = {}
    """The policy's `ModelConfig` fields, so a joining generator can build the model before any weights."""
    bases: list[int | None] = []
    """Per object: the version it applies to (None: a full snapshot). Empty from older publishers."""
    yields: list[int] = []
    """Per object: the version it produces: `version`, or for the full snapshot a joiner starts from, that
    snapshot's (earlier) version, after which the object with that base brings it to `version`."""


class VersionReady(Message, tag="version_ready"):
    """A new policy version's bf16 weights are uploaded to the hub's CKPT object store.

    Produced by actors/trainer/actor.py on `state.version` (STATE stream); consumed by actors/publisher/actor.py,
    which encodes it for the generators and announces it with a WeightManifest.
    """

    version: int
    step: int
    object: str
    digest: str
    version_digest: str = ""
    """Digest over every tensor of the version (kernels/delta/codec.py); generators check it after applying."""
    raw_bytes: int = 0
    created_at: float = msgspec.field(default_factory=time.time)
    model_config: dict[str, Any] = {}
    """The architecture (model/policies/transformer.py `ModelConfig` fields), so consumers can build the model."""


class StateUploaded(Message, tag="state_uploaded"):
    """The trainer's full state for a step (fp32 weights, optimizer, RNG, consumed ids) is in CKPT.

    Produced by actors/trainer/actor.py on `state.upload` (STATE stream); consumed by actors/checkpointer.py,
    which verifies the digests, makes it durable and publishes a CheckpointMark.
    """

    step: int
    policy_version: int
    objects: list[str]
    digests: list[str]
    consumed_rollout_ids: list[str] = []
    parent_step: int | None = None
    created_at: float = msgspec.field(default_factory=time.time)


class CheckpointMark(Message, tag="checkpoint_mark"):
    """A durable checkpoint. Produced by actors/checkpointer.py; consumed by the trainer (resume) and all."""

    step: int
    policy_version: int
    objects: list[str] = []
    digests: list[str] = []
    consumed_rollout_ids: list[str] = []
    """Every rollout id the checkpointed state has already trained on (or dropped)."""
    parent_step: int | None = None
    created_at: float = msgspec.field(default_factory=time.time)


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Resource limits of one sandboxed execution."""

    cpu_seconds: float = 2.0
    memory_mb: int = 256
    max_processes: int = 16
    max_file_mb: int = 8
    max_open_files: int = 64
    wall_seconds: float = 5.0
    max_output_kb: int = 64


class SandboxRequest(Message, tag="sandbox_request"):
    """Run code against tests. Produced by generators/evaluators; consumed by actors/sandbox/supervisor.py (request/reply)."""

    request_id: str
    code: str
    tests: str
    limits: SandboxLimits = SandboxLimits()


class SandboxResult(Message, tag="sandbox_result"):
    """The reply to a SandboxRequest. Produced by actors/sandbox/supervisor.py; consumed by its requester."""

    request_id: str
    verdict: SandboxVerdict
    stdout: str = ""
    stderr: str = ""
    isolation: str = ""
    cpu_seconds: float = 0.0
    max_rss_kb: int = 0
    wall_seconds: float = 0.0


class SessionOpen(Message, tag="session_open"):
    """Open a sandbox session: a workspace seeded with `files`, held while calls renew its lease.
    Produced by generators (actors/common/sessions.py); consumed by a region's sandbox supervisors (queue group)."""

    files: dict[str, bytes] = {}
    """Workspace-relative path → content; directories are made as needed."""
    lease_s: float = 60.0
    """The session is destroyed this long after its last call (capped by `[sandbox] max_lease_s`)."""
    max_file_kb: int | None = None
    """Largest file a tool may write, KiB (None: the supervisor's `[sandbox] max_file_mb`; capped by it)."""
    max_workspace_kb: int | None = None
    """Largest total of the workspace's files, KiB (None: `[sandbox] workspace_mb`; capped by it)."""


class SessionOpened(Message, tag="session_opened"):
    """The reply to a SessionOpen: the session's id (tool calls go to the supervisor it names) or why not."""

    session_id: str = ""
    ok: bool = False
    error: str = ""
    isolation: str = ""
    lease_s: float = 0.0
    """The lease granted (the asked one, capped by the supervisor)."""


class ToolCall(Message, tag="tool_call"):
    """One tool call in a session (`list_files`, `read_file`, `write_file`, `edit_file`, `search`, `run`,
    `grade`, `snapshot`, `digest`; arguments in actors/sandbox/tools.py). Every call renews the session's lease."""

    session_id: str
    call_id: str
    tool: str
    args: dict[str, Any] = {}


class ToolResult(Message, tag="tool_result"):
    """The reply to a ToolCall. `status`: ok, error (the call was refused or failed: `error` says why, for
    the model to read), timeout, output_limit, no_session, busy. `snapshot` fills `files`, `digests`
    (sha256 hex of each) and `deleted`: what changed since the session opened."""

    session_id: str
    call_id: str
    ok: bool
    output: str = ""
    error: str = ""
    truncated: bool = False
    exit_code: int | None = None
    elapsed_ms: float = 0.0
    status: str = "ok"
    files: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    deleted: list[str] = []


class SessionClose(Message, tag="session_close"):
    """Destroy a session and its workspace now (answered with a SessionClosed)."""

    session_id: str


class SessionClosed(Message, tag="session_closed"):
    """The reply to a SessionClose: `existed` is False when the session was already gone (closed or expired)."""

    session_id: str
    existed: bool = True


class Heartbeat(Message, tag="heartbeat"):
    """Liveness and progress of one actor. Produced by every actor (actors/base.py); consumed by `rlbus health`."""

    actor_id: str
    actor_kind: str
    region: str
    state: str
    run: str = ""
    policy_version: int | None = None
    counters: dict[str, int] = {}
    gauges: dict[str, float] = {}
    restarts: int = 0
    last_error: str = ""
    pid: int = 0
    sent_at: float = msgspec.field(default_factory=time.time)


EventKind: TypeAlias = Literal[
    "started", "stopped", "crashed", "restarted", "failed", "dead_letter", "checkpoint",
    "weights_published", "weights_rejected", "stale_dropped", "incident",
]


class Event(Message, tag="event"):
    """A lifecycle event or incident. Produced by any actor or launcher; consumed by `rlbus events`, recorders."""

    event: EventKind
    actor_id: str = ""
    actor_kind: str = ""
    region: str = ""
    detail: str = ""
    data: dict[str, str] = {}
    at: float = msgspec.field(default_factory=time.time)


class DroppedRollout(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout the trainer refused, and why."""

    rollout_id: str
    reason: str


class TrainStep(Message, tag="train_step"):
    """One optimizer step. Produced by actors/trainer/actor.py on TRAINLOG; consumed by ledgers, recorders, replay.

    A record with no `rollout_ids` and only `dropped` entries (same `policy_version` as the step before) is
    the trainer recording drops it could not fold into an optimizer step (its buffer was full)."""

    step: int
    policy_version: int
    parent_checkpoint: int | None = None
    rollout_ids: list[str] = []
    dropped: list[DroppedRollout] = []
    loss: float = 0.0
    kl: float = 0.0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    staleness: dict[str, int] = {}
    """Histogram: versions behind (as a string key) → number of rollouts."""
    world_size: int = 1
    """Trainer ranks that computed the step (`[trainer] world_size`); replay-retrain needs the same."""
    created_at: float = msgspec.field(default_factory=time.time)
    replaced_experts: int = 0
    """Replayed MoE experts the trainer replaced as implausible (`[trainer] router_replay_threshold`)."""


class LevelScore(msgspec.Struct, frozen=True, kw_only=True):
    """One level's share of an EvalReport (the tasks of one `family/level`, e.g. "repo/2")."""

    n: int
    pass_at_1: float
    ci_low: float
    ci_high: float
    mean_at_k: float | None = None
    policy_tokens_mean: float | None = None


class EvalReport(Message, tag="eval_report"):
    """Held-out evaluation of one version. Produced by actors/evaluator.py; consumed by `rlbus up`, plots,
    TensorBoard.

    The fields after `created_at` came later; a report without them (an older evaluator's, or one of
    function-writing tasks scored greedily) leaves them at their defaults."""

    policy_version: int
    task_seed: int
    n: int
    pass_at_1: float
    """Greedy pass@1; `ci_low`, `ci_high` its 95% Wilson interval."""
    ci_low: float
    ci_high: float
    created_at: float = msgspec.field(default_factory=time.time)
    source: str = ""
    """The held-out task source (`[evaluator] tasks`)."""
    samples: int = 0
    """K: sampled completions or episodes per task besides the greedy one (0: greedy only, and the sampled
    fields below stay empty)."""
    mean_at_k: float | None = None
    """The mean pass rate of the K samples."""
    pass_at_k: dict[str, float] = {}
    """{"k": unbiased pass@k averaged over tasks} for k = 1..K."""
    pass_at_k_ci95: dict[str, list[float]] = {}
    """{"k": [low, high]}: the 95% bootstrap interval over tasks of each pass@k."""
    turns_mean: float | None = None
    """Agentic episodes (greedy): mean policy turns; None for function-writing tasks."""
    tool_calls_mean: float | None = None
    """Agentic episodes (greedy): mean tool-call blocks."""
    policy_tokens_mean: float | None = None
    """Agentic episodes (greedy): mean tokens the policy wrote per task; with `pass_at_1`, the accuracy-cost point."""
    observation_tokens_mean: float | None = None
    """Agentic episodes (greedy): mean observation tokens the policy read."""
    wall_s_mean: float | None = None
    """Agentic episodes (greedy): mean seconds per episode."""
    sampled_policy_tokens_mean: float | None = None
    """Agentic episodes (sampled): mean tokens the policy wrote per sampled episode (pass@k costs k of them)."""
    by_level: dict[str, LevelScore] = {}
    """The same scores per `family/level`."""


AnyMessage: TypeAlias = (
    Task | Rollout | WeightManifest | CheckpointMark | SandboxRequest | SandboxResult | Heartbeat | Event
    | TrainStep | EvalReport | VersionReady | StateUploaded
    | SessionOpen | SessionOpened | ToolCall | ToolResult | SessionClose | SessionClosed
)
MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    Task, Rollout, WeightManifest, CheckpointMark, SandboxRequest, SandboxResult, Heartbeat, Event,
    TrainStep, EvalReport, VersionReady, StateUploaded,
    SessionOpen, SessionOpened, ToolCall, ToolResult, SessionClose, SessionClosed,
)
