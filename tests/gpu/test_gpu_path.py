"""The GPU path end to end, on a machine with a CUDA device: `python -m pytest -m gpu tests/gpu -rs`.

Without one every test here is skipped, saying so: nothing in the rest of the suite needs a GPU. With one,
a tiny Hugging Face policy samples (bf16, and MXFP8 weights) and trains (the Triton logprob kernel) on it, the
built-in policy does the same, and `rlbus up` runs a few RL steps with `[policy] device = "cuda"`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf import build_family
from helpers.rollouts import sample_rollouts

from rlbus.actors.trainer.core import Objective, TrainerCore
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import Policy, resolve_device
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.generate import generate
from rlbus.topology.examples import example_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device on this machine: the GPU path was not run")]

HF_POLICY = """
[policy]
kind = "hf"
device = "cuda"

  [policy.recipe]
  architecture = "qwen2"
  size = "tiny"
"""


def _policies(tmp_path: Path) -> list[Policy]:
    cuda = resolve_device("cuda")
    hf = HFPolicy.load(build_family(tmp_path, "qwen2-tied"), device=cuda, dtype=torch.float32)
    torch.manual_seed(0)
    builtin = BuiltinPolicy(Transformer(ModelConfig.tiny(vocab_size=264))).to_(device=cuda)
    return [hf, builtin]


def test_policies_sample_and_train_on_the_gpu(tmp_path: Path) -> None:
    """Sampling in bf16 and with MXFP8 weights, then one trainer step (Triton logprob kernel), all on CUDA."""
    for policy in _policies(tmp_path):
        sampler = policy.clone().to_(dtype=torch.bfloat16).eval()
        prompts = [policy.tokenizer.prompt_ids("def add(x, y):")] * 4
        for quant in ("none", "mxfp8"):
            out = generate(sampler, prompts, max_new_tokens=8, temperature=1.0, eos_id=policy.tokenizer.stop_id,
                           pad_id=policy.tokenizer.pad_id, weight_quant=quant,
                           generator=torch.Generator(device="cuda").manual_seed(0))
            assert len(out) == 4 and all(len(s.tokens) >= 1 for s in out)
            assert all(bool(torch.isfinite(s.logprobs).all()) for s in out)
        core = TrainerCore(policy, policy.clone(), lr=1e-3)
        assert core.policy.device.type == "cuda"
        rollouts = sample_rollouts(core.policy, tasks=2, group_size=2, max_new_tokens=6)
        stats = core.train_step(rollouts, Objective())
        assert stats.applied and stats.tokens > 0
        state = core.bf16_state()
        assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in state.values())


def test_rlbus_up_runs_a_few_steps_with_the_policy_on_the_gpu(tmp_path: Path) -> None:
    text = example_path("tiny").read_text().replace('run = "tiny"', 'run = "gpu"\n' + HF_POLICY, 1)
    text = text.replace("steps = 30", "steps = 4").replace("eval_n = 8", "eval_n = 4")
    topology = tmp_path / "gpu.toml"
    topology.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "up", str(topology), "--state-dir",
                           str(tmp_path / "state"), "--steps", "2", "--no-pretrained-cache"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ledger (clean)" in proc.stdout
    assert "cuda" in (proc.stdout + proc.stderr)        # the actors logged their policy's device
