"""A sandbox supervisor on its own embedded nats-server, for commands that grade code outside any run.

- Owns: `local_sandbox(...)` (a server of its own serving one `SandboxSupervisor`; yields the admin bus) and
  `sandbox_runner(...)` (the same on a thread of its own, as a `model.grading` runner for synchronous code),
  used by `rlbus tasks check`, `rlbus bench sandbox` and `rlbus eval`.
- Guarantee: on exit the supervisor is cancelled, the bus closed and the server stopped.
- Does not: build requests or grade results (actors/common/sandbox_client.py).
"""

from __future__ import annotations

import functools
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
    from rlbus.messages.bus import Bus
    from rlbus.model.tasks.grading import GradeCase, GradeResult


@asynccontextmanager
async def local_sandbox(name: str, config: SandboxConfig,
                        launch: SandboxLaunch | None = None) -> AsyncIterator[Bus]:
    """Serve a supervisor with `config` (and `launch`) on a server of its own; yield the admin bus.

    Starts a JetStream server in a temporary directory, connects as admin on a fresh run id, provisions the
    streams a supervisor writes to (EVENTS, DLQ), serves one `SandboxSupervisor` in region `hub`, and yields
    the bus to send `SandboxRequest`s on; on exit it cancels the supervisor, closes the bus and stops the
    server. Used by `rlbus tasks check` (ops/tasks.py) and `rlbus bench sandbox` (ops/bench/sandbox.py).
    """
    import anyio
    from nats.js.api import StreamConfig

    from rlbus.actors.base import ActorId
    from rlbus.actors.sandbox.supervisor import SandboxSupervisor
    from rlbus.messages.bus import Bus, ConnectOptions
    from rlbus.topology.network.server_config import ServerOptions
    from rlbus.topology.network.servers import EmbeddedServer

    with tempfile.TemporaryDirectory(prefix=f"rlbus-{name}-") as tmp:
        server = EmbeddedServer.start(tmp, ServerOptions(name=name))
        try:
            cred = server.credential("admin")
            bus = await Bus.connect(server.url, run=f"l{uuid.uuid4().hex[:8]}",
                                    options=ConnectOptions(user=cred.user, password=cred.password))
            try:
                s = bus.subjects
                await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))
                await bus.js.add_stream(StreamConfig(name=s.dead_letter_stream(), subjects=[s.all_dead_letters()]))
                actor = SandboxSupervisor(ActorId(s.run, "hub", "sandbox", name), bus, config, launch=launch)
                async with anyio.create_task_group() as tg:
                    await tg.start(actor.serve)
                    yield bus
                    tg.cancel_scope.cancel()
            finally:
                await bus.close()
        finally:
            server.stop()


@contextmanager
def sandbox_runner(name: str, config: SandboxConfig | None = None,
                   ) -> Iterator[Callable[[Sequence[GradeCase]], list[GradeResult]]]:
    """A `model.grading` runner for synchronous callers: each call grades its cases on a `local_sandbox`
    supervisor (served on a thread of its own for the block), results in order.

    :raises SandboxCrashed: (from a call) a case got no definitive verdict after its retries.
    """
    import anyio.from_thread

    from rlbus.actors.common.sandbox_client import grade_cases
    from rlbus.actors.sandbox.config import SandboxConfig

    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            portal.wrap_async_context_manager(local_sandbox(name, config or SandboxConfig())) as bus:
        def run(cases: Sequence[GradeCase]) -> list[GradeResult]:
            return list(portal.call(functools.partial(grade_cases, bus, "hub", list(cases),
                                                      id_prefix=f"{name}-{uuid.uuid4().hex[:12]}")))

        yield run
