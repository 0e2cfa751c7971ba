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
    """A tiny Llama (weights with more signal than the init) saved with 2 heads distilled for 40 steps."""
    folder = build_family(tmp_path_factory.mktemp("mtp"), "llama")
    policy = HFPolicy.load(folder)
    policy.load_tensors_(random_state(policy, seed=3))
    result = distill_mtp_heads(policy, _documents(policy), n_heads=2, steps=40, batch_size=4, seq_len=96)
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
