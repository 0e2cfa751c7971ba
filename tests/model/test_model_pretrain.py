"""Pretraining end to end on the tiny preset, checkpoint loading, greedy decoding and the Wilson interval."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.model.evaluate import greedy_complete, wilson_interval
from rlbus.model.grading import grade_many
from rlbus.model.pretrain import (
    PretrainConfig,
    PretrainProgress,
    _documents,
    corrupt,
    load_checkpoint,
    pretrain,
    settings_key,
)
from rlbus.model.tasks import eval_tasks
from rlbus.model.tokenizer import ByteTokenizer
from rlbus.model.transformer import ModelConfig, Transformer
from rlbus.ops.cli import main

TOK = ByteTokenizer()


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
    """`rlbus pretrain --config tiny` trains (loss falls), writes a loadable checkpoint and a JSON summary."""
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
