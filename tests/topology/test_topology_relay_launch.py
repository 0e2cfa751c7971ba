"""What the launcher adds for a leaf behind a `[regions.link]`: a `weights_relay` instance in that leaf (placed in
its namespace, connecting as its own role, given the hub) and the leaf in the hub publisher's `relayed`; none with
`[weights] relay = false`, for a leaf on loopback, or in a run without a publisher. Pure: no server is started."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.kinds import build_actor
from rlbus.messages.errors import TopologyError
from rlbus.topology.backends.launch import Endpoints, actor_specs
from rlbus.topology.file.load import load

TOPOLOGY = """run = "relayed"
[[regions]]
name = "hub"
role = "hub"
  [[regions.actors]]
  kind = "feeder"
  [[regions.actors]]
  kind = "trainer"
  [[regions.actors]]
  kind = "publisher"
  [[regions.actors]]
  kind = "checkpointer"
[[regions]]
name = "eu"
  [[regions.actors]]
  kind = "generator"
  count = 2
  [[regions.actors]]
  kind = "sandbox"
  [regions.link]
  bandwidth = "100mbit"
[[regions]]
name = "us"
  [[regions.actors]]
  kind = "generator"
  [[regions.actors]]
  kind = "sandbox"
[launch]
oversubscribe = true
"""
REGIONS = ("hub", "eu", "us")


def _specs(tmp_path: Path, extra: str = "") -> dict[str, tuple[str, str, str, dict[str, object]]]:
    """actor id -> (kind, role, netns, launch values) of every process `rlbus up` would start."""
    path = tmp_path / "t.toml"
    path.write_text(TOPOLOGY + extra)
    endpoints = Endpoints(urls={r: ("nats://127.0.0.1:4222",) for r in REGIONS}, domains={r: r for r in REGIONS},
                          hub="hub", credentials={r: None for r in REGIONS}, netns={"eu": "rlbus-x-eu"})
    out = {}
    for spec in actor_specs(load(path), endpoints, state_dir=tmp_path):
        args = list(spec.args)
        launch = json.loads(args[args.index("--launch") + 1]) if "--launch" in args else {}
        out[spec.actor_id] = (spec.kind, args[args.index("--role") + 1], spec.netns, launch)
    return out


def test_a_linked_leaf_gets_a_relay_in_its_namespace_and_the_publisher_relays_it(tmp_path: Path) -> None:
    """eu (linked) gets `eu-weights_relay-0` in its namespace as role weights_relay with the hub named; us (on
    loopback) gets none; the publisher's launch lists eu alone as relayed."""
    specs = _specs(tmp_path)
    relays = {a: s for a, s in specs.items() if s[0] == "weights_relay"}
    assert relays == {"eu-weights_relay-0": ("weights_relay", "weights_relay", "rlbus-x-eu", {"hub": "hub",
                                                                                           "threads": 2})}
    assert specs["hub-publisher-0"][3]["relayed"] == ["eu"]


def test_relay_false_starts_none_and_relays_nothing(tmp_path: Path) -> None:
    """`[weights] relay = false`: no relay anywhere, and the publisher writes every region itself."""
    specs = _specs(tmp_path, "\n[weights]\nrelay = false\n")
    assert not [a for a, s in specs.items() if s[0] == "weights_relay"]
    assert specs["hub-publisher-0"][3]["relayed"] == []


def test_a_relay_without_a_hub_or_in_the_hub_is_refused_naming_it() -> None:
    """The relay kind built with no launch values, or placed in the hub region, is a TopologyError that says why."""
    ident = ActorId(run="r", region="hub", kind="weights_relay", actor_id="hub-weights_relay-0")
    limits = ActorLimits()
    with pytest.raises(TopologyError, match="needs the hub region"):
        build_actor("weights_relay", ident, None, {}, limits)  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="is the hub; a relay runs in a leaf region"):
        build_actor("weights_relay", ident, None, {}, limits, {"hub": "hub"})  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="hub"):           # the launch values lack it
        build_actor("weights_relay", dataclasses.replace(ident, region="eu"), None, {}, limits,  # type: ignore[arg-type]
                    {"threads": 1})


def test_a_run_without_a_publisher_starts_no_relay(tmp_path: Path) -> None:
    """The bus demo behind a link (no publisher, so no weights) gets no relay."""
    path = tmp_path / "demo.toml"
    path.write_text('run = "d"\n[[regions]]\nname = "hub"\nrole = "hub"\n  [[regions.actors]]\n  kind = "demo_consumer"\n'
                    '[[regions]]\nname = "eu"\n  [[regions.actors]]\n  kind = "demo_producer"\n  [regions.link]\n'
                    '  bandwidth = "100mbit"\n')
    endpoints = Endpoints(urls={r: ("nats://127.0.0.1:4222",) for r in ("hub", "eu")},
                          domains={"hub": "hub", "eu": "eu"}, hub="hub", credentials={"hub": None, "eu": None})
    assert [s.kind for s in actor_specs(load(path), endpoints)] == ["demo_consumer", "demo_producer"]
