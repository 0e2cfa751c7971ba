"""Grading a repository against hidden tests through a real sandbox session, outside any run.

Owns: `grade_repository` (open a session seeded with a repository's files on a region's sandbox supervisors,
call its `grade` tool with the hidden tests, close it, return the per-test `GradeReport`) and
`repository_grader`, a plain context manager that serves a `local_sandbox` supervisor on a thread of its own
and yields a synchronous `grade(files, hidden_tests, ...)` for tools that make or check repository tasks (a
task maker's fail-to-pass and pass-to-pass lists are the `tests` of two reports: before and after the fix).
Does not: run the tests (actors/sandbox/grade_runner.py) or decide what a report means for a task
(ops/tasks.py, the environment).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from rlbus.model.tasks.repo_grade import DEFAULT_COMMAND, GradeReport

if TYPE_CHECKING:
    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.messages.bus import Bus

LEASE_S = 120.0
"""Lease of a grading session: it lives for one grade call."""


async def grade_repository(bus: Bus, region: str, files: Mapping[str, str], hidden_tests: Mapping[str, str], *,
                           stdlib_under_test: Sequence[str] = (), timeout_s: float | None = None,
                           test_command: str = DEFAULT_COMMAND) -> GradeReport:
    """Grade `files` (path -> text, the repository as it is) against `hidden_tests` (path -> text) in a session
    on `region`'s sandbox supervisors. With the default `test_command` the hidden `test*.py` files run under the
    grade runner and the report names each test; another command is judged by its exit code.

    :raises SandboxCrashed: no session could be opened, or the grade call got no answer.
    """
    from rlbus.actors.common.sessions import SandboxSession

    seeded = {path: text.encode() for path, text in files.items()}
    async with await SandboxSession.open(bus, region, seeded, lease_s=LEASE_S) as session:
        return await session.grade(hidden_tests, test_command, timeout_s, stdlib_under_test=stdlib_under_test)


class RepositoryGrader(Protocol):
    """`grade_repository`'s arguments but the bus and region, called synchronously."""

    def __call__(self, files: Mapping[str, str], hidden_tests: Mapping[str, str], *,
                 stdlib_under_test: Sequence[str] = (), timeout_s: float | None = None,
                 test_command: str = DEFAULT_COMMAND) -> GradeReport: ...


@contextmanager
def repository_grader(name: str = "grade", config: SandboxConfig | None = None) -> Iterator[RepositoryGrader]:
    """A synchronous `grade_repository` on a `local_sandbox` supervisor (its own nats-server, on a thread of its
    own) for the block. Calls may come from several threads; each grades in a session of its own.

    Example::

        with repository_grader() as grade:
            before = grade(files, hidden_tests, stdlib_under_test=["textwrap"])
            after = grade({**files, **solution}, hidden_tests, stdlib_under_test=["textwrap"])
        fail_to_pass = [t.name for t in after.tests if t.status == "passed"
                        and {b.name: b.status for b in before.tests}.get(t.name) != "passed"]
    """
    import anyio.from_thread

    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.ops.local_sandbox import local_sandbox

    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            portal.wrap_async_context_manager(local_sandbox(name, config or SandboxConfig())) as bus:
        def grade(files: Mapping[str, str], hidden_tests: Mapping[str, str], **kw: Any) -> GradeReport:
            call: Callable[[], Any] = functools.partial(grade_repository, bus, "hub", files, hidden_tests, **kw)
            return portal.call(call)  # type: ignore[no-any-return]

        yield grade


__all__ = ["LEASE_S", "RepositoryGrader", "grade_repository", "repository_grader"]
