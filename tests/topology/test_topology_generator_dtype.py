"""The launcher hands generators the topology's `[policy] dtype`, the dtype they build their synced policy in."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rlbus.actors.generator.config import GeneratorLaunch
from rlbus.topology.backends.launch import kind_launch
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generator_launch_carries_the_policy_dtype(dtype: str, tmp_path: Path) -> None:
    """[policy] dtype reaches GeneratorLaunch.dtype unchanged; the default is bfloat16."""
    topology = load(example_path("tiny"))
    assert kind_launch(topology, "generator", tmp_path).dtype == "bfloat16"
    changed = msgspec.structs.replace(topology, policy=msgspec.structs.replace(topology.policy, dtype=dtype))
    launch = kind_launch(changed, "generator", tmp_path)
    assert isinstance(launch, GeneratorLaunch) and launch.dtype == dtype
