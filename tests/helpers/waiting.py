"""Polling with a hang guard: `eventually` (async) and `eventually_sync` call a probe until its result is good.

The deadline is a hang guard only (a stuck run fails with what was awaited and the last result), never a
performance assertion: tests assert outcomes.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def _give_up(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"hang guard: {what} not within {timeout_s:g} s (last: {last!r})"[:2000])


async def eventually(probe: Callable[[], Awaitable[T] | T], until: Callable[[T], Any] = bool, *, what: str = "",
                     timeout_s: float = 60.0, poll_s: float = 0.1,
                     ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Call `probe()` (awaiting it when it returns an awaitable) every `poll_s` until `until(result)` holds
    (default: the result is truthy); return that result. An exception in `ignoring` counts as not yet (a server
    that is restarting). After `timeout_s`, AssertionError naming `what` and the last result."""
    last: object = None
    try:
        with anyio.fail_after(timeout_s):
            while True:
                try:
                    result = probe()
                    if inspect.isawaitable(result):
                        result = await result
                except ignoring as err:
                    last = err
                else:
                    if until(result):
                        return result
                    last = result
                await anyio.sleep(poll_s)
    except TimeoutError:
        raise _give_up(what or getattr(probe, "__name__", "probe"), timeout_s, last) from None


def eventually_sync(probe: Callable[[], T], until: Callable[[T], Any] = bool, *, what: str = "",
                    timeout_s: float = 60.0, poll_s: float = 0.1,
                    ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """`eventually` for code outside an event loop (processes, files, a Ray cluster): `probe()` every `poll_s`
    until `until(result)` holds; return that result, or AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            result = probe()
        except ignoring as err:
            last = err
        else:
            if until(result):
                return result
            last = result
        if time.monotonic() >= deadline:
            raise _give_up(what or getattr(probe, "__name__", "probe"), timeout_s, last)
        time.sleep(poll_s)
