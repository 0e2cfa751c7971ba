"""Idempotent provisioning of a run's JetStream streams, durable consumers, KV and object-store buckets.

- Owns: which stream/bucket lives on which server (per region vs hub: `provision_region`, `provision_hub`),
  their settings (`StreamSettings`), and creating or updating them (`provision_all`, `provision_run`).
- Guarantee: provisioning twice changes nothing.
- Does not: publish or consume (messages/bus.py), start servers (topology/network/servers.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Literal

import anyio
import structlog
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    ExternalStream,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from rlbus.messages.errors import BusUnavailable, TopologyError
from rlbus.messages.retry import retry_policy
from rlbus.messages.subjects import Subjects

log = structlog.get_logger()

_STREAM_NAME_IN_USE: Final = 10058  # JetStream err_code: stream name already in use with a different config
_WRONG_EXPECTED_STREAM: Final = 10060  # JetStream err_code: expected stream does not match
_PROBE_STREAM: Final = "RLBUS_ROUTING_PROBE"  # no stream has this name: probes are refused, never stored


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Retention, redelivery and dedupe settings of a run's streams (from the topology; tests: `tiny()`)."""

    ack_wait_s: float = 60.0
    """Generators' task consumer: an un-acked task is redelivered after this (long tasks send in-progress)."""
    max_deliver: int = 5
    """Generators' task consumer: deliveries of one task before JetStream gives up on it (advisory)."""
    max_ack_pending: int = 1000
    """Generators' task consumer: tasks handed out and not yet acked, over all generators of a region."""
    trainer_ack_wait_s: float = 60.0
    """Trainer's rollout consumer: the trainer acks only once a CheckpointMark covers a rollout."""
    trainer_max_ack_pending: int = 50_000
    """Trainer's rollout consumer: rollouts consumed but not yet covered by a checkpoint."""
    rollout_max_age_s: float = 0.0
    """ROLLOUTS streams keep rollouts this long for replay; 0 = forever."""
    duplicate_window_s: float = 600.0
    """Publishes with an already seen Nats-Msg-Id inside this window are stored once (a stream with a
    shorter max age gets a window of its max age: JetStream requires window <= max age)."""
    health_max_age_s: float = 3600.0
    """HEALTH keeps heartbeats this long."""
    events_max_age_s: float = 7 * 86400.0
    """EVENTS keeps lifecycle events and incidents this long."""
    replicas: int = 1
    """Replicas of every stream and bucket: 1 on single servers, up to the number of nodes of a clustered
    region (an embedded cluster has 3)."""
    weights_keep: int = 3
    """Weight versions kept in each region's WEIGHTS object store (the publisher deletes older ones)."""
    storage: Literal["file", "memory"] = "file"
    """JetStream storage of every stream and bucket."""

    def __post_init__(self) -> None:
        problems = [f"{f.name} must be >= 0, got {getattr(self, f.name)!r}"
                    for f in fields(self) if f.name.endswith("_s") and getattr(self, f.name) < 0]
        problems += [f"{name} must be >= 1, got {getattr(self, name)!r}"
                     for name in ("max_ack_pending", "trainer_max_ack_pending", "replicas", "weights_keep")
                     if getattr(self, name) < 1]
        if self.max_deliver == 0 or self.max_deliver < -1:
            problems.append(f"max_deliver must be >= 1 or -1 (unlimited), got {self.max_deliver}")
        if self.ack_wait_s == 0 or self.trainer_ack_wait_s == 0 or self.duplicate_window_s == 0:
            problems.append("ack_wait_s, trainer_ack_wait_s and duplicate_window_s must be > 0")
        if problems:
            raise TopologyError("stream settings: " + "; ".join(problems))

    @classmethod
    def tiny(cls) -> StreamSettings:
        """Test-sized settings: short ack waits and windows so redelivery tests finish in seconds."""
        return cls(ack_wait_s=2.0, max_deliver=3, trainer_ack_wait_s=5.0, duplicate_window_s=120.0,
                   health_max_age_s=120.0, events_max_age_s=600.0, weights_keep=2)


# ---- idempotent primitives --------------------------------------------------------------------
def _covers(have: Any, want: Any) -> bool:
    """True when every value set in `want` (recursively; lists element by element) equals `have`'s."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_covers(have.get(k), v)
                                              for k, v in want.items() if v is not None)
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(_covers, have, want))
    return bool(have == want)


_NO_PLACEMENT: Final = 10005
"""JetStream's err_code when a replicated stream finds too few peers online: a cluster still forming."""

PLACEMENT_WAIT_S: Final = 30.0
"""How long a stream or bucket's creation is asked again while the cluster does not see all its peers."""


async def _placed(create: Callable[[], Awaitable[object]], name: str) -> None:
    """`create()` (a stream's, KV or object-store bucket's), asked again every 0.25 s for up to PLACEMENT_WAIT_S
    while the cluster reports too few peers online (a cluster still forming, or a peer that missed heartbeats on a
    loaded machine)."""
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            await create()
            return
        except BadRequestError as err:
            if err.err_code != _NO_PLACEMENT or time.monotonic() > deadline:
                raise
            log.info("stream_placement_wait", stream=name, reason=err.description)
        await anyio.sleep(0.25)


async def _add_stream(js: JetStreamContext, config: StreamConfig) -> None:
    assert config.name is not None
    await _placed(lambda: js.add_stream(config), config.name)


async def ensure_stream(js: JetStreamContext,
                        config: StreamConfig) -> Literal["created", "updated", "unchanged"]:
    """Create `config`'s stream, or update it when a setting we care about differs; else change nothing."""
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await _add_stream(js, config)
            log.info("stream_created", stream=config.name, subjects=config.subjects)
            return "created"
        except BadRequestError as err:  # created concurrently by another provisioner
            if err.err_code != _STREAM_NAME_IN_USE:
                raise
            info = await js.stream_info(config.name)
    if _covers(info.config.as_dict(), config.as_dict()):
        return "unchanged"
    await js.update_stream(config)
    log.info("stream_updated", stream=config.name, subjects=config.subjects)
    return "updated"


async def ensure_consumer(js: JetStreamContext, stream: str,
                          config: ConsumerConfig) -> Literal["created", "updated", "unchanged"]:
    """Create a durable consumer, or update it (create-or-update) when a setting differs."""
    assert config.durable_name is not None
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        await js.add_consumer(stream, config)
        log.info("consumer_created", stream=stream, consumer=config.durable_name)
        return "created"
    if _covers(info.config.as_dict(), config.as_dict()):
        return "unchanged"
    await js.add_consumer(stream, config)
    log.info("consumer_updated", stream=stream, consumer=config.durable_name)
    return "updated"


async def ensure_key_value(js: JetStreamContext, config: KeyValueConfig) -> Literal["created", "unchanged"]:
    """Create a KV bucket unless it exists (an existing bucket is left as it is)."""
    try:
        await js.stream_info(f"KV_{config.bucket}")
        return "unchanged"
    except NotFoundError:
        await _placed(lambda: js.create_key_value(config), f"KV_{config.bucket}")
        log.info("kv_bucket_created", bucket=config.bucket)
        return "created"


async def ensure_object_store(js: JetStreamContext,
                              config: ObjectStoreConfig) -> Literal["created", "unchanged"]:
    """Create an object-store bucket unless it exists (an existing bucket is left as it is)."""
    assert config.bucket is not None
    try:
        await js.stream_info(f"OBJ_{config.bucket}")
        return "unchanged"
    except NotFoundError:
        await _placed(lambda: js.create_object_store(config=config, bucket=config.bucket), f"OBJ_{config.bucket}")
        log.info("object_store_created", bucket=config.bucket)
        return "created"


# ---- the run's layout -------------------------------------------------------------------------
def _storage(settings: StreamSettings) -> StorageType:
    return StorageType.FILE if settings.storage == "file" else StorageType.MEMORY


def _limits(settings: StreamSettings, name: str, subjects: list[str] | None, *, max_age_s: float = 0.0,
            sources: list[StreamSource] | None = None) -> StreamConfig:
    window = settings.duplicate_window_s if max_age_s == 0 else min(settings.duplicate_window_s, max_age_s)
    return StreamConfig(name=name, subjects=subjects, retention=RetentionPolicy.LIMITS,
                        discard=DiscardPolicy.OLD, max_age=max_age_s, duplicate_window=window,
                        storage=_storage(settings), num_replicas=settings.replicas, sources=sources)


def region_streams(subjects: Subjects, region: str, settings: StreamSettings) -> list[StreamConfig]:
    """The streams every region's server holds: its TASKS work queue and its ROLLOUTS stream."""
    tasks = StreamConfig(name=subjects.tasks_stream(region), subjects=[subjects.tasks(region)],
                         retention=RetentionPolicy.WORK_QUEUE, discard=DiscardPolicy.OLD,
                         duplicate_window=settings.duplicate_window_s, storage=_storage(settings),
                         num_replicas=settings.replicas)
    rollouts = _limits(settings, subjects.rollouts_stream(region), [subjects.rollouts(region)],
                       max_age_s=settings.rollout_max_age_s)
    return [tasks, rollouts]


def generator_consumer(subjects: Subjects, region: str, settings: StreamSettings) -> ConsumerConfig:
    """The durable pull consumer on a region's TASKS, shared by all that region's generators."""
    return ConsumerConfig(durable_name=subjects.durable("generator", region), ack_policy=AckPolicy.EXPLICIT,
                          ack_wait=settings.ack_wait_s, max_deliver=settings.max_deliver,
                          max_ack_pending=settings.max_ack_pending)


def hub_streams(subjects: Subjects, hub: str, regions: Mapping[str, str | None],
                settings: StreamSettings) -> list[StreamConfig]:
    """The hub-only streams. `regions`: region → JetStream domain, the hub included (sourced locally)."""
    sources = [StreamSource(name=subjects.rollouts_stream(region)) if region == hub else
               StreamSource(name=subjects.rollouts_stream(region),
                            external=ExternalStream(api=_api(region, domain)))
               for region, domain in sorted(regions.items())]
    return [
        _limits(settings, subjects.hub_rollouts_stream(), None, max_age_s=settings.rollout_max_age_s,
                sources=sources),
        _limits(settings, subjects.trainlog_stream(), [subjects.trainlog()]),
        _limits(settings, subjects.weights_stream(), [subjects.weights()]),
        _limits(settings, subjects.checkpoints_stream(), [subjects.checkpoints()]),
        _limits(settings, subjects.state_stream(), [subjects.all_state()]),
        _limits(settings, subjects.evals_stream(), [subjects.evals()]),
        _limits(settings, subjects.health_stream(), [subjects.all_health()],
                max_age_s=settings.health_max_age_s),
        _limits(settings, subjects.events_stream(), [subjects.all_events()],
                max_age_s=settings.events_max_age_s),
        _limits(settings, subjects.dead_letter_stream(), [subjects.all_dead_letters()]),
    ]


def trainer_consumer(subjects: Subjects, settings: StreamSettings) -> ConsumerConfig:
    """The trainer's durable pull consumer on the hub's ROLLOUTS; never gives up on a rollout."""
    return ConsumerConfig(durable_name=subjects.durable("trainer"), ack_policy=AckPolicy.EXPLICIT,
                          ack_wait=settings.trainer_ack_wait_s, max_deliver=-1,
                          max_ack_pending=settings.trainer_max_ack_pending)


def _api(region: str, domain: str | None) -> str:
    if not domain:
        raise TopologyError(f"region {region!r} needs a JetStream domain for the hub to source its rollouts")
    return Subjects.js_api(domain)


async def provision_region(nc: NATS, subjects: Subjects, region: str, *, domain: str | None,
                           settings: StreamSettings) -> None:
    """Create (or leave as is) one region's streams, consumer and buckets on the server of `domain`
    (None: the server `nc` is connected to). Needs the admin role; safe to call any number of times.

    Every region's server has its own JetStream domain, normally = region name. Each region R, hub
    included, holds `TASKS_<run>_R` (work queue on tasks.R, durable pull consumer `generator_R`),
    `ROLLOUTS_<run>_R` (limits on rollouts.R, dedupe by Nats-Msg-Id), KV `PARTIALS_<run>_R`, object stores
    `WEIGHTS_<run>_R` and `WORKSPACES_<run>_R` (snapshots of agentic episodes' workspaces, written by
    generators), KV `LATEST_<run>_R`.
    """
    js = nc.jetstream(domain=domain)
    for config in region_streams(subjects, region, settings):
        await ensure_stream(js, config)
    await ensure_consumer(js, subjects.tasks_stream(region), generator_consumer(subjects, region, settings))
    await ensure_key_value(js, KeyValueConfig(bucket=subjects.partials_bucket(region), history=1,
                                              storage=_storage(settings), replicas=settings.replicas))
    await ensure_key_value(js, KeyValueConfig(bucket=subjects.latest_bucket(region), history=1,
                                              storage=_storage(settings), replicas=settings.replicas))
    await ensure_object_store(js, ObjectStoreConfig(bucket=subjects.weights_bucket(region),
                                                    storage=_storage(settings), replicas=settings.replicas))
    await ensure_object_store(js, ObjectStoreConfig(bucket=subjects.workspaces_bucket(region),
                                                    storage=_storage(settings), replicas=settings.replicas))


async def provision_hub(nc: NATS, subjects: Subjects, hub: str, regions: Mapping[str, str | None],
                        settings: StreamSettings) -> None:
    """Create (or leave as is) the hub-only streams, the trainer consumer and the CKPT bucket, on the
    hub's domain `regions[hub]` (None: the server `nc` is connected to). Regions' own streams may be
    missing yet: a source retries until its stream appears.

    Hub only: `ROLLOUTS_<run>` (no subjects: sources every region's ROLLOUTS stream, leaves through
    `$JS.<domain>.API`; durable `trainer`), `TRAINLOG`, `WEIGHTS` (manifests), `CHECKPOINTS`, `STATE`,
    `EVALS`, `HEALTH`, `EVENTS`, `DLQ` streams and object store `CKPT`.
    """
    if hub not in regions:
        raise TopologyError(f"hub {hub!r} is not one of the regions {sorted(regions)}")
    js = nc.jetstream(domain=regions[hub])
    for config in hub_streams(subjects, hub, regions, settings):
        await ensure_stream(js, config)
    await ensure_consumer(js, subjects.hub_rollouts_stream(), trainer_consumer(subjects, settings))
    await ensure_object_store(js, ObjectStoreConfig(bucket=subjects.checkpoint_bucket(),
                                                    storage=_storage(settings), replicas=settings.replicas))


async def provision_all(connect: Callable[[str], Awaitable[NATS]], subjects: Subjects, *, hub: str,
                        regions: Mapping[str, str | None], settings: StreamSettings) -> None:
    """Provision every region through its own server (`await connect(region)` → an admin connection to
    that region's server, closed here), then the hub. A cut-off leaf is provisioned where it stands. A region
    whose streams do not answer yet (a cluster electing their leaders) is retried for up to 30 s."""
    for region in [*sorted(r for r in regions if r != hub), hub]:
        nc = await connect(region)
        try:
            # A clustered region restarted on its stores elects each stream's leader a few seconds after its
            # meta leader; until then that stream's API requests go unanswered: retry (it is idempotent).
            retry = retry_policy("provision_retry", on=(ServiceUnavailableError, NoRespondersError, NatsTimeoutError),
                                 initial_s=0.2, max_s=1.0, give_up_after_s=30, region=region)
            async for attempt in retry:
                with attempt:
                    await provision_region(nc, subjects, region, domain=regions[region], settings=settings)
                    if region == hub:
                        await provision_hub(nc, subjects, hub, regions, settings)
        finally:
            await nc.close()


async def provision_run(nc: NATS, subjects: Subjects, *, hub: str, domains: Mapping[str, str | None],
                        settings: StreamSettings) -> None:
    """Provision every region and the hub through one admin connection to the hub: each region's
    resources through `$JS.<domain>.API` across its leaf link (so every leaf must be linked now)."""
    if hub not in domains:
        raise TopologyError(f"hub {hub!r} is not one of the regions {sorted(domains)}")
    for region in [*sorted(r for r in domains if r != hub), hub]:
        # A leaf's `$JS.<domain>.API` interest reaches the hub a moment after the link is up: retry the
        # (idempotent) provisioning on "no responders" for a bounded time.
        retry = retry_policy("provision_retry", on=(ServiceUnavailableError, NoRespondersError), initial_s=0.1,
                             max_s=1.0, give_up_after_s=20, region=region)
        async for attempt in retry:
            with attempt:
                await provision_region(nc, subjects, region, domain=domains[region], settings=settings)
    await provision_hub(nc, subjects, hub, domains, settings)


async def wait_routable(nc: NATS, subject: str, *, timeout_s: float = 10.0) -> None:
    """Block until a stream captures `subject` as seen from `nc`'s server.

    A client connects to its own region's server; `nc.jetstream()` is that server's domain (the leaf link
    does not carry `$JS.API`), `nc.jetstream(domain=hub)` manages/consumes hub streams from a leaf. Plain
    publishes (core or `js.publish`) need no domain: a stream's subjects attract messages across the leaf
    link (hub → leaf TASKS, leaf → hub HEALTH/EVENTS/DLQ) while it is up.

    A stream's interest crosses a leaf link a few ms after the stream is created (or the link comes
    up); a publish in that gap gets "no responders". The probe publishes an empty message that
    expects a stream that does not exist, so the capturing stream answers with an error and stores
    nothing. Needs publish permission on `subject`.

    :raises BusUnavailable: no stream answered within `timeout_s` (not provisioned, or link down).
    """
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await js.publish(subject, b"", stream=_PROBE_STREAM, timeout=min(1.0, timeout_s))
        except BadRequestError as err:
            if err.err_code == _WRONG_EXPECTED_STREAM:
                return
            raise
        except (NoStreamResponseError, NatsTimeoutError):
            if time.monotonic() > deadline:
                where = nc.connected_url.netloc if nc.connected_url is not None else "a closed connection"
                raise BusUnavailable(f"no stream captures {subject!r} as seen from {where} within "
                                     f"{timeout_s}s; is it provisioned, and is the leaf link up?") from None
            await anyio.sleep(0.05)
        else:
            raise BusUnavailable(f"routing probe on {subject!r} was stored: a stream is named "
                                 f"{_PROBE_STREAM}")
