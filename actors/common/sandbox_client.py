"""How generators and evaluators use the sandbox service: tests as asserts, one request, retries.

Owns: `asserts_for` (a task's (args, expected) pairs as one top-level `assert` each, checked like
model/tasks/harness.py: equal and of the same type; a test source follows them as it is), `request_for` (a `SandboxRequest` grading a
completion on a `model.tasks.Task`), `run_in_sandbox` (request/reply on `subjects.sandbox(region)`
with a timeout and a retry of retryable verdicts) and `grade_result` (a `SandboxResult` as the
`model.grading.GradeResult` the RL code uses); `grade_cases` grades a batch concurrently. Does not: run anything itself (actors/sandbox/supervisor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import anyio
import nats.errors

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import SandboxCrashed
from rlbus.messages.retry import retry_policy
from rlbus.messages.schemas import SandboxLimits, SandboxRequest, SandboxResult
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeCase, GradeResult, Status, case_for, extract_code

REPLY_GRACE_S: Final = 10.0
"""Time beyond the wall limit a requester waits for a reply (queueing, executor start, the bus)."""
_TESTS_MARK: Final = "of the tests:"
"""The executor prefixes a failing test statement's message with "line N of the tests:"."""
_SAME: Final = "def _same(got, want):\n    return got == want and type(got) is type(want)\n"


def asserts_for(entry_point: str, cases: Sequence[tuple[str, str]]) -> str:
    """Python source with one top-level assert per (args repr, expected repr) case, so the verdict's
    passed/total count cases: `assert _same(f(*(3,)), 8), 'f(*(3,)) should be 8'`."""
    lines = [_SAME]
    for args, expected in cases:
        message = f"{entry_point}(*{args}) should be {expected}"
        lines.append(f"assert _same({entry_point}(*{args}), {expected}), {message!r}\n")
    return "".join(lines)


def request_for(task: Task, completion: str, *, request_id: str, limits: SandboxLimits | None = None) -> SandboxRequest:
    """The request grading `completion` on `task` exactly as model.grading does (its first fenced code
    block, else all of it, run as `task.program(...)`), one assert per hidden test."""
    return request_for_case(case_for(task, extract_code(completion)), request_id=request_id, limits=limits)


def request_for_case(case: GradeCase, *, request_id: str, limits: SandboxLimits | None = None) -> SandboxRequest:
    """The request running a model.grading `GradeCase`: one assert per (args, expected) pair, then the case's
    test source (top-level asserts the executor counts, `model.grading.source_tests`)."""
    tests = asserts_for(case.entry_point, case.tests) if case.tests or not case.test_source else ""
    if case.test_source:
        tests = f"{tests}\n{case.test_source}" if tests else case.test_source
    return SandboxRequest(request_id=request_id, code=case.code, tests=tests, limits=limits or SandboxLimits())


async def run_in_sandbox(bus: Bus, region: str, request: SandboxRequest, *, timeout_s: float | None = None,
                         attempts: int = 2) -> SandboxResult:
    """Send `request` to the region's sandbox supervisors and return their verdict.

    Waits `wall_seconds + REPLY_GRACE_S` per attempt; retries "crashed"/"error" verdicts and missing
    replies (same request id: a supervisor that already answered it replies from its cache).
    :raises SandboxCrashed: when no attempt got a definitive verdict (the last one's reason inside).
    """
    wait = timeout_s if timeout_s is not None else request.limits.wall_seconds + REPLY_GRACE_S
    data, headers = codec.encode(request)
    no_reply = (nats.errors.TimeoutError, nats.errors.NoRespondersError)
    retry = retry_policy("sandbox_request_retry", on=(*no_reply, _Unsettled), initial_s=0.5, max_s=2.0,
                         attempts=attempts, request_id=request.request_id, region=region)
    try:
        async for attempt in retry:
            with attempt:
                msg = await bus.nc.request(bus.subjects.sandbox(region), data, timeout=wait, headers=headers or None)
                result = codec.decode_as(msg.data, msg.headers, SandboxResult)
                if result.verdict.status in ("crashed", "error"):
                    raise _Unsettled(result)
                return result
    except _Unsettled as last:
        return last.result                         # the last attempt's verdict, as it came
    except no_reply as err:
        raise SandboxCrashed(f"sandbox request {request.request_id} failed {attempts} times; last: no reply "
                             f"from the {region} sandbox service: {type(err).__name__}") from err
    raise AssertionError("unreachable: the policy returns or raises")


class _Unsettled(Exception):
    """A "crashed" or "error" verdict: worth another attempt (internal: carries the result)."""

    def __init__(self, result: SandboxResult) -> None:
        super().__init__(f"{result.verdict.status}: {result.stderr[:300]}")
        self.result = result


def grade_result(result: SandboxResult) -> GradeResult:
    """The sandbox verdict as model.grading's GradeResult (reward 1.0 only when every test passed)."""
    v = result.verdict
    status: Status
    match v.status:
        case "ok":
            status = "passed" if v.passed == v.total else "failed"
        case "timeout":
            status = "timeout"
        case "crashed":
            status = "crashed"
        case "failed":
            status = "failed" if _TESTS_MARK in result.stderr else "error"
        case _:
            status = "error"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    first_test_failure = next((line for line in lines if _TESTS_MARK in line), None)
    feedback = (first_test_failure or (lines[-1] if lines else v.status))[:300]
    return GradeResult(status, v.passed, v.total, feedback)


async def grade_cases(bus: Bus, region: str, cases: Sequence[GradeCase], *, id_prefix: str,
                      limits: SandboxLimits | None = None, concurrency: int = 8) -> list[GradeResult]:
    """Grade many `GradeCase`s on the region's sandboxes, at most `concurrency` requests in flight;
    results in input order. Request ids are `<id_prefix>-<index>` (make the prefix unique per batch).

    :raises SandboxCrashed: when a case got no definitive verdict after its retries.
    """
    results: list[GradeResult | None] = [None] * len(cases)
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(i: int, case: GradeCase) -> None:
        async with limiter:
            request = request_for_case(case, request_id=f"{id_prefix}-{i}", limits=limits)
            results[i] = grade_result(await run_in_sandbox(bus, region, request))

    async with anyio.create_task_group() as tg:
        for i, case in enumerate(cases):
            tg.start_soon(one, i, case)
    return [r for r in results if r is not None]
