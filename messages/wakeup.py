"""`Wakeup`: "look again" for a loop that waits for new work — the wait-then-replace-the-`anyio.Event` idiom.

Owns: the flag one side raises (`set()`, from any task of the loop's event loop) and a waiting loop lowers by
waiting on it. Does not: say what changed — every waiter re-checks what it waits for after waking.
"""

from __future__ import annotations

import anyio


class Wakeup:
    """A level-triggered wakeup: `set()` wakes every task waiting now, and while nobody has waited since, the
    next `wait()` returns at once. Waiting lowers it again, so each `set()` is seen at least once.

    Use in a loop that re-checks its condition: `while not ready(): await wakeup.wait()`.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        """Wake the waiters (and the next one to wait, if none waits now)."""
        self._event.set()

    def is_set(self) -> bool:
        """Whether a `set()` has not been waited for yet."""
        return self._event.is_set()

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Return True once set, lowering it; False when `timeout_s` passes first (None: no limit)."""
        event = self._event
        with anyio.move_on_after(timeout_s):
            await event.wait()
        if not event.is_set():
            return False
        if self._event is event:      # not already lowered (and maybe raised anew) by another waiter
            self._event = anyio.Event()
        return True
