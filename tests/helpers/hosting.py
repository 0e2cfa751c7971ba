"""Actors served in the test's own process: `hosted(actor, ...)` for the body of an `async with`, or `Hosted`
to start and stop one at chosen points inside a task group the test owns."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import anyio.abc

from rlbus.actors.base import Actor, State
from rlbus.messages.bus import Bus

A = TypeVar("A", bound=Actor)

STOP_TIMEOUT_S = 30.0
"""Hang guard on one actor's drain after it is cancelled."""


class Hosted:
    """One actor served in the background of a task group; `stop()` cancels it and waits for its drain."""

    def __init__(self, tg: anyio.abc.TaskGroup, actor: Actor) -> None:
        self.tg, self.actor, self.scope = tg, actor, anyio.CancelScope()
        self.done = anyio.Event()

    async def start(self) -> Hosted:
        """Serve the actor; return once it is ready (its `setup()` succeeded)."""
        async def body(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                with self.scope:
                    await self.actor.serve(task_status=task_status)
            finally:
                self.done.set()

        await self.tg.start(body)
        return self

    async def stop(self) -> State:
        """Cancel the actor and wait for its drain (hang guard `STOP_TIMEOUT_S`); its final state."""
        self.scope.cancel()
        with anyio.fail_after(STOP_TIMEOUT_S):
            await self.done.wait()
        return self.actor.state


@asynccontextmanager
async def hosted(actor: A, *more: Actor, close: Sequence[Bus] = ()) -> AsyncIterator[A]:
    """Serve `actor`, then each of `more`, in this process (each ready before the next starts) for the body of
    the `async with`; then stop them in reverse order, each drained, and close the buses in `close`."""
    try:
        async with anyio.create_task_group() as tg:
            running = [await Hosted(tg, a).start() for a in (actor, *more)]
            try:
                yield actor
            finally:
                for each in reversed(running):
                    await each.stop()
    finally:
        for bus in close:
            await bus.close()
