"""MTP heads of a Hugging Face policy (model/training/mtp.py): distilled from the policy on text, stored beside the
model as `mtp_heads.safetensors` (plain transformers still loads the directory), loaded by `HFPolicy` and carried
by its spec's files, and used by speculative sampling with the same tokens and logprobs as plain decoding."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.hf import TEXTS, build_family, prompts, random_state

from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import policy_from_spec
from rlbus.model.sampling.generate import generate
from rlbus.model.sampling.speculative import speculative_sample
from rlbus.model.training.mtp import MTP_FILE, distill_mtp_heads, summary

torch.set_num_threads(1)


def _documents(policy: HFPolicy) -> Iterator[tuple[list[int], list[float]]]:
    ids = [policy.tokenizer.encode(t) for t in TEXTS]
    for i in itertools.count():
        doc = [t for k in range(6) for t in ids[(7 * i + k) % len(ids)]]
        yield doc, [1.0] * len(doc)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFPolicy, dict[str, float | list[float]]]:
    """A tiny Llama (weights with more signal than the init) saved with 2 heads distilled for 30 steps."""
    folder = build_family(tmp_path_factory.mktemp("mtp"), "llama")
    policy = HFPolicy.load(folder)
    policy.load_tensors_(random_state(policy, seed=3))
    result = distill_mtp_heads(policy, _documents(policy), n_heads=2, steps=30, batch_size=4, seq_len=64)
    policy.set_mtp_heads(result.heads)
    policy.module.save_pretrained(folder)
    for name, data in policy.files().items():
        (folder / name).write_bytes(data)
    return folder, policy, summary(result)


def test_distilled_heads_are_stored_beside_the_model_and_load_with_it(
        distilled: tuple[Path, HFPolicy, dict[str, float | list[float]]]) -> None:
    """Distillation lowers the heads' KL to the main head; the file loads back into `HFPolicy.load` and
    `policy_from_spec` (the spec lists it), and plain transformers loads the directory to the same logits."""
    folder, policy, record = distilled
    assert record["final_kl"] < 0.85 * record["first_kl"]  # type: ignore[operator]
    assert (folder / MTP_FILE).is_file() and MTP_FILE in policy.spec()["files"]
    again = HFPolicy.load(folder)
    joined = policy_from_spec(policy.spec(), policy.files(), dtype=torch.float32)
    joined.load_tensors_(policy.published_state(torch.float32))
    for other in (again, joined):
        assert other.mtp_heads is not None
        for (name, a), (_, b) in zip(policy.mtp_heads.state_dict().items(),  # type: ignore[union-attr]
                                     other.mtp_heads.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([prompts(policy)[0]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, policy.forward(ids).logits, atol=1e-5, rtol=0)


def test_hf_speculation_keeps_greedy_tokens_and_the_policys_logprobs(
        distilled: tuple[Path, HFPolicy, dict[str, float | list[float]]]) -> None:
    """Greedy: the tokens and logprobs of `generate(temperature=0)`, some drafts kept; sampled at temperature 1:
    every recorded logprob is a plain forward's."""
    _, policy, _ = distilled
    batch = prompts(policy)
    plain = generate(policy, batch, max_new_tokens=16, temperature=0)
    spec, stats = speculative_sample(policy, batch, max_new_tokens=16, temperature=0)
    for a, b in zip(plain, spec, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert stats.accepted > 0
    sampled, _ = speculative_sample(policy, batch, max_new_tokens=16, generator=torch.Generator().manual_seed(1))
    for prompt, s in zip(batch, sampled, strict=True):
        with torch.no_grad():
            logits = policy.forward(torch.tensor([prompt + s.tokens.tolist()])).logits[0, len(prompt) - 1 : -1]
        exact = torch.log_softmax(logits.float(), -1).gather(-1, s.tokens[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs, exact, atol=1e-4, rtol=0)


def test_a_phase_with_mtp_heads_distils_them_beside_its_model_and_again_on_resume(tmp_path: Path) -> None:
    """A main phase with `mtp_heads = 2` leaves `mtp_heads.safetensors` beside the model it saved (its marker
    records the distillation); a run that stopped after the save, before the marker, distils the same heads."""
    import dataclasses

    from rlbus.model.policies.interface import load_policy
    from rlbus.model.training.phases import Phase, marker_name, run_phases
    from rlbus.model.training.pretrain import PretrainConfig

    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "mod.py").write_text("".join(f"def f_{i}(x, y):\n    return x * {i} + y\n\n\n" for i in range(40)))
    config = PretrainConfig.preset("tiny", eval_n=1, max_new_tokens=4, batch_size=2, code_fraction=1.0,
                                   corpus_dirs=(str(src.parent),), stdlib=False)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=128))
    phase = Phase("main", "main", 1, seq_len=64, mtp_heads=2, mtp_steps=3)
    start = HFPolicy.load(build_family(tmp_path, "qwen2-tied"), dtype=torch.float32)
    out = tmp_path / "out"
    result = run_phases(config, [phase], 0, out, 1, policy=start)
    heads = (out / MTP_FILE).read_bytes()
    assert result.phases[0]["mtp"]["heads"] == 2 and result.phases[0]["mtp"]["steps"] == 3
    loaded = load_policy(out)
    assert isinstance(loaded, HFPolicy) and loaded.mtp_heads is not None and len(loaded.mtp_heads) == 2
    (out / marker_name(0, phase)).unlink()
    (out / MTP_FILE).unlink()
    again = run_phases(config, [phase], 0, out, 1, policy=start)
    assert again.phases[0]["resumed"] == "saved before its marker"
    assert (out / MTP_FILE).read_bytes() == heads
