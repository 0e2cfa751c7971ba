"""Which class implements which actor kind: one closed `match`, no plugin registry.

Owns: `ACTOR_KINDS`, `LAUNCH_TYPES` (the kind's `*Launch` Struct, for the values the launcher passes beside
a kind's settings) and `build_actor(kind, ident, bus, settings, limits, launch)`. Launchers call this; adding
a kind means adding a case here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import (
    CheckpointerLaunch,
    EvaluatorLaunch,
    FeederLaunch,
    PublisherLaunch,
    RelayLaunch,
    decode_config,
)
from rlbus.actors.demo import build_demo_consumer, build_demo_producer
from rlbus.actors.generator.config import GeneratorLaunch
from rlbus.actors.sandbox.config import SandboxLaunch
from rlbus.actors.sandbox.supervisor import build_sandbox
from rlbus.actors.trainer.config import TrainerLaunch
from rlbus.messages.bus import Bus
from rlbus.messages.errors import TopologyError

ACTOR_KINDS: Final = ("demo_producer", "demo_consumer", "sandbox", "feeder", "generator", "trainer", "trainer_rank",
                      "checkpointer", "publisher", "weights_relay", "evaluator")
LAUNCH_TYPES: Final[dict[str, type[msgspec.Struct]]] = {
    "sandbox": SandboxLaunch, "feeder": FeederLaunch, "generator": GeneratorLaunch, "trainer": TrainerLaunch,
    "trainer_rank": TrainerLaunch,
    "checkpointer": CheckpointerLaunch, "publisher": PublisherLaunch, "weights_relay": RelayLaunch,
    "evaluator": EvaluatorLaunch,
}
"""Kind → what the launcher passes beside its settings (kinds missing here take nothing)."""


def decode_launch(kind: str, launch: Mapping[str, Any] | msgspec.Struct | None) -> msgspec.Struct | None:
    """The kind's `*Launch` from plain values; None when none is given (the builder's defaults) or the kind
    takes none.

    :raises TopologyError: a value is unknown, of the wrong type or out of bounds, or the kind takes none.
    """
    cls = LAUNCH_TYPES.get(kind)
    if cls is None:
        if launch:
            raise TopologyError(f"actor kind {kind!r} takes no launch values, got {launch!r}")
        return None
    return None if launch is None else decode_config(f"{kind} launch", launch, cls)


def build_actor(kind: str, ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                launch: Mapping[str, Any] | msgspec.Struct | None = None) -> Actor:
    """Construct the actor of `kind`: `settings` are the kind's topology section as plain values, `launch`
    what the launcher passes beside it (plain values or the kind's `*Launch`; None: its defaults).

    :raises TopologyError: an unknown kind, or settings or launch values that do not fit (naming the key).
    """
    extra = decode_launch(kind, launch) if kind in ACTOR_KINDS else None
    match kind:
        case "demo_producer":
            return build_demo_producer(ident, bus, settings, limits)
        case "demo_consumer":
            return build_demo_consumer(ident, bus, settings, limits)
        case "sandbox":
            return build_sandbox(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "feeder":
            from rlbus.actors.feeder import build_feeder  # imports torch (model.tasks): only where needed

            return build_feeder(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "generator":
            from rlbus.actors.generator.actor import build_generator

            return build_generator(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "trainer":
            from rlbus.actors.trainer.actor import build_trainer  # imports torch: only where needed

            return build_trainer(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "trainer_rank":
            from rlbus.actors.trainer.rank import build_trainer_rank

            return build_trainer_rank(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "checkpointer":
            from rlbus.actors.checkpointer import build_checkpointer

            return build_checkpointer(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "publisher":
            from rlbus.actors.publisher import build_publisher  # imports torch: only where needed

            return build_publisher(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "weights_relay":
            from rlbus.actors.publisher import build_region_relay

            return build_region_relay(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case "evaluator":
            from rlbus.actors.evaluator import build_evaluator  # imports torch: only where needed

            return build_evaluator(ident, bus, settings, limits, extra)  # type: ignore[arg-type]
        case _:
            raise TopologyError(f"unknown actor kind {kind!r}; known kinds: {', '.join(ACTOR_KINDS)}")
