"""`[durability] replicas` with embedded servers: 1 or 3 (each region a 3-node cluster) is accepted, any other count
is refused naming the key, and replicas 3 beside a shaped link (`[regions.link]`) is refused naming both keys."""

from __future__ import annotations

from rlbus.topology.examples import example_path
from rlbus.topology.file.load import validate_text

LINKED_LEAF = """
[[regions]]
name = "eu"
role = "leaf"
actors = [{kind = "generator"}, {kind = "sandbox"}]
  [regions.link]
  bandwidth = "100mbit"
  latency = "5ms"
"""


def _tiny(replicas: int, extra: str = "") -> str:
    return example_path("tiny").read_text() + extra + f"\n[durability]\nreplicas = {replicas}\n"


def test_embedded_replicas_are_1_or_3_and_not_beside_a_shaped_link() -> None:
    """replicas 3 loads; 2 and 5 are one error at durability.replicas; 3 with a linked leaf names both keys."""
    for ok in (1, 3):
        topology, problems = validate_text(_tiny(ok), local_cores=2)
        assert topology is not None and topology.durability.replicas == ok, problems
    for bad in (2, 5):
        topology, problems = validate_text(_tiny(bad), local_cores=2)
        errors = [p for p in problems if p.severity == "error"]
        assert topology is None and [p.key for p in errors] == ["durability.replicas"], errors
        assert f"expected 1 (one server per region) or 3 (each region a 3-node JetStream cluster) with embedded " \
               f"servers, found {bad}" in errors[0].message
    topology, problems = validate_text(_tiny(1, LINKED_LEAF), local_cores=2)
    assert topology is not None, problems
    topology, problems = validate_text(_tiny(3, LINKED_LEAF), local_cores=2)
    errors = [p for p in problems if p.severity == "error"]
    assert topology is None and [p.key for p in errors] == ["durability.replicas"], errors
    assert "regions[1].link" in errors[0].message and "replicas = 1" in errors[0].message
