"""`rlbus eval` (ops/eval.py): finds the weights (the newest durable checkpoint of a state directory, one
checkpoint directory, a pretrain.pt or a Hugging Face directory), refuses damaged or missing ones with exit 2 and a message that
says what it expected, and reports greedy and sampled pass rates whose bookkeeping adds up."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlbus.actors.checkpointer import write_durable
from rlbus.actors.trainer.core import TrainerCore
from rlbus.messages.bus import digest
from rlbus.messages.schemas import CheckpointMark
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.training.pretrain import CHECKPOINT_NAME
from rlbus.ops.cli import main
from rlbus.ops.eval import summarize

TOK = ByteTokenizer()


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=512)).eval()


def _pretrained(folder: Path) -> Path:
    folder.mkdir(parents=True)
    model = _model()
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": TOK.info(), "meta": {}}, folder / CHECKPOINT_NAME)
    return folder


def _checkpoint(state_dir: Path, step: int) -> Path:
    model = _model()
    blob = TrainerCore(BuiltinPolicy(model), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3).state_blob({"step": step})
    name = f"state-step-{step}-test"
    mark = CheckpointMark(step=step, policy_version=step, objects=[name], digests=[digest(blob)])
    return write_durable(state_dir, mark, {name: blob})


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_summarize_reports_greedy_mean_and_unbiased_pass_at_k_per_level() -> None:
    """Four tasks of K=4 samples with 3, 1, 0, 2 passes: mean@4 = 6/16; pass@k per task is 1 - C(4-c, k)/C(4, k)
    (c=3: .75, 1, 1, 1; c=1: .25, .5, .75, 1; c=2: .5, 5/6, 1, 1), averaged over the tasks and per level."""
    report = summarize(["a/1", "a/1", "b/1", "b/1"], [True, False, False, False], [3, 1, 0, 2], samples=4)
    assert (report["n"], report["greedy_passed"], report["pass_at_1"]) == (4, 1, 0.25)
    assert report["ci95"][0] < 0.25 < report["ci95"][1]
    assert report["mean_at_k"] == report["sampled_pass_at_1"] == 6 / 16
    assert list(report["pass_at_k"].values()) == pytest.approx([1.5 / 4, (1.5 + 5 / 6) / 4, 2.75 / 4, 3 / 4])
    assert list(report["pass_at_k_ci95"]) == ["1", "2", "3", "4"]
    assert all(lo <= report["pass_at_k"][k] <= hi for k, (lo, hi) in report["pass_at_k_ci95"].items())
    assert report["greedy_fail_tasks_by_passes"] == [1, 1, 1, 0, 0]
    assert report["greedy_pass_tasks_by_passes"] == [0, 0, 0, 1, 0]
    by = report["by_level"]
    assert by == report["by_family"] and list(by) == ["a/1", "b/1"]
    assert (by["a/1"]["n"], by["a/1"]["greedy_passed"], by["a/1"]["pass_at_1"], by["a/1"]["mean_at_k"]) == (
        2, 1, 0.5, 0.5)
    assert list(by["a/1"]["pass_at_k"].values()) == pytest.approx([0.5, 0.75, 0.875, 1.0])
    assert list(by["b/1"]["pass_at_k"].values()) == pytest.approx([0.25, 5 / 12, 0.5, 0.5])
    assert report["pass_at_k_ci95"] == summarize(["a/1", "a/1", "b/1", "b/1"], [True, False, False, False],
                                                 [3, 1, 0, 2], samples=4)["pass_at_k_ci95"]      # seeded
    greedy_only = summarize(["a/1"], [False], None, samples=0)
    assert "pass_at_k" not in greedy_only and "mean_at_k" not in greedy_only
    assert greedy_only["by_level"]["a/1"] == {"n": 1, "greedy_passed": 0, "pass_at_1": 0.0,
                                              "ci95": greedy_only["ci95"]}
    with pytest.raises(ValueError, match="same tasks"):
        summarize(["a/1"], [True, False], None, samples=0)


def test_summarize_scores_each_tag_over_its_tasks() -> None:
    """`by_tag` scores each tag over the tasks that carry it (a task with two tags counts in both); no tags, no
    `by_tag`."""
    report = summarize(["a/1", "a/1", "b/1", "b/1"], [True, False, False, True], [3, 1, 0, 2], samples=4,
                       tags=[["compare"], ["compare", "deletion"], ["deletion"], []])
    by = report["by_tag"]
    assert list(by) == ["compare", "deletion"]
    assert (by["compare"]["n"], by["compare"]["pass_at_1"], by["compare"]["mean_at_k"]) == (2, 0.5, 0.5)
    assert (by["deletion"]["n"], by["deletion"]["pass_at_1"], by["deletion"]["mean_at_k"]) == (2, 0.0, 1 / 8)
    assert "by_tag" not in summarize(["a/1"], [True], None, samples=0)
    with pytest.raises(ValueError, match="tags"):
        summarize(["a/1"], [True], None, samples=0, tags=[])


def test_summarize_averages_the_cost_of_episodes_overall_and_per_level() -> None:
    def cost(turns: int, calls: dict[str, int], wall_s: float) -> dict[str, object]:
        return {"turns": turns, "tool_calls": sum(calls.values()) + 1, "tool_calls_by_tool": calls,
                "policy_tokens": 10 * turns, "observation_tokens": 5 * turns, "wall_s": wall_s}

    costs = [cost(2, {"run": 2}, 1.0), cost(4, {"run": 1, "read": 3}, 3.0), cost(1, {}, 2.0)]
    sampled = [cost(1, {}, 1.0), cost(3, {"read": 1}, 1.0), cost(2, {}, 2.0), cost(2, {}, 2.0), cost(1, {}, 0.5),
               cost(1, {"run": 1}, 0.5)]
    report = summarize(["repo/0", "repo/0", "repo/2"], [False, True, True], [0, 2, 1], samples=2, costs=costs,
                       sampled_costs=sampled)
    assert (report["turns_mean"], report["tool_calls_mean"], report["policy_tokens_mean"],
            report["observation_tokens_mean"], report["wall_s_mean"]) == (7 / 3, 9 / 3, 70 / 3, 35 / 3, 2.0)
    assert report["tool_calls_by_tool"] == {"read": 1.0, "run": 1.0}
    level0, level2 = report["by_level"]["repo/0"], report["by_level"]["repo/2"]
    assert (level0["turns_mean"], level0["tool_calls_by_tool"], level0["wall_s_mean"]) == (
        3.0, {"read": 1.5, "run": 1.5}, 2.0)
    assert (level2["turns_mean"], level2["tool_calls_by_tool"], level2["tool_calls_mean"]) == (1.0, {}, 1.0)
    assert report["sampled_cost"]["turns_mean"] == 10 / 6 and level2["sampled_cost"]["tool_calls_by_tool"] == {
        "run": 0.5}
    assert level0["mean_at_k"] == 0.5 and level2["pass_at_k"] == {"1": 0.5, "2": 1.0}
    with pytest.raises(ValueError, match="same tasks"):
        summarize(["repo/0"], [True], None, samples=0, costs=costs)


def test_a_state_directory_is_scored_at_its_newest_checkpoint_and_a_pretrain_file_as_the_base(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _checkpoint(tmp_path / "run", 3)
    _checkpoint(tmp_path / "run", 7)
    code, out, err = _run(capsys, str(tmp_path / "run"), "--tasks", "6", "--samples", "2", "--max-tokens", "8",
                          "--json")
    report = json.loads(out)
    assert code == 0 and "checkpoint step 7, policy version 7" in report["weights"]
    assert report["n"] == 6 and sum(f["n"] for f in report["by_family"].values()) == 6
    assert sum(report["greedy_fail_tasks_by_passes"]) + sum(report["greedy_pass_tasks_by_passes"]) == 6
    assert len(report["greedy_fail_tasks_by_passes"]) == 3 and report["samples"] == 2
    assert report["pass_at_k"]["2"] >= report["pass_at_k"]["1"] == report["mean_at_k"] and "sampled 6/6 tasks" in err
    assert report["by_level"] == report["by_family"] and set(report["pass_at_k_ci95"]) == {"1", "2"}
    again = json.loads(_run(capsys, str(tmp_path / "run"), "--tasks", "6", "--samples", "2", "--max-tokens", "8",
                            "--json")[1])
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in report.items() if k != "seconds"}

    code, out, _ = _run(capsys, str(_pretrained(tmp_path / "pretrained")), "--tasks", "4", "--max-tokens", "8")
    assert code == 0 and "(pretrained base)" in out and "greedy pass@1 0.000" in out and "all" in out
    assert "samples" not in out


def test_damaged_or_missing_weights_are_exit_2_saying_what_was_expected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = _checkpoint(tmp_path / "run", 5)
    obj = next(step.glob("state-*"))
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF                   # one flipped byte in the middle of the state
    obj.write_bytes(bytes(data))
    code, _, err = _run(capsys, str(step), "--tasks", "2")
    assert code == 2 and "the checkpoint is damaged" in err and str(obj) in err
    obj.unlink()
    assert "missing" in _run(capsys, str(step), "--tasks", "2")[2]

    (tmp_path / "empty").mkdir()
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    for path, fragment in ((tmp_path / "nowhere", "no such file or directory"),
                           (tmp_path / "empty", "expected a run's state directory"),
                           (tmp_path / "fresh", "no durable checkpoint")):
        code, _, err = _run(capsys, str(path))
        assert code == 2 and fragment in err, err
    for flag, value in (("--tasks", "0"), ("--samples", "100000")):
        code, _, err = _run(capsys, str(tmp_path / "run"), flag, value)
        assert code == 2 and f"{flag} {value}: expected an integer" in err


def test_a_file_that_is_not_a_checkpoint_is_exit_2_from_the_real_command(tmp_path: Path) -> None:
    """The `rlbus eval` process itself, on a text file: exit 2, naming the file, the error and what was expected
    (a subprocess: torch's unpickler fails on it, and that stays out of the test process)."""
    bad = tmp_path / "text.pt"
    bad.write_text("not a checkpoint\n")
    done = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "eval", str(bad), "--tasks", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"{bad}: not a readable pretrain.pt (UnpicklingError" in done.stderr
    assert "expected the file `rlbus pretrain` or `rlbus up` writes" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_the_policy_is_the_published_bf16_one_on_the_chosen_device(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`load_policy` gives a Policy whose tokenizer the scoring uses: a checkpoint's tensors are the bf16 version
    it publishes, a pretrain.pt's the bf16 cast of its weights; `--device cuda` without CUDA is exit 2, one line."""
    from rlbus.actors.trainer.core import read_state
    from rlbus.model.policies.interface import Policy
    from rlbus.ops.eval import load_policy

    step = _checkpoint(tmp_path / "run", 4)
    policy, label = load_policy(tmp_path / "run", device="cpu")
    assert isinstance(policy, Policy) and "checkpoint step 4" in label and not policy.module.training
    assert policy.tokenizer.prompt_ids("x") == TOK.prompt_ids("x")
    saved = read_state(next(step.glob("state-*")).read_bytes())["model"]
    for name, tensor in policy.named_tensors().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, saved[name].to(torch.bfloat16)), name

    base, label = load_policy(_pretrained(tmp_path / "pretrained") / CHECKPOINT_NAME)
    want = _model().state_dict()
    assert "(pretrained base)" in label and base.device == torch.device("cpu")
    assert all(torch.equal(t, want[n].to(torch.bfloat16)) for n, t in base.named_tensors().items())

    keyless = tmp_path / "keyless.pt"
    torch.save({"state_dict": {}}, keyless)
    code, _, err = _run(capsys, str(keyless), "--tasks", "2")
    assert code == 2 and f"{keyless}: not a pretrain.pt" in err and err.count("\n") == 1, err
    if not torch.cuda.is_available():
        code, _, err = _run(capsys, str(tmp_path / "run"), "--tasks", "2", "--device", "cuda")
        assert code == 2 and "no CUDA device" in err and err.count("\n") == 1, err


def test_a_hugging_face_directory_is_scored_and_an_export_decodes_as_the_policy_it_came_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlbus eval` takes a Hugging Face directory; a built-in policy exported by `rlbus export` loads back as a
    Hugging Face policy that frames prompts with the same ids and decodes greedily to the same tokens (float32)."""
    from helpers.hf import build_family

    from rlbus.model.sampling.evaluate import greedy_complete
    from rlbus.ops.eval import load_policy

    code, out, _ = _run(capsys, str(build_family(tmp_path, "qwen2-tied")), "--tasks", "2", "--max-tokens", "4",
                        "--json", "--device", "cpu")
    report = json.loads(out)
    assert code == 0 and "Hugging Face directory, hf policy" in report["weights"] and report["n"] == 2

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.2)   # decodes past one token
    folder = tmp_path / "noisy"
    folder.mkdir()
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": TOK.info(), "meta": {}}, folder / CHECKPOINT_NAME)
    assert main(["export", str(folder), "-o", str(tmp_path / "export")]) == 0
    base, _ = load_policy(folder, dtype=torch.float32)
    exported, label = load_policy(tmp_path / "export", dtype=torch.float32)
    assert exported.kind == "hf" and "Hugging Face directory" in label
    prompts = [TOK.prompt_ids(text) for text in ("def add(x, y):", "Return the reward.", "ok")]
    assert [exported.tokenizer.prompt_ids(text) for text in ("def add(x, y):", "Return the reward.", "ok")] == prompts
    assert exported.tokenizer.stop_id == TOK.stop_id and exported.tokenizer.pad_id == TOK.pad_id
    kwargs = {"max_new_tokens": 12, "stop_id": TOK.stop_id, "pad_id": TOK.pad_id}
    want = greedy_complete(base, prompts, **kwargs)
    assert greedy_complete(exported, prompts, **kwargs) == want and len({t for row in want for t in row}) > 3


def test_any_task_source_is_scored_and_a_bad_one_is_named_before_the_weights_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--source humaneval scores the package's first problems, a JSONL file its tasks; an unreadable source is
    exit 2 naming it, even beside weights that do not exist (the tasks are read first)."""
    base = str(_pretrained(tmp_path / "pretrained"))
    code, out, err = _run(capsys, base, "--source", "humaneval", "--tasks", "3", "--max-tokens", "4", "--json")
    report = json.loads(out)
    assert code == 0 and report["n"] == 3 and report["source"] == "humaneval" and "from humaneval" in err
    listed = tmp_path / "tasks.jsonl"
    listed.write_text(json.dumps({"task_id": "inc", "prompt": "def inc(x):\n", "entry_point": "inc",
                                  "test": "def check(candidate):\n    assert candidate(1) == 2\n"}) + "\n")
    code, out, _ = _run(capsys, base, "--source", str(listed), "--max-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["n"] == 1
    for source in ("no-such-source", str(tmp_path / "missing.jsonl")):
        code, _, err = _run(capsys, str(tmp_path / "nowhere"), "--source", source)
        assert code == 2 and f"--source {source}:" in err and "nowhere" not in err, err
