"""`[trainer] precision`: `rlbus validate` refuses an expert precision on a policy without experts in one line
naming the key, accepts it with `precision_scope = "all"` or on a mixture-of-experts policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf import build_family

from rlbus.ops.cli import main
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import validate


def _topology(tmp_path: Path, trainer: str, policy: str = "") -> Path:
    text = example_path("tiny").read_text().replace("[trainer]\n", f"[trainer]\n{trainer}\n", 1)
    if policy:
        text = text.replace('run = "tiny"', f'run = "tiny"\n\n{policy}\n', 1)
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_expert_precision_on_a_dense_policy_is_one_line_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topology(tmp_path, 'precision = "nvfp4"')
    assert main(["validate", str(path)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if "trainer.precision" in line]
    assert len(lines) == 1 and "precision_scope" in lines[0] and "'nvfp4'" in lines[0], lines


def test_scope_all_quantises_a_dense_policy(tmp_path: Path) -> None:
    topology, problems = validate(_topology(tmp_path, 'precision = "mxfp8"\nprecision_scope = "all"'))
    assert topology is not None and not [p for p in problems if p.severity == "error"], problems
    assert topology.trainer.precision == "mxfp8" and topology.trainer.precision_scope == "all"


def test_expert_precision_on_a_moe_policy_and_bad_values(tmp_path: Path) -> None:
    """A Qwen3-MoE directory takes nvfp4 on its experts; a threshold above 1 or an unknown precision is refused."""
    moe = build_family(tmp_path / "models", "qwen3_moe")
    policy = f'[policy]\nkind = "hf"\npath = "{moe}"'
    topology, problems = validate(_topology(tmp_path, 'precision = "nvfp4"\nrouter_replay_threshold = 0.5', policy))
    assert topology is not None, problems
    assert topology.trainer.router_replay_threshold == 0.5
    _, problems = validate(_topology(tmp_path, 'precision = "fp4"\nrouter_replay_threshold = 1.5', policy))
    keys = {p.key for p in problems if p.severity == "error"}
    assert keys == {"trainer.precision", "trainer.router_replay_threshold"}, problems
