"""A trainer stand-in for tests and benchmarks: real AdamW steps, each version uploaded as the trainer uploads it.

Owns: `published_state` (the bf16 cast a version is), `upload_version` (a version's full blob to the
hub's CKPT under `Subjects.version_object(N)`, then `VersionReady` on `state.version` with msg_id
`version-N`, exactly as actors/trainer/actor.py does, with the policy's files beside it) and `VersionSource`
(any policy's fp32 master weights trained with AdamW on tokens of the task corpus, one published version per step).
Does not: consume rollouts, compute RL losses or checkpoint (actors/trainer/actor.py is the real trainer).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from torch import Tensor

from rlbus.kernels.delta.state import encode_state
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import VersionReady
from rlbus.messages.subjects import Subjects
from rlbus.model.policies.builtin import config_dict
from rlbus.model.policies.interface import ChatTokenizer, Policy, as_policy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.builtin import make_task


def published_state(model: Policy | Transformer) -> dict[str, Tensor]:
    """The version a policy's fp32 master weights publish: its named tensors cast to bf16, contiguous."""
    return as_policy(model).published_state(torch.bfloat16)


async def upload_version(bus: Bus, *, version: int, step: int, state: Mapping[str, Tensor],
                         model_config: ModelConfig | Mapping[str, Any], files: Mapping[str, bytes] | None = None,
                         domain: str | None = None, threads: int = 2) -> VersionReady:
    """Upload the policy's `files` (as the trainer does beside its first version), `encode_state(state, None)` to
    CKPT as `Subjects.version_object(version)`, then publish its VersionReady (msg_id `version-<N>`, so a repeat
    is stored once). `model_config`: the policy's spec (a built-in ModelConfig is turned into one). `domain`: the
    hub's, from a leaf."""
    for data in (files or {}).values():
        await bus.put_object(bus.subjects.checkpoint_bucket(),
                             Subjects.policy_file_object(hashlib.sha256(data).hexdigest()), data, domain=domain,
                             keep_same=True)
    spec = config_dict(model_config) if isinstance(model_config, ModelConfig) else dict(model_config)
    index, blob = await anyio.to_thread.run_sync(lambda: encode_state(state, None, threads=threads))
    name = Subjects.version_object(version)
    digest = await bus.put_object(bus.subjects.checkpoint_bucket(), name, blob, domain=domain)
    ready = VersionReady(version=version, step=step, object=name, digest=digest,
                         version_digest=index.version_digest.hex(),
                         raw_bytes=sum(t.numel() * t.element_size() for t in state.values()),
                         model_config=spec)
    await bus.publish(bus.subjects.version_ready(), ready, msg_id=f"version-{version}")
    return ready


def task_corpus(tokens: int, tok: ChatTokenizer, *, seed: int = 0) -> Tensor:
    """(n >= tokens,) int64 token ids of task prompts and canonical solutions, each bos/eos framed."""
    ids: list[int] = []
    i = 0
    while len(ids) < tokens:
        task = make_task(random.Random(f"rlbus-version-source:{seed}:{i}"), f"src-{seed}-{i}")
        ids += [*tok.bos(), *tok.encode(task.prompt + "\n" + task.solution), tok.eos_id]
        i += 1
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class VersionSource:
    """fp32 master weights trained by AdamW on the task corpus; `await publish(bus)` uploads the next version.

    Version 0 is the starting weights; every `step()` makes the next one. `lr` is the post-warm-up rate.
    """

    model: Policy | Transformer
    """The policy trained (a bare built-in Transformer is wrapped as one)."""
    lr: float = 1e-6
    batch: int = 4
    seq_len: int = 64
    seed: int = 0
    version: int = 0
    """The version the current weights are (0 until the first step)."""
    history: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    """Published bf16 versions by number (for bit-exact checks), when `keep_history`."""
    keep_history: bool = True

    def __post_init__(self) -> None:
        self.policy = as_policy(self.model).train()
        self.optimizer = torch.optim.AdamW(self.policy.module.parameters(), lr=self.lr, betas=(0.9, 0.95),
                                           weight_decay=0.1)
        self._corpus = task_corpus(64 * self.batch * (self.seq_len + 1), self.policy.tokenizer, seed=self.seed)
        self._rng = torch.Generator().manual_seed(self.seed)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """One AdamW step of next-token loss on a random batch of the corpus; the weights become version+1."""
        T = self.seq_len
        starts = torch.randint(0, self._corpus.numel() - T - 1, (self.batch,), generator=self._rng)
        seqs = torch.stack([self._corpus[s:s + T + 1] for s in starts.tolist()])
        logits = self.policy(seqs[:, :-1].to(self.policy.device)).logits
        seqs = seqs.to(logits.device)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return float(loss.item())

    def state(self) -> dict[str, Tensor]:
        """The current version's bf16 tensors."""
        return self.policy.published_state(torch.bfloat16)

    async def publish(self, bus: Bus, *, domain: str | None = None, threads: int = 2) -> VersionReady:
        """Upload the current version (see `upload_version`); remembered in `history` when `keep_history`."""
        state = self.state()
        if self.keep_history:
            self.history[self.version] = state
        return await upload_version(bus, version=self.version, step=self.version, state=state,
                                    model_config=self.policy.spec(), files=self.policy.files(), domain=domain,
                                    threads=threads)

    async def step_and_publish(self, bus: Bus, *, domain: str | None = None) -> VersionReady:
        """A real optimizer step off the event loop, then its upload."""
        await anyio.to_thread.run_sync(self.step)
        return await self.publish(bus, domain=domain)
