"""Pretraining end to end on the tiny preset (built-in and Hugging Face), continuing a run, checkpoint loading,
the code corpus and its decontamination, greedy decoding and the Wilson interval."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.model.policies.interface import load_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.evaluate import greedy_complete, wilson_interval
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.model.tasks.grading import grade_many
from rlbus.model.training.corpus import (
    SKIP_DIRS,
    Decontaminator,
    code_documents,
    source_files,
    split_source,
    stdlib_root,
)
from rlbus.model.training.pretrain import (
    PretrainConfig,
    PretrainProgress,
    PretrainResult,
    _corpus,
    _documents,
    corrupt,
    load_checkpoint,
    new_hf_policy,
    pretrain,
    settings_key,
)
from rlbus.ops.cli import main

TOK = ByteTokenizer()
PNG = b"\x89PNG\r\n\x1a\n"


def test_wilson_interval_hand_values() -> None:
    """Wilson 95% bounds match hand computation: 20/200 -> (0.0657, 0.1494), 0/10 -> (0, 0.2775)."""
    low, high = wilson_interval(20, 200)
    assert low == pytest.approx(0.06566, abs=1e-4) and high == pytest.approx(0.14943, abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(3.8415 / 10 / (1 + 3.8415 / 10), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_greedy_with_cache_matches_full_recompute() -> None:
    """Length-sorted, left-padded cached greedy decoding equals argmax of a full forward pass at every step."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size))
    prompts = [[256, 5, 9, 13], [256, 7], [256, 1, 2, 3, 4, 5, 6]]
    out = greedy_complete(model, prompts, max_new_tokens=6, stop_id=TOK.stop_id, pad_id=TOK.pad_id, batch_size=2)
    for prompt, completion in zip(prompts, out, strict=True):
        seq = list(prompt)
        with torch.no_grad():
            while len(seq) < len(prompt) + 6 and seq[-1] != TOK.stop_id:
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert completion == seq[len(prompt):]


def test_a_prompt_past_the_context_gets_an_empty_completion_and_the_others_decode_as_alone() -> None:
    """A prompt whose length plus max_new_tokens exceeds max_seq_len is not decoded (an empty completion);
    the other prompts get what they get without it."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size))
    short, long = [256, 5, 9, 13], [256] + [7] * 251            # 252 + 6 > 256
    out = greedy_complete(model, [long, short], max_new_tokens=6, stop_id=TOK.stop_id, pad_id=TOK.pad_id)
    alone = greedy_complete(model, [short], max_new_tokens=6, stop_id=TOK.stop_id, pad_id=TOK.pad_id)
    assert out == [[], alone[0]] and alone[0]


def test_corrupted_attempts_fail_and_documents_mask_them() -> None:
    """Most corrupted solutions fail; a retry document trains only on the final, correct attempt."""
    rng = random.Random(1)
    tasks = eval_tasks(1, 60)
    results = grade_many([(t, corrupt(t.solution, rng)) for t in tasks])
    assert sum(not r.passed for r in results) >= 50
    config = PretrainConfig.preset("tiny", retry_fraction=1.0)
    ids, weights = next(_documents(config, seed=0, tokenizer=TOK))
    text = TOK.decode(ids, specials=True)
    assert text.count("<|assistant|>") == 2 and "<|observation|>" in text and "tests passed" in text
    trained = TOK.decode([i for i, w in zip(ids, weights, strict=True) if w > 0])
    final = text.rsplit("<|assistant|>", 1)[1].removesuffix("<|end_turn|>")
    assert trained == final


def test_tiny_pretrain_end_to_end(tmp_path: Path) -> None:
    """`rlbus pretrain --config tiny` trains (loss falls), writes a loadable checkpoint, a JSON summary and the loss
    curve; `--from` that folder continues the step count."""
    code = main(["pretrain", "--config", "tiny", "--steps", "30", "--seed", "1", "--threads", "1",
                 "--eval-n", "12", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "pretrain.json").read_text())
    assert summary["step"] == 30 and summary["eval"]["n"] == 12
    assert summary["final_loss"] < summary["first_loss"] - 1.5  # first ~ ln(264) = 5.58
    low, high = summary["eval"]["ci95"]
    assert (low, high) == pytest.approx(wilson_interval(summary["eval"]["passed"], 12))
    model, tokenizer, meta = load_checkpoint(tmp_path)
    assert tokenizer == TOK and meta["final"] and meta["seed"] == 1
    assert model.config.vocab_size == TOK.vocab_size and not model.training
    reloaded = load_checkpoint(tmp_path / "pretrain.pt")[0]
    for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG)
    assert summary["policy"] == "builtin" and len(summary["losses"]) == 30 and summary["config"]["code_fraction"] == 0
    more = tmp_path / "more"
    assert main(["pretrain", "--from", str(tmp_path), "--steps", "2", "--threads", "1", "--eval-n", "2",
                 "--out", str(more)]) == 0
    continued = json.loads((more / "pretrain.json").read_text())
    assert (continued["step"], continued["start_step"], continued["policy"]) == (32, 30, "builtin")
    assert load_checkpoint(more)[2]["step"] == 32


def test_pretrain_is_deterministic(tmp_path: Path) -> None:
    """Two runs with the same seed give identical losses, weights and completions."""
    config = PretrainConfig.preset("tiny", eval_n=4, max_new_tokens=16)
    seen: list[PretrainProgress] = []
    first = pretrain(config, 8, 3, tmp_path / "a", 1, progress=seen.append)
    second = pretrain(config, 8, 3, tmp_path / "b", 1)
    assert (first.first_loss, first.final_loss) == (second.first_loss, second.final_loss)
    assert first.eval.completions == second.eval.completions
    a, b = load_checkpoint(tmp_path / "a")[0], load_checkpoint(tmp_path / "b")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert [p.phase for p in seen][-2:] == ["eval", "checkpoint"] and seen[0].step == 1


def _changed(value: Any) -> Any:
    """Another value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, tuple):
        return (*value, 1)
    raise TypeError(value)


def test_settings_key_is_equal_for_equal_settings_and_differs_for_any_change() -> None:
    """The cache key of a pretrained base: the same settings (built afresh) give the same key; changing any
    one field of the config or of its model, the steps, the seed or the thread count gives another, each
    different from all the others."""
    config = PretrainConfig.preset("small", task_seed=1)
    key = settings_key(config, 300, 0, 2)
    assert key == settings_key(PretrainConfig.preset("small", task_seed=1), 300, 0, 2)
    assert len(key) == 16 and int(key, 16) >= 0
    others = [settings_key(config, 301, 0, 2), settings_key(config, 300, 1, 2), settings_key(config, 300, 0, 3)]
    for field in dataclasses.fields(PretrainConfig):
        if field.name != "model":
            others.append(settings_key(dataclasses.replace(config, **{field.name: _changed(getattr(config, field.name))}),
                                       300, 0, 2))
    valid = {"d_model": 256, "n_heads": 8}            # a model shape must still split into heads
    for field in dataclasses.fields(ModelConfig):
        value = valid.get(field.name, _changed(getattr(config.model, field.name)))
        model = dataclasses.replace(config.model, **{field.name: value})
        others.append(settings_key(dataclasses.replace(config, model=model), 300, 0, 2))
    assert len(others) == 3 + len(dataclasses.fields(PretrainConfig)) - 1 + len(dataclasses.fields(ModelConfig))
    assert key not in others and len(set(others)) == len(others)


# ---- the code corpus -------------------------------------------------------------------------------------

def test_a_planted_copy_of_a_held_out_task_in_a_corpus_folder_is_dropped(tmp_path: Path) -> None:
    """A --corpus file holding a held-out task's prompt and solution (re-spaced: the rule normalises whitespace)
    gives no document; a clean file beside it does, each document of it at most `code_tokens` (and the context)
    long and ending with eos, and no document of the mix contains a held-out prompt or solution."""
    config = PretrainConfig.preset("tiny", eval_n=20, code_fraction=1.0, stdlib=False,
                                   corpus_dirs=(str(tmp_path),))
    held_out = eval_tasks(config.task_seed, config.eval_n)
    task = held_out[7]
    planted = ("import os\n\n\n" + task.prompt.replace("\n", "\n\n") + task.solution.replace("    ", "\t")
               + "\n\nprint(f(3))\n")
    (tmp_path / "planted.py").write_text(planted)
    clean = "".join(f"def g{i}(a, b):\n    '''Add {i}.'''\n    return a + b + {i}\n\n" for i in range(40))
    (tmp_path / "clean.py").write_text(clean)
    decontaminate = Decontaminator(held_out)
    assert not decontaminate.clean(planted) and decontaminate.clean(clean)
    limit = min(config.model.max_seq_len, config.code_tokens) + 1
    expected = split_source(clean, TOK, limit)
    assert len(expected) > 1
    docs = list(itertools.islice(_corpus(config, 0, TOK, config.model.max_seq_len, held_out), 3 * len(expected)))
    assert sorted(map(tuple, (ids for ids, _ in docs))) == sorted(map(tuple, expected * 3))
    for ids, weights in docs:
        text = " ".join(TOK.decode(ids).split())
        assert ids[-1] == TOK.eos_id and len(ids) <= limit and set(weights) == {1.0}
        assert " ".join(task.solution.split()) not in text and "def f(" not in text


def test_the_stdlib_corpus_is_sampled_lazily_and_deterministically() -> None:
    """The standard library's sources are listed without tests, site-packages or idlelib; code documents come
    in the same order for the same seed, another for another seed; with code_fraction 0 the task documents pass
    through untouched."""
    files = source_files([], stdlib=True)
    root = stdlib_root()
    assert len(files) > 100 and all(f.is_relative_to(root) and f.suffix == ".py" for f in files)
    assert not any(SKIP_DIRS & set(f.relative_to(root).parts[:-1]) for f in files)
    assert root / "json" / "decoder.py" in files
    clean = Decontaminator(eval_tasks(0, 20))

    def first(seed: int) -> list[list[int]]:
        return [ids for ids, _ in itertools.islice(code_documents(files, TOK, 257, random.Random(seed), clean), 5)]

    assert first(1) == first(1) != first(2)
    assert all(len(ids) <= 257 and ids[-1] == TOK.eos_id for ids in first(1))
    config = PretrainConfig.preset("tiny")
    assert list(itertools.islice(_corpus(config, 4, TOK, 512, []), 12)) == list(
        itertools.islice(_documents(config, 4, TOK), 12))


# ---- Hugging Face policies ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[PretrainResult, list[PretrainProgress]]:
    """4 steps of a tiny Qwen2 built from scratch (its BPE tokenizer trained on the corpus), half the documents
    standard-library source, an intermediate checkpoint at step 2; the output folder already holds a note."""
    out = tmp_path_factory.mktemp("hf") / "qwen2"
    out.mkdir()
    (out / "NOTES.txt").write_text("kept\n")
    config = PretrainConfig.preset("tiny", eval_n=3, max_new_tokens=8, checkpoint_every=2, code_fraction=0.5,
                                   batch_size=4)
    policy = new_hf_policy(config, "qwen2", "tiny", 0, max_seq_len=256)
    seen: list[PretrainProgress] = []
    return pretrain(config, 4, 0, out, 1, progress=seen.append, policy=policy), seen


def test_a_hugging_face_run_writes_a_directory_plain_transformers_loads(
        hf_run: tuple[PretrainResult, list[PretrainProgress]]) -> None:
    """The output folder is a model directory: AutoModelForCausalLM and AutoTokenizer load it, the model's
    logits equal the in-memory policy's, `load_policy` loads it; pretrain.json and loss.png are inside, the
    intermediate checkpoint was named, no temporary folder is left beside it, and a loose file that was in the
    folder is still there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, seen = hf_run
    out = result.checkpoint
    assert result.policy is not None and result.policy.kind == "hf" and out.is_dir()
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["step"] == 4 and summary["final"] and summary["policy"] == "hf" and len(summary["losses"]) == 4
    assert summary["eval"]["n"] == 3 and (out / "loss.png").read_bytes().startswith(PNG)
    assert [(p.phase, p.step) for p in seen if p.phase == "checkpoint"] == [("checkpoint", 2), ("checkpoint", 4)]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    assert (out / "NOTES.txt").read_text() == "kept\n"

    policy = result.policy
    tokenizer = policy.tokenizer
    prompt = eval_tasks(0, 1)[0].prompt
    ids = torch.tensor([tokenizer.prompt_ids(prompt)])
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        expected = policy.forward(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(load_policy(out).forward(ids).logits, expected, rtol=0, atol=1e-5)
    assert hf_tok.eos_token_id == tokenizer.eos_id and hf_tok.pad_token_id == tokenizer.pad_id
    assert hf_tok.decode(ids[0].tolist(), skip_special_tokens=False) == tokenizer.decode(ids[0].tolist(),
                                                                                            specials=True)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=False)
    assert chat == tokenizer.decode(ids[0].tolist(), specials=True)


def test_from_continues_a_hugging_face_directory(hf_run: tuple[PretrainResult, list[PretrainProgress]],
                                                 tmp_path: Path) -> None:
    """`rlbus pretrain --from DIR` trains on from DIR's weights: the step count continues (4 + 2), losses are
    recorded, and the new directory loads with plain transformers and differs from DIR's weights."""
    from transformers import AutoModelForCausalLM

    start = hf_run[0].checkpoint
    out = tmp_path / "more"
    code = main(["pretrain", "--from", str(start), "--steps", "2", "--eval-n", "2", "--threads", "1",
                 "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "pretrain.json").read_text())
    assert (summary["step"], summary["start_step"], summary["from"]) == (6, 4, str(start))
    assert len(summary["losses"]) == 2 and all(0 < loss < 20 for loss in summary["losses"])
    assert summary["config"]["code_fraction"] == 0.5
    before = AutoModelForCausalLM.from_pretrained(start).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("case", ["missing", "not_a_model", "unknown_arch", "out_has_folders"])
def test_a_bad_start_is_a_one_line_error(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--from a folder that does not exist or holds no model, --hf an architecture the recipe does not build, or
    an --out folder holding folders (a Hugging Face run replaces the folder): exit 2 with one line naming it,
    nothing trained."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a model\n")
    start = {"missing": ["--from", str(tmp_path / "nope")], "not_a_model": ["--from", str(tmp_path / "notes")],
             "unknown_arch": ["--hf", "gpt7"], "out_has_folders": ["--hf", "qwen2", "--out", str(tmp_path)]}[case]
    code = main(["pretrain", "--out", str(tmp_path / "out"), *start, "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("rlbus pretrain: ")
    assert {"missing": "nope", "not_a_model": "config.json", "unknown_arch": "gpt7",
            "out_has_folders": "holds folders (notes)"}[case] in err
    assert not (tmp_path / "out").exists()
