"""Continuous batching of a generator's sampling calls: requests join the turn engine's running decoding batch
between steps, and each is answered as soon as its own rows ended.

- Owns: `EngineDriver` — async callers submit (contexts, n, seed) and await exactly their rows; one pump task runs
  the engine's steps in a worker thread, in short bursts under the generator's model lock, opening the requests
  that arrived before each step (`TurnEngine.open_turns`: a context continues its episode's resting row).
- Guarantee: a cancelled caller's rows are closed once they end; an error of the engine (or of a hook) goes to the
  requests in flight, and later requests are served (by the engine `engine_for` gives next).
- Does not: make the engine, swap weights or close finished episodes' rows (the generator's hooks do), know tasks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio

from rlbus.model.sampling.engine import TurnEngine, TurnSample, as_sequence
from rlbus.model.sampling.generate import SampledSequence

BURST_STEPS: Final = 8
"""Decoding steps one hold of the model lock runs at most: scoring, summaries and weight loads get the lock
between bursts."""

StepHook = Callable[[TurnEngine, int], None]
"""(engine, step) before each decoding step, model lock held: swap weights in (and `engine.swap` their version),
close finished episodes' rows."""


@dataclass(eq=False)
class _Request:
    contexts: list[list[int]]
    n: int
    seed: int
    done: anyio.Event
    keys: list[Hashable] = field(default_factory=list)
    """Its rows in the engine, once opened."""
    ended: dict[Hashable, TurnSample] = field(default_factory=dict)
    error: BaseException | None = None
    cancelled: bool = False


class EngineDriver:
    """Serves sampling requests from a `TurnEngine` with continuous batching.

    `sample` queues a request and waits; the pump (`run`, one task) takes the model lock for a burst of at most
    `burst_steps` decoding steps in a worker thread. Before each step it opens the requests that arrived (they join
    the running batch at that step, prefilled together) and calls `before_step`; after each, the rows whose turn
    ended leave the batch and a request whose rows have all ended is answered at once (the burst stops there).
    Rows of different requests never wait for one another, so a task whose tool call returned joins while
    another task's rows decode, and the batch stays full while tools run. Each request's rows match and seed as
    `TurnEngine.generate` would for it alone: a row draws the same tokens whichever rows share its steps.

    `engine_for` gives the engine at each burst (model lock held); while rows are open the engine must stay the
    same object (another one fails the open requests). `after_burst` reads the engine's counters; `on_error`
    hears that a step raised (the engine's state is then unknown: the generator makes a fresh one).
    """

    def __init__(self, engine_for: Callable[[], TurnEngine], lock: threading.Lock, *, before_step: StepHook,
                 after_burst: Callable[[TurnEngine], None] | None = None, on_error: Callable[[], None] | None = None,
                 burst_steps: int = BURST_STEPS) -> None:
        if burst_steps < 1:
            raise ValueError(f"burst_steps must be >= 1, got {burst_steps}")
        self._engine_for = engine_for
        self._lock = lock
        self._before_step = before_step
        self._after_burst = after_burst
        self._on_error = on_error
        self._burst_steps = burst_steps
        self._mutex = threading.Lock()
        """Guards what both the event loop and the worker thread touch: `_waiting`, `_open`, `_orphans`, `_finished`
        and requests' `keys`, `ended`, `cancelled`."""
        self._waiting: list[_Request] = []
        self._open: dict[Hashable, _Request] = {}
        """Rows queued or decoding, by key, and their request."""
        self._orphans: list[tuple[TurnEngine | None, Hashable]] = []
        """Resting rows of cancelled requests (and their engine), closed before the next step."""
        self._finished: list[_Request] = []
        self._engine: TurnEngine | None = None
        """The engine the open rows live in."""
        self._wake = anyio.Event()
        self.steps = 0
        """Engine steps run."""
        self.submitted = 0
        """Requests submitted."""
        self.requests = 0
        """Requests answered (with rows or an error)."""
        self.joined_running = 0
        """Requests opened while rows of another request were decoding (they joined a running batch)."""

    async def sample(self, contexts: Sequence[Sequence[int]], n: int, seed: int = 0) -> list[SampledSequence]:
        """Up to n tokens after each context (fewer at the stop id); one sequence per context, in order.

        :raises ValueError: a context the engine refuses (`TurnEngine.open_turns`).
        """
        request = _Request([list(c) for c in contexts], n, seed, anyio.Event())
        with self._mutex:
            self._waiting.append(request)
        self.submitted += 1
        self._wake.set()
        try:
            await request.done.wait()
        except BaseException:
            self._cancel(request)
            raise
        if request.error is not None:
            raise request.error
        return [as_sequence(c, request.ended[k]) for c, k in zip(request.contexts, request.keys, strict=True)]

    def _cancel(self, request: _Request) -> None:
        """The caller left: its rows are closed, those that ended now and the rest when they end."""
        with self._mutex:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
            self._orphans.extend((self._engine, key) for key in request.ended)
        self._wake.set()

    async def run(self) -> None:
        """The pump: bursts of steps in a worker thread while any request is waiting or open; until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._pending():
                try:
                    await anyio.to_thread.run_sync(self._burst)
                except Exception as err:     # the engine's state is unknown: fail what is in it, start afresh
                    self._fail(err)
                self._answer()

    def _pending(self) -> bool:
        with self._mutex:
            return bool(self._waiting or self._open or self._orphans or self._finished)

    def _answer(self) -> None:
        with self._mutex:
            finished, self._finished = self._finished, []
        for request in finished:
            self.requests += 1
            request.done.set()

    def _fail(self, err: Exception) -> None:
        """Every request waiting or open gets `err`; the engine is forgotten."""
        with self._mutex:
            failed = {id(r): r for r in [*self._open.values(), *self._waiting]}
            self._open.clear()
            self._waiting.clear()
            self._orphans.clear()
            for r in failed.values():
                r.error = err
                self._finished.append(r)
        self._engine = None
        if self._on_error is not None:
            self._on_error()

    def _burst(self) -> None:
        """Worker thread: up to `burst_steps` steps under the model lock; stops once a request is answered."""
        with self._lock:
            engine = self._engine_for()
            if self._engine is not None and engine is not self._engine and self._open:
                raise RuntimeError("the generator's turn engine changed while rows were decoding")
            self._engine = engine
            try:
                for _ in range(self._burst_steps):
                    self._open_waiting(engine)
                    if not engine.busy:
                        if self._open:
                            raise RuntimeError(f"{len(self._open)} rows open, yet the turn engine is idle")
                        break
                    self._before_step(engine, self.steps)
                    ended = engine.step()
                    self.steps += 1
                    if self._end(engine, ended):
                        break
            finally:
                if self._after_burst is not None:
                    self._after_burst(engine)

    def _open_waiting(self, engine: TurnEngine) -> None:
        """Close orphaned rows, then queue the turns of every request that arrived (a refused one is answered)."""
        with self._mutex:
            waiting, self._waiting = self._waiting, []
            orphans, self._orphans = self._orphans, []
        for owner, key in orphans:
            if owner is engine and key in engine.rows("resting"):
                engine.close(key)
        running = engine.busy
        for request in waiting:
            try:
                keys = engine.open_turns(request.contexts, max_new_tokens=request.n, seed=request.seed)
            except ValueError as err:
                request.error = err
                with self._mutex:
                    self._finished.append(request)
                continue
            self.joined_running += running
            with self._mutex:
                request.keys = keys
                self._open.update((k, request) for k in keys)
                if not keys:
                    self._finished.append(request)

    def _end(self, engine: TurnEngine, ended: list[TurnSample]) -> bool:
        """Hand ended turns to their requests; True when a request has all its rows (it is answered now)."""
        answered = False
        with self._mutex:
            for turn in ended:
                request = self._open.pop(turn.row, None)
                if request is None:
                    continue
                request.ended[turn.row] = turn
                if request.cancelled:
                    engine.close(turn.row)
                elif len(request.ended) == len(request.keys):
                    self._finished.append(request)
                    answered = True
        return answered


__all__ = ["BURST_STEPS", "EngineDriver"]
