"""The generator's engine driver (actors/generator/stepper.py) on a real tiny policy: a request submitted while
another's rows decode joins the running batch and is answered first; each request's rows are what
`TurnEngine.generate` samples for it alone; a cancelled caller's rows are closed and an engine error reaches the
requests in flight, while later requests are served."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import pytest
import torch
from helpers import eventually

from rlbus.actors.generator.stepper import EngineDriver
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.engine import TurnEngine
from rlbus.model.sampling.generate import SampledSequence

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)
LOGP_ATOL = 1e-4
"""As tests/model/test_model_sampling_engine.py: the cache was filled in other batches than a lone call's."""
GATE_S = 60.0
"""Most a held step waits for the test to let it go (only a failing test reaches it)."""


def _policy() -> BuiltinPolicy:
    torch.manual_seed(0)
    return BuiltinPolicy(Transformer(ModelConfig.tiny(vocab_size=300, max_seq_len=256, tie_embeddings=False))).eval()


def _engine(policy: BuiltinPolicy) -> TurnEngine:
    return TurnEngine(policy, temperature=1.0, kv_cache_tokens=4096)


def _contexts(first: int, rows: int, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(first)
    return [torch.randint(3, 250, (length + 3 * r,), generator=g).tolist() for r in range(rows)]


class Gate:
    """A `before_step` hook that records the rows decoding at each step and holds step `at` until `release`."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.reached = threading.Event()
        self.released = threading.Event()
        self.decoding: list[int] = []
        self.fail = False

    def __call__(self, engine: TurnEngine, step: int) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("a step failed")
        if step == self.at:
            self.reached.set()
            assert self.released.wait(GATE_S)
        self.decoding.append(len(engine.rows("decoding")))


async def _serve(driver: EngineDriver, body: Callable[[], object]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(driver.run)
        await body()  # type: ignore[misc]
        tg.cancel_scope.cancel()


def _same(got: list[SampledSequence], want: list[SampledSequence]) -> None:
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in want]
    for s, w in zip(got, want, strict=True):
        torch.testing.assert_close(s.logprobs, w.logprobs, atol=LOGP_ATOL, rtol=0)


async def test_a_request_joins_the_running_batch_and_is_answered_before_the_longer_one() -> None:
    """Request A (2 rows, 24 tokens) is held at its third step; request B (1 row, 4 tokens) submitted meanwhile
    decodes beside A's rows from the next step and is answered while A's rows still decode."""
    engine = _engine(_policy())
    gate = Gate(at=3)
    driver = EngineDriver(lambda: engine, threading.Lock(), before_step=gate)
    order: list[str] = []
    results: dict[str, list[SampledSequence]] = {}

    async def ask(name: str, contexts: list[list[int]], n: int, seed: int) -> None:
        results[name] = await driver.sample(contexts, n, seed)
        order.append(name)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "a", _contexts(1, 2), 24, 1)
            await eventually(lambda: gate.reached.is_set(), what="A held at its third step", poll_s=0.01)
            tg.start_soon(ask, "b", _contexts(2, 1), 4, 2)
            await eventually(lambda: driver.submitted, lambda n: n == 2, what="B submitted", poll_s=0.01)
            gate.released.set()
    await _serve(driver, body)
    assert order == ["b", "a"] and driver.joined_running == 1
    assert [len(s.tokens) for s in results["a"]] == [24, 24] and len(results["b"][0].tokens) == 4
    assert max(gate.decoding) == 3 and gate.decoding[:3] == [0, 2, 2]      # B joined A's running batch
    assert engine.stats.decode_rows < 3 * engine.stats.decode_steps     # B left before A ended
    assert sorted(map(len, (engine.rows("resting"), engine.rows("decoding"), engine.rows("queued")))) == [0, 0, 3]


async def test_rows_equal_what_generate_samples_for_each_request_alone() -> None:
    """Two concurrent requests, then each one's next chunk (its rows continued): per row, the tokens and (within
    LOGP_ATOL) logprobs a fresh engine's `generate` gives for each request alone, in the same order."""
    policy = _policy()
    engine = _engine(policy)
    driver = EngineDriver(lambda: engine, threading.Lock(), before_step=Gate())
    asks = [(_contexts(3, 2), 9, 5), (_contexts(4, 3), 6, 6)]
    got: dict[int, list[SampledSequence]] = {}

    async def ask(i: int, contexts: list[list[int]], n: int, seed: int) -> None:
        got[i] = await driver.sample(contexts, n, seed)

    async def body() -> None:
        for rounds in range(2):
            async with anyio.create_task_group() as tg:
                for i, (contexts, n, seed) in enumerate(asks):
                    tg.start_soon(ask, 2 * rounds + i, contexts, n, seed)
            for i, (contexts, n, seed) in enumerate(asks):     # the next chunk of each row, after an observation
                asks[i] = ([c + s.tokens.tolist() + [7, 8] for c, s in zip(contexts, got[2 * rounds + i],
                                                                          strict=True)], n, seed + 10)
    await _serve(driver, body)
    assert engine.stats.reused_tokens > 0 and len(engine.rows("resting")) == 5
    reference = _engine(policy)
    asks = [(_contexts(3, 2), 9, 5), (_contexts(4, 3), 6, 6)]
    for rounds in range(2):
        for i, (contexts, n, seed) in enumerate(asks):
            want = reference.generate(contexts, max_new_tokens=n, seed=seed)
            _same(got[2 * rounds + i], want)
            asks[i] = ([c + s.tokens.tolist() + [7, 8] for c, s in zip(contexts, want, strict=True)], n, seed + 10)


async def test_a_cancelled_caller_and_an_engine_error_leave_the_driver_serving() -> None:
    """A caller cancelled while its rows decode: its rows are closed once they end, and the next request is
    answered. A step that raises: the request in flight gets the error, the engine is made again, and the next
    request is answered from the fresh engine."""
    policy = _policy()
    engines = [_engine(policy)]
    gate = Gate(at=2)
    driver = EngineDriver(lambda: engines[-1], threading.Lock(), before_step=gate,
                          on_error=lambda: engines.append(_engine(policy)))

    async def body() -> None:
        with anyio.CancelScope() as scope:
            async def cancel_when_held() -> None:
                await eventually(lambda: gate.reached.is_set(), what="the request held at its second step",
                                 poll_s=0.01)
                scope.cancel()
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_held)
                await driver.sample(_contexts(5, 2), 16, 1)
        assert scope.cancelled_caught
        gate.released.set()
        after = await driver.sample(_contexts(6, 1), 5, 2)
        _same(after, _engine(policy).generate(_contexts(6, 1), max_new_tokens=5, seed=2))
        await eventually(lambda: engines[0].busy, lambda busy: not busy, what="the cancelled rows ended", poll_s=0.01)
        assert len(engines[0].rows("resting")) == 1      # they were closed; the later request's row rests
        gate.fail = True
        with pytest.raises(RuntimeError, match="a step failed"):
            await driver.sample(_contexts(7, 1), 5, 3)
        last = await driver.sample(_contexts(8, 2), 5, 4)
        _same(last, _engine(policy).generate(_contexts(8, 2), max_new_tokens=5, seed=4))
    await _serve(driver, body)
    assert len(engines) == 2 and len(engines[1].rows("resting")) == 2
