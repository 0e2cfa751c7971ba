"""`rlbus eval --source` of a repository task file: each task a greedy agentic episode in a session of a sandbox
supervisor of its own, pass@1 the share whose hidden tests pass, per level; a bad row is named (file, line,
key) before the weights load, and sampling is refused for it; the closing evaluation of `rlbus up` scores such a
file the same way."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlbus.actors.trainer.core import TrainerCore
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.evaluate import wilson_interval
from rlbus.model.tasks.sources import read_repo_tasks_file
from rlbus.model.training.pretrain import CHECKPOINT_NAME
from rlbus.ops.cli import main
from rlbus.ops.final_eval import evaluate_repo_state

TOK = ByteTokenizer()
BUGGY = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a - b\n"}
FIXED = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a + b\n"}
TESTS = {"tests/test_calc.py": "import unittest\n\nfrom calc.core import add\n\n\nclass Calc(unittest.TestCase):\n"
                               "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"}
ROWS = [{"task_id": "buggy", "instruction": "add() subtracts; make it add.", "files": BUGGY, "hidden_tests": TESTS,
         "solution": FIXED},
        {"task_id": "fixed", "instruction": "Check that add() adds.", "files": FIXED, "hidden_tests": TESTS,
         "solution": {}, "level": 2}]


def _pretrained(folder: Path) -> Path:
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=1024)).eval()
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": TOK.info(), "meta": {}}, folder / CHECKPOINT_NAME)
    return folder


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_repository_task_file_is_scored_as_agentic_episodes(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A random tiny policy changes nothing: the buggy task fails and the already-fixed one passes (pass@1 0.5,
    one per level); each episode is listed with its turns and why it ended."""
    base = str(_pretrained(tmp_path / "pretrained"))
    source = str(_write(tmp_path / "calc.jsonl", ROWS))
    code = main(["eval", base, "--source", source, "--max-tokens", "8", "--json"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == 0 and (report["n"], report["greedy_passed"], report["pass_at_1"]) == (2, 1, 0.5), out.err
    assert report["by_family"] == {"repo/0": {"n": 1, "greedy_passed": 0, "pass_at_1": 0.0},
                                   "repo/2": {"n": 1, "greedy_passed": 1, "pass_at_1": 1.0}}
    assert [(e["task_id"], e["passed"]) for e in report["episodes"]] == [("buggy", False), ("fixed", True)]
    assert all(e["turns"] >= 1 and e["ended"] in ("turns", "tokens") for e in report["episodes"])
    assert "greedy agentic episodes on 2 repository tasks" in out.err


def test_a_bad_repository_row_or_sampling_is_refused_before_the_weights_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 naming the file, the line and the key of a bad row, or refusing --samples, with weights that do not
    exist (nothing is loaded first)."""
    source = str(_write(tmp_path / "calc.jsonl", [ROWS[0], {**ROWS[1], "files": {"../up.py": ""}}]))
    assert main(["eval", str(tmp_path / "nowhere"), "--source", source]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: key 'files'" in err and "nowhere" not in err, err
    _write(tmp_path / "calc.jsonl", ROWS)
    assert main(["eval", str(tmp_path / "nowhere"), "--source", source, "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "--samples 2: repository tasks are evaluated greedily only" in err and "nowhere" not in err, err


@pytest.mark.anyio
async def test_the_closing_evaluation_of_a_run_scores_a_repository_task_file_the_same_way(tmp_path: Path) -> None:
    """`rlbus up`'s closing evaluation of a trainer state on a repository task file: the same episodes in a
    sandbox supervisor of its own, as an EvalResult with pass@1 and its interval per level."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=1024)).eval()
    blob = TrainerCore(BuiltinPolicy(model), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3).state_blob({"step": 1})
    tasks = read_repo_tasks_file(_write(tmp_path / "calc.jsonl", ROWS))
    result = await evaluate_repo_state(blob, tasks, 8, 1)
    assert (result.n, result.passed, result.pass_at_1) == (2, 1, 0.5)
    assert (result.ci_low, result.ci_high) == wilson_interval(1, 2)
    assert result.by_family == {"repo/0": (0, 1), "repo/2": (1, 1)}
