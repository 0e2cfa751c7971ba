"""Where a generator's (or evaluator's) policy weights come from: the `WeightSource` interface.

- Owns: the `WeightSource` protocol the generator samples through (a model, the version it holds, a
  thread-safe `maybe_swap(step)`, `wait_for_version`), `LocalWeights` (a fixed policy) and
  `open_weights(spec, ...)`, which turns the `generator.weights` setting into a source.
- Does not: fetch, verify or decode published versions (actors/common/weight_sync.py, `WeightSync`,
  the real source).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio
import torch
from torch import nn

from rlbus.messages.bus import Bus
from rlbus.messages.errors import TopologyError
from rlbus.model.policies.interface import ChatTokenizer, Policy, as_policy, load_policy, resolve_device


@runtime_checkable
class WeightSource(Protocol):
    """What a generator needs from its weights. `maybe_swap` runs on the generation thread between decoding
    steps (it is `model.generate`'s `on_step`); everything else on the event loop."""

    @property
    def model(self) -> Policy:
        """The policy to sample from; its tensors are updated in place by `maybe_swap`."""
        ...

    @property
    def held_version(self) -> int | None:
        """Version the model's weights are now (None before the first version arrived)."""
        ...

    def maybe_swap(self, step: int) -> int | None:
        """Apply a staged newer version in place and return it, else None (`model.generate` `on_step`)."""
        ...

    async def wait_for_version(self, version: int) -> None:
        """Return once `held_version` is at least `version` (applying what is staged)."""
        ...


class LocalWeights:
    """A fixed policy that never changes: `held_version` is always `version`. A pretrain checkpoint or
    Hugging Face directory, or a policy handed in by a test."""

    def __init__(self, model: Policy | nn.Module, *, version: int = 0) -> None:
        self._model = as_policy(model).eval()
        self._version = version
        self.swaps = 0
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._model.tokenizer

    @classmethod
    def from_checkpoint(cls, path: Path, *, version: int = 0, device: str = "cpu") -> LocalWeights:
        """Load a `pretrain.pt` (model/training/pretrain.py), the folder holding it, or a Hugging Face directory.

        :raises PolicyError: nothing loadable there.
        """
        return cls(load_policy(path, device=resolve_device(device)), version=version)

    @property
    def model(self) -> Policy:
        return self._model

    @property
    def held_version(self) -> int | None:
        return self._version

    def maybe_swap(self, step: int) -> int | None:
        return None

    async def wait_for_version(self, version: int) -> None:
        if version > self._version:
            await anyio.sleep_forever()      # a fixed model never reaches a newer version


@asynccontextmanager
async def open_weights(spec: str, bus: Bus, region: str, *, local_version: int = 0,
                       device: str = "cpu", dtype: str = "bfloat16") -> AsyncIterator[WeightSource]:
    """The weight source named by `spec`, open for the block, its policy on `device` ("auto": CUDA when
    present); a synced policy in `dtype` ("bfloat16" or "float32": versions are bf16, held exactly in either).

    Specs: "sync" — the region's published versions through `WeightSync`; "local:<path>" — a fixed
    `pretrain.pt` checkpoint (or its folder) or Hugging Face directory, reported as version `local_version`.

    :raises TopologyError: an unknown spec (the `[generator] weights` setting's pattern allows none).
    """
    kind, _, rest = spec.partition(":")
    if kind == "local" and rest:
        yield await anyio.to_thread.run_sync(
            lambda: LocalWeights.from_checkpoint(Path(rest), version=local_version, device=device))
        return
    if kind == "sync":
        from rlbus.actors.common.weight_sync import WeightSync

        async with WeightSync.open(bus, region, device=device, dtype=getattr(torch, dtype)) as sync:
            yield sync
        return
    raise TopologyError(f"generator weights {spec!r}: expected 'sync' or 'local:<path to pretrain.pt>'")
