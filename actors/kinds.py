"""Which class implements which actor kind: one closed `match`, no plugin registry.

Owns: `ACTOR_KINDS` and `build_actor(kind, ident, bus, settings)`. Launchers call this; adding a kind
means adding a case here.
"""

from __future__ import annotations

from typing import Any, Final

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.demo import DemoConsumer, DemoProducer, DemoSettings
from rlbus.actors.sandbox.supervisor import build_sandbox
from rlbus.messages.bus import Bus

ACTOR_KINDS: Final = ("demo_producer", "demo_consumer", "sandbox", "feeder", "generator", "trainer", "checkpointer",
                      "publisher", "evaluator")


def build_actor(kind: str, ident: ActorId, bus: Bus, settings: dict[str, Any], limits: ActorLimits) -> Actor:
    """Construct the actor of `kind`; `settings` are the kind's topology settings as plain values."""
    match kind:
        case "demo_producer":
            return DemoProducer(ident, bus, DemoSettings(**settings), limits)
        case "demo_consumer":
            return DemoConsumer(ident, bus, limits=limits, **settings)
        case "sandbox":
            return build_sandbox(ident, bus, settings, limits)
        case "feeder":
            from rlbus.actors.feeder import build_feeder   # imports torch (model.tasks): only where needed

            return build_feeder(ident, bus, settings, limits)
        case "generator":
            from rlbus.actors.generator.actor import build_generator

            return build_generator(ident, bus, settings, limits)
        case "trainer":
            from rlbus.actors.trainer.actor import build_trainer   # imports torch: only where needed

            return build_trainer(ident, bus, settings, limits)
        case "checkpointer":
            from rlbus.actors.checkpointer import build_checkpointer

            return build_checkpointer(ident, bus, settings, limits)
        case "publisher":
            from rlbus.actors.publisher import build_publisher   # imports torch: only where needed

            return build_publisher(ident, bus, settings, limits)
        case "evaluator":
            from rlbus.actors.evaluator import build_evaluator   # imports torch: only where needed

            return build_evaluator(ident, bus, settings, limits)
        case _:
            raise ValueError(f"unknown actor kind {kind!r}; known kinds: {', '.join(ACTOR_KINDS)}")
