"""Trainer ranks: one trainer over N processes (`torch.distributed`, FSDP2), led by rank 0.

- Owns: `RankSpec` (a rank's place, from the launcher's environment), `join` / `leave` (the process group over
  a TCPStore rank 0 hosts), `ShardedCore` (the `Core` over the group), `follow` (a follower's command loop),
  sharded checkpoints (each rank writes its own `torch.distributed.checkpoint` files).
- Guarantee: a dead rank or a collective past `timeout_s` raises `RankError` on every survivor.
- Does not: talk to the bus, place processes (ops/local_ranks.py starts N on loopback) or decide when to
  step; the step's math and the checkpoint layout are in actors/trainer/sharded.py.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from rlbus.actors.common.errors import CheckpointError
from rlbus.actors.trainer import sharded
from rlbus.actors.trainer.config import RANK_ENV, RENDEZVOUS_ENV, TIMEOUT_ENV, WORLD_ENV
from rlbus.actors.trainer.core import (
    Objective,
    StepStats,
    TrainerCore,
    Upload,
    read_state,
    shard_files,
    state_payload,
)
from rlbus.actors.trainer.sharded import is_sharded, shards_to_payload
from rlbus.kernels.delta.state import encode_state
from rlbus.messages import codec
from rlbus.messages.errors import RlbusError
from rlbus.messages.schemas import Rollout
from rlbus.model.policies.interface import Policy

__all__ = ["RankError", "RankSpec", "ShardedCore", "follow", "is_sharded", "join", "leave", "shards_to_payload",
           "state_bytes"]

OPS: Final = ("stop", "ping", "train", "gather", "save", "load_shards", "load_full")
"""The leader's commands, by their code on the wire (the index)."""
_JOINED: Final = "rlbus/joined/"


class RankError(RlbusError):
    """The trainer group cannot go on: a rank did not join, died, or a collective timed out. The message names
    the rank(s) and the rendezvous address, and says what to do. Raised on every survivor: the group is then
    unusable and must be torn down (`leave`) and restarted from the newest checkpoint."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """One rank's place in a trainer group."""

    rank: int
    world_size: int
    addr: str
    port: int
    timeout_s: float = 60.0
    """Rendezvous timeout and every collective's timeout."""

    @property
    def address(self) -> str:
        return f"{self.addr}:{self.port}"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RankSpec | None:
        """From RLBUS_RANK, RLBUS_WORLD_SIZE, RLBUS_RENDEZVOUS ("host:port") and RLBUS_COLLECTIVE_TIMEOUT_S
        (default 60); None without RLBUS_WORLD_SIZE or at world size 1.

        :raises RankError: a variable missing or not what is expected.
        """
        raw = env.get(WORLD_ENV, "").strip()
        if not raw:
            return None

        def number(name: str, value: str, kind: type[int] | type[float]) -> Any:
            try:
                return kind(value)
            except ValueError:
                raise RankError(f"environment variable {name}={value!r}: expected a {kind.__name__}") from None

        world = number(WORLD_ENV, raw, int)
        if world == 1:
            return None
        rank = number(RANK_ENV, env.get(RANK_ENV, ""), int)
        if world < 1 or not 0 <= rank < world:
            raise RankError(f"environment variables RLBUS_RANK={rank}, RLBUS_WORLD_SIZE={world}: expected "
                            f"0 <= rank < world size")
        where = env.get(RENDEZVOUS_ENV, "")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise RankError(f"environment variable RLBUS_RENDEZVOUS={where!r}: expected host:port")
        timeout = number(TIMEOUT_ENV, env.get(TIMEOUT_ENV, "60"), float)
        if not timeout > 0:
            raise RankError(f"environment variable RLBUS_COLLECTIVE_TIMEOUT_S={timeout}: expected seconds > 0")
        return cls(rank=rank, world_size=world, addr=host.strip("[]"), port=int(port), timeout_s=timeout)

    def env(self) -> dict[str, str]:
        """The environment variables `from_env` reads back."""
        return {RANK_ENV: str(self.rank), WORLD_ENV: str(self.world_size), RENDEZVOUS_ENV: self.address,
                TIMEOUT_ENV: repr(self.timeout_s)}


# ---- the process group ------------------------------------------------------------------------------------
def join(spec: RankSpec, device: torch.device) -> None:
    """Join the trainer group: rank 0 hosts a TCPStore at the spec's address, every rank marks itself joined
    there and waits (up to `timeout_s`) for all the others, then the process group starts (gloo on the CPU;
    gloo for CPU tensors and NCCL for CUDA ones on a CUDA device), every collective under `timeout_s`.

    :raises RankError: naming the ranks that did not join within `timeout_s`, or rank 0 when its store cannot
        be reached (or, on rank 0, hosted).
    """
    if dist.is_initialized():
        raise RankError(f"trainer rank {spec.rank} already belongs to a process group; leave() it first")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore(spec.addr, spec.port, spec.world_size, is_master=spec.leader, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, dist.DistError) as err:
        if spec.leader:
            raise RankError(f"trainer rank 0 cannot host the rendezvous at {spec.address} ({_line(err)}); "
                            f"choose a free port") from None
        raise RankError(f"trainer rank 0 did not open the rendezvous at {spec.address} within "
                        f"{spec.timeout_s:g} s (seen from rank {spec.rank}); start rank 0, or check the address") \
            from None
    deadline = time.monotonic() + spec.timeout_s
    try:
        store.set(f"{_JOINED}{spec.rank}", "1")
        missing = list(range(spec.world_size))
        while True:
            missing = [k for k in missing if not store.check([f"{_JOINED}{k}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except (RuntimeError, dist.DistError) as err:
        raise RankError(f"trainer rank {spec.rank}: the rendezvous at {spec.address} failed ({_line(err)}); "
                        f"rank 0 hosting it may have died: restart the group") from None
    if missing:
        who = ", ".join(map(str, missing))
        raise RankError(f"trainer rank{'s' if len(missing) > 1 else ''} {who} did not join the rendezvous at "
                        f"{spec.address} within {spec.timeout_s:g} s; start {'them' if len(missing) > 1 else 'it'} "
                        f"with RLBUS_RANK={missing[0]} RLBUS_WORLD_SIZE={spec.world_size} "
                        f"RLBUS_RENDEZVOUS={spec.address}, or raise RLBUS_COLLECTIVE_TIMEOUT_S")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("rlbus/pg", store), rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
    except (RuntimeError, dist.DistError) as err:
        raise RankError(f"trainer rank {spec.rank}: the process group at {spec.address} did not start "
                        f"({_line(err)}); restart the group") from None


_broken = False
"""Set once a collective of this process's group failed (`RankError` from `_group`)."""


def leave() -> None:
    """Destroy this process's trainer group (nothing when there is none); never raises. A group broken by a
    failed collective is left as it is: gloo's teardown of a timed-out collective can abort the process
    (std::terminate) before it reports the error; such a process ends, and is restarted, with its group."""
    if _broken:
        return
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


# ---- the sharded core -------------------------------------------------------------------------------------
class ShardedCore:
    """A `TrainerCore` over the ranks (a `Core`) of a joined group: the leader (rank 0) calls it where it would call the
    core; each follower builds the same object and hands it to `follow`.

    Every rank must build its core from the same checkpoint; the leader's weights are broadcast anyway before
    sharding, so they are what every rank starts from. The leader's methods are serialised by a lock (the
    trainer calls them from worker threads).
    """

    def __init__(self, core: TrainerCore, spec: RankSpec) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RankError(f"trainer rank {spec.rank}: join() the group at {spec.address} before sharding")
        self.spec = spec
        self._core = core
        self._lock = threading.Lock()
        self._stopped = False
        self.policy: Policy = core.policy
        self.reference: Policy = core.reference
        module = core.policy.module
        self._names = list(core.policy.named_tensors())
        """The published tensors' names (one per tied tensor), in the one-rank order."""
        self._spec = core.model_config_dict()
        self._files = core.policy_files()
        """Both read before sharding: `fully_shard` renames the module's class (FSDPQwen2ForCausalLM)."""
        group = core.optimizer.param_groups[0]
        hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
        core.optimizer.state.clear()
        core.optimizer.param_groups.clear()       # its references would keep the full tensors alive
        device = core.policy.device
        with self._group("sharding the policy"):
            for net in (core.policy, core.reference):
                for t in net.module.state_dict().values():
                    dist.broadcast(t.data, 0)
            mesh = init_device_mesh(device.type, (spec.world_size,))
            for net in (core.policy, core.reference):
                _shard(net, mesh)
        self.optimizer = torch.optim.AdamW(module.parameters(), **hyper)
        core.optimizer = self.optimizer

    # ---- what TrainerCore offers ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.module

    @property
    def moe(self) -> tuple[int, int] | None:
        return self.policy.moe

    def check(self, rollout: Rollout) -> str | None:
        return self._core.check(rollout)

    def model_config_dict(self) -> dict[str, Any]:
        return dict(self._spec)

    def policy_files(self) -> dict[str, bytes]:
        return dict(self._files)

    # ---- leader: commands -------------------------------------------------------------------------------
    def train_step(self, rollouts: Sequence[Rollout], objective: Objective, *, lr: float | None = None) -> StepStats:
        """`TrainerCore.train_step` over the group: every rank trains its share of `rollouts` (the whole list is
        broadcast); the stats are the whole batch's."""
        payload = msgspec.msgpack.encode({"rollouts": [codec.encode(r) for r in rollouts],
                                          "objective": objective, "lr": lr})
        with self._command("train", payload):
            return self._train(rollouts, objective, lr)

    def bf16_state(self) -> dict[str, Tensor]:
        """The published version (`TrainerCore.bf16_state`): on the leader every tensor gathered one at a time,
        each cast to bfloat16 before the gather (no fp32 copy of a whole tensor is made); {} on a follower."""
        with self._command("gather"):
            return self._gather()

    def published_version(self) -> tuple[bytes, str, int]:
        """`TrainerCore.published_version` of `bf16_state` (leader only)."""
        state = self.bf16_state()
        index, blob = encode_state(state, None)
        return blob, index.version_digest.hex(), sum(t.numel() * t.element_size() for t in state.values())

    def save_shards(self, meta: Mapping[str, Any], upload: Upload) -> tuple[list[str], list[str]]:
        """Save the sharded state (`torch.distributed.checkpoint` of model and AdamW state; rng, spec, policy
        files, meta and world size in the leader's `trainer-state.pt`); every rank stores its own files through
        its `upload`. -> (objects, digests) of every rank's files, rank 0's first, each rank's in name order."""
        with self._command("save"):
            return self._save(meta, upload)

    def save(self, meta: Mapping[str, Any], upload: Upload) -> tuple[list[str], list[str]]:
        """`Core.save`: `save_shards`."""
        return self.save_shards(meta, upload)

    def load(self, state: Mapping[str, bytes]) -> dict[str, Any]:
        """`Core.load`: the shards of a checkpoint at any world size (`load_shards`), or a one-rank state blob
        split across the ranks (`load_full`)."""
        files = shard_files(state)
        if files is not None:
            return self.load_shards(files)
        return self.load_full(state_payload(state))

    def load_shards(self, files: Mapping[str, bytes]) -> dict[str, Any]:
        """Load a sharded checkpoint (every file, by the names `save_shards` gave `upload`) saved at any world
        size: the files are broadcast and every rank loads its part (DCP resharding). -> its meta.

        :raises CheckpointError: not a sharded checkpoint, or one of another architecture (nothing is loaded).
        """
        leader = sharded.read_leader(files)
        self._same_architecture(leader["model_config"])
        with self._command("load_shards", msgspec.msgpack.encode(dict(files))):
            return self._load_shards(files)

    def load_full(self, state: bytes | Mapping[str, Any]) -> dict[str, Any]:
        """Load a one-rank state (`TrainerCore.state_blob` bytes, or its `read_state` payload) into the shards,
        AdamW state and rng included. -> its meta.

        :raises CheckpointError: not a trainer state, or one of another architecture (nothing is loaded).
        """
        payload = read_state(bytes(state)) if isinstance(state, bytes | bytearray | memoryview) else dict(state)
        self._same_architecture(payload["model_config"])
        blob = bytes(state) if isinstance(state, bytes | bytearray | memoryview) else sharded.leader_blob(payload)
        with self._command("load_full", blob):
            return self._load_full(payload)

    def ping(self) -> None:
        """A command that does nothing: sent every few seconds while idle, it keeps the followers' wait for the
        next command under the collective timeout and notices a dead rank."""
        with self._command("ping"):
            pass

    def stop(self) -> None:
        """Tell the followers to return from `follow` (once; later calls do nothing)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            with self._group("stopping the followers"):
                self._send("stop", b"")

    # ---- every rank -------------------------------------------------------------------------------------
    def _train(self, rollouts: Sequence[Rollout], objective: Objective, lr: float | None) -> StepStats:
        with self._group("running a train step"):
            return sharded.local_step(self.policy, self.reference, self.optimizer, rollouts, objective, lr=lr,
                                      rank=self.spec.rank, world_size=self.spec.world_size)

    @torch.no_grad()
    def _gather(self) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        live = self.policy.module.state_dict(keep_vars=True)
        out: dict[str, Tensor] = {}
        with self._group("gathering a version"):
            for name in self._names:
                t = live[name].detach().to(torch.bfloat16)
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if self.spec.leader:
                    out[name] = full.to(device="cpu", copy=full.device.type == "cpu").contiguous()
                del full, t
        return out

    def _save(self, meta: Mapping[str, Any], upload: Upload) -> tuple[list[str], list[str]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        module = self.policy.module
        with self._group("saving a checkpoint"):
            empty = not self.optimizer.state      # DCP would initialise AdamW's state (a step at lr 0): skip it
            if empty:
                state: dict[str, Any] = {"model": get_model_state_dict(module)}
            else:
                model_sd, optim_sd = get_state_dict(module, self.optimizer)
                state = {"model": model_sd, "optim": optim_sd}
            with tempfile.TemporaryDirectory(prefix="rlbus-dcp-") as tmp:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1))
                files = {sharded.stored_name(p.name): p.read_bytes() for p in sorted(Path(tmp).iterdir())
                         if p.is_file()}
            if self.spec.leader:
                group = self.optimizer.param_groups[0]
                files[sharded.LEADER_FILE] = sharded.leader_blob({
                    "sharded_format": sharded.SHARDED_FORMAT, "world_size": self.spec.world_size,
                    "rng": {"torch": torch.get_rng_state()}, "model_config": self.model_config_dict(),
                    "policy_files": self.policy_files(), "meta": dict(meta), "names": list(self._names),
                    "optimizer_empty": empty,
                    "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                      "params": list(range(len(group["params"])))}]})
            done = [upload(name, data) for name, data in sorted(files.items())]
            every: list[Any] = [None] * self.spec.world_size
            dist.all_gather_object(every, done)
        objects = [obj for rank_files in every for obj, _ in rank_files]
        digests = [digest for rank_files in every for _, digest in rank_files]
        return (objects, digests) if self.spec.leader else ([], [])

    def _load_shards(self, files: Mapping[str, bytes]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        leader = sharded.read_leader(files)
        module = self.policy.module
        with self._group("loading a sharded checkpoint"), tempfile.TemporaryDirectory(prefix="rlbus-dcp-") as tmp:
            sharded.write_dcp_dir(files, Path(tmp))
            reader = dcp.FileSystemReader(tmp)
            if leader["optimizer_empty"]:
                state: dict[str, Any] = {"model": get_model_state_dict(module)}
                dcp.load(state, storage_reader=reader)
                set_model_state_dict(module, state["model"])
                self.optimizer.state.clear()
            else:
                model_sd, optim_sd = get_state_dict(module, self.optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, storage_reader=reader)
                set_state_dict(module, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
        torch.set_rng_state(leader["rng"]["torch"])
        return dict(leader["meta"])

    @torch.no_grad()
    def _load_full(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, distribute_tensor

        live = self.policy.module.state_dict(keep_vars=True)
        model = payload["model"]
        if set(model) != set(self._names):
            raise CheckpointError(f"trainer state's tensors differ from the policy's: missing "
                                  f"{sorted(set(self._names) - set(model))[:5]}, extra "
                                  f"{sorted(set(model) - set(self._names))[:5]}")

        def placed(full: Tensor, like: Tensor) -> Tensor:
            if isinstance(like, DTensor):
                return distribute_tensor(full.to(device=like.device, dtype=like.dtype), like.device_mesh,
                                         like.placements, src_data_rank=None)
            return full.to(device=like.device, dtype=like.dtype)

        with self._group("loading a one-rank state"):
            for name in self._names:
                if tuple(model[name].shape) != tuple(live[name].shape):
                    raise CheckpointError(f"trainer state tensor {name}: shape {tuple(model[name].shape)}, the "
                                          f"policy's is {tuple(live[name].shape)}")
                live[name].copy_(placed(model[name], live[name]))
            saved = payload["optimizer"]
            if not saved["state"]:
                self.optimizer.state.clear()
            else:
                params = [p for group in self.optimizer.param_groups for p in group["params"]]
                state = {int(i): {k: placed(v, params[int(i)]) if isinstance(v, Tensor) and v.dim() else v
                                  for k, v in values.items()} for i, values in saved["state"].items()}
                self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        torch.set_rng_state(payload["rng"]["torch"])
        return dict(payload["meta"])

    def _same_architecture(self, config: Any) -> None:
        if config != self.model_config_dict():
            raise CheckpointError(f"trainer state is for architecture {config}, this trainer runs "
                                  f"{self.model_config_dict()}")

    # ---- the command channel ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _command(self, op: str, payload: bytes = b"") -> Iterator[None]:
        """Leader only: under the lock, broadcast `op` (and its payload), then run the leader's side."""
        if not self.spec.leader:
            raise RuntimeError(f"trainer rank {self.spec.rank} is a follower: only rank 0 sends commands")
        with self._lock:
            if self._stopped:
                raise RankError(f"trainer rank 0: the group at {self.spec.address} was stopped")
            with self._group(f"sending command {op!r}"):
                self._send(op, payload)
            yield

    def _send(self, op: str, payload: bytes) -> None:
        """The header goes round as an all-reduce (followers add zeros), not a broadcast: it completes only once
        every rank has taken part, so even a ping notices a rank that stopped answering."""
        header = torch.tensor([OPS.index(op), len(payload)], dtype=torch.int64)
        dist.all_reduce(header)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)

    def receive(self) -> tuple[str, bytes]:
        """Follower: wait (up to the collective timeout) for the leader's next command -> (op, payload)."""
        header = torch.zeros(2, dtype=torch.int64)
        with self._group("waiting for the leader's next command"):
            dist.all_reduce(header)
            code, size = (int(v) for v in header.tolist())
            data = torch.empty(size, dtype=torch.uint8)
            if size:
                dist.broadcast(data, 0)
        return OPS[code], data.numpy().tobytes()

    def run(self, op: str, payload: bytes, upload: Upload) -> None:
        """Follower: run one command of the leader's."""
        match op:
            case "ping" | "stop":
                pass
            case "train":
                body = msgspec.msgpack.decode(payload)
                rollouts = [codec.decode_as(data, headers, Rollout) for data, headers in body["rollouts"]]
                objective = msgspec.convert(body["objective"], Objective)
                self._train(rollouts, objective, body["lr"])
            case "gather":
                self._gather()
            case "save":
                self._save({}, upload)
            case "load_shards":
                self._load_shards(msgspec.msgpack.decode(payload, type=dict[str, bytes]))
            case "load_full":
                self._load_full(read_state(payload))
            case _:
                raise RankError(f"trainer rank {self.spec.rank}: unknown command {op!r} from the leader")

    @contextlib.contextmanager
    def _group(self, what: str) -> Iterator[None]:
        """Collective failures (a dead peer, a timeout) as `RankError` naming this rank and the address."""
        from torch.distributed.checkpoint import CheckpointException

        try:
            yield
        except (RankError, CheckpointError):
            raise
        except CheckpointException as err:      # a BaseException: what failed on which rank, gathered by DCP
            raise CheckpointError(f"trainer rank {self.spec.rank}: {what} failed: {_line(err)}") from None
        except (RuntimeError, dist.DistError) as err:
            if not _collective_failure(err):
                raise
            global _broken
            _broken = True
            raise RankError(f"trainer rank {self.spec.rank}: the group at {self.spec.address} broke while "
                            f"{what} (a rank died, or a collective took over {self.spec.timeout_s:g} s): "
                            f"{_line(err)}; tear the group down and restart it from the newest checkpoint") from err


def _collective_failure(err: BaseException) -> bool:
    """Whether an error out of torch.distributed means the group is broken (not a bug in what it computed)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(s in text for s in ("gloo", "Gloo", "NCCL", "Connection", "connection", "Timed out", "timed out",
                                   "timeout", "Socket", "peer", "ProcessGroup"))


def _shard(net: Policy, mesh: Any) -> None:
    """`fully_shard` each of `net.shard_units()`, then the root; gradients summed across ranks (not averaged),
    with SUM collectives only (gloo has no AVG); unused parameters' zero gradients reduced too for MoE."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for unit in net.shard_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(net.module, mesh=mesh)
    for m in net.module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    if net.moe is not None:
        root = net.module
        assert isinstance(root, FSDPModule)
        root.set_reduce_scatter_unused_params(True)


def follow(core: ShardedCore, upload: Upload, *, on_command: Callable[[str], None] = lambda op: None) -> None:
    """A follower's loop (only the leader is given rollouts and metadata; a follower learns everything from its
    commands): wait for the leader's next command and run it; `on_command(op)` is called as each one
    arrives, before it runs. Returns on "stop".

    :raises RankError: the group broke (a rank died, a collective timed out).
    """
    while True:
        op, payload = core.receive()
        on_command(op)
        if op == "stop":
            return
        core.run(op, payload, upload)


def state_bytes(payload: Mapping[str, Any]) -> bytes:
    """A `read_state` payload (e.g. `shards_to_payload`'s) as `TrainerCore.state_blob` bytes."""
    buffer = io.BytesIO()
    torch.save(dict(payload), buffer)
    return buffer.getvalue()
