"""The one retry policy of rlbus: tenacity with exponential, jittered backoff, a logged `before_sleep`, and a
stop chosen on purpose at every call site.

Owns: `retry_policy()` (an `AsyncRetrying` to iterate: `async for attempt in retry_policy(...): with attempt:`)
and `GIVE_UP_S`, how long an actor rides out an outage of a server it cannot work without before it fails
and its restart takes over. Every policy either stops (after `give_up_after_s` seconds, `attempts` tries, or
once `until()` is true) and then re-raises the last error, or says in `forever=` why it never may.
Does not: decide what is transient (callers pass the errors to retry `on`) or hide the error it gives up on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog
import tenacity
from tenacity.stop import stop_base
from tenacity.wait import wait_base

log = structlog.get_logger()

GIVE_UP_S: Final = 300.0
"""How long an actor retries a server it cannot work without (the hub for the trainer's mark watch and the
publisher) before the error fails it; its restart then resumes from what the bus holds."""


class _SinceProgress(wait_base):
    """`wait_exponential_jitter`'s delays counted from the last progress rather than the first try: the tries
    since `since()` last changed set the exponent."""

    def __init__(self, initial_s: float, max_s: float, since: Callable[[], float]) -> None:
        self.initial_s, self.max_s, self.since = initial_s, max_s, since
        self._seen: float | None = None
        self._base = 0

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        mark = self.since()
        if mark != self._seen:
            self._seen, self._base = mark, retry_state.attempt_number - 1
        tries = retry_state.attempt_number - self._base
        return float(min(self.max_s, self.initial_s * 2 ** (tries - 1) + random.uniform(0, self.initial_s)))


class _Until(stop_base):
    """Stop once a caller's predicate holds (a budget the caller keeps, e.g. bad objects seen)."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self.predicate = predicate

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.predicate()


class _QuietSince(stop_base):
    """Stop once `since()` (monotonic seconds of the last progress) is more than `seconds` ago."""

    def __init__(self, seconds: float, since: Callable[[], float]) -> None:
        self.seconds, self.since = seconds, since

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return time.monotonic() - self.since() > self.seconds


def retry_policy(event: str, *, on: type[BaseException] | tuple[type[BaseException], ...], initial_s: float,
                 max_s: float, give_up_after_s: float | None = None, attempts: int | None = None,
                 until: Callable[[], bool] | None = None, forever: str | None = None,
                 since: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[Any]] | None = None, **fields: Any) -> tenacity.AsyncRetrying:
    """Retry errors of the types `on`, waiting `initial_s * 2**(n-1)` (plus up to `initial_s` of jitter,
    at most `max_s`) before try n+1, and log `event` as a warning before each wait with `attempt`, `error`,
    `retry_s` and `fields` (a callable field is called at log time, e.g. the version being written).
    Any other error, and the last one once the policy stops, is raised as it is.

    Stops: after `give_up_after_s` seconds, after `attempts` tries, or once `until()` holds, whichever comes
    first. A loop that must never give up passes `forever="<why>"` instead (logged with its first retry).
    `since`: monotonic time of the caller's last progress (a follower that reached its server); the backoff
    and the `give_up_after_s` clock then start again from it. `sleep`: how to wait (default `anyio.sleep`),
    e.g. a `Wakeup`'s `wait` so new work cuts a wait short.

    :raises ValueError: neither a stop nor `forever` is given, or both are.
    """
    stops: list[stop_base] = []
    if give_up_after_s is not None:
        stops.append(_QuietSince(give_up_after_s, since) if since is not None
                     else tenacity.stop_after_delay(give_up_after_s))
    if attempts is not None:
        stops.append(tenacity.stop_after_attempt(attempts))
    if until is not None:
        stops.append(_Until(until))
    if bool(stops) == (forever is not None):
        raise ValueError(f"retry policy {event!r}: give exactly one of a stop (give_up_after_s, attempts, until) "
                         f"or forever='<why it must never give up>'")
    wait: wait_base = (_SinceProgress(initial_s, max_s, since) if since is not None
                       else tenacity.wait_exponential_jitter(multiplier=initial_s, max=max_s, jitter=initial_s))

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        extra = {k: v() if callable(v) else v for k, v in fields.items()}
        if forever is not None and state.attempt_number == 1:
            extra["forever"] = forever
        log.warning(event, attempt=state.attempt_number, error=repr(error),
                    retry_s=round(state.upcoming_sleep, 3), **extra)

    options: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(on), wait=wait,
        stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never,
        before_sleep=before_sleep, reraise=True, **options)
