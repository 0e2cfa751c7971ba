"""Slots: the turn engine's decoding batch for the built-in transformer, in preallocated buffers.

- Owns: `Slots` — rows join and leave the batch by copying only their own keys and values (a leaving row's slot
  takes the last row's), where rebuilding the batch cache would copy every row at each change.
- Does not: decide who joins or leaves (model/sampling/engine.py), or hold a Hugging Face policy's cache (its
  DynamicCache grows by concatenation anyway; the engine rebuilds that batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlbus.model.policies.interface import RowKV
from rlbus.model.policies.transformer import KVCache, ModelConfig


class Slots:
    """Keys and values of up to `rows` batch rows in buffers (rows, H, width, Dh) per layer; `cache` is a `KVCache`
    whose tensors are views of the first `batch` rows, so the transformer's forward writes straight into them.

    Every row's real slots are contiguous and end at the shared `length` (a row joins right-aligned there, and
    each decoding step gives every row one more slot), so a row's keys sit in [length - n, length). The buffers
    grow (doubling) when a join needs more rows or slots; leading slots no row uses are dropped when they are
    more than half of `length` or when room is needed.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)
        self.batch = 0
        self.length = 0
        self.cache = self._view()

    # ---- the view the forward runs on ----------------------------------------------------------------
    def _view(self) -> KVCache:
        cache = KVCache.__new__(KVCache)
        cache.k = [k[: self.batch] for k in self.k]
        cache.v = [v[: self.batch] for v in self.v]
        cache.key_mask = self.mask[: self.batch]
        cache.next_pos = self.pos[: self.batch].clone()
        cache.length = self.length
        cache.max_len = int(self.mask.shape[1])
        cache.has_padding = bool((self.pos[: self.batch] < self.length).any())
        return cache

    def synced(self) -> None:
        """Take back what a forward changed on the view (its length and positions)."""
        self.length = self.cache.length
        self.pos[: self.batch] = self.cache.next_pos

    # ---- membership ------------------------------------------------------------------------------------
    def leave(self, i: int) -> RowKV:
        """Row i's keys and values (copied out); the last row moves into its slot."""
        self.synced()
        n = int(self.pos[i])
        lo = self.length - n
        kv = RowKV([k[i, :, lo : self.length].clone() for k in self.k], [v[i, :, lo : self.length].clone() for v in self.v])
        last = self.batch - 1
        if i != last:
            for store in (self.k, self.v):
                for t in store:
                    t[i, :, : self.length] = t[last, :, : self.length]
            self.mask[i] = self.mask[last]
            self.pos[i] = self.pos[last]
        self.mask[last] = False
        self.pos[last] = 0
        self.batch = last
        self.cache = self._view()
        return kv

    def join(self, rows: list[RowKV], extra: int) -> None:
        """Rows (each at least one slot) in the next slots, right-aligned at `length`, with room for `extra` more
        slots for every row."""
        self.synced()
        longest = max([r.length for r in rows] + [int(self.pos[: self.batch].max()) if self.batch else 0])
        self._compact(force=self.length + extra > int(self.mask.shape[1]) or longest > self.length)
        if longest > self.length:  # a joiner longer than every slot so far: move the rows right
            self._shift(longest - self.length)
        self._reserve(self.batch + len(rows), self.length + extra)
        for r in rows:
            b, n = self.batch, r.length
            for layer in range(self.config.n_layers):
                self.k[layer][b, :, self.length - n : self.length] = r.keys[layer]
                self.v[layer][b, :, self.length - n : self.length] = r.values[layer]
            self.mask[b] = False
            self.mask[b, self.length - n : self.length] = True
            self.pos[b] = n
            self.batch += 1
        self.cache = self._view()

    def ensure(self, extra: int) -> None:
        """Room for `extra` more slots (before decoding steps)."""
        self.synced()
        if self.length + extra > int(self.mask.shape[1]):
            self._compact(force=True)
            self._reserve(self.batch, self.length + extra)
            self.cache = self._view()

    # ---- buffers ---------------------------------------------------------------------------------------
    def _compact(self, *, force: bool) -> None:
        """Drop the leading slots no row uses, when forced or when they are more than half of `length`."""
        used = int(self.pos[: self.batch].max()) if self.batch else 0
        first = self.length - used
        if first <= 0 or not (force or first * 2 > self.length):
            return
        for store in (self.k, self.v):
            for t in store:
                t[: self.batch, :, :used] = t[: self.batch, :, first : self.length].clone()
        self.mask[: self.batch, :used] = self.mask[: self.batch, first : self.length].clone()
        self.mask[: self.batch, used:] = False
        self.length = used

    def _shift(self, d: int) -> None:
        """Move every row's slots d to the right (a longer row is joining)."""
        self._reserve(self.batch, self.length + d)
        for store in (self.k, self.v):
            for t in store:
                t[: self.batch, :, d : d + self.length] = t[: self.batch, :, : self.length].clone()
        self.mask[: self.batch, d : d + self.length] = self.mask[: self.batch, : self.length].clone()
        self.mask[: self.batch, :d] = False
        self.length += d

    def _reserve(self, rows: int, width: int) -> None:
        """Buffers of at least `rows` rows and `width` slots (grown by doubling, the active rows copied)."""
        have_rows, have_width = int(self.mask.shape[0]), int(self.mask.shape[1])
        if rows <= have_rows and width <= have_width:
            return
        new_rows = max(rows, have_rows * 2 if rows > have_rows else have_rows)
        new_width = max(width, have_width * 2 if width > have_width else have_width)
        heads, dh = self.config.n_heads, self.config.d_model // self.config.n_heads
        for store in (self.k, self.v):
            for layer in range(self.config.n_layers):
                t = torch.zeros((new_rows, heads, new_width, dh), device=self.device, dtype=self.dtype)
                if layer < len(store):
                    t[: self.batch, :, : self.length] = store[layer][: self.batch, :, : self.length]
                    store[layer] = t
                else:
                    store.append(t)
        mask = torch.zeros(new_rows, new_width, dtype=torch.bool, device=self.device)
        mask[: self.batch, : self.length] = self.mask[: self.batch, : self.length]
        pos = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        pos[: self.batch] = self.pos[: self.batch]
        self.mask, self.pos = mask, pos
