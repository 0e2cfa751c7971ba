"""Shared fixtures: one real JetStream server per session, a bus per test isolated by run id, and one finished
`rlbus up` run for the tests that only read a stopped run (`finished_run`).

Two session-wide guards keep CI from going red for nothing: `ast_guard` fails any test during which Python
source was parsed into an AST off the main thread outside rlbus's AST lock (tests/helpers/ast_guard.py,
messages/astlock.py), and a watchdog ends a run that hangs after its last test (session teardown, interpreter
exit) with every thread's stack.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest
from helpers import new_run
from helpers.ast_guard import AstOffMainThread, import_rewritten_plugin_modules
from helpers.runs import FinishedRun, finished_tiny_run

from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.topology.network.regions import RegionSet
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

SESSION_END_TIMEOUT_S = 120.0
"""Longest the session's teardown and the interpreter's exit may take before the watchdog dumps every thread's
stack and exits 1 (pytest-timeout guards each test, not what follows the last one)."""


ast_off_main_thread = AstOffMainThread()
sys.addaudithook(ast_off_main_thread.hook)         # for the whole process: audit hooks cannot be removed
import_rewritten_plugin_modules()


@pytest.fixture(autouse=True)
def ast_guard() -> Iterator[AstOffMainThread]:
    """Fails a test during which (or since the previous test's end) an AST was built off the main thread."""
    ast_off_main_thread.check("since the previous test ended (a thread outlived its test)")
    yield ast_off_main_thread
    ast_off_main_thread.check("during this test")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After the last test: report ASTs built off the main thread since, and arm the exit watchdog (a hang in
    session teardown or interpreter exit, say a non-daemon thread that never returns, ends with a dump)."""
    if found := ast_off_main_thread.take():
        sys.stderr.write("\nan AST was built off the main thread after the last test:\n" + "\n".join(found))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    faulthandler.dump_traceback_later(SESSION_END_TIMEOUT_S, exit=True, file=sys.stderr)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """nats-py is asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """One JetStream server for the session (per-role users); tests that kill servers start their own."""
    server = EmbeddedServer.start(tmp_path_factory.mktemp("js"), ServerOptions(name="session"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """One `rlbus up` on tiny (an evaluator, 4 steps, recorded) run to its end, shared by the tests that read
    a stopped run (helpers.runs.finished_tiny_run); each asserts its exit status and output itself."""
    return finished_tiny_run(tmp_path_factory.mktemp("finished"))


@pytest.fixture
def run_id() -> str:
    """A fresh run id for this test (helpers.new_run), so subjects, streams and buckets of tests never collide."""
    return new_run()


@pytest.fixture
async def admin_bus(nats_server: EmbeddedServer) -> AsyncIterator[Bus]:
    """A bus connected as the admin role (provisions streams), on a fresh run id."""
    cred = nats_server.credential("admin")
    bus = await Bus.connect(nats_server.url, run=new_run(),
                            options=ConnectOptions(user=cred.user, password=cred.password))
    try:
        yield bus
    finally:
        await bus.close()


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[RegionSet]:
    """A hub and two leaf regions (`hub`, `eu`, `us`), each leaf linked through a cuttable relay."""
    rs = RegionSet.start(tmp_path / "regions", ["hub", "eu", "us"], "hub", relay=True)
    try:
        yield rs
    finally:
        rs.stop()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that runs the CLI configures structlog for its own captured stderr; undo it afterwards."""
    yield
    import structlog

    structlog.reset_defaults()


def _processes_mentioning(text: str) -> list[int]:
    """PIDs of this machine's processes (other than this one) whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


@pytest.fixture
def processes_mentioning() -> Callable[[str], list[int]]:
    """The leftover-process probe of the launch tests: `processes_mentioning(str(state_dir)) == []`
    proves a run left nothing behind."""
    return _processes_mentioning


async def _plaintext_refused(port: int, user: str, password: str) -> bool:
    """True when a client that speaks plaintext gets neither +OK nor PONG and is dropped."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    replies = b""
    try:
        replies += await stream.receive()                      # INFO, sent before any handshake
        await stream.send(b'CONNECT {"verbose":true,"user":"%s","pass":"%s"}\r\nPING\r\n'
                          % (user.encode(), password.encode()))
        with anyio.fail_after(10):
            try:
                while True:
                    replies += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                pass
    finally:
        await stream.aclose()
    return b'"tls_required":true' in replies and b"+OK" not in replies and b"PONG" not in replies


@pytest.fixture
def plaintext_refused() -> Callable[[int, str, str], Awaitable[bool]]:
    """The TLS tests' probe: `await plaintext_refused(port, user, password)` is True when a server that
    requires TLS drops a client speaking plaintext without a reply."""
    return _plaintext_refused
