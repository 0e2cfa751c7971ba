"""Cross-task batching of a generator's sampling calls: the open drafts of every task a generator works
on are sampled in one `model.generate` call instead of one call per task.

- Owns: `SampleBatcher` — tasks submit (contexts, n); requests that arrive while a call is running go
  together into the next call; each caller gets back exactly its rows, cut to its own n tokens.
- Does not: know about tasks, partials or weights (the caller's `run` function does the sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

import anyio
import anyio.lowlevel

from rlbus.model.sampling.generate import SampledSequence

LINGER_S: Final = 0.02
"""How long a call waits for the previous call's callers to come back: they save their partials to the bus
first, a few milliseconds; a call takes hundreds."""

SampleFn = Callable[[list[list[int]], int, int], list[SampledSequence]]
"""(contexts, max_new_tokens, seed) -> one SampledSequence per context, run in a worker thread."""


@dataclass
class _Request:
    contexts: list[list[int]]
    n: int
    seed: int
    result: list[SampledSequence] | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Its call has run (with a result or an error)."""
        return self.result is not None or self.error is not None


def cut(sample: SampledSequence, n: int) -> SampledSequence:
    """`sample` limited to its first n generated tokens (a cut sample's finish_reason is "length")."""
    if len(sample.tokens) <= n:
        return sample
    routing = sample.routing[:len(sample.prompt) + n] if sample.routing is not None else None
    return replace(sample, tokens=sample.tokens[:n], logprobs=sample.logprobs[:n], versions=sample.versions[:n],
                   routing=routing, finish_reason="length")


class SampleBatcher:
    """Merges concurrent sampling requests into one call of `run`.

    Tasks submit (contexts, n); requests that arrive while a call is running wait and go together into the
    next call; each caller gets back exactly its rows, cut to its own n tokens. On CPU a decoding step of a
    small model costs about the same for 8 rows as for 64, so this multiplies a generator's tokens/s by up
    to the number of concurrent tasks. The callers of one call come back a few milliseconds apart (each
    saves its partial first), so a call waits at most `linger_s` for as many requests as the previous call
    had: without that, the first caller back ran alone and the rest in a second call of about the same cost.

    `max_len` is the model's max_seq_len: a merged call decodes min(max n, max_len - longest context)
    tokens, which is at least 1 because every request fits on its own; a request that asked for more
    than the merged call gave gets fewer tokens (its draft simply continues in its next chunk).
    """

    def __init__(self, run: SampleFn, *, max_len: int, max_rows: int = 256, linger_s: float = LINGER_S) -> None:
        self._run = run
        self._max_len = max_len
        self._max_rows = max_rows
        self._linger_s = linger_s
        self._waiting: list[_Request] = []
        self._arrived = anyio.Event()
        self._last_requests = 0
        """Requests in the previous call: the next one waits (at most `linger_s`) for as many."""
        self._lock = anyio.Lock()
        self.calls = 0
        """Merged calls made so far."""
        self.rows = 0
        """Rows sampled so far (rows / calls is the mean batch)."""

    async def sample(self, contexts: Sequence[Sequence[int]], n: int, seed: int = 0) -> list[SampledSequence]:
        """Sample up to n tokens after each context; returns one sequence per context, in order. The call
        is seeded with the seed of its first request (a call of one request is reproducible)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        for c in contexts:
            if len(c) + n > self._max_len:
                raise ValueError(f"a context of {len(c)} tokens + {n} new ones exceeds max_seq_len {self._max_len}")
        request = _Request([list(c) for c in contexts], n, seed)
        self._waiting.append(request)
        self._arrived.set()
        await anyio.lowlevel.checkpoint()    # let the other tasks of this event-loop turn join in
        try:
            while not request.done:
                async with self._lock:
                    if not request.done:
                        await self._flush(request)
        finally:
            if request in self._waiting:     # cancelled before its call: nobody samples it
                self._waiting.remove(request)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    async def _flush(self, own: _Request) -> None:
        """Run waiting requests (in order, up to max_rows rows, at least one) in one call. An error of the
        call goes to every request in it; if the calling task is cancelled meanwhile, the other requests
        go back to the front of the queue for their own tasks to run."""
        await self._gather()
        batch: list[_Request] = []
        rows = 0
        while self._waiting and (not batch or rows + len(self._waiting[0].contexts) <= self._max_rows):
            request = self._waiting.pop(0)
            batch.append(request)
            rows += len(request.contexts)
        contexts = [c for r in batch for c in r.contexts]
        n = min(max(r.n for r in batch), self._max_len - max(len(c) for c in contexts))
        try:
            samples = await anyio.to_thread.run_sync(self._run, contexts, n, batch[0].seed)
        except anyio.get_cancelled_exc_class():
            self._waiting[:0] = [r for r in batch if r is not own]
            raise
        except Exception as err:
            for r in batch:
                r.error = err
            return
        self.calls += 1
        self.rows += rows
        self._last_requests = len(batch)
        first = 0
        for r in batch:
            r.result = [cut(s, r.n) for s in samples[first:first + len(r.contexts)]]
            first += len(r.contexts)

    async def _gather(self) -> None:
        """Wait until as many requests wait as the previous call had, or `max_rows` rows do, or `linger_s`
        has passed (callers that finished sampling do not come back)."""
        with anyio.move_on_after(self._linger_s):
            while (len(self._waiting) < self._last_requests
                   and sum(len(r.contexts) for r in self._waiting) < self._max_rows):
                self._arrived = anyio.Event()
                await self._arrived.wait()
