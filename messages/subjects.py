"""Every NATS subject, stream, consumer and bucket name of rlbus, built and validated in one place.

Owns: the naming scheme (all subjects of a run live under `rlbus.<run>.`), token validation, and the
subject patterns each role may publish or subscribe to (used for the servers' user permissions).
Does not: talk to a server (messages/bus.py) or create streams (messages/streams.py).
No other module writes a subject literal; tests/test_subjects.py checks that.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Final, Literal

from rlbus.messages.errors import SubjectError

_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+")
_KV_KEY: Final = re.compile(r"[-/_=A-Za-z0-9]+(\.[-/_=A-Za-z0-9]+)*")
"""A JetStream KV key (nats-py's rule): tokens of letters, digits, '-', '/', '_' or '=', joined by dots."""
_ROOT: Final = "rlbus"
SHARD_PREFIX: Final = "state-shard-"
_INBOX_ROOT: Final = "_INBOX"

LATEST_KEY: Final = "latest"
"""Key of each region's LATEST bucket (`Subjects.latest_bucket`) holding the newest WeightManifest: written by
the publisher (or the region's relay), watched by generators, the feeder and the evaluator."""
LINK_KEY: Final = "link"
"""Key of a relayed region's LATEST bucket naming the one object of each version that crossed its link (a
WeightManifest listing it): written by the hub's publisher, watched by the region's `RegionRelay`."""
POSITION_KEY: Final = "feeder-position"
"""Key of the feeder's cursors in the hub region's PARTIALS bucket (generators use task ids as keys)."""

Role = Literal["feeder", "generator", "trainer", "trainer_rank", "publisher", "weights_relay", "checkpointer",
               "sandbox", "evaluator", "observer", "admin", "leaf"]
ROLES: Final[tuple[Role, ...]] = ("feeder", "generator", "trainer", "trainer_rank", "publisher", "weights_relay",
                                  "checkpointer", "sandbox", "evaluator", "observer", "admin", "leaf")


def token(value: str, what: str) -> str:
    """Return `value` if it is a single subject token (letters, digits, '_' or '-'), else raise."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise SubjectError(f"{what} {value!r} cannot be a subject token (use letters, digits, '_' or '-')")
    return value


def inbox_prefix(role: str) -> str:
    """`_INBOX.<role>`: the reply inboxes of every connection of `role` live under it, and that role may
    subscribe to inboxes only there (`role_permissions`)."""
    return f"{_INBOX_ROOT}.{token(role, 'role')}"


def connection_inbox(role: str) -> str:
    """A fresh private inbox prefix for one connection of `role`, `_INBOX.<role>.<32 hex>` (nats-py
    `connect(inbox_prefix=...)`): request replies, pull-consumer deliveries and KV/object-store reads of that
    connection arrive under it, out of other roles' reach and unguessable within its own."""
    return f"{inbox_prefix(role)}.{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subjects, stream names and bucket names of one run. `Subjects("r1").tasks("eu")` etc."""

    run: str

    def __post_init__(self) -> None:
        token(self.run, "run id")

    # ---- subjects -------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """`rlbus.<run>`: every subject of the run starts with it."""
        return f"{_ROOT}.{self.run}"

    def everything(self) -> str:
        """Wildcard over every subject of the run."""
        return f"{self.prefix}.>"

    def tasks(self, region: str) -> str:
        """Tasks assigned to one region (TASKS work queue of that region)."""
        return f"{self.prefix}.tasks.{token(region, 'region')}"

    def rollouts(self, region: str) -> str:
        """Rollouts produced in one region (that region's ROLLOUTS stream)."""
        return f"{self.prefix}.rollouts.{token(region, 'region')}"

    def all_rollouts(self) -> str:
        return f"{self.prefix}.rollouts.*"

    def trainlog(self) -> str:
        """One TrainStep per optimizer step."""
        return f"{self.prefix}.trainlog"

    def weights(self) -> str:
        """WeightManifest announcements."""
        return f"{self.prefix}.weights"

    def checkpoints(self) -> str:
        """CheckpointMark announcements."""
        return f"{self.prefix}.checkpoints"

    def state_uploads(self) -> str:
        """Trainer → checkpointer: `StateUploaded` notices (full trainer state of step N is in CKPT)."""
        return f"{self.prefix}.state.upload"

    def version_ready(self) -> str:
        """Trainer → publisher: `VersionReady` notices (bf16 weights of version N are in CKPT)."""
        return f"{self.prefix}.state.version"

    def all_state(self) -> str:
        return f"{self.prefix}.state.>"

    def evals(self) -> str:
        """EvalReport announcements."""
        return f"{self.prefix}.evals"

    def sandbox(self, region: str) -> str:
        """Request/reply subject of a region's sandbox supervisors (queue group)."""
        return f"{self.prefix}.sandbox.{token(region, 'region')}"

    def session_open(self, region: str) -> str:
        """Request/reply subject where a region's sandbox supervisors open sessions (queue group)."""
        return f"{self.prefix}.session.{token(region, 'region')}"

    def session_calls(self, region: str, supervisor: str) -> str:
        """Request/reply subject of one supervisor's sessions: tool calls and closes (`session_host`)."""
        return f"{self.prefix}.session.{token(region, 'region')}.{token(supervisor, 'supervisor id')}"

    @staticmethod
    def new_session_id(supervisor: str) -> str:
        """A fresh session id, `<supervisor id>.<16 hex>`: it names the supervisor that holds the session."""
        return f"{token(supervisor, 'supervisor id')}.{secrets.token_hex(8)}"

    @staticmethod
    def session_host(session_id: str) -> str:
        """The supervisor id a session id names (`new_session_id`).

        :raises SubjectError: the id is not `<supervisor id>.<hex>`.
        """
        host, _, rest = session_id.partition(".") if isinstance(session_id, str) else ("", "", "")
        if not rest or not re.fullmatch(r"[0-9a-f]+", rest):
            raise SubjectError(f"session id {session_id!r} is not '<supervisor id>.<hex>'")
        return token(host, "supervisor id")

    def health(self, region: str, kind: str, actor: str) -> str:
        """Heartbeats of one actor."""
        return f"{self.prefix}.health.{token(region, 'region')}.{token(kind, 'kind')}.{token(actor, 'actor id')}"

    def all_health(self) -> str:
        return f"{self.prefix}.health.>"

    def events(self, region: str, kind: str) -> str:
        """Lifecycle events and incidents raised by actors of one kind in one region."""
        return f"{self.prefix}.events.{token(region, 'region')}.{token(kind, 'kind')}"

    def all_events(self) -> str:
        return f"{self.prefix}.events.>"

    def dead_letter(self, source: str) -> str:
        """Where a consumer republishes a message it could not use, by source stream name."""
        return f"{self.prefix}.dlq.{token(source, 'dead-letter source')}"

    def all_dead_letters(self) -> str:
        return f"{self.prefix}.dlq.>"

    @staticmethod
    def js_api(domain: str) -> str:
        """The JetStream API prefix of another domain (region), e.g. for sourcing a leaf's stream."""
        return f"$JS.{token(domain, 'JetStream domain')}.API"

    @staticmethod
    def kv_key(bucket: str, key: str, *, domain: str | None = None) -> str:
        """The subject a KV bucket stores `key` under; with `domain`, the one to *write* it from another
        domain: `$KV.>` does not cross leaf links, `$JS.<domain>.API.$KV.>` does (the Go client's way).
        `key` is any KV key (dots make it several tokens)."""
        if not isinstance(key, str) or not _KV_KEY.fullmatch(key):
            raise SubjectError(f"KV key {key!r} is not a key (tokens of letters, digits, '-', '/', '_' or '=', "
                               f"joined by dots)")
        subject = f"$KV.{token(bucket, 'bucket')}.{key}"
        return subject if domain is None else f"{Subjects.js_api(domain)}.{subject}"

    @staticmethod
    def service_status(kind: str, actor: str) -> str:
        """The `status` endpoint of an actor's NATS micro service (beside `$SRV.PING/INFO/STATS`)."""
        return f"$SRV.STATUS.rlbus-{token(kind, 'kind')}.{token(actor, 'actor id')}"

    # ---- stream, consumer and bucket names ------------------------------------------------------
    def _name(self, base: str, region: str | None = None) -> str:
        parts = [base, self.run] + ([token(region, "region")] if region is not None else [])
        return "_".join(parts)

    def tasks_stream(self, region: str) -> str:
        return self._name("TASKS", region)

    def rollouts_stream(self, region: str) -> str:
        """A region's own rollout stream (leaf) — the hub's is `hub_rollouts_stream()`."""
        return self._name("ROLLOUTS", region)

    def hub_rollouts_stream(self) -> str:
        """The hub's ROLLOUTS stream: the hub's own rollouts plus every leaf stream, sourced."""
        return self._name("ROLLOUTS")

    def trainlog_stream(self) -> str:
        return self._name("TRAINLOG")

    def weights_stream(self) -> str:
        return self._name("WEIGHTS")

    def checkpoints_stream(self) -> str:
        return self._name("CHECKPOINTS")

    def state_stream(self) -> str:
        return self._name("STATE")

    def evals_stream(self) -> str:
        return self._name("EVALS")

    def health_stream(self) -> str:
        return self._name("HEALTH")

    def events_stream(self) -> str:
        return self._name("EVENTS")

    def dead_letter_stream(self) -> str:
        return self._name("DLQ")

    def partials_bucket(self, region: str) -> str:
        """KV bucket of in-progress rollouts of one region."""
        return self._name("PARTIALS", region)

    def weights_bucket(self, region: str) -> str:
        """Object store of weight blobs, one copy per region."""
        return self._name("WEIGHTS", region)

    def workspaces_bucket(self, region: str) -> str:
        """Object store of workspace snapshots of agentic episodes in progress, one per region (content-addressed:
        `workspace_object`)."""
        return self._name("WORKSPACES", region)

    @staticmethod
    def workspace_object(sha256_hex: str) -> str:
        """WORKSPACES object holding one snapshot of a workspace's changed files, named by its content."""
        return f"ws-{token(sha256_hex, 'sha256')}"

    def latest_bucket(self, region: str) -> str:
        """KV bucket holding the `latest` weight pointer, one per region."""
        return self._name("LATEST", region)

    def checkpoint_bucket(self) -> str:
        """Hub object store of trainer state uploads and checkpoints."""
        return self._name("CKPT")

    @staticmethod
    def version_object(version: int) -> str:
        """CKPT object holding policy version N's bf16 weights (one full `encode_state` blob)."""
        return f"weights-v{version}"

    @staticmethod
    def policy_file_object(sha256_hex: str) -> str:
        """Object holding one file a policy needs besides its tensors (a Hugging Face config or tokenizer file),
        named by its content: the trainer puts it in CKPT, the publisher copies it to every region's WEIGHTS."""
        return f"policy-file-{token(sha256_hex, 'sha256')}"

    @staticmethod
    def state_object(step: int, incarnation: str) -> str:
        """CKPT object holding the trainer's full state after step N, uploaded by one trainer incarnation."""
        return f"state-step-{step}-{token(incarnation, 'incarnation')}"

    @staticmethod
    def shard_object(sha256_hex: str, filename: str) -> str:
        """CKPT object of one file of a sharded trainer state (`torch.distributed.checkpoint`, one set per
        checkpoint across the ranks), named by its content so every rank names its own files untold."""
        return f"{SHARD_PREFIX}{token(sha256_hex[:32], 'digest')}-{filename}"

    @staticmethod
    def shard_filename(name: str) -> str | None:
        """The checkpoint file a `shard_object` name holds; None for any other object."""
        if not name.startswith(SHARD_PREFIX):
            return None
        return name[len(SHARD_PREFIX):].partition("-")[2] or None

    def durable(self, role: str, region: str | None = None) -> str:
        """Durable consumer name for a role (one shared per role and region)."""
        return "_".join([token(role, "role")] + ([token(region, "region")] if region else []))


@dataclass(frozen=True, slots=True)
class BucketScope:
    """The runs and regions whose KV and object-store buckets a server grants to roles.

    NATS wildcards match whole tokens only, and a bucket name is one token (`WEIGHTS_<run>_<region>`),
    so bucket rights must name each bucket: a server started for a run lists that run and its regions.
    """

    runs: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()

    def buckets(self, kind: Literal["partials", "weights", "latest", "checkpoint", "workspaces"]) -> list[str]:
        """`$KV.<bucket>.>` / `$O.<bucket>.>` publish patterns of one bucket kind, for every run and region."""
        out: list[str] = []
        for run in self.runs:
            s = Subjects(run)
            match kind:
                case "partials":
                    out += [f"$KV.{s.partials_bucket(r)}.>" for r in self.regions]
                case "latest":
                    out += [f"$KV.{s.latest_bucket(r)}.>" for r in self.regions]
                case "weights":
                    out += [f"$O.{s.weights_bucket(r)}.>" for r in self.regions]
                case "workspaces":
                    out += [f"$O.{s.workspaces_bucket(r)}.>" for r in self.regions]
                case "checkpoint":
                    out += [f"$O.{s.checkpoint_bucket()}.>"]
        return out


RESPONSE_PERMISSION: Final = {"max": 1, "expires": "10m"}
"""`allow_responses` of every role but admin: it may publish one reply to the reply subject of each request it
received, for 10 minutes (a sandbox verdict, a `$SRV` discovery answer); other inboxes stay closed to it."""

_API_PREFIXES: Final = ("$JS.API", "$JS.*.API")
"""The JetStream API of the client's own server, and of any domain (region) across the leaf links."""
_DURABLE_OWNERS: Final[tuple[Role, ...]] = ("trainer", "publisher", "checkpointer")
"""Roles whose durable consumer is named after the role (`Subjects.durable(role)`); generators' are per region."""


def _durable(role: str, region: str | None = None) -> str:
    return "_".join([role] + ([region] if region else []))


def role_durables(scope: BucketScope | None = None) -> dict[Role, list[str]]:
    """The durable consumers of the run's actors by owning role (generators' per region of `scope`)."""
    scope = scope or BucketScope()
    out: dict[Role, list[str]] = {role: [_durable(role)] for role in _DURABLE_OWNERS}
    out["generator"] = [_durable("generator", r) for r in scope.regions]
    return out


def _api(*suffixes: str) -> list[str]:
    return [f"{prefix}.{suffix}" for suffix in suffixes for prefix in _API_PREFIXES]


def _jetstream_reads() -> list[str]:
    """JetStream API every role may use: read stream/consumer info and messages, create ephemeral
    consumers and pull from them, delete them afterwards. Durables of other roles are carved out by
    `role_denials`; nothing here creates, changes, purges or deletes a stream."""
    return _api("INFO", "STREAM.INFO.*", "STREAM.NAMES", "STREAM.LIST", "STREAM.MSG.GET.*", "DIRECT.GET.>",
                "CONSUMER.INFO.*.*", "CONSUMER.NAMES.*", "CONSUMER.LIST.*", "CONSUMER.CREATE.*",
                "CONSUMER.CREATE.*.*", "CONSUMER.CREATE.*.*.>", "CONSUMER.MSG.NEXT.*.*", "CONSUMER.DELETE.*.*")


def _bucket_writes(patterns: list[str]) -> list[str]:
    """Write rights for buckets: the plain `$KV.<b>.>`/`$O.<b>.>` subjects, the same through another
    domain's API (`$JS.<domain>.API.$KV.<b>.>`, how a KV key is written across a leaf link), and purging
    the bucket's own stream (an object store purges old chunks on overwrite and delete)."""
    out: list[str] = []
    for pattern in patterns:
        bucket_stream = ("KV_" if pattern.startswith("$KV.") else "OBJ_") + pattern.split(".")[1]
        out += [pattern, f"$JS.*.API.{pattern}", *_api(f"STREAM.PURGE.{bucket_stream}")]
    return out


def role_permissions(role: Role, scope: BucketScope | None = None) -> tuple[list[str], list[str]]:
    """(publish allow, subscribe allow) patterns for a role, across every run; `role_denials` carves out
    what these wildcards would over-grant.

    Every role may read through the JetStream API (stream and consumer info, messages, ephemeral
    consumers), ack, use service discovery, and publish its own heartbeats, events and dead letters. Reply
    inboxes are private: a role subscribes only under its own `_INBOX.<role>.>` (each connection under its
    own random prefix in there, `connection_inbox`), and publishes to no inbox at all except as a response
    to a request it received (the servers set `allow_responses`, see `RESPONSE_PERMISSION`). No role but
    admin may create, update, purge or delete a stream, or publish raw to another domain's API. Data subjects are granted by role: only the trainer side (trainer, publisher,
    checkpointer) writes weights, checkpoints and TRAINLOG (a trainer's other ranks: only their checkpoint shards; a leaf's
    weights relay: only weight objects and LATEST, announcing nothing); only the feeder writes tasks; only generators
    write rollouts and workspace snapshots. Bucket writes (plain and through `$JS.<domain>.API`, plus purging the bucket's stream)
    are granted per bucket for the runs and regions of `scope`.
    """
    scope = scope or BucketScope()
    run = f"{_ROOT}.*"
    common_pub = [*_jetstream_reads(), "$JS.ACK.>", "$JS.FC.>", "$SRV.>",
                  f"{run}.health.>", f"{run}.events.>", f"{run}.dlq.>"]
    if role in ("admin", "leaf"):
        return [">"], [">"]
    common_sub = [f"{inbox_prefix(role)}.>", "$SRV.>", f"{run}.>", "$JS.EVENT.>", "$KV.>", "$O.>"]
    data: dict[str, list[str]] = {
        "feeder": [f"{run}.tasks.*", *_bucket_writes(scope.buckets("partials"))],
        "generator": [f"{run}.rollouts.*", f"{run}.sandbox.*", f"{run}.session.>",
                      *_bucket_writes(scope.buckets("partials")), *_bucket_writes(scope.buckets("workspaces"))],
        "trainer": [f"{run}.trainlog", f"{run}.state.*", *_bucket_writes(scope.buckets("checkpoint"))],
        "trainer_rank": _bucket_writes(scope.buckets("checkpoint")),   # its checkpoint shards, nothing else
        "publisher": [f"{run}.weights", *_bucket_writes(scope.buckets("weights")),
                      *_bucket_writes(scope.buckets("latest"))],
        # a leaf's weights relay: that region's weight objects and LATEST; no announcement, no durable
        "weights_relay": [*_bucket_writes(scope.buckets("weights")), *_bucket_writes(scope.buckets("latest"))],
        "checkpointer": [f"{run}.checkpoints", *_bucket_writes(scope.buckets("checkpoint"))],
        "sandbox": [],
        "evaluator": [f"{run}.evals", f"{run}.sandbox.*", f"{run}.session.>"],
        "observer": [],
    }
    if role not in data:
        raise SubjectError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    own_durables = [api for name in role_durables(scope).get(role, [])    # (re)created by the actor itself
                    for api in _api(f"CONSUMER.DURABLE.CREATE.*.{name}")]
    return common_pub + own_durables + data[role], common_sub


def role_denials(role: Role, scope: BucketScope | None = None) -> tuple[list[str], list[str]]:
    """(publish deny, subscribe deny) patterns for a role: they win over `role_permissions`' allows.

    Publish: no role pulls from, acks for, or creates/updates another role's durable consumer (stealing
    or stalling its work), and nobody but admin deletes a durable. Subscribe: only sandbox supervisors
    listen on sandbox request and session subjects (a listener there could answer with forged verdicts).
    Generators' durables are named per region, so they are protected for the regions of `scope` only.
    """
    if role in ("admin", "leaf"):
        return [], []
    if role not in ROLES:
        raise SubjectError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    durables = role_durables(scope)
    deny: list[str] = []
    for owner, names in durables.items():
        for name in names:
            deny += _api(f"CONSUMER.DELETE.*.{name}")
            if owner != role:
                deny += [*_api(f"CONSUMER.MSG.NEXT.*.{name}", f"CONSUMER.CREATE.*.{name}",
                               f"CONSUMER.CREATE.*.{name}.>"),
                         f"$JS.ACK.*.{name}.>", f"$JS.ACK.*.*.*.{name}.>"]
    sub_deny = [] if role == "sandbox" else [f"{_ROOT}.*.sandbox.*", f"{_ROOT}.*.session.>"]
    return deny, sub_deny
