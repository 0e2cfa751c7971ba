"""A loopback TCP relay that tests and `rlbus chaos` can cut and heal, to partition a leaf from its hub.

Owns: one listening socket on 127.0.0.1 that forwards every accepted connection to a fixed upstream
address, on its own thread and event loop (so it works under sync fixtures and async tests alike);
`cut()` closes every forwarded connection and refuses new ones, `heal()` accepts again. With `latency_s`
(and `jitter_s`) given, every chunk is held that long in each direction before it is passed on (in order: jitter never
reorders a stream), which is how a shaped link between regions gets its delay (topology/network/links.py; this kernel
has no `netem`); `spike(extra_s)` adds to it for a latency spike.
Does not: know about NATS (topology/network/servers.py puts one in front of the hub's leafnode port).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Final, TypeVar

import structlog

from rlbus.messages.errors import ServerError

log = structlog.get_logger()

_CHUNK: Final = 64 * 1024
_DELAY_QUEUE: Final = 1024
"""Chunks a delayed direction holds at most (64 MiB); past it the relay stops reading (TCP backpressure)."""
_T = TypeVar("_T")


class Relay:
    """Forward `127.0.0.1:<port>` to `upstream`; `cut()` partitions, `heal()` reconnects.

    `Relay(("127.0.0.1", 4222)).start()` binds a free port (or `listen_port` when given, e.g. to keep
    the same port after a restart of whatever uses it) and returns once it accepts connections.
    `stop()` closes everything and joins the thread; it is bounded by `timeout_s`.
    """

    def __init__(self, upstream: tuple[str, int], *, listen_port: int = 0, host: str = "127.0.0.1",
                 name: str = "relay", timeout_s: float = 5.0, latency_s: float | None = None,
                 jitter_s: float = 0.0) -> None:
        if (latency_s or 0.0) < 0 or jitter_s < 0:
            raise ServerError(f"relay {name}: latency {latency_s!r} and jitter {jitter_s!r} must be >= 0 seconds")
        self.upstream: Final = upstream
        self.delays: Final = latency_s is not None
        """Whether connections pass through the delaying pipe (`latency_s` given, even 0: `spike()` works)."""
        self.latency_s = latency_s or 0.0
        """One-way delay added to each direction, seconds."""
        self.jitter_s = jitter_s
        """Each chunk's delay is `latency_s` plus uniform noise in [-jitter_s, +jitter_s] (never below 0)."""
        self.extra_s = 0.0
        """A latency spike on top of `latency_s` (`spike()`), seconds."""
        self.host: Final = host
        self.name: Final = name
        self._listen_port = listen_port
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._cut = False
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.connections_total = 0
        """Connections accepted and forwarded since start (refused ones during a cut not counted)."""

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Relay:
        """Bind and start forwarding; raises `ServerError` if the port cannot be bound."""
        if self._thread is not None:
            raise ServerError(f"relay {self.name} is already started on port {self._listen_port}")
        self._thread = threading.Thread(target=self._main, name=f"rlbus-{self.name}", daemon=True)
        self._thread.start()
        if not self._started.wait(self._timeout_s):
            raise ServerError(f"relay {self.name} did not start within {self._timeout_s}s")
        if self._error is not None:
            self._thread.join(self._timeout_s)
            self._thread = None
            raise ServerError(f"relay {self.name} cannot listen on {self.host}:{self._listen_port}: "
                              f"{self._error}; choose another port or stop what holds it") from self._error
        log.info("relay_started", relay=self.name, port=self.port,
                 upstream=f"{self.upstream[0]}:{self.upstream[1]}")
        return self

    def stop(self) -> None:
        """Close every connection and the listener, and join the thread (bounded)."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed: the thread has ended
            loop.call_soon_threadsafe(stop.set)
        thread.join(self._timeout_s)
        if thread.is_alive():
            raise ServerError(f"relay {self.name} thread did not stop within {self._timeout_s}s")
        self._thread = None
        log.info("relay_stopped", relay=self.name, port=self._listen_port)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The port the relay listens on (fixed after the first start)."""
        return self._listen_port

    @property
    def is_cut(self) -> bool:
        return self._cut

    # ---- partition control ----------------------------------------------------------------------
    def cut(self) -> None:
        """Drop every forwarded connection now and refuse new ones until `heal()`."""
        self._call(self._do_cut())
        log.info("relay_cut", relay=self.name, port=self.port)

    def heal(self) -> None:
        """Accept and forward connections again (clients reconnect on their own schedule)."""
        self._cut = False
        log.info("relay_healed", relay=self.name, port=self.port)

    def spike(self, extra_s: float) -> None:
        """Add `extra_s` seconds to each direction's delay from now on (0 ends the spike)."""
        if extra_s < 0:
            raise ServerError(f"relay {self.name}: a latency spike of {extra_s!r}s must be >= 0")
        self.extra_s = extra_s
        log.info("relay_latency_spike", relay=self.name, extra_s=extra_s)

    def delay_s(self) -> float:
        """The delay of the next chunk: latency, jitter and spike (0 when the relay adds none)."""
        base = self.latency_s + self.extra_s
        if self.jitter_s > 0:
            base += random.uniform(-self.jitter_s, self.jitter_s)
        return max(base, 0.0)

    # ---- internals ------------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._loop is None or self._thread is None:
            coro.close()
            raise ServerError(f"relay {self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._listen_port))
            self._server = await asyncio.start_server(self._accept, sock=sock)
        except OSError as err:
            self._error = err
            self._started.set()
            return
        self._listen_port = sock.getsockname()[1]
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            self._server.close()
            await self._do_cut()
            handlers = list(self._handlers)  # a delayed chunk may still be waiting: end them before the loop
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await self._server.wait_closed()

    async def _do_cut(self) -> None:
        self._cut = True
        writers, self._writers = list(self._writers), set()
        for writer in writers:
            _abort(writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut or self._stop is None or self._stop.is_set():
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as err:
            log.debug("relay_upstream_refused", relay=self.name, error=repr(err))
            _abort(writer)
            return
        if self._cut:  # cut while we were connecting
            _abort(writer)
            _abort(up_writer)
            return
        self.connections_total += 1
        self._writers.update((writer, up_writer))
        if (me := asyncio.current_task()) is not None:
            self._handlers.add(me)
        try:
            async with asyncio.TaskGroup() as tg:  # each pipe closes the other side when it ends
                pipe = self._delayed_pipe if self.delays else _pipe
                tg.create_task(pipe(reader, up_writer))
                tg.create_task(pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # the relay is stopping (`_serve`); the stream server's callback must not see a cancelled task
        finally:
            if me is not None:
                self._handlers.discard(me)
            for w in (writer, up_writer):
                self._writers.discard(w)
                _abort(w)

    async def _delayed_pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`_pipe` with each chunk passed on `delay_s()` after it was read, no earlier than the one before it."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(_DELAY_QUEUE)

        async def send() -> None:
            try:
                while (item := await queue.get()) is not None:
                    due, chunk = item
                    if (wait := due - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                    writer.write(chunk)
                    await writer.drain()
            except OSError:
                pass
            finally:
                _abort(writer)

        sender = asyncio.create_task(send())
        last_due = 0.0
        try:
            while chunk := await reader.read(_CHUNK):
                last_due = max(last_due, time.monotonic() + self.delay_s())
                await queue.put((last_due, chunk))
            await queue.put(None)
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if not sender.done():
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            _abort(writer)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until EOF or error, then close the other side so its peer sees the drop."""
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close a connection at once (RST-like: no waiting for buffered bytes)."""
    transport = writer.transport
    if not transport.is_closing():
        transport.abort()
