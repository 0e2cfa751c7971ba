"""Every actor setting has one schema: the topology file's sections are the actors' own Config classes, an
out-of-bounds setting is refused by `rlbus validate` with file, key and bound, and a builder given settings
that do not fit raises `TopologyError` naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.checkpointer import build_checkpointer
from rlbus.actors.common.config import (
    CheckpointerConfig,
    EvaluatorConfig,
    FeederConfig,
    PublisherConfig,
    decode_config,
)
from rlbus.actors.demo import build_demo_producer
from rlbus.actors.generator.config import GeneratorConfig
from rlbus.actors.kinds import LAUNCH_TYPES, build_actor
from rlbus.actors.sandbox.config import SandboxConfig
from rlbus.actors.sandbox.supervisor import build_sandbox
from rlbus.actors.trainer.config import LengthPenaltyConfig, TrainerConfig, TrainerLaunch
from rlbus.messages.errors import TopologyError
from rlbus.ops.validate import register
from rlbus.topology.backends.launch import kind_launch, kind_settings
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load
from rlbus.topology.file.schema import Topology

SECTIONS: dict[str, type[msgspec.Struct]] = {
    "feeder": FeederConfig, "generator": GeneratorConfig, "trainer": TrainerConfig,
    "checkpoint": CheckpointerConfig, "sandbox": SandboxConfig, "evaluator": EvaluatorConfig,
    "weights": PublisherConfig,
}
"""Topology section → the actor's Config class that declares it."""
HEADER = 'run = "t"\n\n[[regions]]\nname = "hub"\nrole = "hub"\n\n  [[regions.actors]]\n  kind = "trainer"\n\n'


def test_each_section_is_the_actors_own_config_class() -> None:
    """The topology schema holds the very Config classes the actors decode, so the two cannot drift."""
    fields = {f.name: f for f in msgspec.inspect.type_info(Topology).fields}  # type: ignore[union-attr]
    for section, cls in SECTIONS.items():
        assert fields[section].type.cls is cls, section     # type: ignore[union-attr]
        assert type(getattr(Topology(run="t", regions=[]), section)) is cls
    trainer = msgspec.inspect.type_info(TrainerConfig)
    assert {f.name: f.type for f in trainer.fields}["length_penalty"].cls is LengthPenaltyConfig  # type: ignore[union-attr]


def test_launch_values_are_not_topology_keys() -> None:
    """What the launcher adds (pretrained path, state dir, regions, ...) is no key of the kind's own section."""
    own = {"checkpointer": "checkpoint", "publisher": "weights", "weights_relay": "weights", "trainer_rank": "trainer"}
    for kind, launch in LAUNCH_TYPES.items():
        section = SECTIONS[own.get(kind, kind)]
        assert not set(launch.__struct_fields__) & set(section.__struct_fields__), kind
    assert {"pretrained", "state_dir", "checkpoint_interval"} <= set(TrainerLaunch.__struct_fields__)


@pytest.mark.parametrize("name", ["tiny", "three_regions", "demo"])
def test_what_the_launcher_passes_decodes_for_every_kind(name: str, tmp_path: Path) -> None:
    """Each instance's settings decode into its Config and its launch values into its `*Launch`."""
    topology = load(example_path(name))
    for inst in topology.instances():
        settings = kind_settings(topology, inst.kind)
        launch = kind_launch(topology, inst.kind, tmp_path)
        if inst.kind in LAUNCH_TYPES:
            assert isinstance(launch, LAUNCH_TYPES[inst.kind])
            decode_config(inst.kind, msgspec.to_builtins(launch), LAUNCH_TYPES[inst.kind])
        section = {"checkpointer": "checkpoint", "publisher": "weights"}.get(inst.kind, inst.kind)
        if section in SECTIONS:
            assert decode_config(section, settings, SECTIONS[section]) == getattr(topology, section)


def _validate(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Path]:
    path = tmp_path / "topo.toml"
    path.write_text(HEADER + text)
    parser = argparse.ArgumentParser(prog="rlbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", str(path)])
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out + err, path


@pytest.mark.parametrize(("text", "key", "bound"), [
    ("[generator]\nmax_attempts = 9\n", "generator.max_attempts", "<= 8"),
    ("[generator]\npartial_credit = 1.0\n", "generator.partial_credit", "< 1"),
    ("[generator]\nsandbox_timeout_s = 0\n", "generator.sandbox_timeout_s", "> 0"),
    ("[feeder]\nbacklog_per_region = 0\n", "feeder.backlog_per_region", ">= 1"),
    ("[feeder]\npoll_interval_s = -1.0\n", "feeder.poll_interval_s", "> 0"),
    ("[feeder]\nregion_weights = {hub = -1}\n", "feeder.region_weights", ">= 0"),
])
def test_validate_refuses_an_out_of_bounds_actor_setting(text: str, key: str, bound: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`rlbus validate` exits 2 and names the file, the key and the bound of a generator or feeder setting."""
    code, out, path = _validate(text, tmp_path, capsys)
    assert code == 2
    line = next(line for line in out.splitlines() if key in line)
    assert line.startswith(f"{path}: {key}") and bound in line


IDENT = ActorId(run="t", region="hub", kind="x", actor_id="hub-x-0")
LIMITS = ActorLimits(heartbeat_interval_s=1.0, drain_timeout_s=1.0)


@pytest.mark.parametrize(("kind", "settings", "key"), [
    ("generator", {"group_size": 0}, "generator.group_size"),
    ("generator", {"max_attempts": "three"}, "generator.max_attempts"),
    ("feeder", {"poll_interval_s": 0}, "feeder.poll_interval_s"),
    ("feeder", {"regions": ["hub"]}, "regions"),
    ("trainer", {"lr": -1.0}, "trainer.lr"),
    ("trainer", {"pretrained": "/p"}, "pretrained"),
    ("trainer", {"length_penalty": {"budget": 0}}, "trainer.length_penalty.budget"),
    ("checkpointer", {"keep": 0}, "checkpoint.keep"),
    ("checkpointer", {"state_dir": "/s"}, "state_dir"),
    ("sandbox", {"memory_mb": 8}, "sandbox.memory_mb"),
    ("sandbox", {"isolation": "none"}, "isolation"),
    ("publisher", {"full_every": 0}, "weights.full_every"),
    ("publisher", {"regions": ["hub"]}, "regions"),
    ("evaluator", {"n_tasks": 0}, "evaluator.n_tasks"),
    ("evaluator", {"max_tokens": 16}, "max_tokens"),
    ("demo_producer", {"tokens": 0}, "demo_producer.tokens"),
])
def test_a_builder_refuses_settings_that_do_not_fit(kind: str, settings: dict[str, Any], key: str) -> None:
    """Every kind's builder (through `build_actor`, before anything connects) raises TopologyError naming the
    key; launcher-only values are no settings keys (they travel as the kind's `*Launch`)."""
    with pytest.raises(TopologyError, match=key.replace(".", r"\.")):
        build_actor(kind, IDENT, None, settings, LIMITS)  # type: ignore[arg-type]


def test_launch_values_that_do_not_fit_are_refused_too() -> None:
    """A launch value out of bounds is a TopologyError naming it; a kind that takes none refuses them."""
    with pytest.raises(TopologyError, match=r"trainer launch\.checkpoint_interval"):
        build_actor("trainer", IDENT, None, {}, LIMITS, {"checkpoint_interval": 0})  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="takes no launch values"):
        build_actor("demo_consumer", IDENT, None, {}, LIMITS, {"x": 1})  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="unknown actor kind"):
        build_actor("nope", IDENT, None, {}, LIMITS)  # type: ignore[arg-type]


def test_builders_decode_through_one_helper() -> None:
    """The builders called directly refuse the same way (no builder lets a ValidationError escape)."""
    for build, settings, key in [(build_sandbox, {"pool_size": 0}, "sandbox.pool_size"),
                                 (build_checkpointer, {"interval_steps": 0}, "checkpoint.interval_steps"),
                                 (build_demo_producer, {"rate_per_s": -1}, "demo_producer.rate_per_s")]:
        with pytest.raises(TopologyError, match=key.replace(".", r"\.")):
            build(IDENT, None, settings, LIMITS)  # type: ignore[operator]
