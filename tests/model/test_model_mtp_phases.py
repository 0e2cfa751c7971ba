"""MTP heads of the built-in policy from a pretraining phase with `mtp_heads` (model/training/phases.py,
model/training/mtp.py `distill_mtp_heads`): distilled from scratch, saved in the phase's `pretrain.pt`, kept by
the phases after it and by a resumed run, and drafting for exact speculative sampling."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import PolicyError
from rlbus.model.policies.transformer import ModelConfig
from rlbus.model.sampling.generate import generate
from rlbus.model.sampling.speculative import drafter_for, speculative_sample
from rlbus.model.training.phases import Phase, marker_name, run_phases
from rlbus.model.training.pretrain import CHECKPOINT_NAME, PretrainConfig

HEADS = Phase("main", "main", 60, seq_len=64, lr=1e-2, warmup_steps=0, mtp_heads=2, mtp_steps=40)
LATER = Phase("more", "main", 2, seq_len=64)
PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24]]


def _config(tmp: Path) -> PretrainConfig:
    src = tmp / "src" / "pkg"
    src.mkdir(parents=True, exist_ok=True)
    (src / "mod.py").write_text("".join(f"def f_{i}(x, y):\n    return x * {i} + y\n\n\n" for i in range(40)))
    config = PretrainConfig.preset("tiny", eval_n=1, max_new_tokens=4, batch_size=4, code_fraction=1.0,
                                   corpus_dirs=(str(src.parent),), stdlib=False)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=128))


def _heads(policy: BuiltinPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.transformer.state_dict().items() if k.startswith("mtp.")}


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[PretrainConfig, Path, dict]:
    """A run of the one phase with heads: its config, output folder and marker record."""
    tmp = tmp_path_factory.mktemp("mtp-phases")
    config = _config(tmp)
    result = run_phases(config, [HEADS], 0, tmp / "out", 1)
    return config, tmp / "out", result.phases[0]


def test_a_builtin_phase_distils_heads_whose_loss_falls_into_its_checkpoint(distilled: tuple) -> None:
    """The marker records 2 heads, 40 steps and a falling distillation KL; `pretrain.pt` loads with them (the
    config says 2, the heads are no longer their zero initialisation) and `drafter_for` accepts the policy."""
    _, out, record = distilled
    mtp = record["mtp"]
    assert mtp["heads"] == 2 and mtp["steps"] == 40 and mtp["file"] == CHECKPOINT_NAME
    assert mtp["final_kl"] < 0.8 * mtp["first_kl"]
    loaded = BuiltinPolicy.load(out)
    assert loaded.config.mtp_heads == 2 and len(loaded.transformer.mtp) == 2
    assert all(float(h.fc.weight.detach().abs().max()) > 0 for h in loaded.transformer.mtp)
    assert drafter_for(loaded).n_heads == 2


def test_the_heads_survive_a_later_phase_and_a_resume_at_a_boundary(distilled: tuple, tmp_path: Path) -> None:
    """Run again with a later phase (the first is marked, so the run resumes at its boundary from the saved
    model): the later phase trains the model, not the heads, and saves them. A run stopped after the first
    phase's save, before its marker, distils the same heads again."""
    config, out, _ = distilled
    heads = _heads(BuiltinPolicy.load(out))
    main = BuiltinPolicy.load(out).transformer.embed.weight.clone()
    resumed = run_phases(config, [HEADS, LATER], 0, out, 1)
    assert [r["name"] for r in resumed.phases] == ["main", "more"] and "mtp" not in resumed.phases[1]
    after = BuiltinPolicy.load(out)
    assert after.config.mtp_heads == 2 and not torch.equal(after.transformer.embed.weight, main)
    for name, value in _heads(after).items():
        torch.testing.assert_close(value, heads[name], atol=0, rtol=0)
    again = tmp_path / "again"
    run_phases(config, [HEADS], 0, again, 1)
    (again / marker_name(0, HEADS)).unlink()
    redone = run_phases(config, [HEADS], 0, again, 1)
    assert redone.phases[0]["resumed"] == "saved before its marker"
    for name, value in _heads(BuiltinPolicy.load(again)).items():
        torch.testing.assert_close(value, heads[name], atol=0, rtol=0)


def test_speculation_with_the_distilled_heads_equals_plain_greedy(distilled: tuple) -> None:
    """Greedy speculative sampling drafts with the distilled heads, keeps some drafts, and emits exactly the
    tokens and logprobs of plain greedy decoding."""
    _, out, _ = distilled
    model = BuiltinPolicy.load(out).transformer
    plain = generate(model, PROMPTS, max_new_tokens=16, temperature=0)
    spec, stats = speculative_sample(model, PROMPTS, max_new_tokens=16, temperature=0)
    for a, b in zip(plain, spec, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert stats.accepted > 0 and stats.forward_passes < 16


def test_a_routed_policy_is_refused_its_heads(tmp_path: Path) -> None:
    """Speculative sampling refuses an MoE policy, so a phase refuses to distil heads it could never draft with."""
    config = _config(tmp_path)
    config = dataclasses.replace(config, model=ModelConfig.tiny(vocab_size=config.model.vocab_size, max_seq_len=128,
                                                                moe_layers=(1,), n_experts=2, top_k=1))
    with pytest.raises(PolicyError, match="routed"):
        run_phases(config, [dataclasses.replace(HEADS, steps=1, mtp_steps=1)], 0, tmp_path / "out", 1)
