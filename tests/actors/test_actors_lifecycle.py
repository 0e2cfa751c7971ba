"""Actor lifecycle against a real server: heartbeats, ready/busy, SIGTERM → draining → stopped with a
final heartbeat, failures reported as failed, and NATS service discovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import anyio
import pytest
from nats.js.api import StreamConfig

from rlbus.actors.base import Actor, ActorId, ActorLimits, State
from rlbus.actors.demo import DemoConfig, DemoProducer
from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Heartbeat
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=2.0)


async def _streams(bus: Bus) -> None:
    s = bus.subjects
    await bus.js.add_stream(StreamConfig(name=s.rollouts_stream("hub"), subjects=[s.rollouts("hub")]))
    await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))


class _Boom(Actor):
    kind = "boom"

    async def setup(self) -> None:
        pass

    async def run(self) -> None:
        await anyio.sleep(0.5)
        raise RuntimeError("kaput")


class _BadSetup(_Boom):
    async def setup(self) -> None:
        raise OSError("no weights file")


async def _heartbeats(bus: Bus, actor: str, until: set[str], timeout_s: float = 20) -> list[str]:
    """States of an actor's heartbeats, in order, until one of `until` is seen."""
    sub = await bus.nc.subscribe(bus.subjects.all_health())
    states: list[str] = []
    try:
        with anyio.fail_after(timeout_s):
            async for msg in sub.messages:
                hb = codec.decode_as(msg.data, msg.headers, Heartbeat)
                if hb.actor_id == actor:
                    states.append(hb.state)
                    if hb.state in until:
                        return states
    finally:
        await sub.unsubscribe()
    return states


async def test_heartbeats_ready_and_graceful_stop(admin_bus: Bus) -> None:
    """A served actor heartbeats ready/busy; cancelling it drains and the last heartbeat says stopped."""
    await _streams(admin_bus)
    actor = DemoProducer(ActorId(admin_bus.subjects.run, "hub", "demo_producer", "p1"), admin_bus,
                         DemoConfig(rate_per_s=50, tokens=10), FAST)
    states: list[str] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            states.extend(await _heartbeats(admin_bus, "p1", {"stopped", "failed"}))
        tg.start_soon(watch)
        await anyio.sleep(0.1)
        with anyio.CancelScope() as scope:
            async def stop_later() -> None:
                await anyio.sleep(1.0)
                scope.cancel()
            tg.start_soon(stop_later)
            await actor.serve()
    assert actor.state is State.STOPPED
    assert states[-1] == "stopped" and "draining" in states
    assert set(states[:-2]) <= {"ready", "busy"} and states[:-2]
    assert actor.counters["published"] > 5


async def test_exception_in_run_gives_failed(admin_bus: Bus) -> None:
    """run() raising ends in FAILED, with a final failed heartbeat carrying the error."""
    await _streams(admin_bus)
    actor = _Boom(ActorId(admin_bus.subjects.run, "hub", "boom", "b1"), admin_bus, FAST)
    states: list[str] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            states.extend(await _heartbeats(admin_bus, "b1", {"failed", "stopped"}))
        tg.start_soon(watch)
        await anyio.sleep(0.1)
        with pytest.raises(ExceptionGroup) as info:
            await actor.serve()
    assert info.group_contains(RuntimeError, match="kaput")
    assert actor.state is State.FAILED and "kaput" in actor.last_error
    assert states[-1] == "failed"


async def test_setup_failure_never_reaches_ready(admin_bus: Bus) -> None:
    """A setup() error propagates out of tg.start(): the starter learns at once, state is failed."""
    await _streams(admin_bus)
    actor = _BadSetup(ActorId(admin_bus.subjects.run, "hub", "boom", "b2"), admin_bus, FAST)
    with pytest.raises(BaseException) as info:
        async with anyio.create_task_group() as tg:
            await tg.start(actor.serve)
    assert "no weights file" in repr(info.value.exceptions if hasattr(info.value, "exceptions") else info.value)
    assert actor.state is State.FAILED


async def test_actor_answers_service_discovery(admin_bus: Bus) -> None:
    """$SRV.PING/INFO find a running actor with its kind, and the status endpoint returns its heartbeat."""
    await _streams(admin_bus)
    actor = DemoProducer(ActorId(admin_bus.subjects.run, "hub", "demo_producer", "p9"), admin_bus,
                         DemoConfig(rate_per_s=5, tokens=10), FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.serve)
        ping = json.loads((await admin_bus.nc.request("$SRV.PING.rlbus-demo_producer", b"", timeout=5)).data)
        info = json.loads((await admin_bus.nc.request("$SRV.INFO.rlbus-demo_producer", b"", timeout=5)).data)
        status = await admin_bus.nc.request(admin_bus.subjects.service_status("demo_producer", "p9"), b"", timeout=5)
        tg.cancel_scope.cancel()
    assert ping["name"] == "rlbus-demo_producer"
    assert info["metadata"]["actor"] == "p9"
    assert json.loads(status.data)["actor_id"] == "p9"


async def test_sigterm_to_actor_process_drains_to_stopped(admin_bus: Bus, nats_server: EmbeddedServer) -> None:
    """SIGTERM to an actor process: heartbeats go draining → stopped, the process exits 0."""
    await _streams(admin_bus)
    cred = nats_server.credential("generator")
    env = {**os.environ, "RLBUS_NATS_USER": cred.user, "RLBUS_NATS_PASSWORD": cred.password}
    cmd = [sys.executable, "-m", "rlbus.ops.actor", "--kind", "demo_producer", "--run", admin_bus.subjects.run,
           "--region", "hub", "--id", "proc1", "--url", nats_server.url, "--heartbeat-s", "0.2",
           "--settings", json.dumps({"rate_per_s": 20, "tokens": 10})]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with anyio.create_task_group() as tg:
            states: list[str] = []

            async def watch() -> None:
                sub = await admin_bus.nc.subscribe(admin_bus.subjects.health("hub", "demo_producer", "proc1"))
                try:
                    async for msg in sub.messages:
                        states.append(codec.decode_as(msg.data, msg.headers, Heartbeat).state)
                        if states[-1] in ("stopped", "failed"):
                            return
                finally:
                    await sub.unsubscribe()
            tg.start_soon(watch)
            with anyio.fail_after(60):
                while not {"ready", "busy"} & set(states):
                    await anyio.sleep(0.1)        # hang guard only: the watcher fills `states`
            os.kill(proc.pid, signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    assert states[-1] == "stopped"
    assert "draining" in states
    stored = (await admin_bus.js.stream_info(admin_bus.subjects.rollouts_stream("hub"))).state.messages
    assert stored > 0
