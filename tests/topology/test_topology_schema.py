"""The schema's defaults, helpers and the pure cross-field rules, on Topology objects built in code."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rlbus.actors.common.config import FeederConfig
from rlbus.topology.file.load import check, validate_text
from rlbus.topology.file.reference import _schema_structs, field_docs, reference_markdown, struct_tables
from rlbus.topology.file.schema import ActorSpec, Region, Topology, parse_duration

MINIMAL = """
run = "m"
[[regions]]
name = "hub"
role = "hub"
actors = [{kind = "feeder"}, {kind = "generator", count = 2}, {kind = "sandbox"}, {kind = "trainer"},
          {kind = "publisher"}, {kind = "checkpointer"}]
"""


def test_minimal_file_gets_every_default() -> None:
    """A short file is enough: state dir, Ray resource, settings and instance ids come from defaults."""
    topology, problems = validate_text(MINIMAL, local_cores=64)
    assert problems == [] and topology is not None
    assert topology.state_path == Path(".rlbus/m")
    assert topology.hub.resource == "region:hub"
    assert topology.generator.group_size == 8 and topology.trainer.batch_rollouts == 64
    assert topology.launch.backend == "local" and topology.durability.sync_interval == "default"
    assert [i.actor_id for i in topology.instances() if i.kind == "generator"] == ["hub-generator-0", "hub-generator-1"]
    assert all(i.torch_threads == 1 for i in topology.instances())


def test_schema_rejects_unknown_fields_itself() -> None:
    """The Structs forbid unknown keys even when decoded directly with msgspec."""
    with pytest.raises(msgspec.ValidationError, match="unknown field `colour`"):
        msgspec.convert({"kind": "trainer", "colour": "red"}, type=ActorSpec)


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("90s", 90.0), ("2m", 120.0), ("1h", 3600.0),
                                               ("7d", 604800.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    """Durations are a whole number and a unit."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["7 days", "0s", "1.5h", "", "s"])
def test_parse_duration_rejects(text: str) -> None:
    """Anything else is a ValueError naming the text."""
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def _hub(*kinds: str) -> list[ActorSpec]:
    return [ActorSpec(kind=k) for k in kinds]  # type: ignore[arg-type]


FULL = ("feeder", "generator", "sandbox", "trainer", "publisher", "checkpointer")


def test_check_is_pure_on_objects() -> None:
    """check() works on a Topology built in code and finds the cross-field problems of two hubs and a lost trainer."""
    topology = Topology(run="r", regions=[
        Region(name="a", role="hub", actors=_hub("feeder", "generator", "sandbox", "publisher", "checkpointer")),
        Region(name="b", role="hub", actors=_hub("generator", "sandbox")),
        Region(name="c", actors=_hub("generator", "sandbox", "trainer")),
    ])
    problems = check(topology, local_cores=64)
    assert [(p.key, p.severity) for p in problems] == [("regions[1].role", "error"),
                                                       ("regions[2].actors[2].kind", "error")]
    assert problems[1].message == "the trainer must run in the hub region 'a', found it in leaf region 'c'"
    assert problems[0].file == ""


def test_threads_counted_per_host() -> None:
    """Torch threads add up per host: two regions on one named host with 4 cores asking 2x3 threads warn once."""
    topology = Topology(run="r", regions=[
        Region(name="a", role="hub", host="box", cores=4,
               actors=[*_hub(*FULL), ActorSpec(kind="generator", name="big", torch_threads=2)]),
        Region(name="b", host="box", actors=_hub("generator", "sandbox")),
        Region(name="c", host="far", actors=_hub("generator", "sandbox")),   # cores unknown: not checked
    ])
    problems = check(topology, local_cores=1)
    assert [(p.key, p.severity) for p in problems] == [("regions[0].host", "warning")]
    # a: generator 1 + trainer 1 + publisher 1 + big 2; b: generator 1 -> 6 > 4
    assert "host 'box' has 4 cores but its torch actors ask for 6 threads" in problems[0].message


def test_region_weights_for_a_region_without_generators() -> None:
    """A region weight > 0 on a region with no generators is an error naming that weight's key."""
    topology = Topology(run="r", regions=[
        Region(name="hub", role="hub", actors=_hub(*FULL)),
        Region(name="eu", actors=_hub("sandbox")),
    ], feeder=FeederConfig(region_weights={"hub": 1.0, "eu": 3.0}))
    problems = check(topology, local_cores=64)
    assert [(p.key, p.severity) for p in problems] == [
        ("regions[1].actors", "warning"),    # eu has sandboxes and nothing to use them
        ("feeder.region_weights.eu", "error"),
    ]
    assert problems[1].message == "region 'eu' gets tasks (weight 3.0) but has no generator to work on them"


def test_every_schema_field_has_a_docstring() -> None:
    """STYLE rule 9: a docstring line under every field of every schema Struct (the reference is built from them)."""
    structs = _schema_structs()
    assert len(structs) >= 14
    for cls in structs:
        docs = field_docs(cls)
        missing = [f.name for f in msgspec.structs.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_reference_names_every_key_of_every_table() -> None:
    """The generated reference has a section per table and a row per key, with its docstring."""
    text = reference_markdown()
    headers = [h for h, _ in struct_tables()]
    assert headers[:3] == ["", "[[regions]]", "[[regions.actors]]"]
    assert "[trainer.length_penalty]" in headers
    for header, t in struct_tables():
        assert (f"## `{header}`" if header else "## top level") in text
        docs = field_docs(t.cls)
        for field in t.fields:
            assert f"| `{field.encode_name}` |" in text
            assert docs[field.name] in text
    assert "| `role` | one of 'hub', 'leaf' | `\"leaf\"` |" in text
    assert "| `run` | a name of letters, digits, '_' or '-'" in text


def test_redeliver_after_is_both_ack_waits_of_the_run() -> None:
    """`[durability] redeliver_after` sets the generators' and the trainer's ack wait (default 60s), and the
    consumers' configs carry it; `rlbus chaos` shortens it so its quiet period does not wait a minute."""
    from rlbus.messages.streams import generator_consumer, trainer_consumer
    from rlbus.messages.subjects import Subjects
    from rlbus.ops.chaos.run import chaos_topology
    from rlbus.topology.backends.launch import stream_settings

    topology, problems = validate_text(MINIMAL)
    assert topology is not None and not [p for p in problems if p.severity == "error"], problems
    default = stream_settings(topology)
    assert default.ack_wait_s == default.trainer_ack_wait_s == 60.0
    topology, problems = validate_text(MINIMAL + '[durability]\nredeliver_after = "15s"\n')
    assert topology is not None and not [p for p in problems if p.severity == "error"], problems
    short = stream_settings(topology)
    assert short.ack_wait_s == short.trainer_ack_wait_s == 15.0
    s = Subjects("m")
    assert generator_consumer(s, "hub", short).ack_wait == trainer_consumer(s, short).ack_wait == 15.0
    assert stream_settings(chaos_topology()).trainer_ack_wait_s == 20.0
