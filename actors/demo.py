"""Demo actors for the bus demo and launcher tests: a rollout producer and a rollout consumer.

Owns: `DemoProducer` (publishes synthetic Rollouts of realistic size to its region's ROLLOUTS with
rollout-id dedupe) and `DemoConsumer` (pulls the hub's ROLLOUTS, acks, counts distinct ids).
They exercise the real path — typed publish, sourcing across regions, durable pull, dead-lettering —
without a model. Does not: train or generate anything.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Annotated, Any

import anyio
import msgspec
import structlog

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Rollout, TensorBlob

log = structlog.get_logger()


class DemoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How fast and how big the demo producer's rollouts are (no topology section: the launcher passes none)."""

    rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 20.0
    """Rollouts published per second; 0: as fast as the bus takes them."""
    tokens: Annotated[int, msgspec.Meta(ge=1)] = 2000
    """Completion tokens per rollout."""
    limit: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Stop after this many rollouts (0: never)."""


class DemoConsumerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which durable consumer the demo consumer reads the hub's ROLLOUTS through."""

    durable: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """Durable consumer name; None: the trainer's (the demo consumer plays the trainer's part)."""


def build_demo_producer(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits) -> DemoProducer:
    """`actors/kinds.py` entry.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return DemoProducer(ident, bus, decode_config("demo_producer", settings, DemoConfig), limits)


def build_demo_consumer(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits) -> DemoConsumer:
    """`actors/kinds.py` entry.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    config = decode_config("demo_consumer", settings, DemoConsumerConfig)
    return DemoConsumer(ident, bus, durable=config.durable, limits=limits)


def synthetic_rollout(rollout_id: str, region: str, producer: str, tokens: int, rng: random.Random) -> Rollout:
    """A Rollout of realistic size: `tokens` completion tokens with logprobs, versions and mask (13 B/token)."""
    return Rollout(
        rollout_id=rollout_id, task_id=f"demo-{rng.randrange(10**6)}", group_index=0, group_size=1,
        prompt_tokens=TensorBlob.of([rng.randrange(256) for _ in range(64)], "int32"),
        completion_tokens=TensorBlob.of([rng.randrange(256) for _ in range(tokens)], "int32"),
        behaviour_logprobs=TensorBlob.of([-rng.random() * 4 for _ in range(tokens)], "float32"),
        policy_versions=TensorBlob.of([0] * tokens, "int32"), loss_mask=TensorBlob.of([1] * tokens, "uint8"),
        reward=float(rng.random() < 0.3),
        region=region, generator_id=producer,
    )


class DemoProducer(Actor):
    """Publishes synthetic rollouts to `rollouts.<region>` at a steady rate."""

    kind = "demo_producer"

    def __init__(self, ident: ActorId, bus: Bus, settings: DemoConfig | None = None,
                 limits: ActorLimits | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.settings = settings or DemoConfig()
        self._rng = random.Random(ident.actor_id)

    async def setup(self) -> None:
        self.subject = self.bus.subjects.rollouts(self.ident.region)

    async def run(self) -> None:
        period = 1.0 / self.settings.rate_per_s if self.settings.rate_per_s > 0 else 0.0
        n = 0
        while not self.settings.limit or n < self.settings.limit:
            rollout_id = f"{self.ident.actor_id}-{self.restarts}-{n}"
            with self.busy():
                rollout = synthetic_rollout(rollout_id, self.ident.region, self.ident.actor_id,
                                            self.settings.tokens, self._rng)
                ack = await self.bus.publish(self.subject, rollout, msg_id=rollout_id)
            self.count("published")
            if ack.duplicate:
                self.count("duplicates")
            n += 1
            await anyio.sleep(period)
        log.info("demo_producer_done", published=n)
        await anyio.sleep_forever()


class DemoConsumer(Actor):
    """Consumes the hub's aggregated ROLLOUTS through a durable consumer and counts distinct ids."""

    kind = "demo_consumer"

    def __init__(self, ident: ActorId, bus: Bus, *, durable: str | None = None,
                 limits: ActorLimits | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.durable = durable or bus.subjects.durable("trainer")   # plays the trainer's part
        self.seen: set[str] = set()

    async def setup(self) -> None:
        self.stream = self.bus.subjects.hub_rollouts_stream()
        await self.bus.js.consumer_info(self.stream, self.durable)   # fail fast if not provisioned

    async def run(self) -> None:
        async for delivery in self.bus.consume(self.stream, self.durable, Rollout):
            with self.busy():
                rid = delivery.message.rollout_id
                if rid in self.seen:
                    self.count("duplicates")
                self.seen.add(rid)
                self.count("consumed")
                self.gauges["distinct"] = float(len(self.seen))
                await delivery.ack()
