"""The trainer's precision and replay check: `build_core` runs NVFP4 experts, publishes a spec from which a
generator builds the same quantised forward (so behaviour logprobs are the quantised forward's), and each step
counts the replayed experts the plausibility check replaced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.rollouts import sample_rollouts

from rlbus.actors.trainer.core import Objective, build_core, rollout_batch
from rlbus.messages.schemas import Rollout, TensorBlob
from rlbus.model.policies.interface import policy_from_spec
from rlbus.model.policies.quant import QuantLinear
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    model = Transformer(ModelConfig.tiny(vocab_size=264, moe_layers=(0, 1), n_experts=4, top_k=2))
    path = tmp_path_factory.mktemp("moe") / "pretrain.pt"
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": ByteTokenizer().info(), "meta": {}}, path)
    return path


def _quantised(module: torch.nn.Module) -> int:
    return sum(isinstance(m, QuantLinear) for m in module.modules())


def test_generators_build_the_trainers_quantised_forward(moe_checkpoint: Path) -> None:
    """The published spec names nvfp4; a policy built from it (as generators build theirs) gives the trainer's
    logits bit for bit, and rollouts it samples replay to their behaviour logprobs at the trainer."""
    core = build_core(str(moe_checkpoint), lr=1e-3, seed=0, device="cpu", precision="nvfp4")
    assert _quantised(core.policy.module) == _quantised(core.reference.module) == 24
    spec = core.model_config_dict()
    assert spec["numerics"] == {"precision": "nvfp4", "scope": "experts"}
    generator = policy_from_spec(spec, dtype=torch.float32)
    generator.load_tensors_({k: v.detach() for k, v in core.policy.named_tensors().items()})
    plain = policy_from_spec({k: v for k, v in spec.items() if k != "numerics"}, dtype=torch.float32)
    plain.load_tensors_({k: v.detach() for k, v in core.policy.named_tensors().items()})
    tokens = torch.randint(0, 264, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = core.policy(tokens).logits
        assert torch.equal(generator(tokens).logits, want)
        assert not torch.equal(plain(tokens).logits, want)
    rollouts = sample_rollouts(generator, tasks=2, group_size=2, max_new_tokens=6, seed=1)
    batch = rollout_batch(rollouts, moe=core.moe)
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)


def _flipped(rollouts: list[Rollout]) -> list[Rollout]:
    out = []
    for r in rollouts:
        assert r.routing is not None
        routing = (r.routing.numpy() + 1) % 4
        out.append(msgspec.structs.replace(r, routing=TensorBlob.of(routing, "int64")))
    return out


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_each_step_counts_the_replaced_experts(moe_checkpoint: Path, threshold: float) -> None:
    """Replaying each rollout's own routing replaces nothing; replaying other experts (ids + 1 mod 4) replaces
    some at threshold 1 and none at threshold 0 (replay as recorded)."""
    core = build_core(str(moe_checkpoint), lr=1e-3, seed=0, device="cpu", precision="mxfp8",
                      router_replay_threshold=threshold)
    rollouts = sample_rollouts(core.policy, tasks=2, group_size=2, max_new_tokens=6, seed=2)
    own = core.train_step(rollouts, Objective())
    assert own.replayed and own.replaced_experts == 0
    flipped = core.train_step(_flipped(rollouts), Objective())
    assert flipped.replayed
    assert (flipped.replaced_experts > 0) == (threshold > 0)
