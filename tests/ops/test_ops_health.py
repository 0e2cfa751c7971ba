"""`rlbus health`: the model's verdicts on hand-made heartbeats, and against a real server — a live actor
shows up, a SIGKILLed actor process is dead past its deadline (`--once --json` exits 1), an idle actor
is stalled, and the Prometheus scrape parses with prometheus-client's own parser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import eventually
from helpers.ops import json_in, provision_single, run_cli, target_of, url_args, write_credentials
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.demo import DemoConfig, DemoProducer
from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Event, Heartbeat
from rlbus.ops.health.model import BusHealth, HealthModel, HealthRules, Snapshot
from rlbus.ops.health.view import registry_for, render_table, serve_metrics, to_json
from rlbus.ops.health.watch import HealthWatch
from rlbus.topology.network.servers import EmbeddedServer

FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=1.0)
RULES = ["--min-deadline-s", "1", "--stall-s", "1.5", "--settle-s", "0.3"]


# ---- the model, by hand --------------------------------------------------------------------------------
def _hb(actor: str = "a", *, at: float, state: str = "ready", counters: dict[str, int] | None = None,
        version: int | None = None, pid: int = 10, restarts: int = 0, kind: str = "k",
        gauges: dict[str, float] | None = None) -> Heartbeat:
    return Heartbeat(actor_id=actor, actor_kind=kind, region="hub", state=state, counters=counters or {},
                     policy_version=version, pid=pid, restarts=restarts, sent_at=at, gauges=gauges or {})


def _feed(model: HealthModel, beats: list[Heartbeat]) -> None:
    for hb in beats:
        model.observe(hb, hb.sent_at)


def test_deadline_is_k_times_the_median_interval_with_a_floor() -> None:
    """Gaps 1.0, 1.2, 0.8 → interval 1.0 → deadline max(3 × 1.0, 3) = 3; gaps of 2 s → 6 s; dead only past it."""
    model = HealthModel(HealthRules(deadline_factor=3, min_deadline_s=3, stall_s=0))
    _feed(model, [_hb(at=t) for t in (100.0, 101.0, 102.2, 103.0)])
    assert model.interval("a") == 1.0
    assert model.judge("a", 105.9).status == "ok"
    dead = model.judge("a", 106.1)
    assert (dead.status, dead.deadline_s, dead.age_s) == ("dead", 3.0, 3.1)
    _feed(model, [_hb("b", at=t) for t in (0.0, 2.0, 4.0)])
    assert model.judge("b", 4.0).deadline_s == 6.0
    _feed(model, [_hb("c", at=0.0)])
    assert model.judge("c", 0.0).deadline_s == 6.0          # default interval 2 s until two beats were seen


def test_stalled_lagging_restarting_failed_and_stopped() -> None:
    """Each verdict from hand-made beats, and problems sort first (dead, failed, stalled, lagging, restarting)."""
    model = HealthModel(HealthRules(stall_s=10, lag_versions=2, restart_window_s=30, min_deadline_s=3))
    _feed(model, [_hb("stuck", at=t, counters={"n": 5}) for t in range(0, 12)])
    _feed(model, [_hb("busy", at=t, counters={"n": t}, version=8) for t in range(0, 12)])
    _feed(model, [_hb("old", at=t, counters={"n": t}, version=7) for t in range(0, 12)])
    _feed(model, [_hb("boot", at=0.0, counters={"n": 0}), _hb("boot", at=1.0, counters={"n": 1}),
                  _hb("boot", at=2.0, counters={"n": 0}, pid=11, restarts=1)]
          + [_hb("boot", at=float(t), counters={"n": t}, pid=11, restarts=1) for t in range(3, 12)])
    _feed(model, [_hb("done", at=0.0), _hb("done", at=1.0, state="stopped")])
    _feed(model, [_hb("gone", at=t) for t in range(0, 12)])
    model.observe_event(Event(event="failed", actor_id="gone", detail="restart policy exhausted"), 11.5)
    model.observe_version(10)                                # a WeightManifest of version 10
    v = {h.actor_id: h for h in model.verdicts(11.5)}
    assert v["stuck"].problems == ["stalled"] and v["stuck"].no_progress_s == 11.5
    assert (v["busy"].status, v["busy"].lag) == ("ok", 2)
    assert (v["old"].status, v["old"].lag) == ("lagging", 3)
    assert v["boot"].problems == ["restarting"] and v["boot"].restarts == 1
    assert v["done"].status == "stopped" and model.judge("done", 1000.0).status == "stopped"   # silent, not dead
    assert (v["gone"].status, v["gone"].last_error) == ("failed", "restart policy exhausted")
    order = [h.actor_id for h in model.verdicts(11.5)]
    assert order == ["gone", "stuck", "old", "boot", "busy", "done"]
    assert model.judge("boot", 2.0 + 31).problems == ["dead"]   # restart window over; silent since 11 s


def test_an_actor_on_a_schedule_lags_only_past_its_schedule() -> None:
    """An evaluator scoring one version per block of 50 (it says so in its `every_versions` gauge) reports the
    version it last scored: 20 or 52 versions behind the newest is its schedule plus the usual slack of 2, not
    lagging; 53 is. A generator equally far behind lags as before, and a gauge of 0 means no schedule."""
    model = HealthModel(HealthRules(stall_s=0, lag_versions=2))
    for name, version in (("eval-20", 80), ("eval-52", 48), ("eval-53", 47)):
        _feed(model, [_hb(name, kind="evaluator", at=t, version=version, gauges={"every_versions": 50.0})
                      for t in (0.0, 1.0)])
    _feed(model, [_hb("gen", kind="generator", at=t, version=80) for t in (0.0, 1.0)])
    _feed(model, [_hb("zero", kind="evaluator", at=t, version=80, gauges={"every_versions": 0.0}) for t in (0.0, 1.0)])
    model.observe_version(100)
    v = {h.actor_id: h for h in model.verdicts(1.0)}
    assert [(v[a].status, v[a].lag, v[a].lag_allowed) for a in ("eval-20", "eval-52", "eval-53")] == [
        ("ok", 20, 52), ("ok", 52, 52), ("lagging", 53, 52)]
    assert (v["gen"].status, v["gen"].lag, v["gen"].lag_allowed) == ("lagging", 20, 2)
    assert (v["zero"].status, v["zero"].lag_allowed) == ("lagging", 2)
    assert model.rules.lag_allowed() == 2 and model.rules.lag_allowed(50) == 52


def test_repeated_and_older_heartbeats_change_nothing() -> None:
    """History read after live beats: a beat not newer than the last one is ignored (no zero gaps)."""
    model = HealthModel()
    _feed(model, [_hb(at=10.0), _hb(at=11.0)])
    model.observe(_hb(at=11.0), 11.0)
    model.observe(_hb(at=10.5), 12.0)
    assert model.interval("a") == 1.0 and model.tracks["a"].seen_at == 11.0


def test_a_supervisors_sessions_open_and_tool_latencies_show_in_the_table_and_json() -> None:
    """A sandbox supervisor's heartbeat gauges `sessions_open` and `tool_<name>_ms` (not `_last_ms`) become the
    verdict's `sessions_open` and `tool_ms`, in `--json` and in the table's sessions column; an actor without them
    shows none."""
    model = HealthModel()
    _feed(model, [_hb("sb", at=10.0, kind="sandbox", gauges={"sessions_open": 3.0, "tool_read_file_ms": 0.8,
                                                             "tool_read_file_last_ms": 2.5, "tool_run_ms": 4.1}),
                  _hb("g", at=10.0, kind="generator", gauges={"tokens_per_s": 9.0})])
    sandbox, gen = model.judge("sb", 10.5), model.judge("g", 10.5)
    assert (sandbox.sessions_open, sandbox.tool_ms) == (3, {"read_file": 0.8, "run": 4.1})
    assert (gen.sessions_open, gen.tool_ms) == (None, {})
    snap = Snapshot(run="r", hub="hub", at=10.5, actors=[sandbox, gen], bus=BusHealth(regions=[]),
                    newest_policy_version=None)
    doc = json.loads(json.dumps(to_json(snap)))
    assert [(a["sessions_open"], a["tool_ms"]) for a in doc["actors"]] == [(3, {"read_file": 0.8, "run": 4.1}),
                                                                          (None, {})]
    console = Console(width=400, record=True)
    console.print(render_table(snap))
    rows = {line.split("│")[4].strip(): line.split("│")[10].strip() for line in console.export_text().splitlines()
            if line.count("│") > 10}
    assert rows["sb"] == "3 | read_file 0.8 run 4.1" and rows["g"] == "-"


# ---- against a real server ------------------------------------------------------------------------------
class _Idle(Actor):
    """Heartbeats but never makes progress."""

    kind = "idle"

    async def setup(self) -> None:
        pass

    async def run(self) -> None:
        await anyio.sleep_forever()


async def _wait_beat(bus: Bus, actor: str, timeout_s: float = 30) -> Heartbeat:
    sub = await bus.nc.subscribe(bus.subjects.all_health())
    try:
        with anyio.fail_after(timeout_s):
            async for msg in sub.messages:
                hb = codec.decode_as(msg.data, msg.headers, Heartbeat)
                if hb.actor_id == actor and hb.state == "ready":
                    return hb
    finally:
        await sub.unsubscribe()
    raise AssertionError("unreachable")


async def _snapshot(server: EmbeddedServer, run: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(run_cli, ["health", *url_args(server, run), "--once", "--json", *RULES])
    doc = json_in(capsys.readouterr().out)
    return code, doc


@pytest.fixture
async def live(admin_bus: Bus) -> AsyncIterator[Bus]:
    """A provisioned single-server run with an in-process producer (`p1`) and an idle actor (`i1`)."""
    await provision_single(admin_bus)
    run = admin_bus.subjects.run
    async with anyio.create_task_group() as tg:
        tg.start_soon(DemoProducer(ActorId(run, "hub", "demo_producer", "p1"), admin_bus,
                                   DemoConfig(rate_per_s=20, tokens=8), FAST).serve)
        tg.start_soon(_Idle(ActorId(run, "hub", "idle", "i1"), admin_bus, FAST).serve)
        yield admin_bus
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.chaos
async def test_sigkilled_actor_is_dead_and_once_json_exits_1(live: Bus, nats_server: EmbeddedServer,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A live actor process shows up ok; SIGKILLed, it is dead once its deadline passed and --once exits 1."""
    run = live.subjects.run
    creds = write_credentials(nats_server, tmp_path / "credentials.json", ["generator"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus.ops.actor", "--kind", "demo_producer", "--run", run, "--region", "hub",
         "--id", "victim", "--url", nats_server.url, "--role", "generator", "--credentials", str(creds),
         "--heartbeat-s", "0.2", "--settings", json.dumps({"rate_per_s": 5, "tokens": 8})],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        beat = await _wait_beat(live, "victim")
        assert beat.pid == proc.pid

        def victim_and_p1_ok(found: tuple[int, dict[str, Any]]) -> bool:     # past the settle time, both beating
            seen = {a["actor_id"]: a for a in found[1]["actors"]}
            return (all(seen.get(a, {}).get("status") == "ok" for a in ("victim", "p1"))
                    and seen["p1"]["counters"].get("published", 0) > 0)
        code, doc = await eventually(lambda: _snapshot(nats_server, run, capsys), victim_and_p1_ok,
                                     what="the victim and p1 ok in a snapshot, p1 having published")
        actors = {a["actor_id"]: a for a in doc["actors"]}
        assert code == 0 and doc["dead"] is False
        assert actors["victim"]["status"] == "ok" and actors["victim"]["pid"] == proc.pid
        assert actors["p1"]["status"] == "ok" and actors["p1"]["counters"]["published"] > 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = actors["victim"]["deadline_s"]
        assert deadline == pytest.approx(max(3 * actors["victim"]["interval_s"], 1.0), abs=0.01)   # floor: 1 s

        def victim_dead_i1_stalled(found: tuple[int, dict[str, Any]]) -> bool:
            seen = {a["actor_id"]: a["status"] for a in found[1]["actors"]}
            return seen.get("victim") == "dead" and seen.get("i1") == "stalled"
        code, doc = await eventually(lambda: _snapshot(nats_server, run, capsys), victim_dead_i1_stalled,
                                     what="the victim dead past its deadline and the idle actor stalled")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    actors = {a["actor_id"]: a for a in doc["actors"]}
    assert code == 1 and doc["dead"] is True and doc["summary"]["dead"] == 1
    assert actors["victim"]["status"] == "dead" and actors["victim"]["age_s"] > deadline
    assert actors["p1"]["status"] == "ok"
    assert actors["i1"]["status"] == "stalled" and actors["i1"]["no_progress_s"] >= 1.5
    assert doc["actors"][0]["actor_id"] == "victim"        # problems first
    assert doc["bus"]["regions"][0]["region"] == "hub" and doc["bus"]["regions"][0]["reachable"] is True
    assert doc["bus"]["rollouts_stored"] > 0


@pytest.mark.anyio
async def test_prometheus_scrape_parses(live: Bus, nats_server: EmbeddedServer) -> None:
    """The metrics endpoint serves per-actor up/dead/stalled/state/counters and per-region gauges that parse."""
    run = live.subjects.run
    subject = live.subjects.health("hub", "demo_producer", "ghost")
    for _ in range(3):                      # an actor whose heartbeats stop
        await live.publish_core(subject, Heartbeat(actor_id="ghost", actor_kind="demo_producer", region="hub",
                                                   state="busy", run=run, pid=1))
        await anyio.sleep(0.2)
    await _wait_beat(live, "p1")
    target = target_of(nats_server, run)
    async with await target.connect() as bus, anyio.create_task_group() as tg:
        watch = HealthWatch(target, bus, HealthRules(min_deadline_s=1.0, stall_s=60))
        await watch.load()
        tg.start_soon(watch.follow)
        await watch.probe()

        def ghost_dead_p1_up() -> Snapshot | None:          # the ghost's last beat older than its 1 s deadline
            snap = watch.snapshot()
            status = {a.actor_id: a.status for a in snap.actors}
            return snap if status.get("ghost") == "dead" and status.get("p1") == "ok" else None
        snap = await eventually(ghost_dead_p1_up, what="the ghost dead and p1 ok in the watch")
        port = await tg.start(lambda task_status: serve_metrics(registry_for(lambda: snap), 0, host="127.0.0.1",
                                                                 task_status=task_status))
        text = await anyio.to_thread.run_sync(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
        tg.cancel_scope.cancel()
        await watch.aclose()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, **labels: str) -> float:
        found = [s.value for s in families[name].samples if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return float(found[0])

    assert value("rlbus_actor_up", actor="p1", run=run, region="hub", kind="demo_producer") == 1.0
    assert value("rlbus_actor_up", actor="ghost") == 0.0
    assert value("rlbus_actor_dead", actor="ghost") == 1.0 and value("rlbus_actor_dead", actor="p1") == 0.0
    assert value("rlbus_actor_stalled", actor="p1") == 0.0
    assert value("rlbus_actor_state", actor="ghost", state="busy") == 1.0
    assert value("rlbus_actor_state", actor="ghost", state="ready") == 0.0
    assert value("rlbus_actor_counter", actor="p1", counter="published") >= 1.0
    assert value("rlbus_actor_restarts", actor="p1") == 0.0
    assert value("rlbus_region_up", region="hub") == 1.0
    assert value("rlbus_region_tasks_pending", region="hub") == 0.0
    assert value("rlbus_rollouts_stored", run=run) >= 1.0
    assert value("rlbus_dead_letters", run=run) == 0.0
    assert value("rlbus_actors", status="dead") == 1.0
