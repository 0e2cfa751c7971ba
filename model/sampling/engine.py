"""The turn engine: agentic episodes whose KV cache lives across turns, decoded with continuous batching.

- Owns: `TurnEngine` (one row per episode: a turn prefills only what is new in its context; rows join and leave
  the decoding batch between steps; `kv_cache_tokens` makes rows wait, never fail; `swap` keeps the caches;
  `open_turns` and `generate`, a drop-in for `generate`'s call that needs no row keys; `close_ended`),
  `TurnSample`, `EngineStats`, `as_sequence`.
- Does not: run tools, frame turns or summarise (a summary is just a new context), load weights (the caller
  swaps them in place and calls `swap`), or record MoE routing (a routed policy is refused).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import Policy, PolicyCache, RowKV, as_policy
from rlbus.model.sampling.generate import SampledSequence, SwapHook, sampling_kv_dtype
from rlbus.model.sampling.slots import Slots

State = Literal["resting", "queued", "decoding"]
_MATCH_IDS = 16
"""`TurnEngine.generate` looks for a context's row among the rows whose first ids equal the context's first
_MATCH_IDS ids (a shorter context opens a row of its own)."""


@dataclass(frozen=True)
class TurnSample:
    """One finished turn of a row."""

    row: Hashable
    tokens: list[int]
    """Ids sampled; the last is eos when finish_reason == "eos"."""
    logprobs: list[float]
    """Behaviour logprob of each: log softmax(logits / tau)[token] (tau = 1 for greedy)."""
    versions: list[int]
    """Policy version (`TurnEngine.swap`) of the weights whose logits produced each token."""
    finish_reason: Literal["eos", "length"]
    context: int
    """Tokens of context the turn was sampled after."""
    reused: int
    """Of those, tokens whose keys and values the row already held (not prefilled again)."""


@dataclass
class EngineStats:
    """Counters since the engine was made."""

    steps: int = 0
    """Calls of `step` that ran a forward."""
    decode_steps: int = 0
    """Batched decoding forwards (prefills not counted)."""
    decode_rows: int = 0
    """Rows summed over the decoding forwards (decode_rows / decode_steps is the mean batch)."""
    prefill_tokens: int = 0
    """Context tokens prefilled (fed to the model other than as a decoding step's one token)."""
    reused_tokens: int = 0
    """Context tokens whose keys and values a turn found cached."""
    sampled_tokens: int = 0
    evictions: int = 0
    """Resting rows whose cache was dropped to make room (they prefill their whole context next turn)."""
    waits: int = 0
    """Steps at which a queued row could not join for want of room under `kv_cache_tokens` or `max_batch`."""


@dataclass
class _Row:
    key: Hashable
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    """The whole context: `cached` tokens whose keys and values are held, then those not fed yet."""
    cached: int = 0
    kv: RowKV | None = None
    """The held keys and values while the row is not in the decoding batch."""
    state: State = "resting"
    budget: int = 0
    context: int = 0
    reused: int = 0
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_used: int = 0

    def reserved(self) -> int:
        """Cache slots this row may hold before its turn ends (a queued row: what it holds while it waits)."""
        if self.state != "decoding":
            return self.cached
        return len(self.tokens) + self.budget - len(self.sampled)


@dataclass(frozen=True)
class _Anonymous:
    """The key of a row `TurnEngine.generate` opened (its number)."""

    number: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def as_sequence(context: Sequence[int], turn: TurnSample) -> SampledSequence:
    """A finished turn as `generate` returns its row (routing None)."""
    return SampledSequence(prompt=torch.as_tensor(list(context), dtype=torch.long),
                           tokens=torch.tensor(turn.tokens, dtype=torch.long),
                           logprobs=torch.tensor(turn.logprobs, dtype=torch.float32),
                           versions=torch.tensor(turn.versions, dtype=torch.long), routing=None,
                           finish_reason=turn.finish_reason)


class TurnEngine:
    """Episode rows, each with a KV cache kept across its turns; one batched decoding forward per `step`.

    A caller asks for a turn with `turn(row, context, max_new_tokens)`, giving the row's whole context (task,
    earlier turns, the latest observation, the next assistant header). The engine keeps the longest prefix of
    that context its cache holds (everything but the new ids, after a turn of its own), drops the rest, and
    prefills only what is new; a summary's context (task + summary) shares the task with the old one, so only
    the summary is prefilled. A row whose turn ended (eos, or `max_new_tokens` sampled) leaves the decoding
    batch and rests until its next `turn` (a tool runs meanwhile); a row asked for a turn joins at the next
    `step` after its prefill, which runs batched with the other rows joining then. `close` frees a row.

    kv_cache_tokens caps the cache slots held by all rows together: a decoding row reserves its context plus
    the rest of its turn, a resting row what it holds. A row that does not fit waits (first come, first
    served); resting rows' caches are evicted first, least recently used first (such a row prefills its whole
    context again). A single turn larger than the cap is refused at `turn`. max_batch caps the rows decoding. A row
    that fits the model's context alone but not beside the rows joining with it (their prefill cache is
    right-aligned) waits for the next step.
    A built-in policy's decoding batch lives in `Slots` (model/sampling/slots.py); a Hugging Face policy's batch
    cache is rebuilt when rows join.

    Equality with re-prefill. A turn sampled here draws the same tokens, with the same behaviour logprobs up to
    float summation order, as `generate([context], generator=g)` on the whole context with the row's generator
    `g`: each row samples with its own `torch.Generator` (`torch.multinomial` of its (1, V) row, as `generate`
    does for one prompt), so what a row draws never depends on which rows share its decoding steps. Bit-exact
    equality is not to be had: the history's keys and values were computed one token (or one observation) at a
    time, in batches with left padding, where re-prefill computes them in one (P, D) matmul; BLAS blocks those
    reductions differently, so the logits differ in the last bits (about 1e-6 relative in float32). Greedy
    tokens are identical and logprobs agree within 1e-4 (tests/model/test_model_sampling_engine.py).
    """

    def __init__(self, policy: Policy, *, temperature: float = 1.0, eos_id: int | None = None,
                 kv_cache_tokens: int | None = None, max_batch: int = 64, kv_dtype: torch.dtype | None = None,
                 version: int = 0) -> None:
        policy = as_policy(policy)
        if policy.moe is not None:
            raise ValueError("the turn engine records no MoE routing; sample a routed policy with `generate`")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if max_batch < 1 or (kv_cache_tokens is not None and kv_cache_tokens < 2):
            raise ValueError(f"max_batch must be >= 1 and kv_cache_tokens >= 2, got {max_batch}, {kv_cache_tokens}")
        self.policy = policy
        self.temperature = temperature
        self.eos_id = eos_id
        self.kv_cache_tokens = kv_cache_tokens
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype if kv_dtype is not None else sampling_kv_dtype(policy.device)
        self.version = version
        self.stats = EngineStats()
        self._rows: dict[Hashable, _Row] = {}
        self._queue: list[_Row] = []
        self._batch: list[_Row] = []
        self._cache: PolicyCache | None = None
        """The decoding batch's cache (a Hugging Face policy; rebuilt when rows change)."""
        self._slots: Slots | None = None
        """The decoding batch of a built-in policy (only the rows that change are copied)."""
        if isinstance(policy, BuiltinPolicy):
            self._slots = Slots(policy.config, device=policy.device, dtype=self.kv_dtype or policy.dtype)
        self._tick = 0
        self._opened = 0

    # ---- rows ------------------------------------------------------------------------------------------
    def turn(self, row: Hashable, context: Sequence[int], max_new_tokens: int, *, seed: int | None = None,
             generator: torch.Generator | None = None) -> None:
        """Queue a turn of `row` after `context` (its whole context); it joins the batch at the next `step`.

        A new row samples with `generator`, else one seeded with `seed` (temperature > 0 needs one of them); a
        known row goes on with its own.

        :raises ValueError: the row is queued or decoding, the turn cannot fit the model or the cache cap, or a
            new row has no generator at temperature > 0.
        """
        self._check_turn(context, max_new_tokens)
        r = self._rows.get(row)
        if r is None:
            if generator is None and seed is not None:
                generator = torch.Generator().manual_seed(seed)
            if generator is None and self.temperature > 0:
                raise ValueError(f"row {row!r}: sampling at temperature {self.temperature} needs a seed or generator")
            r = self._rows[row] = _Row(row, generator)
        elif r.state != "resting":
            raise ValueError(f"row {row!r} is {r.state}: its turn has not ended")
        keep = min(common_prefix(r.tokens[: r.cached], context), len(context) - 1)  # one id is fed for the logits
        if r.kv is not None and keep < r.kv.length:
            r.kv = r.kv.truncated(keep) if keep else None
        r.cached = keep if r.kv is not None else 0
        r.tokens = list(context)
        r.context, r.reused, r.budget = len(context), r.cached, max_new_tokens
        r.sampled, r.logprobs, r.versions = [], [], []
        r.state = "queued"
        self._queue.append(r)

    def _check_turn(self, context: Sequence[int], max_new_tokens: int) -> None:
        """:raises ValueError: a turn after `context` can never be sampled here."""
        if not context or max_new_tokens < 1:
            raise ValueError("a turn needs a context of at least one id and max_new_tokens >= 1")
        need = len(context) + max_new_tokens
        if need > self.policy.max_seq_len:
            raise ValueError(f"context of {len(context)} + {max_new_tokens} new tokens exceeds max_seq_len "
                             f"{self.policy.max_seq_len}; summarise the history")
        if self.kv_cache_tokens is not None and need > self.kv_cache_tokens:
            raise ValueError(f"a turn of {need} cache slots can never fit kv_cache_tokens {self.kv_cache_tokens}")

    def reset(self, row: Hashable) -> None:
        """Drop the resting row's cache: its next turn prefills its whole context."""
        r = self._resting(row)
        r.kv, r.cached = None, 0

    def close(self, row: Hashable) -> None:
        """Forget a resting row (its episode ended) and free its cache."""
        self._resting(row)
        del self._rows[row]

    def close_prefixed(self, prefix: Sequence[int]) -> int:
        """Forget every resting row whose context starts with `prefix` (the ids all of a finished task's contexts
        begin with) and free its cache; returns how many were closed."""
        n = len(prefix)
        if n == 0:
            return 0
        head = list(prefix)
        gone = [r.key for r in self._rows.values()
                if r.state == "resting" and len(r.tokens) >= n and r.tokens[:n] == head]
        for key in gone:
            del self._rows[key]
        return len(gone)

    def swap(self, version: int) -> None:
        """The caller loaded new weights in place between two `step`s: tokens sampled from now carry `version`.

        Every cache is kept, as `generate`'s in-flight swap keeps its own: the keys and values of tokens fed
        before the swap stay those the old weights computed, and each token's behaviour logprob is that of the
        weights that sampled it, over that cache (what the trainer's importance ratio expects).
        """
        self.version = version

    def cached_tokens(self) -> int:
        """Cache slots held now by every row (decoding rows: what they have fed so far)."""
        return sum(r.cached for r in self._rows.values())

    def rows(self, state: State) -> list[Hashable]:
        return [r.key for r in self._rows.values() if r.state == state]

    @property
    def busy(self) -> bool:
        """A row is queued or decoding."""
        return bool(self._queue or self._batch)

    def _resting(self, row: Hashable) -> _Row:
        r = self._rows.get(row)
        if r is None or r.state != "resting":
            raise ValueError(f"row {row!r} is {'unknown' if r is None else r.state}; expected a resting row")
        return r

    # ---- a drop-in for `generate` ------------------------------------------------------------------------
    def open_turns(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int) -> list[Hashable]:
        """Queue a turn after each context without row keys (they join at the next `step`); returns the rows, in
        order. Each context continues the resting row (of earlier calls of this method) whose ids share the longest
        prefix with it, a chunk or turn of the same episode; otherwise it opens a row. Either way the row samples this
        turn with a generator seeded from `seed` and the context's index, as a row opened now would: what a call
        draws does not depend on whether its rows were cached (a group resumed from its partial by another
        generator, whose engine holds none of its rows, samples what the first would have). Every context is
        checked before any is queued. Rows are never closed here: their
        caches go least recently used first when `kv_cache_tokens` needs room, and a row without a cache is
        forgotten, so kv_cache_tokens is required.

        :raises ValueError: no kv_cache_tokens, or a context `turn` refuses (nothing queued then).
        """
        if self.kv_cache_tokens is None:
            raise ValueError("TurnEngine.generate keeps rows of earlier calls: it needs kv_cache_tokens")
        for context in contexts:
            self._check_turn(context, max_new_tokens)
        index: dict[tuple[int, ...], list[_Row]] = {}
        for r in self._rows.values():
            if r.state == "resting" and isinstance(r.key, _Anonymous) and r.cached:
                index.setdefault(tuple(r.tokens[:_MATCH_IDS]), []).append(r)
        keys: list[Hashable] = []
        for i, context in enumerate(contexts):
            generator = (torch.Generator().manual_seed((seed * 1_000_003 + i) % 2**63) if self.temperature > 0
                         else None)
            found = [r for r in index.get(tuple(context[:_MATCH_IDS]), []) if r.state == "resting"]
            best = max(found, key=lambda r: common_prefix(r.tokens[: r.cached], context), default=None)
            if best is not None:
                best.generator = generator
                self.turn(best.key, context, max_new_tokens)
                keys.append(best.key)
                continue
            key = _Anonymous(self._opened)
            self._opened += 1
            self.turn(key, context, max_new_tokens, generator=generator)
            keys.append(key)
        return keys

    def generate(self, contexts: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int,
                 on_step: SwapHook | None = None, version: int | None = None) -> list[SampledSequence]:
        """What `generate(contexts, ...)` returns (one sequence per context, routing None), with the caches kept
        from call to call: no row keys are needed (`open_turns` matches each context to its row). on_step is
        `generate`'s hook: called with the step index before each `step` (0: before the prefill); a version it
        returns is passed to `swap`; `version`, when given, is the version of the weights the call starts with
        (weights swapped between calls). The call steps until every one of its rows ended (rows queued by others
        meanwhile decode beside them).

        :raises ValueError: what `open_turns` refuses.
        """
        keys = self.open_turns(contexts, max_new_tokens=max_new_tokens, seed=seed)
        if version is not None:
            self.swap(version)
        ended: dict[Hashable, TurnSample] = {}
        step = 0
        while len(ended) < len(keys):
            if on_step is not None and (version := on_step(step)) is not None:
                self.swap(version)
            ended.update((t.row, t) for t in self.step())
            step += 1
        return [as_sequence(context, ended[k]) for k, context in zip(keys, contexts, strict=True)]

    def close_ended(self, ids: Sequence[int]) -> Hashable | None:
        """Close the resting row (of `open_turns`) that an ended episode's whole ids continue: among the rows whose
        last context is a prefix of `ids` and whose last turn's first id follows it there, the one sharing the
        longest prefix with `ids`. Returns its key, or None when no row fits (evicted, or never opened here)."""
        best: _Row | None = None
        best_n = 0
        for r in self._rows.values():
            if r.state != "resting" or not isinstance(r.key, _Anonymous) or len(r.tokens) <= r.context:
                continue
            n = common_prefix(r.tokens, ids)
            if n > r.context and n > best_n:
                best, best_n = r, n
        if best is None:
            return None
        del self._rows[best.key]
        return best.key

    # ---- decoding ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[TurnSample]:
        """One decoding forward over the rows decoding, then the queued rows that fit join (one batched prefill
        of what is new in their contexts, their first token sampled from it). Returns the turns that ended."""
        self._tick += 1
        ran = False
        if self._batch:
            feed = torch.tensor([[r.tokens[-1]] for r in self._batch], dtype=torch.long, device=self.policy.device)
            if self._slots is not None:
                self._slots.ensure(1)
                logits = self.policy(feed, cache=self._slots.cache).logits[:, -1]
                self._slots.synced()
            else:
                logits = self.policy(feed, cache=self._cache).logits[:, -1]
            for r in self._batch:
                r.cached += 1
            self._sample(self._batch, logits)
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(self._batch)
            ran = True
        joiners = self._admit()
        join_cache = self._prefill(joiners) if joiners else None
        ran = ran or bool(joiners)
        self.stats.steps += ran
        return self._regroup(joiners, join_cache)

    def run(self) -> list[TurnSample]:
        """`step` until no row is queued or decoding; every turn that ended, in order."""
        out: list[TurnSample] = []
        while self.busy:
            out.extend(self.step())
        return out

    def _admit(self) -> list[_Row]:
        """The queued rows that fit now, first come first served, evicting resting caches (LRU) for room."""
        joiners: list[_Row] = []
        while self._queue and len(self._batch) + len(joiners) < self.max_batch:
            r = self._queue[0]
            if not self._fits_context(joiners, r) or not self._room_for(r):
                break
            self._queue.pop(0)
            joiners.append(r)
            r.state = "decoding"
        if self._queue:
            self.stats.waits += 1
        return joiners

    def _fits_context(self, joiners: list[_Row], r: _Row) -> bool:
        """Whether `r` can join with `joiners` within the model's context: their prefill cache is right-aligned
        (the longest cached prefix, then the longest of what each feeds and samples), and a Hugging Face decoding
        batch rebuilt (every row's ids, then the longest rest of a turn). One row alone always fits (`turn`)."""
        limit = self.policy.max_seq_len
        group = [*joiners, r]
        if max(o.cached for o in group) + max(len(o.tokens) - o.cached + o.budget for o in group) > limit:
            return False
        if self._slots is None and self._batch:
            rows = [*self._batch, *group]
            return max(len(o.tokens) for o in rows) + max(o.budget - len(o.sampled) for o in rows) <= limit
        return True

    def _room_for(self, r: _Row) -> bool:
        if self.kv_cache_tokens is None:
            return True
        need = len(r.tokens) + r.budget
        held = sum(o.reserved() for o in self._rows.values() if o is not r)
        if held + need <= self.kv_cache_tokens:
            return True
        idle = sorted((o for o in self._rows.values() if o is not r and o.state != "decoding" and o.kv is not None),
                      key=lambda o: (o.state == "queued", o.last_used))
        for o in idle:
            held -= o.cached
            o.kv, o.cached, o.reused = None, 0, 0
            self.stats.evictions += 1
            if o.state == "resting" and isinstance(o.key, _Anonymous):
                del self._rows[o.key]
            if held + need <= self.kv_cache_tokens:
                return True
        return False

    def _prefill(self, joiners: list[_Row]) -> PolicyCache:
        """Feed each joiner what its cache lacks (right-aligned, left-padded) and sample its first token."""
        rows = [r.kv if r.kv is not None else RowKV([], []) for r in joiners]
        new = [r.tokens[r.cached:] for r in joiners]
        width = max(len(ids) for ids in new)
        extra = max(len(ids) + r.budget for ids, r in zip(new, joiners, strict=True))
        cache = self.policy.cache_from_rows(rows, extra, self.kv_dtype)
        pad = getattr(self.policy.tokenizer, "pad_id", 0)
        feed = torch.full((len(joiners), width), pad, dtype=torch.long)
        mask = torch.zeros(len(joiners), width, dtype=torch.bool)
        for b, ids in enumerate(new):
            feed[b, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            mask[b, width - len(ids):] = True
        device = self.policy.device
        logits = self.policy(feed.to(device), cache=cache, attention_mask=mask.to(device)).logits[:, -1]
        for r, ids in zip(joiners, new, strict=True):
            r.kv = None
            r.cached += len(ids)
            self.stats.prefill_tokens += len(ids)
            self.stats.reused_tokens += r.reused
        self._sample(joiners, logits)
        return cache

    def _sample(self, rows: list[_Row], logits: Tensor) -> None:
        logp = torch.log_softmax(logits.float() / (self.temperature or 1.0), dim=-1)
        if self.temperature == 0:
            tokens = logp.argmax(-1).tolist()
        else:
            probs = logp.exp()
            tokens = [int(torch.multinomial(self._on(probs[b : b + 1], r.generator), 1, generator=r.generator)[0, 0])
                      for b, r in enumerate(rows)]
        chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
        for r, t, lp in zip(rows, tokens, chosen, strict=True):
            r.sampled.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            r.tokens.append(t)
        self.stats.sampled_tokens += len(rows)

    @staticmethod
    def _on(probs: Tensor, generator: torch.Generator | None) -> Tensor:
        """probs on the generator's device (a CPU generator samples a CUDA policy's row on the CPU)."""
        return probs if generator is None or probs.device == generator.device else probs.to(generator.device)

    def _ended(self, r: _Row) -> bool:
        return (self.eos_id is not None and r.sampled[-1] == self.eos_id) or len(r.sampled) >= r.budget

    def _finish(self, r: _Row, kv: RowKV) -> TurnSample:
        r.kv, r.state, r.last_used = kv, "resting", self._tick
        return TurnSample(r.key, r.sampled, r.logprobs, r.versions,
                          "eos" if self.eos_id is not None and r.sampled[-1] == self.eos_id else "length",
                          r.context, r.reused)

    def _regroup_slots(self, slots: Slots, joiners: list[_Row], join_cache: PolicyCache | None) -> list[TurnSample]:
        """`_regroup` over `Slots`: only the rows that leave or join are copied."""
        out: list[TurnSample] = []
        for i in reversed(range(len(self._batch))):
            r = self._batch[i]
            if self._ended(r):
                out.append(self._finish(r, slots.leave(i)))
                self._batch[i] = self._batch[-1]
                self._batch.pop()
        staying: list[tuple[_Row, RowKV]] = []
        for b, r in enumerate(joiners):
            kv = join_cache.row_kv(b)  # type: ignore[union-attr]
            if self._ended(r):
                out.append(self._finish(r, kv))
            else:
                staying.append((r, kv))
        if staying:
            self._batch += [r for r, _ in staying]
            slots.join([kv for _, kv in staying], max(r.budget - len(r.sampled) for r in self._batch))
        return out

    def _regroup(self, joiners: list[_Row], join_cache: PolicyCache | None) -> list[TurnSample]:
        """Rows whose turn ended leave (their keys and values kept as `RowKV`); joiners enter the batch."""
        if self._slots is not None:
            return self._regroup_slots(self._slots, joiners, join_cache)
        members = self._batch + joiners
        caches = [(self._cache, b) for b in range(len(self._batch))] + [(join_cache, b) for b in range(len(joiners))]
        ended = [i for i, r in enumerate(members) if self._ended(r)]
        if not ended and not joiners:
            return []
        out: list[TurnSample] = []
        for i in ended:
            cache, b = caches[i]
            out.append(self._finish(members[i], cache.row_kv(b)))  # type: ignore[union-attr]
        gone = set(ended)
        stay = [i for i in range(len(members)) if i not in gone]
        before = self._cache if self._batch else None
        self._batch = [members[i] for i in stay]
        extra = max((r.budget - len(r.sampled) for r in self._batch), default=0)
        device = self.policy.device
        if not self._batch:
            self._cache = None
        elif before is None or not joiners:
            # One cache holds every row that stays: keep those rows (room for the rest of their turns).
            cache = join_cache if before is None else before
            assert cache is not None
            if ended:
                cache.keep_rows(torch.tensor(stay, dtype=torch.long, device=device), extra)
            self._cache = cache
        else:
            rows = [caches[i][0].row_kv(caches[i][1]) for i in stay]  # type: ignore[union-attr]
            self._cache = self.policy.cache_from_rows(rows, extra, self.kv_dtype)
        return out
