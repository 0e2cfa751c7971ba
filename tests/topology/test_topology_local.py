"""The local backend on a real 3-region embedded bus: a SIGKILLed actor is restarted with an Event and
the others are undisturbed; past the restart policy it is failed and the run keeps its other actors;
`rlbus up` starts and stops cleanly and leaves no process behind, for the bus demo and for the RL job on a
Hugging Face policy with a generator in every region."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import anyio
import msgspec
import pytest
from helpers import eventually_sync, new_run
from helpers.hf import build_family

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Event
from rlbus.topology.backends.launch import Launch, actor_specs
from rlbus.topology.backends.local import LocalSupervisor, ProcessSpec, RestartPolicy
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load
from rlbus.topology.file.schema import RestartSettings, Topology

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]


def _demo(tmp_path: Path, max_restarts: int) -> Topology:
    topology = load(example_path("demo"))
    return msgspec.structs.replace(
        topology, run=new_run(), state_dir=str(tmp_path / "state"),
        restart=RestartSettings(max_restarts=max_restarts, window_s=120, backoff_initial_s=0.2, backoff_max_s=0.5))


async def _next_event(bus: Bus, psub: object, kind: str, actor: str, timeout_s: float = 30) -> Event:
    with anyio.fail_after(timeout_s):
        while True:
            try:
                msgs = await psub.fetch(10, timeout=1)  # type: ignore[attr-defined]
            except Exception:   # nats TimeoutError: nothing yet
                continue
            for msg in msgs:
                await msg.ack()
                event = codec.decode_as(msg.data, msg.headers, Event)
                if event.event == kind and event.actor_id == actor:
                    return event


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_sigkilled_actor_restarts_then_fails_past_policy(tmp_path: Path) -> None:
    """SIGKILL → restarted (Event), others keep their PIDs; the second kill exhausts max_restarts=1 → failed."""
    topology = _demo(tmp_path, max_restarts=1)
    async with Launch.open(topology) as launch, anyio.create_task_group() as tg:
        await tg.start(lambda task_status: launch.run_actors(heartbeat_s=0.5, task_status=task_status))
        events = await launch.admin.js.pull_subscribe(launch.admin.subjects.all_events(), durable="t",
                                                      stream=launch.admin.subjects.events_stream())
        sup = launch.supervisor
        before = sup.pids()
        victim = "eu-demo_producer-0"
        os.kill(before[victim], signal.SIGKILL)
        restarted = await _next_event(launch.admin, events, "restarted", victim)
        assert "SIGKILL" in restarted.detail
        after = sup.pids()
        assert after[victim] != before[victim]
        assert {k: v for k, v in after.items() if k != victim} == {k: v for k, v in before.items() if k != victim}
        os.kill(after[victim], signal.SIGKILL)
        failed = await _next_event(launch.admin, events, "failed", victim)
        assert "restart policy" in failed.detail
        assert sup.actors[victim].state == "failed"
        others = {k: v for k, v in sup.pids().items()}
        assert victim not in others and set(others) == set(before) - {victim}
        assert all(_alive(pid) for pid in others.values())
        tg.cancel_scope.cancel()
    assert not any(_alive(pid) for pid in before.values())


def _rendezvous(pid: int) -> str:
    env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RLBUS_RENDEZVOUS=")), "")


async def test_a_restart_group_goes_down_and_up_together_on_a_fresh_rendezvous(tmp_path: Path) -> None:
    """Two actors in one restart group (how a trainer's ranks run) share a rendezvous address; SIGKILL of one
    takes the other down too, both restart (new pids, one new shared rendezvous), and the actors outside the
    group keep their pids."""
    topology = _demo(tmp_path, max_restarts=2)
    seen: list[tuple[str, str]] = []

    async def sink(kind: str, spec: ProcessSpec, detail: str) -> None:
        seen.append((kind, spec.actor_id))

    async with Launch.open(topology) as launch, anyio.create_task_group() as tg:
        specs = actor_specs(topology, launch.endpoints, heartbeat_s=0.5, state_dir=launch.state_dir)
        members = [replace(spec, group="g") for spec in specs if spec.kind == "demo_producer"][:2]
        others = [spec for spec in specs if spec.actor_id not in {m.actor_id for m in members}]
        sup = LocalSupervisor([*members, *others], policy=RestartPolicy(max_restarts=2, backoff_initial_s=0.1),
                              log_dir=tmp_path / "logs", on_event=sink)
        await tg.start(sup.run)
        before = sup.pids()
        a, b = (m.actor_id for m in members)
        shared = {_rendezvous(before[a]), _rendezvous(before[b])}
        assert len(shared) == 1 and next(iter(shared)).startswith("127.0.0.1:")
        os.kill(before[b], signal.SIGKILL)
        with anyio.fail_after(30):
            while sum(k == "restarted" for k, _ in seen) < 2:
                await anyio.sleep(0.1)
        after = sup.pids()
        assert after[a] != before[a] and after[b] != before[b]
        assert not _alive(before[a]) and not _alive(before[b])
        again = {_rendezvous(after[a]), _rendezvous(after[b])}
        assert len(again) == 1 and again != shared
        assert {k: v for k, v in after.items() if k not in (a, b)} == {k: v for k, v in before.items() if k not in (a, b)}
        assert [k for k, x in seen if x == b] == ["started", "crashed", "restarted"]
        assert [k for k, x in seen if x == a] == ["started", "crashed", "restarted"]
        tg.cancel_scope.cancel()
    assert not any(_alive(pid) for pid in after.values())


LEAF = '''[[regions]]
name = "{name}"
role = "leaf"

  [[regions.actors]]
  kind = "generator"

  [[regions.actors]]
  kind = "sandbox"

'''
LEAVES = "".join(LEAF.format(name=name) for name in ("eu", "us"))


def _three_regions_hf(tmp_path: Path) -> Path:
    """tiny.toml spread over a hub and two leaves (a generator and a sandbox in each), its policy a tiny Qwen2
    Hugging Face directory given by `[policy] path` (nothing to pretrain)."""
    model = build_family(tmp_path / "models", "qwen2-tied", max_seq_len=1024)
    text = example_path("tiny").read_text().replace("[feeder]\n", LEAVES + "[feeder]\n", 1)
    text += f'\n[policy]\nkind = "hf"\npath = "{model}"\ndevice = "cpu"\n'
    path = tmp_path / "three_hf.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("stop", ["for", "sigint", pytest.param("steps-hf", marks=pytest.mark.slow)])
def test_rlbus_up_three_regions_stops_clean(tmp_path: Path, stop: str,
                                            processes_mentioning: Callable[[str], list[int]]) -> None:
    """`rlbus up` on the 3-region demo runs, stops (by --for or Ctrl-C) with exit 0, and no process survives.
    "steps-hf": the RL job in three regions on a Hugging Face policy, stopped by Ctrl-C once every region's
    generator holds the policy, built from the files and weights in its own region's store, and the trainer took
    2 steps (a fixed --steps could end the run before the slowest region's generator has loaded it); the ledger is
    clean."""
    state = tmp_path / "state"
    topology = str(_three_regions_hf(tmp_path)) if stop == "steps-hf" else "demo"
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "up", topology, "--state-dir", str(state)]
    if stop == "for":
        proc = subprocess.run([*cmd, "--for", "6"], capture_output=True, text=True, timeout=120)
        out, code = proc.stdout, proc.returncode
    elif stop == "steps-hf":
        console = tmp_path / "console.txt"
        with console.open("w") as sink:     # a file, not a pipe: nothing reads it until the run ends
            p = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.DEVNULL, text=True)
        try:
            logs = {name: state / "logs" / f"{name}.log" for name in
                    ("hub-generator-0", "eu-generator-0", "us-generator-0", "hub-trainer-0")}

            def said(name: str, event: str) -> int:
                path = logs[name]
                return path.read_text().count(f'"event": "{event}"') if path.exists() else 0

            eventually_sync(lambda: (all(said(g, "generator_weights_ready") for g in list(logs)[:3])
                            and said("hub-trainer-0", "trainer_step") >= 2) or p.poll() is not None,
                            what="every region's generator holding the policy and 2 trainer steps", timeout_s=480)
            p.send_signal(signal.SIGINT)
            code = p.wait(timeout=120)
            out = console.read_text()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    else:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            lines = []
            assert p.stdout is not None
            for line in p.stdout:                     # wait until actors report progress
                lines.append(line)
                if "published=" in line:
                    break
            p.send_signal(signal.SIGINT)
            rest, _ = p.communicate(timeout=60)
            out, code = "".join(lines) + rest, p.returncode
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code == 0, out[-3000:]
    assert "rlbus up: summary" in out
    if stop == "steps-hf":
        assert "rlbus up: run 'tiny', 3 region(s)" in out
        assert int(out.split("optimizer steps ", 1)[1].split(",", 1)[0]) >= 2
        assert "ledger (clean)" in out and "lost 0, trained twice 0" in out
        for region in ("hub", "eu", "us"):
            log = (state / "logs" / f"{region}-generator-0.log").read_text()
            ready = [line for line in log.splitlines() if "generator_weights_ready" in line]
            assert ready and all("hf policy" in line for line in ready), log[-2000:]
    else:
        if stop == "sigint":        # it waited for progress; --for may end before a slow machine's first heartbeat
            assert "demo_producer.published" in out
        assert "eu-demo_producer-0: stopped" in out and "hub-demo_consumer-0: stopped" in out
    assert processes_mentioning(str(state)) == []
