"""Launching a topology: servers (embedded or joined), streams, and every actor through a backend.

Owns: `Launch`, the run's lifetime as an async context manager — start the embedded region servers
(or join the `nats_urls` given), provision every stream, connect an admin bus at the hub for events,
turn the topology's actor instances into `ProcessSpec`s (role, credentials, settings, launch values; plus what the
launcher adds: a trainer's other ranks, and a weights relay in each leaf behind a `[regions.link]` while
`[weights] relay` is on), and run them through the `local` or `ray` backend until cancelled; then stop actors, then
servers, by PID.
Does not: draw progress (ops/up.py) or implement actors (actors/).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import msgspec
import nats
import structlog

from rlbus.actors.common.config import (
    CheckpointerLaunch,
    EvaluatorLaunch,
    FeederLaunch,
    PublisherLaunch,
    RelayLaunch,
)
from rlbus.actors.generator.config import GeneratorLaunch
from rlbus.actors.sandbox.config import SandboxLaunch
from rlbus.actors.trainer.config import TrainerLaunch
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.errors import TopologyError
from rlbus.messages.schemas import Event
from rlbus.messages.streams import StreamSettings, provision_all, wait_routable
from rlbus.topology.backends.local import (
    RANK_ENV,
    TIMEOUT_ENV,
    WORLD_ENV,
    LocalSupervisor,
    ProcessSpec,
    RestartPolicy,
)
from rlbus.topology.file.schema import Topology, parse_duration
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet
from rlbus.topology.network.tls import TlsFiles, client_context

log = structlog.get_logger()

ROLE_OF_KIND: Final[dict[str, str]] = {
    "feeder": "feeder", "generator": "generator", "trainer": "trainer", "trainer_rank": "trainer_rank",
    "publisher": "publisher", "weights_relay": "weights_relay",
    "checkpointer": "checkpointer", "sandbox": "sandbox", "evaluator": "evaluator",
    "demo_producer": "generator", "demo_consumer": "trainer",
}
"""The NATS user (and so the publish rights) each actor kind connects as."""
PRETRAINED_DIR: Final = "pretrained"
"""`<state_dir>/pretrained/`: where `rlbus up` pretrains once (model/training/pretrain.py writes `pretrain.pt` there)."""
RUN_FILE: Final = "run.json"
"""Written into the state directory by `Launch.open`: where the run's buses are, for `rlbus health` & co."""


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where each region's bus is and how to authenticate to it."""

    urls: dict[str, tuple[str, ...]]
    domains: dict[str, str]
    hub: str
    credentials: dict[str, Path | None]
    """Region → credentials JSON file ({role: {user, password}}), None: no auth."""
    tls_ca: Path | None = None
    """PEM file of the CA every connection trusts (`[tls]`), None: plaintext or the system's trust store."""
    netns: dict[str, str] = field(default_factory=dict)
    """Region → the network namespace its server runs in (`[regions.link]`); its local actors run there too."""


def kind_settings(topology: Topology, kind: str) -> dict[str, Any]:
    """The topology section an actor kind reads, as plain JSON-able values (its Config's fields, nothing
    else; what the launcher adds travels in `kind_launch`)."""
    match kind:
        case "feeder":
            section: Any = topology.feeder
        case "generator":
            section = topology.generator
        case "trainer":
            section = topology.trainer
        case "checkpointer":
            section = topology.checkpoint
        case "sandbox":
            section = topology.sandbox
        case "evaluator":
            section = topology.evaluator
        case "publisher" | "weights_relay":
            section = topology.weights
        case _:
            return {}
    return dict(msgspec.to_builtins(section))


def kind_launch(topology: Topology, kind: str, state_dir: Path | None = None,
                torch_threads: int = 0) -> msgspec.Struct | None:
    """What the launcher passes an actor kind beside its section (the kind's `*Launch`), None for a kind that
    takes nothing. `state_dir`: the run's state directory (default the topology's); the trainer and
    checkpointer get it, the trainer also the pretrained checkpoint folder `<state_dir>/pretrained`, the
    checkpoint interval, the generators' temperature and how many version objects to keep. `torch_threads`:
    the instance's (generators; 0 leaves it to `RLBUS_TORCH_THREADS`)."""
    state = (state_dir or topology.state_path).resolve()
    match kind:
        case "feeder":
            return feeder_launch(topology)
        case "generator":
            return GeneratorLaunch(torch_threads=torch_threads, device=topology.policy.device,
                                   dtype=topology.policy.dtype)
        case "trainer":
            return TrainerLaunch(pretrained=str(policy_dir(topology, state)), state_dir=str(state),
                                 device=topology.policy.device,
                                 checkpoint_interval=topology.checkpoint.interval_steps,
                                 keep_version_objects=max(16, 2 * topology.weights.keep_versions),
                                 sampling_temperature=topology.generator.temperature or 1.0)
        case "checkpointer":
            return CheckpointerLaunch(state_dir=str(state))
        case "sandbox":
            return SandboxLaunch()
        case "evaluator":
            return EvaluatorLaunch(max_tokens=topology.generator.max_tokens, device=topology.policy.device,
                                   agentic=msgspec.to_builtins(topology.generator.agentic))
        case "publisher":    # it writes every region's weight bucket: it needs their names, the hub, the relayed
            return PublisherLaunch(regions=[r.name for r in topology.regions], hub=topology.hub.name,
                                   relayed=relayed_regions(topology))
        case "weights_relay":
            return RelayLaunch(hub=topology.hub.name)
        case _:
            return None


def policy_dir(topology: Topology, state: Path) -> Path:
    """Where the run's starting policy is: `[policy] path` (an existing model, or where the recipe builds one),
    else `<state_dir>/pretrained` (where `rlbus up` pretrains the built-in policy, or builds one by the recipe)."""
    path = topology.policy.path
    return Path(path).resolve() if path else state / PRETRAINED_DIR


def feeder_launch(topology: Topology) -> FeederLaunch:
    """What the feeder cannot see itself: every region, the generator group size, the evaluator's held-out
    seed and source (skipped by the task sequence), and shares proportional to each region's generator instances (used
    while `region_weights` is empty)."""
    counts = {r.name: float(sum(1 for i in topology.instances(r.name) if i.kind == "generator"))
              for r in topology.regions}
    return FeederLaunch(regions=[r.name for r in topology.regions], group_size=topology.generator.group_size,
                        hub=topology.hub.name,
                        eval_seed=topology.evaluator.seed,    # training never draws the evaluator's held-out prompts
                        eval_tasks=topology.evaluator.tasks, eval_n=topology.evaluator.n_tasks,
                        default_weights=counts if any(counts.values()) else {})


async def read_fed_tasks(topology: Topology, bus: Bus, *, settle_s: float = 10.0) -> Any:
    """The run's task ledger (actors/common/ledger.py `TaskLedger`: every task the feeder fed is rolled out, pending
    or dead-lettered), read through `bus` (connected to the hub) with the feeder's settings as launched; None
    when the topology has no feeder. A task whose rollouts are still on their way from a leaf to the hub
    reads as lost, so while some are, it re-reads for up to `settle_s`.

    :raises TopologyError: the feeder's saved position was written under other feeder settings.
    """
    from rlbus.actors.common.ledger import read_task_ledger

    feeders = [i for i in topology.instances() if i.kind == "feeder"]
    if not feeders:
        return None
    launch = feeder_launch(topology)
    deadline = anyio.current_time() + settle_s
    while True:
        book = await read_task_ledger(bus, topology.feeder, launch, feeder_region=feeders[0].region)
        if book.clean or anyio.current_time() >= deadline:
            return book
        await anyio.sleep(1.0)


def relayed_regions(topology: Topology) -> list[str]:
    """The leaves that get a weights relay: each with a `[regions.link]`, while `[weights] relay` is on and the run
    has a publisher (one object per version then crosses each such link; the relay makes the rest in the leaf)."""
    if not topology.weights.relay or not any(i.kind == "publisher" for i in topology.instances()):
        return []
    return [r.name for r in topology.regions if r.link is not None and r.role != "hub"]


@dataclass(frozen=True, slots=True)
class _Added:
    """An actor instance the launcher adds to the topology's own (a weights relay)."""

    region: str
    kind: str
    actor_id: str
    torch_threads: int = 1


def rank_id(trainer_id: str, rank: int) -> str:
    """The actor id of rank `rank` (>= 1) of the trainer `trainer_id` (rank 0 is the trainer itself)."""
    return f"{trainer_id}-rank{rank}"


def _instances(topology: Topology) -> list[tuple[Any, str, str, dict[str, str], str]]:
    """(instance, actor id, kind, rank environment, group) of every process to start: a trainer of
    `[trainer] world_size = N` is N processes, rank 0 (the trainer) and `trainer_rank` ranks 1..N-1, one group;
    then a `weights_relay` in each of `relayed_regions`, `<leaf>-weights_relay-0`."""
    out: list[tuple[Any, str, str, dict[str, str], str]] = []
    world = topology.trainer.world_size
    for inst in topology.instances():
        if inst.kind != "trainer" or world == 1:
            out.append((inst, inst.actor_id, inst.kind, {}, ""))
            continue
        for rank in range(world):
            env = {RANK_ENV: str(rank), WORLD_ENV: str(world),
                   TIMEOUT_ENV: str(topology.trainer.collective_timeout_s)}
            out.append((inst, rank_id(inst.actor_id, rank) if rank else inst.actor_id,
                        "trainer_rank" if rank else "trainer", env, inst.actor_id))
    for leaf in relayed_regions(topology):
        relay = _Added(region=leaf, kind="weights_relay", actor_id=f"{leaf}-weights_relay-0")
        out.append((relay, relay.actor_id, relay.kind, {}, ""))
    return out


def actor_specs(topology: Topology, endpoints: Endpoints, *, heartbeat_s: float = 2.0,
                drain_s: float = 10.0, state_dir: Path | None = None) -> list[ProcessSpec]:
    """One ProcessSpec per actor process of the topology (a trainer's ranks: one each, in one restart group)."""
    specs = []
    for inst, actor_id, kind, rank_env, group in _instances(topology):
        region = topology.region(inst.region)
        role = ROLE_OF_KIND[kind]
        args = ["--kind", kind, "--run", topology.run, "--region", inst.region, "--id", actor_id,
                "--domain", endpoints.domains[inst.region], "--role", role,
                "--settings", json.dumps(kind_settings(topology, inst.kind)),
                "--heartbeat-s", str(heartbeat_s), "--drain-s", str(drain_s)]
        launch = kind_launch(topology, inst.kind, state_dir, inst.torch_threads)
        if launch is not None:
            args += ["--launch", msgspec.json.encode(launch).decode()]
        for url in endpoints.urls[inst.region]:
            args += ["--url", url]
        creds = endpoints.credentials[inst.region]
        if creds is not None:
            args += ["--credentials", str(creds)]
        if endpoints.tls_ca is not None:
            args += ["--tls-ca", str(endpoints.tls_ca)]
        env = {"OMP_NUM_THREADS": str(inst.torch_threads), "RLBUS_TORCH_THREADS": str(inst.torch_threads),
               **rank_env}
        specs.append(ProcessSpec(actor_id=actor_id, kind=kind, region=inst.region, args=tuple(args),
                                 env=env, resource=region.resource, netns=endpoints.netns.get(inst.region, ""),
                                 group=group))
    return specs


def stream_settings(topology: Topology) -> StreamSettings:
    """Stream settings from the topology's durability and retention sections (`redeliver_after`: both ack waits)."""
    redeliver_after_s = parse_duration(topology.durability.redeliver_after)
    return StreamSettings(
        ack_wait_s=redeliver_after_s,
        trainer_ack_wait_s=redeliver_after_s,
        rollout_max_age_s=parse_duration(topology.retention.rollouts_max_age),
        health_max_age_s=parse_duration(topology.retention.health_max_age),
        events_max_age_s=parse_duration(topology.retention.events_max_age),
        replicas=topology.durability.replicas,
        weights_keep=topology.weights.keep_versions,
    )


class Launch:
    """One run of a topology on this machine (servers, streams, actors); use `async with Launch.open(...)`."""

    def __init__(self, topology: Topology, state_dir: Path, endpoints: Endpoints, regions: RegionSet | None,
                 admin: Bus) -> None:
        self.topology = topology
        self.state_dir = state_dir
        self.endpoints = endpoints
        self.regions = regions
        self.admin = admin
        self.supervisor: Any = None

    @classmethod
    @asynccontextmanager
    async def open(cls, topology: Topology, *, state_dir: Path | None = None, fresh: bool = False,
                   relay: bool = False) -> AsyncIterator[Launch]:
        """Start (or resume, or join) the run's servers and streams; stop the embedded servers on exit.

        `relay`: join each embedded leaf to the hub through a cuttable relay, so `launch.regions.cut(leaf)`
        partitions it (`rlbus chaos`); ignored when the servers are not embedded. Leaves with `[regions.link]`
        run in network namespaces behind shaped links (`launch.regions.links`), their local actors with them.
        `[durability] replicas` above 1 makes every embedded region a JetStream cluster (`RegionSet.nodes_for`);
        every client is given all of its region's node URLs."""
        state = (state_dir or topology.state_path).resolve()
        if fresh and state.exists():
            shutil.rmtree(state)
        state.mkdir(parents=True, exist_ok=True)
        names = [r.name for r in topology.regions]
        regions: RegionSet | None = None
        if all(r.embedded for r in topology.regions):
            sync = None if topology.durability.sync_interval == "default" else topology.durability.sync_interval
            tls = embedded_tls(topology)
            nodes = RegionSet.nodes_for(topology.durability.replicas)
            regions = await anyio.to_thread.run_sync(
                lambda: RegionSet.start(state / "nats", names, topology.hub.name, sync_interval=sync,
                                        run=topology.run, relay=relay, tls=tls, links=topology.link_shapes(),
                                        nodes=nodes))
            creds_file: Path | None = state / "nats" / CREDENTIALS_NAME
            endpoints = Endpoints(urls={n: regions.urls(n) for n in names}, domains={n: n for n in names},
                                  hub=topology.hub.name, credentials={n: creds_file for n in names},
                                  tls_ca=regions.tls.ca if regions.tls is not None else None,
                                  netns={n: ns for n in names if (ns := regions.netns(n)) is not None})
        else:
            ca = topology.tls.ca_file if topology.tls.enabled else None
            endpoints = Endpoints(
                urls={r.name: tuple(r.nats_urls) for r in topology.regions}, domains={n: n for n in names},
                hub=topology.hub.name, credentials={r.name: _external_credentials(r.credentials_file,
                                                                                  r.credentials_env)
                                                    for r in topology.regions},
                tls_ca=Path(ca).resolve() if ca is not None else None)  # noqa: ASYNC240 - once, at start
        write_run_file(state / RUN_FILE, topology.run, endpoints)
        try:
            admin = await _admin_bus(topology, endpoints)
            try:
                await provision_all(lambda region: _admin_connect(endpoints, region), admin.subjects,
                                    hub=topology.hub.name, regions=endpoints.domains,
                                    settings=stream_settings(topology))
                for name in names:      # interest in a new stream crosses the leaf links a moment later
                    await wait_routable(admin.nc, admin.subjects.tasks(name))
                yield cls(topology, state, endpoints, regions, admin)
            finally:
                await admin.close()
        finally:
            if regions is not None:
                await anyio.to_thread.run_sync(regions.stop)

    async def run_actors(self, *, backend: str | None = None, heartbeat_s: float = 2.0,
                         worker_setup: Callable[[], None] | None = None,
                         task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every actor through the backend until cancelled; stopping drains them.

        `worker_setup` runs first in every Ray worker (e.g. logging configuration)."""
        specs = actor_specs(self.topology, self.endpoints, heartbeat_s=heartbeat_s, state_dir=self.state_dir)
        r = self.topology.restart
        policy = RestartPolicy(max_restarts=r.max_restarts, window_s=r.window_s,
                               backoff_initial_s=r.backoff_initial_s, backoff_max_s=r.backoff_max_s)
        chosen = backend or self.topology.launch.backend
        if chosen == "ray":
            from rlbus.topology.backends.ray_cluster import RayBackend

            self.supervisor = RayBackend(specs, policy=policy, address=self.topology.launch.ray_address,
                                         on_event=self._event, worker_setup=worker_setup)
        else:
            self.supervisor = LocalSupervisor(specs, policy=policy, log_dir=self.state_dir / "logs",
                                              on_event=self._event)
        await self.supervisor.run(task_status=task_status)

    async def _event(self, kind: str, spec: ProcessSpec, detail: str) -> None:
        await self.admin.event(Event(event=kind, actor_id=spec.actor_id, actor_kind=spec.kind,  # type: ignore[arg-type]
                                     region=spec.region, detail=detail))


def embedded_tls(topology: Topology) -> bool | TlsFiles:
    """What `RegionSet.start(tls=...)` gets from `[tls]`: False (off), True (generate a CA and certificate under
    the state directory), or the operator's own files (resolved from the working directory)."""
    tls = topology.tls
    if not tls.enabled:
        return False
    if tls.ca_file is None or tls.cert_file is None or tls.key_file is None:
        return True      # a checked topology has all three files or none
    return TlsFiles(ca=Path(tls.ca_file).resolve(), cert=Path(tls.cert_file).resolve(),
                    key=Path(tls.key_file).resolve())


def write_run_file(path: Path, run: str, endpoints: Endpoints) -> None:
    """`{run, hub, urls: {region: [url]}, domains, credentials: {region: path|null}, tls_ca: path|null}`,
    replaced atomically."""
    doc = {"run": run, "hub": endpoints.hub, "urls": {r: list(u) for r, u in endpoints.urls.items()},
           "domains": dict(endpoints.domains),
           "credentials": {r: None if c is None else str(c.resolve()) for r, c in endpoints.credentials.items()},
           "tls_ca": None if endpoints.tls_ca is None else str(endpoints.tls_ca)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def _admin_credentials(endpoints: Endpoints, region: str) -> tuple[str | None, str | None]:
    creds = endpoints.credentials[region]
    if creds is None:
        return None, None
    entry = json.loads(creds.read_text()).get("admin")
    if entry is None:
        raise TopologyError(f"{creds}: no admin credentials; `rlbus up` needs them to provision streams and "
                            f"record events")
    return str(entry["user"]), str(entry["password"])


async def _admin_connect(endpoints: Endpoints, region: str) -> nats.aio.client.Client:
    user, password = _admin_credentials(endpoints, region)
    tls = client_context(endpoints.tls_ca) if endpoints.tls_ca is not None else None
    return await nats.connect(list(endpoints.urls[region]), user=user, password=password, connect_timeout=5,
                              max_reconnect_attempts=3, tls=tls)


async def _admin_bus(topology: Topology, endpoints: Endpoints) -> Bus:
    hub = topology.hub.name
    user, password = _admin_credentials(endpoints, hub)
    return await Bus.connect(list(endpoints.urls[hub]), run=topology.run,
                             identity=Identity(actor_id="launcher", kind="launcher", region=hub),
                             domain=endpoints.domains[hub],
                             options=ConnectOptions(user=user, password=password, role="admin",
                                                    tls_ca_file=None if endpoints.tls_ca is None
                                                    else str(endpoints.tls_ca)))


def _external_credentials(path: str | None, env: str | None) -> Path | None:
    if path is not None:
        return Path(path)
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise TopologyError(f"credentials_env {env!r} is not set; export it with the path of the region's "
                                f"credentials file")
        return Path(value)
    return None
