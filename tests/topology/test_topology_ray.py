"""The ray launch backend on a real 2-node Ray cluster on loopback (hub node 127.0.0.2, eu node 127.0.0.3):
actors land on the node of their region, a SIGKILLed worker's actor is restarted by Ray and heartbeats
again with a new pid, Ray giving up is reported failed, a stop drains every actor, a restart group is placed
across the nodes and restarts together, and a two-rank trainer trains across them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import msgspec
import pytest
from helpers import eventually, new_run
from nats.js.api import StreamConfig

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Heartbeat
from rlbus.topology.backends.local import ProcessSpec, RestartPolicy
from rlbus.topology.backends.ray_cluster import RayBackend
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio

HUB_IP, EU_IP = "127.0.0.2", "127.0.0.3"
# 127.0.0.1 is not usable: Ray replaces it with the machine's outward address (services.resolve_ip_for_localhost)
RAY_TEST_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # GCS settings (ray_config_def.h names): a dead node is declared dead after ~1.5 s, not ~30 s
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _group_pids(pgids: set[int]) -> set[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class RayCluster:
    """Two `ray start --block` processes, each the leader of its own process group."""

    address: str
    temp_dir: Path
    starts: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        """SIGKILL both process groups (SIGTERM makes `ray start` drain for 30 s) and reap the leaders."""
        for proc in self.starts:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.starts:
            proc.wait(timeout=30)


def _ray_start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", *args],
                                env={**os.environ, **RAY_TEST_ENV}, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A head node (region:hub) and a worker node (region:eu) on distinct loopback addresses."""
    temp = Path(tempfile.mkdtemp(prefix="rlray", dir="/tmp"))   # Ray's socket paths must stay short
    port = _free_port(HUB_IP)
    cluster = RayCluster(address=f"{HUB_IP}:{port}", temp_dir=temp)
    store = str(100 * 2**20)
    try:
        cluster.starts.append(_ray_start(
            ["--head", "--node-ip-address", HUB_IP, "--port", str(port), "--num-cpus", "1",
             "--resources", json.dumps({"region:hub": 10}), "--include-dashboard", "false",
             "--dashboard-agent-listen-port", str(_free_port(HUB_IP)), "--object-store-memory", store,
             "--temp-dir", str(temp), "--disable-usage-stats"], temp / "head.log"))
        cluster.starts.append(_ray_start(
            ["--address", cluster.address, "--node-ip-address", EU_IP, "--num-cpus", "1",
             "--resources", json.dumps({"region:eu": 10}), "--dashboard-agent-listen-port",
             str(_free_port(EU_IP)), "--object-store-memory", store, "--disable-usage-stats"], temp / "eu.log"))
        _wait_for_nodes(cluster, 2)
        yield cluster
    finally:
        pgids = {p.pid for p in cluster.starts}
        cluster.stop()
        deadline = time.monotonic() + 15
        while _group_pids(pgids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _group_pids(pgids)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes survived: {sorted(left)}"


def _wait_for_nodes(cluster: RayCluster, n: int, timeout_s: float = 90) -> None:
    """Until `ray start --block` printed its banner on both nodes (each one blocks after that)."""
    deadline = time.monotonic() + timeout_s
    logs = [cluster.temp_dir / "head.log", cluster.temp_dir / "eu.log"]
    while time.monotonic() < deadline:
        for proc, log in zip(cluster.starts, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if all("Ray runtime started" in log.read_text() for log in logs[:n]):
            return
        time.sleep(0.2)
    raise TimeoutError("the Ray nodes did not start: " + " | ".join(p.read_text()[-1500:] for p in logs))


def _specs(bus: Bus, server: EmbeddedServer, credentials: Path, names: dict[str, str]) -> list[ProcessSpec]:
    """One demo producer per (actor id → region), with fast heartbeats and a short drain."""
    return [ProcessSpec(actor_id=actor, kind="demo_producer", region=region, resource=f"region:{region}",
                        args=("--kind", "demo_producer", "--run", bus.subjects.run, "--region", region,
                              "--id", actor, "--url", server.url, "--credentials", str(credentials),
                              "--role", "generator", "--heartbeat-s", "0.3", "--drain-s", "2",
                              "--settings", json.dumps({"rate_per_s": 5, "tokens": 16})))
            for actor, region in names.items()]


async def _provision(bus: Bus, server: EmbeddedServer, tmp_path: Path, regions: list[str]) -> Path:
    s = bus.subjects
    for region in regions:
        await bus.js.add_stream(StreamConfig(name=s.rollouts_stream(region), subjects=[s.rollouts(region)]))
    await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))
    cred = server.credential("generator")
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"generator": {"user": cred.user, "password": cred.password}}))
    return path


class Watch:
    """Every heartbeat of the run and every supervisor event, in arrival order."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.events: list[tuple[str, str, str]] = []

    async def on_event(self, kind: str, spec: ProcessSpec, detail: str) -> None:
        self.events.append((kind, spec.actor_id, detail))

    async def heartbeats(self, bus: Bus, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        sub = await bus.nc.subscribe(bus.subjects.all_health())
        task_status.started()
        try:
            async for msg in sub.messages:
                self.beats.append(codec.decode_as(msg.data, msg.headers, Heartbeat))
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    def last(self, actor: str) -> Heartbeat | None:
        return next((b for b in reversed(self.beats) if b.actor_id == actor), None)


async def _until(what: Callable[[], bool], why: str, timeout_s: float = 90) -> None:
    """Hang guard only: poll `what` until true; a timeout names what was awaited."""
    await eventually(what, what=why, timeout_s=timeout_s)


def _node_resources(node_id: str) -> dict[str, float]:
    import ray

    return next(dict(n["Resources"]) for n in ray.nodes() if n["NodeID"] == node_id)


def _gcs_actor_nodes() -> dict[int, str]:
    """Pid → node id of the live actors, as the GCS actor table has them (the dashboard's state API is off)."""
    import ray._private.state

    return {int(a["Pid"]): a["Address"]["NodeID"] for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE"}


async def test_ray_actors_land_in_their_regions_and_restart(
        ray_cluster: RayCluster, nats_server: EmbeddedServer, admin_bus: Bus, tmp_path: Path) -> None:
    """Each actor runs on its region's node; a SIGKILLed worker's actor comes back with a new pid and a
    `restarted` event, the other actor undisturbed; stopping drains both to `stopped`."""
    credentials = await _provision(admin_bus, nats_server, tmp_path, ["hub", "eu"])
    specs = _specs(admin_bus, nats_server, credentials, {"hub-p-0": "hub", "eu-p-0": "eu"})
    watch = Watch()
    backend = RayBackend(specs, policy=RestartPolicy(max_restarts=2, backoff_initial_s=0.2),
                         address=ray_cluster.address, node_ip_address=HUB_IP, on_event=watch.on_event,
                         drain_timeout_s=10)
    async with anyio.create_task_group() as outer:
        await outer.start(watch.heartbeats, admin_bus)
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            placed = backend.placements
            await _until(lambda: len(placed()) == 2 and all(
                (hb := watch.last(a)) is not None and hb.pid == p.pid and hb.counters.get("published", 0) > 0
                for a, p in placed().items()), "both actors publish")

            hub, eu = placed()["hub-p-0"], placed()["eu-p-0"]
            assert (hub.node_ip, eu.node_ip) == (HUB_IP, EU_IP)
            assert "region:hub" in _node_resources(hub.node_id) and "region:eu" not in _node_resources(hub.node_id)
            assert "region:eu" in _node_resources(eu.node_id) and "region:hub" not in _node_resources(eu.node_id)
            gcs = _gcs_actor_nodes()
            assert (gcs[hub.pid], gcs[eu.pid]) == (hub.node_id, eu.node_id)
            assert sorted((k, a) for k, a, _ in watch.events) == [("started", "eu-p-0"), ("started", "hub-p-0")]

            os.kill(eu.pid, signal.SIGKILL)
            await _until(lambda: any(k == "restarted" and a == "eu-p-0" for k, a, _ in watch.events), "restarted")
            await _until(lambda: (hb := watch.last("eu-p-0")) is not None and hb.pid != eu.pid
                         and hb.counters.get("published", 0) > 0, "eu publishes again")
            again = placed()["eu-p-0"]
            assert again.pid != eu.pid and again.incarnation != eu.incarnation and again.node_id == eu.node_id
            assert watch.last("eu-p-0").restarts == 1   # type: ignore[union-attr]
            assert [k for k, a, _ in watch.events if a == "eu-p-0"] == ["started", "crashed", "restarted"]
            assert [k for k, a, _ in watch.events if a == "hub-p-0"] == ["started"]
            assert {b.pid for b in watch.beats if b.actor_id == "hub-p-0"} == {hub.pid}
            pids = {hub.pid, eu.pid, again.pid}
            tg.cancel_scope.cancel()
        await _until(lambda: {watch.last(a).state for a in ("hub-p-0", "eu-p-0")} == {"stopped"},  # type: ignore[union-attr]
                     "final heartbeats", timeout_s=10)
        outer.cancel_scope.cancel()

    assert {e.state for e in backend.actors.values()} == {"stopped"}
    await _until(lambda: not any(_alive(p) for p in pids), "Ray workers gone", timeout_s=20)


async def test_ray_gives_up_and_the_actor_is_failed(
        ray_cluster: RayCluster, nats_server: EmbeddedServer, admin_bus: Bus, tmp_path: Path) -> None:
    """With no restarts left, a killed worker's actor and an actor that fails on its own are reported
    `failed` (no restart loop); the other actor keeps running."""
    credentials = await _provision(admin_bus, nats_server, tmp_path, ["hub", "eu"])
    specs = _specs(admin_bus, nats_server, credentials, {"hub-q-0": "hub", "eu-q-0": "eu", "hub-bad-0": "hub"})
    bad = specs[2]
    specs[2] = replace(bad, args=(*bad.args, "--settings", json.dumps({"no_such_setting": 1})))
    watch = Watch()
    backend = RayBackend(specs, policy=RestartPolicy(max_restarts=0), address=ray_cluster.address,
                         node_ip_address=HUB_IP, on_event=watch.on_event, drain_timeout_s=10)
    async with anyio.create_task_group() as outer:
        await outer.start(watch.heartbeats, admin_bus)
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            await _until(lambda: {"hub-q-0", "eu-q-0"} <= set(backend.placements()), "both placed")
            victim = backend.placements()["eu-q-0"]
            os.kill(victim.pid, signal.SIGKILL)
            await _until(lambda: sum(k == "failed" for k, _, _ in watch.events) == 2, "both failed")
            assert [k for k, a, _ in watch.events if a == "eu-q-0"] == ["started", "crashed", "failed"]
            bad = [k for k, a, _ in watch.events if a == "hub-bad-0"]      # no restart loop: it ends failed
            assert bad[0] == "started" and bad[-1] == "failed" and "restarted" not in bad
            assert {a: e.state for a, e in backend.actors.items()} == {
                "hub-q-0": "running", "eu-q-0": "failed", "hub-bad-0": "failed"}
            seen = len(watch.beats)
            await _until(lambda: any(b.actor_id == "hub-q-0" for b in watch.beats[seen:]), "hub still beats")
            tg.cancel_scope.cancel()
        await _until(lambda: watch.last("hub-q-0").state == "stopped", "final heartbeat", timeout_s=10)  # type: ignore[union-attr]
        outer.cancel_scope.cancel()

    assert not _alive(victim.pid)


async def test_a_ray_restart_group_is_placed_across_nodes_and_restarts_together(
        ray_cluster: RayCluster, nats_server: EmbeddedServer, admin_bus: Bus, tmp_path: Path) -> None:
    """A restart group (how a trainer's ranks are launched) is placed by one placement group, a bundle per
    member on its region's node, and meets at a rendezvous on the first member's node; SIGKILL of the second
    member takes the first one down too, and both come back (new pids) and heartbeat again."""
    credentials = await _provision(admin_bus, nats_server, tmp_path, ["hub", "eu"])
    specs = [replace(spec, group="g") for spec in
             _specs(admin_bus, nats_server, credentials, {"hub-g-0": "hub", "eu-g-1": "eu"})]
    watch = Watch()
    backend = RayBackend(specs, policy=RestartPolicy(max_restarts=2, backoff_initial_s=0.2),
                         address=ray_cluster.address, node_ip_address=HUB_IP, on_event=watch.on_event,
                         drain_timeout_s=10)
    async with anyio.create_task_group() as outer:
        await outer.start(watch.heartbeats, admin_bus)
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            placed = backend.placements
            await _until(lambda: len(placed()) == 2 and all(
                (hb := watch.last(a)) is not None and hb.pid == p.pid for a, p in placed().items()), "both beat")
            first, second = placed()["hub-g-0"], placed()["eu-g-1"]
            assert (first.node_ip, second.node_ip) == (HUB_IP, EU_IP)
            os.kill(second.pid, signal.SIGKILL)
            await _until(lambda: sum(k == "restarted" for k, _, _ in watch.events) == 2, "both restarted")
            await _until(lambda: all((hb := watch.last(a)) is not None and hb.pid not in (first.pid, second.pid)
                                     for a in ("hub-g-0", "eu-g-1")), "both beat again from new processes")
            assert [k for k, a, _ in watch.events if a == "eu-g-1"] == ["started", "crashed", "restarted"]
            assert [k for k, a, _ in watch.events if a == "hub-g-0"] == ["started", "restarted"]
            assert placed()["hub-g-0"].node_ip == HUB_IP and placed()["eu-g-1"].node_ip == EU_IP
            pids = {first.pid, second.pid, *(p.pid for p in placed().values())}
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()
    await _until(lambda: not any(_alive(p) for p in pids), "Ray workers gone", timeout_s=20)


async def test_a_two_rank_trainer_trains_across_two_ray_nodes(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """A trainer of world size 2 launched by the Ray backend, rank 0 on the hub node and rank 1 on the eu node
    (one placement group, a bundle per rank), meets at a rendezvous on rank 0's node and trains: every TrainStep
    records world size 2, each rank heartbeats from its own node, and the version published after the steps is
    the gathered full policy."""
    from helpers.rl_bus import HUB, connect, credentials_file, provision, publish_rollouts, wait_for
    from helpers.rollouts import sample_rollouts

    from rlbus.actors.trainer.config import TrainerLaunch
    from rlbus.actors.trainer.core import build_core
    from rlbus.messages.schemas import TrainStep, VersionReady
    from rlbus.topology.backends.launch import rank_id
    from rlbus.topology.backends.local import RANK_ENV, TIMEOUT_ENV, WORLD_ENV
    from rlbus.topology.network.regions import RegionSet

    run = new_run()
    rs = RegionSet.start(tmp_path / "nats", [HUB], HUB, run=run)
    try:
        await provision(rs, run)
        settings = json.dumps({"lr": 1e-3, "batch_rollouts": 4, "staleness_versions": 8, "world_size": 2,
                               "collective_timeout_s": 30.0})
        launch = msgspec.json.encode(TrainerLaunch(checkpoint_interval=100, resume_wait_s=5.0)).decode()

        def spec(rank: int, kind: str, node: str) -> ProcessSpec:
            actor = rank_id("hub-trainer-0", rank) if rank else "hub-trainer-0"
            return ProcessSpec(
                actor_id=actor, kind=kind, region=HUB, resource=f"region:{node}", group="hub-trainer-0",
                args=("--kind", kind, "--run", run, "--region", HUB, "--id", actor, "--url", rs.url(HUB),
                      "--domain", HUB, "--role", kind, "--credentials", str(credentials_file(rs)),
                      "--settings", settings, "--launch", launch, "--heartbeat-s", "0.5", "--drain-s", "10"),
                env={"RLBUS_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", RANK_ENV: str(rank), WORLD_ENV: "2",
                     TIMEOUT_ENV: "30"})

        watch = Watch()
        backend = RayBackend([spec(0, "trainer", "hub"), spec(1, "trainer_rank", "eu")],
                             policy=RestartPolicy(max_restarts=1, backoff_initial_s=0.2),
                             address=ray_cluster.address, node_ip_address=HUB_IP, on_event=watch.on_event,
                             drain_timeout_s=20)
        source = build_core("", lr=1e-3, seed=0).model
        bus = await connect(rs, run, "generator")
        try:
            async with anyio.create_task_group() as outer:
                await outer.start(watch.heartbeats, bus)
                async with anyio.create_task_group() as tg:
                    await tg.start(backend.run)
                    await publish_rollouts(bus, sample_rollouts(source, tasks=4, group_size=2, seed=1, tag="r"))
                    steps = await wait_for(bus, TrainStep, lambda found: len(found) >= 2, timeout_s=180)
                    versions = await wait_for(bus, VersionReady, lambda found: len(found) >= 3, timeout_s=60)
                    placed = backend.placements()
                    assert placed["hub-trainer-0"].node_ip == HUB_IP
                    assert placed["hub-trainer-0-rank1"].node_ip == EU_IP
                    beats = {b.actor_id: b for b in watch.beats}
                    assert beats["hub-trainer-0-rank1"].gauges.get("rank") == 1.0
                    assert beats["hub-trainer-0-rank1"].pid == placed["hub-trainer-0-rank1"].pid
                    assert not any(k in ("crashed", "restarted", "failed") for k, _, _ in watch.events), watch.events
                    tg.cancel_scope.cancel()
                outer.cancel_scope.cancel()
        finally:
            await bus.close()
        assert [s.world_size for s in steps] == [2] * len(steps) and len(steps) >= 2
        assert sorted(v.version for v in versions)[:3] == [0, 1, 2]
        assert versions[0].model_config == build_core("", lr=1e-3, seed=0).model_config_dict()
    finally:
        rs.stop()


def _children() -> set[int]:
    """Live (non-zombie) child processes of this test process."""
    mine = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and fields[0] != "Z" and fields[1] == mine:
            found.add(int(entry.name))
    return found


async def test_ray_backend_starts_and_shuts_down_a_local_cluster(
        nats_server: EmbeddedServer, admin_bus: Bus, tmp_path: Path) -> None:
    """Without an address the backend starts a local Ray cluster declaring the regions' resources, runs the
    actor there, and on stop drains it and shuts the cluster down: no process it started is left."""
    credentials = await _provision(admin_bus, nats_server, tmp_path, ["hub"])
    specs = _specs(admin_bus, nats_server, credentials, {"hub-l-0": "hub"})
    before = _children()
    watch = Watch()
    backend = RayBackend(specs, policy=RestartPolicy(), num_cpus=1, on_event=watch.on_event, drain_timeout_s=10,
                         temp_dir=Path(tempfile.mkdtemp(prefix="rlray", dir="/tmp")))
    assert backend.temp_dir is not None
    try:
        async with anyio.create_task_group() as outer:
            await outer.start(watch.heartbeats, admin_bus)
            async with anyio.create_task_group() as tg:
                await tg.start(backend.run)
                await _until(lambda: (hb := watch.last("hub-l-0")) is not None and hb.counters.get("published", 0) > 0,
                             "the actor publishes")
                import ray

                assert ray.cluster_resources()["region:hub"] == 100
                started = _children() - before
                assert started   # gcs_server, raylet, ... are children of this process
                tg.cancel_scope.cancel()
            await _until(lambda: watch.last("hub-l-0").state == "stopped", "final heartbeat", timeout_s=10)  # type: ignore[union-attr]
            outer.cancel_scope.cancel()
        assert not ray.is_initialized()
        await _until(lambda: not (_children() - before), "the local Ray cluster is gone", timeout_s=20)
        assert [k for k, _, _ in watch.events] == ["started"]
    finally:
        shutil.rmtree(backend.temp_dir, ignore_errors=True)
