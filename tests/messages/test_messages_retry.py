"""The one retry policy (messages/retry.py) and `Wakeup` (messages/wakeup.py), as pure logic: a stop or a
reason to go on forever is required, the last error comes back unchanged, each wait is logged with its
fields, the backoff restarts after progress; a wakeup is seen once and wakes every waiter."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
import tenacity
from structlog.testing import capture_logs

from rlbus.messages.retry import retry_policy
from rlbus.messages.wakeup import Wakeup

pytestmark = pytest.mark.anyio


class Flaky:
    """Fails with `error` the first `failures` calls, then returns the number of calls."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures, self.error, self.calls = failures, error or ConnectionError("down"), 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.calls


async def _run(retry: tenacity.AsyncRetrying, call: Flaky) -> int:
    async for attempt in retry:
        with attempt:
            return await call()
    raise AssertionError("unreachable")


def _no_sleep(slept: list[float]) -> Callable[[float], Awaitable[None]]:
    """A sleep that only records how long it was asked to wait."""

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
    return sleep


def test_a_policy_needs_a_stop_or_a_reason_to_go_on_forever() -> None:
    with pytest.raises(ValueError, match="forever"):
        retry_policy("x_retry", on=OSError, initial_s=0.1, max_s=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        retry_policy("x_retry", on=OSError, initial_s=0.1, max_s=1.0, attempts=3, forever="because")


async def test_retries_until_it_works_and_logs_each_wait_with_its_fields() -> None:
    slept: list[float] = []
    call = Flaky(2)
    version = [7]
    with capture_logs() as logs:
        got = await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=1.0, attempts=5,
                                      sleep=_no_sleep(slept), region="eu", version=lambda: version[0]), call)
    assert got == 3 and call.calls == 3
    waits = [e for e in logs if e["event"] == "x_retry"]
    assert [e["attempt"] for e in waits] == [1, 2]
    assert all(e["log_level"] == "warning" and e["region"] == "eu" and e["version"] == 7 for e in waits)
    assert "ConnectionError('down')" in waits[0]["error"]
    assert [round(e["retry_s"], 3) for e in waits] == [round(s, 3) for s in slept]
    assert 0.1 <= slept[0] <= 0.2 and 0.2 <= slept[1] <= 0.3          # doubling, up to initial_s of jitter


async def test_gives_up_after_its_attempts_with_the_last_error_unchanged() -> None:
    call = Flaky(10, ConnectionError("still down"))
    with pytest.raises(ConnectionError, match="still down"):
        await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=1.0, attempts=3,
                                sleep=_no_sleep([])), call)
    assert call.calls == 3


async def test_other_errors_are_not_retried() -> None:
    call = Flaky(1, KeyError("bug"))
    with pytest.raises(KeyError):
        await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=1.0, attempts=3,
                                sleep=_no_sleep([])), call)
    assert call.calls == 1


async def test_until_stops_on_the_callers_budget() -> None:
    call = Flaky(10)
    with pytest.raises(ConnectionError):
        await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=1.0,
                                until=lambda: call.calls >= 2, sleep=_no_sleep([])), call)
    assert call.calls == 2


async def test_forever_says_why_with_its_first_retry_and_never_gives_up() -> None:
    call = Flaky(30)
    slept: list[float] = []
    with capture_logs() as logs:
        got = await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=0.4,
                                      forever="the region must catch up", sleep=_no_sleep(slept)), call)
    assert got == 31
    reasons = [e.get("forever") for e in logs if e["event"] == "x_retry"]
    assert reasons[0] == "the region must catch up" and not any(reasons[1:])
    assert max(slept) <= 0.4


async def test_since_restarts_the_backoff_and_the_give_up_clock_after_progress() -> None:
    """With `since` (the caller's last progress), the tries since it moved set the delay, and the policy
    gives up only once it has not moved for `give_up_after_s`."""
    clock = [time.monotonic()]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 4:
            clock[0] = time.monotonic()          # the follower reached its server again

    call = Flaky(6)
    await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=10.0, give_up_after_s=3600,
                            since=lambda: clock[0], sleep=sleep), call)
    bases = [0.1, 0.2, 0.4, 0.8, 0.1, 0.2]                 # doubling, from the first delay again after progress
    assert len(slept) == len(bases) and all(b <= s <= b + 0.1 for s, b in zip(slept, bases, strict=True))
    old = Flaky(10)
    with pytest.raises(ConnectionError):
        await _run(retry_policy("x_retry", on=ConnectionError, initial_s=0.1, max_s=1.0, give_up_after_s=5,
                                since=lambda: time.monotonic() - 6, sleep=_no_sleep([])), old)
    assert old.calls == 1


async def test_wakeup_set_before_the_wait_is_seen_once() -> None:
    wakeup = Wakeup()
    wakeup.set()
    assert wakeup.is_set()
    with anyio.fail_after(5):
        assert await wakeup.wait() is True
    assert not wakeup.is_set()
    assert await wakeup.wait(0.05) is False


async def test_wakeup_wakes_every_waiter_and_a_timed_wait_returns_early() -> None:
    wakeup = Wakeup()
    woken: list[str] = []

    async def waiter(name: str) -> None:
        if await wakeup.wait(30):
            woken.append(name)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "a")
            tg.start_soon(waiter, "b")
            await anyio.wait_all_tasks_blocked()
            wakeup.set()
    assert sorted(woken) == ["a", "b"]
    assert not wakeup.is_set()
