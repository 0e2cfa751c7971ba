"""What the generator tests share: a module's embedded nats-server that grants its runs' buckets to the roles
(`server_fixture`), a provisioned run of one region, "hub", per test (`env_fixture`, `provisioned`), role
connections, generators and sandbox supervisors served in the test's process, actor processes spawned and
stopped, and readers of what a group left: the rollouts in the region's ROLLOUTS stream, a plain forward pass's
logprobs of a rollout, the runs of 1s of a loss mask."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.hosting import hosted
from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Rollout
from rlbus.messages.streams import StreamSettings, provision_hub, provision_region
from rlbus.messages.subjects import BucketScope
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import Transformer
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=3.0)
"""The actors' limits here: heartbeats every 0.2 s, 3 s to drain."""
REPO = Path(__file__).resolve().parents[2]


async def connect(server: EmbeddedServer, run: str, role: str) -> Bus:
    cred = server.credential(role)
    return await Bus.connect(server.url, run=run, options=ConnectOptions(user=cred.user, password=cred.password))


@dataclass
class Env:
    server: EmbeddedServer
    run: str
    admin: Bus

    async def bus(self, role: str) -> Bus:
        return await connect(self.server, self.run, role)


async def provisioned(server: EmbeddedServer, run: str, settings: StreamSettings | None = None) -> Env:
    """`run` with the hub's region and hub streams provisioned (`settings`, tiny by default), read by an admin bus
    the caller closes."""
    admin = await connect(server, run, "admin")
    settings = settings or StreamSettings.tiny()
    await provision_region(admin.nc, admin.subjects, "hub", domain=None, settings=settings)
    await provision_hub(admin.nc, admin.subjects, "hub", {"hub": None}, settings)
    return Env(server, run, admin)


def server_fixture(name: str, runs: Sequence[str]) -> Any:
    """A module-scoped `server` fixture: a server whose role users may write the buckets of `runs`."""
    @pytest.fixture(scope="module", name="server")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
        srv = EmbeddedServer.start(tmp_path_factory.mktemp(f"{name}-js"), ServerOptions(
            name=name, scope=BucketScope(runs=tuple(runs), regions=("hub",))))
        try:
            yield srv
        finally:
            srv.stop()
    return server


def env_fixture(runs: Sequence[str], settings: StreamSettings | None = None) -> Any:
    """An `env` fixture: each test a fresh run of `runs`, provisioned (`provisioned`)."""
    free = list(runs)

    @pytest.fixture(name="env")
    async def env(server: EmbeddedServer) -> AsyncIterator[Env]:
        made = await provisioned(server, free.pop(), settings)
        try:
            yield made
        finally:
            await made.admin.close()
    return env


@asynccontextmanager
async def serving(env: Env, role: str, make: Callable[[Bus], Actor]) -> AsyncIterator[Any]:
    """Serve the actor `make(bus)` builds (on a bus of `role`) in this process until the block ends."""
    bus = await env.bus(role)
    async with hosted(make(bus), close=[bus]) as actor:
        yield actor


def serve_generator(env: Env, model: Transformer, config: GeneratorConfig, *, version: int,
                    actor_id: str = "g1") -> Any:
    """A generator sampling `model` (held as `version`), served in this process."""
    return serving(env, "generator", lambda bus: Generator(ActorId(env.run, "hub", "generator", actor_id), bus,
                                                           config, FAST, weights=LocalWeights(model, version=version)))


def serve_sandbox(env: Env, config: SandboxConfig, launch: SandboxLaunch | None = None) -> Any:
    """A sandbox supervisor "sb", served in this process."""
    return serving(env, "sandbox", lambda bus: SandboxSupervisor(ActorId(env.run, "hub", "sandbox", "sb"), bus,
                                                                  config, FAST, launch))


async def stored_in(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).state.messages)


async def stored(env: Env, stream: str) -> int:
    return await stored_in(env.admin, stream)


async def rollouts(source: Env | Bus, task_id: str | None = None) -> list[Rollout]:
    """The rollouts in the hub's ROLLOUTS stream (those of `task_id` if given), by task id and group index."""
    bus = source.admin if isinstance(source, Env) else source
    stream = bus.subjects.rollouts_stream("hub")
    info = await bus.js.stream_info(stream)
    out: list[Rollout] = []
    if not info.state.messages:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await bus.js.get_msg(stream, seq)
        rollout = codec.decode_as(msg.data, msg.headers, Rollout)
        if task_id is None or rollout.task_id == task_id:
            out.append(rollout)
    return sorted(out, key=lambda r: (r.task_id, r.group_index))


def teacher_forced(model: Transformer, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """(T,) log-probability of each completion token given everything before it (at `temperature`, with the
    rollout's MoE routing if any), one plain forward pass."""
    ids = torch.tensor([*rollout.prompt_tokens.tolist(), *rollout.completion_tokens.tolist()])[None]
    routing = None if rollout.routing is None else torch.from_numpy(rollout.routing.numpy().copy())[None]
    with torch.no_grad():
        logits = model(ids, routing=routing, with_mtp=False).logits[0].float()
    P = len(rollout.prompt_tokens)
    return torch.log_softmax(logits / temperature, dim=-1)[P - 1:-1].gather(-1, ids[0, P:, None])[:, 0]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the policy's turns."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


def save_checkpoint(model: Transformer, path: Path) -> Path:
    """`model` as the `pretrain.pt` a `local:` generator starts from (byte tokenizer)."""
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": ByteTokenizer().info(), "meta": {}}, path)
    return path


def spawn(env: Env, kind: str, actor_id: str, settings: dict[str, object], log_path: Path,
          launch: dict[str, object] | None = None, *, nice: int = 0) -> subprocess.Popen[bytes]:
    """An actor process of `kind` in the hub of `env`'s run, its stderr in `log_path`; `nice` > 0 runs it at that
    niceness, so the test process reacts to what it writes before it gets far (a kill aimed between two of its
    writes)."""
    cred = env.server.credential(kind)
    cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "rlbus.ops.actor", "--kind", kind,
           "--run", env.run, "--region", "hub",
           "--id", actor_id, "--url", env.server.url, "--heartbeat-s", "0.2", "--drain-s", "3",
           "--settings", json.dumps(settings)]
    if launch is not None:
        cmd += ["--launch", json.dumps(launch)]
    environ = {**os.environ, "RLBUS_NATS_USER": cred.user, "RLBUS_NATS_PASSWORD": cred.password,
               "RLBUS_TORCH_THREADS": "1"}
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, env=environ, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO)


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM `proc` (SIGKILL after 20 s); its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def reap(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL and wait for each of `procs` still running."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
