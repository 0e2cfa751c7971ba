"""Tiny Hugging Face model directories for tests, built from a config (no downloads) by `rlbus.model.policies.hf_recipe`.

`FAMILIES` names the variants tests parametrize over; `build_family` writes one directory; `TEXTS` is the few KB
of text the tokenizers are trained on; `random_state` gives a policy weights of more signal than the init (a
random tied model at the usual 0.02 init just repeats its last token when decoding greedily); `prompts` are a
few encoded prompts of different lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from rlbus.model.policies.hf_recipe import build_hf_dir
from rlbus.model.policies.interface import Policy

FAMILIES: Final[dict[str, dict[str, Any]]] = {
    "llama": {"architecture": "llama"},
    # a default system turn (as Qwen2's templates add one) lands in bos()
    "qwen2-tied": {"architecture": "qwen2", "tie_embeddings": True, "system_prompt": "You are a helpful assistant."},
    "qwen2-untied": {"architecture": "qwen2", "tie_embeddings": False},
    "qwen3": {"architecture": "qwen3"},
    "qwen3_moe": {"architecture": "qwen3_moe"},
}
DENSE: Final = tuple(name for name in FAMILIES if name != "qwen3_moe")


def _texts() -> tuple[str, ...]:
    words = ("policy", "rollout", "token", "reward", "sandbox", "version", "weights", "trainer", "region", "stream")
    code = [f"def {w}_{i}(x, y):\n    return x * {i} + y  # {w}\n" for i, w in enumerate(words * 6)]
    prose = [f"The {a} sends the {b} to every {c} before version {i}.\n"
             for i, (a, b, c) in enumerate(zip(words, words[3:] + words[:3], words[7:] + words[:7], strict=True))]
    return (*code, *prose * 4)


TEXTS: Final = _texts()
"""About 4 KB of Python and prose; the same every run, so the tokenizers (and ids) are too."""

PROMPTS: Final = ("def add(x, y):", "Write a function that returns the reward of a rollout.", "ok")


def build_family(root: Path, family: str, *, seed: int = 0, max_seq_len: int = 128) -> Path:
    """Write the tiny directory of `family` (a key of `FAMILIES`) under `root`; returns it. A generator on a
    coding task needs a longer `max_seq_len` (the task's prompt alone is a few hundred of these ids)."""
    return build_hf_dir(root / family, texts=TEXTS, vocab_size=400, size="tiny", max_seq_len=max_seq_len, seed=seed,
                        **FAMILIES[family])


def random_state(policy: Policy, seed: int, std: float = 0.2) -> dict[str, Tensor]:
    """`policy.published_state(float32)` plus N(0, std^2) noise drawn from `seed`: weights whose greedy
    decoding varies (and differs between seeds)."""
    g = torch.Generator().manual_seed(seed)
    return {name: t + std * torch.randn(t.shape, generator=g)
            for name, t in policy.published_state(torch.float32).items()}


def prompts(policy: Policy) -> list[list[int]]:
    """`PROMPTS` as one-turn conversations ready for the policy (lengths differ)."""
    return [policy.tokenizer.prompt_ids(text) for text in PROMPTS]
