"""`rlbus eval --source` of a repository task file: each task a greedy agentic episode in a session of a sandbox
supervisor of its own, pass@1 the share whose hidden tests pass, per level, with the mean cost of an episode;
--samples K adds K seeded sampled episodes per task (mean@K, pass@k); a bad row is named (file, line, key) before
the weights load; the closing evaluation of `rlbus up` scores such a file the same way."""

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
    one per level); each episode is listed with its turns, why it ended and its cost, and the means add up."""
    base = str(_pretrained(tmp_path / "pretrained"))
    source = str(_write(tmp_path / "calc.jsonl", ROWS))
    code = main(["eval", base, "--source", source, "--max-tokens", "8", "--json"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == 0 and (report["n"], report["greedy_passed"], report["pass_at_1"]) == (2, 1, 0.5), out.err
    assert report["ci95"] == list(wilson_interval(1, 2)) and report["by_level"] == report["by_family"]
    assert {level: (r["n"], r["greedy_passed"], r["pass_at_1"]) for level, r in report["by_level"].items()} == {
        "repo/0": (1, 0, 0.0), "repo/2": (1, 1, 1.0)}
    episodes = report["episodes"]
    assert [(e["task_id"], e["passed"]) for e in episodes] == [("buggy", False), ("fixed", True)]
    assert all(e["turns"] >= 1 and e["ended"] in ("turns", "tokens") for e in episodes)
    assert all(1 <= e["policy_tokens"] <= 8 * e["turns"] and e["wall_s"] > 0 for e in episodes), episodes
    for key in ("turns", "tool_calls", "policy_tokens", "observation_tokens", "wall_s"):
        assert report[f"{key}_mean"] == pytest.approx(sum(e[key] for e in episodes) / 2), key
        assert report["by_level"]["repo/2"][f"{key}_mean"] == episodes[1][key], key
    assert "mean_at_k" not in report and "greedy agentic episodes on 2 repository tasks" in out.err


def test_the_built_in_repository_tasks_are_scored_as_agentic_episodes(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--source repo:1` draws the built-in level-1 tasks from `--seed`: a random tiny policy fixes none of them, so
    every episode fails its hidden tests, all in level 1; the same seed draws the same tasks."""
    base = str(_pretrained(tmp_path / "pretrained"))
    runs = []
    for _ in range(2):
        code = main(["eval", base, "--source", "repo:1", "--tasks", "2", "--seed", "3", "--max-tokens", "8", "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        runs.append(json.loads(out.out))
    report = runs[0]
    assert (report["n"], report["greedy_passed"], report["pass_at_1"]) == (2, 0, 0.0)
    assert set(report["by_level"]) == {"repo/1"}
    assert [e["task_id"] for e in report["episodes"]] == [e["task_id"] for e in runs[1]["episodes"]]
    assert all(e["task_id"].startswith("repo-L1-") for e in report["episodes"])


def test_sampled_episodes_give_mean_and_pass_at_k_for_repository_tasks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--samples 2: two sampled episodes per task besides the greedy one; a random policy leaves each repository
    as given, so every sample of the fixed task passes and none of the buggy one (mean@2 0.5, pass@1 and pass@2
    0.5 overall, 1 and 0 per level); the same seed gives the same report; the table shows the figures."""
    base = str(_pretrained(tmp_path / "pretrained"))
    source = str(_write(tmp_path / "calc.jsonl", ROWS))
    argv = ["eval", base, "--source", source, "--max-tokens", "8", "--samples", "2", "--temperature", "1.0"]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert (report["pass_at_1"], report["mean_at_k"], report["pass_at_k"]) == (0.5, 0.5, {"1": 0.5, "2": 0.5})
    assert report["by_level"]["repo/2"]["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert report["by_level"]["repo/0"]["pass_at_k_ci95"] == {"1": [0.0, 0.0], "2": [0.0, 0.0]}
    assert report["greedy_fail_tasks_by_passes"] == [1, 0, 0] and report["greedy_pass_tasks_by_passes"] == [0, 0, 1]
    assert report["sampled_cost"]["turns_mean"] >= 1 and report["temperature"] == 1.0
    assert "2 sampled episodes per task" in out.err
    assert main([*argv, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    drop = ("seconds", "wall_s_mean", "sampled_cost", "episodes", "by_level", "by_family")
    assert {k: v for k, v in again.items() if k not in drop} == {k: v for k, v in report.items() if k not in drop}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "mean@2" in text and "pass@k (unbiased, bootstrap 95%): @1 0.500" in text and "policy tok" in text


def test_a_bad_repository_row_is_refused_before_the_weights_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 naming the file, the line and the key of a bad row, with weights that do not exist (nothing is loaded
    first)."""
    source = str(_write(tmp_path / "calc.jsonl", [ROWS[0], {**ROWS[1], "files": {"../up.py": ""}}]))
    assert main(["eval", str(tmp_path / "nowhere"), "--source", source]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: key 'files'" in err and "nowhere" not in err, err


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
