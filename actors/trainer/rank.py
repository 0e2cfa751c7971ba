"""A trainer's other ranks (`[trainer] world_size` > 1): the `trainer_rank` actor, ranks 1..N-1.

Owns: building the same core as the trainer (rank 0), joining its process group (`actors/trainer/ranks.py`),
and following rank 0's commands until it says stop (`follow`): each step's share of the batch, each
version's gather, each checkpoint's shards, which this rank uploads to CKPT under its own role
(`trainer_rank`: heartbeats, events and checkpoint objects, nothing else). It heartbeats like every actor
(rank, world size, steps followed); a broken group (a dead rank, a collective past its timeout) fails it,
and the launcher restarts the whole group from the newest mark.
Does not: touch ROLLOUTS, TRAINLOG, STATE or any other stream: exactly-once stays with rank 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.from_thread
import structlog

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
from rlbus.messages.bus import Bus
from rlbus.messages.errors import RlbusError
from rlbus.messages.subjects import Subjects

log = structlog.get_logger()


def build_trainer_rank(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                       launch: TrainerLaunch | None = None) -> TrainerRank:
    """The rank of a `[trainer]` section (plain values) — called by actors/kinds.py.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return TrainerRank(ident, bus, decode_config("trainer", settings, TrainerConfig), limits, launch)


class TrainerRank(Actor):
    """Rank k >= 1 of a trainer group; see the module docstring."""

    kind = "trainer_rank"

    def __init__(self, ident: ActorId, bus: Bus, config: TrainerConfig | None = None,
                 limits: ActorLimits | None = None, launch: TrainerLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config or TrainerConfig()
        self.launch = launch or TrainerLaunch()
        self.core: Any = None
        self.spec: Any = None

    async def setup(self) -> None:
        from rlbus.actors.trainer.actor import build_trainer_core, trainer_threads
        from rlbus.actors.trainer.ranks import RankSpec, ShardedCore, join

        spec = RankSpec.from_env()
        if spec is None or spec.rank == 0:
            raise RlbusError("a trainer_rank needs RLBUS_RANK >= 1, RLBUS_WORLD_SIZE > 1 and RLBUS_RENDEZVOUS "
                             "(the launcher sets them for [trainer] world_size > 1)")
        self.spec = spec
        self.gauges.update(rank=float(spec.rank), world_size=float(spec.world_size))
        cfg, threads, launch = self.config, trainer_threads(), self.launch

        def build() -> Any:
            core = build_trainer_core(cfg, threads=threads, pretrained=launch.pretrained, device=launch.device)
            join(spec, core.policy.device)
            return ShardedCore(core, spec)

        self.core = await anyio.to_thread.run_sync(build)
        log.info("trainer_rank_joined", rank=spec.rank, world_size=spec.world_size,
                 rendezvous=f"{spec.addr}:{spec.port}")

    async def run(self) -> None:
        from rlbus.actors.trainer.ranks import follow, leave

        bucket = self.bus.subjects.checkpoint_bucket()

        def upload(filename: str, data: bytes) -> tuple[str, str]:
            name = Subjects.shard_object(hashlib.sha256(data).hexdigest(), filename)
            digest = anyio.from_thread.run(self.bus.put_object, bucket, name, data)
            self.count("shards_uploaded")
            return name, digest

        def on_command(op: str) -> None:
            self.count(f"commands_{op}")

        try:
            await anyio.to_thread.run_sync(lambda: follow(self.core, upload, on_command=on_command))
        finally:
            await anyio.to_thread.run_sync(leave)
        log.info("trainer_rank_released", rank=self.spec.rank)
