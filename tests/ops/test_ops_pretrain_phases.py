"""`rlbus pretrain --phases FILE` and `rlbus up`'s pretraining with `[[pretrain.phases]]`: phases run into one
output and print their losses (the long-context one its held-out loss at the new length), a finished run is not
trained again, and a bad key is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import pytest

from rlbus.ops.cli import main
from rlbus.ops.up import _ensure_pretrained
from rlbus.topology.examples import __file__ as examples_init
from rlbus.topology.file.load import validate_text

TINY: Final = (Path(examples_init).parent / "tiny.toml").read_text().replace("steps = 30\n", "").replace(
    "eval_n = 8", "eval_n = 1\nmax_seq_len = 128")


def _phases_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "phases.toml"
    path.write_text(f'[pretrain]\npreset = "tiny"\neval_n = 1\nthreads = 1\nmax_seq_len = 128\n{body}')
    return path


def _repos(root: Path) -> Path:
    for name in ("alpha", "beta", "gamma"):
        (root / name).mkdir(parents=True)
        (root / name / "core.py").write_text("".join(f"def {name}_{i}(x):\n    return x + {i}\n\n\n"
                                                      for i in range(20)))
    return root


def test_pretrain_phases_runs_each_phase_once_into_one_output(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A main then a long-context phase: both print their step lines and the long one its held-out loss before and
    after at 512 tokens; the same command again finds both markers and trains nothing."""
    repos = _repos(tmp_path / "repos")
    path = _phases_file(tmp_path, '[[pretrain.phases]]\nname = "main"\nsteps = 2\nbatch_size = 2\n\n[[pretrain.phases]]\n'
                                  f'name = "long"\nkind = "long_context"\nsteps = 1\nseq_len = 512\ndata = "{repos}"\n')
    out = tmp_path / "out"
    args = ["pretrain", "--phases", str(path), "--out", str(out)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "step     1/2" in first and "step     3/3" in first and "held-out loss at 512 tokens" in first
    assert "phase 2 long" in first and sorted(p.name for p in out.glob("*.done")) == ["phase-1-main.done",
                                                                                      "phase-2-long.done"]
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "step     " not in again and "held-out greedy pass@1" in again
    assert [p["name"] for p in json.loads((out / "pretrain.json").read_text())["phases"]] == ["main", "long"]


def test_a_bad_phase_key_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A long-context seq_len under 4x the context, and an unknown kind, are refused in one line naming the key."""
    short = _phases_file(tmp_path, '[[pretrain.phases]]\nname = "long"\nkind = "long_context"\nsteps = 1\n'
                                   'seq_len = 256\n')
    assert main(["pretrain", "--phases", str(short), "--out", str(tmp_path / "o")]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"rlbus pretrain: {short}: pretrain: phases[0].seq_len: 256;") and "= 512" in said
    kind = _phases_file(tmp_path, '[[pretrain.phases]]\nname = "x"\nkind = "finetune"\nsteps = 1\n')
    assert main(["pretrain", "--phases", str(kind), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith(f"rlbus pretrain: {kind}: pretrain.phases[0].kind: Invalid enum value")


def test_rlbus_up_pretrains_the_phases_of_its_topology_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlbus up`'s pretraining runs `[[pretrain.phases]]` (here main then sft) into the run's pretrained/, and a
    second start finds the finished base instead of training again."""
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "def one():"},
                                             {"role": "assistant", "content": "return 1"}]}) + "\n")
    text = TINY + (f'\n[[pretrain.phases]]\nname = "main"\nsteps = 2\nbatch_size = 2\n\n[[pretrain.phases]]\nname = "chat"\n'
                   f'kind = "sft"\nsteps = 1\ndata = "{data}"\n')
    topology, problems = validate_text(text)
    assert topology is not None, problems
    state = tmp_path / "state"
    summary = _ensure_pretrained(topology, state, cache=False)
    first = capsys.readouterr().out
    assert summary is not None and "main main 2 steps, chat sft 1 steps" in first and "step     3/3" in first
    assert [p["kind"] for p in json.loads((state / "pretrained" / "pretrain.json").read_text())["phases"]] == [
        "main", "sft"]
    _ensure_pretrained(topology, state, cache=False)
    assert "pretrained policy found" in capsys.readouterr().out
