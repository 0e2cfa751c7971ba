"""SampleBatcher: concurrent sampling requests of a generator merge into one call, each gets its own rows."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from rlbus.actors.generator.batcher import SampleBatcher, cut
from rlbus.model.sampling.generate import SampledSequence


class _Recorder:
    """A pure-logic stand-in for `generate`: row r's token t is 1000*r + t; records every call."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
        self.gate.wait(5)
        self.calls.append((len(contexts), n, seed))
        if self.fail:
            raise RuntimeError("model exploded")
        return [SampledSequence(prompt=torch.tensor(c), tokens=torch.tensor([c[0] * 1000 + t for t in range(n)]),
                                logprobs=torch.full((n,), -0.5), versions=torch.zeros(n, dtype=torch.long),
                                routing=None, finish_reason="length") for c in contexts]


@pytest.mark.anyio
async def test_concurrent_requests_merge_into_one_call_and_get_their_own_rows() -> None:
    """Three tasks asking at once: one call of 2+1+3 rows, n = the largest ask; each result cut to its n."""
    run = _Recorder()
    batcher = SampleBatcher(run, max_len=100)
    results: dict[str, list[SampledSequence]] = {}

    async def ask(name: str, contexts: list[list[int]], n: int, seed: int) -> None:
        results[name] = await batcher.sample(contexts, n, seed)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "a", [[1], [2]], 4, 11)
        tg.start_soon(ask, "b", [[3]], 2, 22)
        tg.start_soon(ask, "c", [[4], [5], [6]], 3, 33)
    assert run.calls == [(6, 4, 11)]
    assert [s.tokens.tolist() for s in results["a"]] == [[1000, 1001, 1002, 1003], [2000, 2001, 2002, 2003]]
    assert [s.tokens.tolist() for s in results["b"]] == [[3000, 3001]]
    assert [s.tokens.tolist() for s in results["c"]] == [[4000, 4001, 4002], [5000, 5001, 5002], [6000, 6001, 6002]]
    assert (batcher.calls, batcher.rows) == (1, 6)


@pytest.mark.anyio
async def test_requests_arriving_during_a_call_go_together_into_the_next() -> None:
    """While a call runs, later requests queue; they share the following call."""
    run = _Recorder()
    run.gate.clear()
    batcher = SampleBatcher(run, max_len=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.sample, [[1]], 2, 1)
        await anyio.sleep(0.05)                       # the first call is now blocked in its thread
        tg.start_soon(batcher.sample, [[2]], 2, 2)
        tg.start_soon(batcher.sample, [[3]], 5, 3)
        await anyio.sleep(0.05)
        run.gate.set()
    assert run.calls == [(1, 2, 1), (2, 5, 2)]


@pytest.mark.anyio
async def test_callers_coming_back_apart_share_one_call_and_a_missing_one_is_not_waited_for_long() -> None:
    """Three callers of one call come back a few milliseconds apart (as after saving their partials): one call
    takes all three, not a call for the first back and another for the rest. When only two of the three come
    back, the call goes ahead without the third (after the linger)."""
    run = _Recorder()
    batcher = SampleBatcher(run, max_len=100, linger_s=1.0)

    async def task(row: int, chunks: int, delay: float) -> None:
        for _ in range(chunks):
            await batcher.sample([[row]], 2, row)
            await anyio.sleep(delay)                 # the save between chunks

    async with anyio.create_task_group() as tg:
        for row, delay in ((1, 0.0), (2, 0.01), (3, 0.02)):
            tg.start_soon(task, row, 2, delay)
    assert [rows for rows, _, _ in run.calls] == [3, 3]
    async with anyio.create_task_group() as tg:
        tg.start_soon(task, 4, 1, 0.0)
        tg.start_soon(task, 5, 1, 0.0)
    assert [rows for rows, _, _ in run.calls] == [3, 3, 2]


@pytest.mark.anyio
async def test_merged_call_never_exceeds_max_seq_len_and_rows_are_capped() -> None:
    """A long context limits the merged n to max_len - longest; max_rows splits the queue into calls."""
    run = _Recorder()
    batcher = SampleBatcher(run, max_len=10, max_rows=3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.sample, [[1] * 8], 2, 1)      # 8 + 2 = 10 fits
        tg.start_soon(batcher.sample, [[2], [3]], 6, 2)     # alone it could take 6
        tg.start_soon(batcher.sample, [[4]], 1, 3)
    assert run.calls == [(3, 2, 1), (1, 1, 3)]
    with pytest.raises(ValueError, match="exceeds max_seq_len 10"):
        await batcher.sample([[1] * 9], 2)


@pytest.mark.anyio
async def test_an_error_of_the_call_reaches_every_caller_in_it() -> None:
    """The model raising inside a merged call is raised to each of its callers, and the batcher goes on."""
    run = _Recorder(fail=True)
    batcher = SampleBatcher(run, max_len=100)
    errors: list[str] = []

    async def ask(contexts: list[list[int]]) -> None:
        try:
            await batcher.sample(contexts, 2)
        except RuntimeError as err:
            errors.append(str(err))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, [[1]])
        tg.start_soon(ask, [[2]])
    assert errors == ["model exploded", "model exploded"]
    run.fail = False
    assert [s.tokens.tolist() for s in await batcher.sample([[7]], 1)] == [[7000]]


def test_cut_keeps_the_first_n_tokens_and_their_routing() -> None:
    """cut() trims tokens, logprobs, versions and the (P + N) routing record; a short sample is untouched."""
    sample = SampledSequence(prompt=torch.tensor([5, 6]), tokens=torch.tensor([7, 8, 9]),
                             logprobs=torch.tensor([-1.0, -2.0, -3.0]), versions=torch.tensor([0, 1, 1]),
                             routing=torch.arange(5).reshape(5, 1, 1), finish_reason="eos")
    short = cut(sample, 2)
    assert short.tokens.tolist() == [7, 8] and short.logprobs.tolist() == [-1.0, -2.0]
    assert short.versions.tolist() == [0, 1] and short.finish_reason == "length"
    assert short.routing is not None and short.routing.flatten().tolist() == [0, 1, 2, 3]
    assert cut(sample, 3) is sample
