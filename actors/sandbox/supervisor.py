"""The sandbox supervisor: a NATS service that runs (code, tests) pairs in isolated, pre-forked executors.

- Owns: `SandboxSupervisor` (kind "sandbox"): `SandboxRequest`s in the region's queue group, each answered
  with exactly one `SandboxResult`, under limits, a concurrency bound and a circuit breaker (`Breaker`); and
  the sessions' messages (open, tool calls, close), held by actors/sandbox/sessions.py.
- Guarantee: every request gets one answer; a bad one is answered with an "error" verdict and dead-lettered.
- Does not: build jails or run snippets (actors/sandbox/pool.py, actors/sandbox/executor.py), or grade
  tasks (actors/common/sandbox_client.py renders a task's tests as asserts).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import anyio
import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import (
    ISOLATION_RANK,
    ExecutorCrashed,
    ExecutorPool,
    Isolation,
    available_levels,
    first_working_jail,
)
from rlbus.actors.sandbox.sessions import SessionHost, too_long
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage, TopologyError
from rlbus.messages.schemas import (
    Heartbeat,
    Message,
    SandboxRequest,
    SandboxResult,
    SandboxVerdict,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    ToolCall,
    ToolResult,
)

log = structlog.get_logger()

GRACE_S: Final = 5.0
"""An executor that has not answered `wall_seconds + GRACE_S` after a request is killed as hung."""
DONE_CACHE: Final = 1024
"""Recent final results kept by request id: a retried request gets the same answer without a rerun."""
RETRYABLE: Final = frozenset({"crashed", "error"})


class Breaker:
    """Closed → open after `failures` consecutive infrastructure failures → half-open after the
    cool-down (requests pass; the next failure re-opens, the next success closes)."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.consecutive = 0
        self.open_until = 0.0
        self.is_open = False

    def rejects(self) -> bool:
        return self.is_open and time.monotonic() < self.open_until

    def failure(self) -> bool:
        """Record one; True when this one opened (or re-opened) the breaker."""
        self.consecutive += 1
        if self.consecutive >= self.failures and not self.rejects():
            self.is_open = True
            self.open_until = time.monotonic() + self.cooldown_s
            return True
        return False

    def success(self) -> bool:
        """Record one; True when this one closed an open breaker."""
        self.consecutive = 0
        was_open, self.is_open = self.is_open, False
        return was_open


class SandboxSupervisor(Actor):
    """Request/reply sandbox service of one region.

    It answers `SandboxRequest`s on `subjects.sandbox(region)` in the region's queue group with exactly one
    `SandboxResult` each: limits clamped to the topology's `[sandbox]` ceiling, at most `concurrency`
    executions at once (up to `max_queued` more wait; past that the supervisor stops reading and its bounded
    subscription buffer takes the rest), a circuit breaker that answers "error" at once while executions
    keep failing for infrastructure reasons, bad requests answered with an "error" verdict and
    dead-lettered. The isolation level in use is in every result, the logs, the `started` event and the
    heartbeat (`isolation_level` gauge, `isolation_<level>` counter).

    Sessions: `SessionOpen` on `subjects.session_open(region)` (queue group) is answered with a
    `SessionOpened` whose id names this supervisor; `ToolCall`s and `SessionClose`s come on
    `subjects.session_calls(region, id)` and are answered with a `ToolResult` / `SessionClosed`. A message
    there that does not decode (or a ToolCall whose args are not a map) is answered with an error and
    dead-lettered. Sessions are destroyed when the supervisor stops; the heartbeat shows `sessions_open` and
    per-tool latency (`tool_<name>_ms`, the median of recent calls, and `tool_<name>_last_ms`).

    Verdicts (`SandboxVerdict.status`; passed/total count the top-level `assert` statements of `tests`):
    ok (every assert passed, clean exit), failed (an assert failed, or the code raised/exited/was killed
    by a signal), timeout (wall or CPU limit), oom (MemoryError under the memory limit), output_limit
    (stdout+stderr past the cap: killed) — these judge the code. crashed (the executor died under it;
    it was replaced) and error (bad request, tests that do not parse, breaker open, supervisor stopping)
    do not: a requester may retry them.
    """

    kind = "sandbox"

    def __init__(self, ident: ActorId, bus: Bus, config: SandboxConfig | None = None,
                 limits: ActorLimits | None = None, launch: SandboxLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config or SandboxConfig()
        self.launch = launch or SandboxLaunch()
        self.breaker = Breaker(self.launch.breaker_failures, self.launch.breaker_cooldown_s)
        self.limiter = anyio.CapacityLimiter(self.config.concurrency)
        self.isolation: Isolation | None = None
        self.pool: ExecutorPool | None = None
        self._sub: Subscription | None = None
        self._session_subs: list[Subscription] = []
        self.sessions: SessionHost | None = None
        self._done: OrderedDict[str, SandboxResult] = OrderedDict()
        self._running: dict[str, anyio.Event] = {}
        self._exec_ms_mean = 0.0

    # ---- lifecycle ------------------------------------------------------------------------------
    async def setup(self) -> None:
        wanted = self.launch.isolation
        if wanted != "auto" and wanted not in ISOLATION_RANK:
            raise TopologyError(f"sandbox isolation {wanted!r}: expected auto, bwrap, unshare or rlimits-only")
        levels: list[Isolation] = available_levels() if wanted == "auto" else [wanted]  # type: ignore[list-item]
        tmpfs_mb = 4 * self.config.max_file_mb + 16
        jail, why_not = await first_working_jail(levels, tmpfs_mb=tmpfs_mb)
        self.isolation = jail.level
        if why_not:
            log.warning("sandbox_isolation_degraded", isolation=jail.level, reasons=why_not)
        self.pool = ExecutorPool(jail, self.config.pool_size, on_failure=self._infra_failure)
        await self.pool.start()
        self.counters[f"isolation_{jail.level.replace('-', '_')}"] = 1
        # subscribed before `ready`, so a requester that saw the actor ready is answered
        subject = self.bus.subjects.sandbox(self.ident.region)
        queue = self.bus.subjects.durable("sandbox", self.ident.region)
        pending = {"pending_msgs_limit": self.launch.pending_limit,
                   "pending_bytes_limit": self.launch.pending_limit * 1024 * 1024}
        self.sessions = SessionHost(self.config, jail.level, self.limiter, self.busy)
        try:
            self._sub = await self.bus.nc.subscribe(subject, queue=queue, **pending)
            self._session_subs = [
                await self.bus.nc.subscribe(self.bus.subjects.session_open(self.ident.region), queue=queue, **pending),
                await self.bus.nc.subscribe(self.bus.subjects.session_calls(self.ident.region, self.ident.actor_id),
                                            **pending)]
            await self.bus.nc.flush()
        except BaseException:
            await self.sessions.close_all()
            await self.pool.aclose()
            raise
        log.info("sandbox_ready", isolation=jail.level, pool_size=self.config.pool_size,
                 concurrency=self.config.concurrency, snippet_uid=jail.snippet_uid)

    async def run(self) -> None:
        assert self.pool is not None and self.isolation is not None and self._sub is not None
        assert self.sessions is not None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.pool.maintain)
                tg.start_soon(self.sessions.reap)
                tg.start_soon(self.sessions.maintain_spares)
                session_slots = anyio.Semaphore(self.config.max_sessions + self.launch.max_queued)
                for sub in self._session_subs:
                    tg.start_soon(self._serve_sessions, sub, session_slots)
                await self.emit("started", detail=f"sandbox isolation {self.isolation}", isolation=self.isolation,
                                pool_size=str(self.config.pool_size), concurrency=str(self.config.concurrency))
                slots = anyio.Semaphore(self.config.concurrency + self.launch.max_queued)
                async for msg in self._sub.messages:
                    await slots.acquire()            # bounded: a flood waits in the (bounded) subscription
                    tg.start_soon(self._handle_in_slot, msg, slots)
        finally:
            with anyio.move_on_after(1.0, shield=True):
                for sub in (self._sub, *self._session_subs):
                    await sub.unsubscribe()
            await self.sessions.close_all()
            await self.pool.aclose()

    def heartbeat(self) -> Heartbeat:
        pool = self.pool
        stats = self.limiter.statistics()
        self.gauges.update({
            "isolation_level": float(ISOLATION_RANK.get(self.isolation or "", 0)),
            "executors_alive": float(len(pool.live)) if pool else 0.0,
            "in_flight": float(stats.borrowed_tokens), "queued": float(stats.tasks_waiting),
            "breaker_open": float(self.breaker.rejects()), "exec_ms_mean": self._exec_ms_mean,
            **(self.sessions.gauges() if self.sessions else {}),
        })
        return super().heartbeat()

    # ---- one request ----------------------------------------------------------------------------
    async def _handle_in_slot(self, msg: Msg, slots: anyio.Semaphore) -> None:
        try:
            await self._handle(msg)
        finally:
            slots.release()

    async def _handle(self, msg: Msg) -> None:
        self.count("requests")
        try:
            request = codec.decode_as(msg.data, msg.headers, SandboxRequest)
            checks.check(request)
        except BadMessage as err:
            await self._bad_request(msg, str(err))
            return
        if not msg.reply:
            await self._bad_request(msg, "a sandbox request needs a reply subject (use request/reply)")
            return
        try:
            result = await self._result_for(request)
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(1.0, shield=True):
                await self._reply(msg, self._error(request.request_id, "the sandbox supervisor is stopping; retry"))
            raise
        except Exception as err:            # a fault of ours: answer, count it, never die of one request
            log.exception("sandbox_request_failed", request_id=request.request_id)
            await self._infra_failure(f"supervisor: {err!r}")
            result = self._error(request.request_id, f"sandbox supervisor error: {err!r}")
        await self._reply(msg, result)

    async def _result_for(self, request: SandboxRequest) -> SandboxResult:
        rid = request.request_id
        if not rid:                                   # no id: nothing to share an answer with
            async with self.limiter:
                with self.busy():
                    return await self._execute(request)
        while rid in self._running:                   # a retry of a request still running: share its answer
            await self._running[rid].wait()
        if rid in self._done:
            self.count("duplicates")
            return self._done[rid]
        if self.breaker.rejects():
            self.count("breaker_rejected")
            return self._error(rid, "sandbox circuit breaker open after repeated executor failures; retry later")
        self._running[rid] = done = anyio.Event()
        try:
            async with self.limiter:
                with self.busy():
                    result = await self._execute(request)
        finally:
            del self._running[rid]
            done.set()
        if result.verdict.status not in RETRYABLE:
            self._done[rid] = result
            while len(self._done) > DONE_CACHE:
                self._done.popitem(last=False)
        return result

    async def _execute(self, request: SandboxRequest) -> SandboxResult:
        assert self.pool is not None and self.isolation is not None
        limits = self.config.clamp(request.limits)
        payload = {"id": request.request_id, "code": request.code, "tests": request.tests,
                   "limits": msgspec.to_builtins(limits)}
        started = time.monotonic()
        try:
            raw = await self.pool.execute(payload, limits.wall_seconds + GRACE_S)
        except ExecutorCrashed as err:
            self.count("executor_crashes")
            log.warning("sandbox_executor_crashed", request_id=request.request_id, error=str(err))
            await self._infra_failure(f"executor crashed: {err}")
            return self._result(request.request_id, "crashed", stderr=f"sandbox executor crashed: {err}")
        status = str(raw.get("status", "error"))
        if status == "error" and str(raw.get("detail", "")).startswith("executor:"):
            await self._infra_failure(str(raw["detail"]))
        elif self.breaker.success():
            self.count("breaker_closed")
            await self.emit("incident", detail="sandbox circuit breaker closed: executions succeed again")
        elapsed_ms = (time.monotonic() - started) * 1000
        self._exec_ms_mean = elapsed_ms if not self._exec_ms_mean else 0.9 * self._exec_ms_mean + 0.1 * elapsed_ms
        self.count("executions")
        self.count(f"verdict_{status}")
        if raw.get("cleanup_killed"):                 # processes the previous execution left behind, killed
            self.count("leftovers_killed", int(raw["cleanup_killed"]))
        stderr = str(raw.get("stderr", "")) or str(raw.get("detail", ""))
        return self._result(request.request_id, status, passed=int(raw.get("passed", 0)),  # type: ignore[arg-type]
                            total=int(raw.get("total", 0)), exit_code=raw.get("exit_code"),
                            stdout=str(raw.get("stdout", "")), stderr=stderr,
                            cpu_seconds=float(raw.get("cpu_seconds", 0.0)), max_rss_kb=int(raw.get("max_rss_kb", 0)),
                            wall_seconds=float(raw.get("wall_seconds", 0.0)))

    def _result(self, request_id: str, status: Any, *, passed: int = 0, total: int = 0,
                exit_code: int | None = None, stdout: str = "", stderr: str = "", cpu_seconds: float = 0.0,
                max_rss_kb: int = 0, wall_seconds: float = 0.0) -> SandboxResult:
        return SandboxResult(request_id=request_id,
                             verdict=SandboxVerdict(passed=passed, total=total, exit_code=exit_code, status=status),
                             stdout=stdout, stderr=stderr, isolation=self.isolation or "", cpu_seconds=cpu_seconds,
                             max_rss_kb=max_rss_kb, wall_seconds=wall_seconds)

    def _error(self, request_id: str, why: str) -> SandboxResult:
        return self._result(request_id, "error", stderr=why)

    async def _infra_failure(self, what: str) -> None:
        """An execution failed for reasons of ours (not the snippet's): feed the breaker."""
        self.count("infra_failures")
        self.last_error = what[:500]
        if self.breaker.failure():
            self.count("breaker_opened")
            log.error("sandbox_breaker_open", cooldown_s=self.breaker.cooldown_s, last_failure=what)
            await self.emit("incident", detail=f"sandbox circuit breaker open for {self.breaker.cooldown_s:g}s "
                                               f"after {self.breaker.consecutive} infrastructure failures; "
                                               f"last: {what[:300]}")

    # ---- sessions -------------------------------------------------------------------------------
    async def _serve_sessions(self, sub: Subscription, slots: anyio.Semaphore) -> None:
        async with anyio.create_task_group() as tg:
            async for msg in sub.messages:
                await slots.acquire()        # bounded like snippet requests
                tg.start_soon(self._session_in_slot, msg, slots)

    async def _session_in_slot(self, msg: Msg, slots: anyio.Semaphore) -> None:
        try:
            await self._session_message(msg)
        finally:
            slots.release()

    async def _session_message(self, msg: Msg) -> None:
        """One session message: open, tool call or close; anything else is answered and dead-lettered."""
        assert self.sessions is not None
        opening = msg.subject == self.bus.subjects.session_open(self.ident.region)
        try:
            message = codec.decode(msg.data, msg.headers)
            wanted: tuple[type[Message], ...] = (SessionOpen,) if opening else (ToolCall, SessionClose)
            if not isinstance(message, wanted):
                raise BadMessage(f"expected {' or '.join(t.__name__ for t in wanted)} here, got "
                                 f"{type(message).__name__}")
            if isinstance(message, (ToolCall, SessionClose)) and (long := too_long(
                    message.session_id, getattr(message, "call_id", ""), getattr(message, "tool", ""))):
                raise BadMessage(f"id {long[:40]!r}... is longer than 256 characters")
        except BadMessage as err:
            await self._bad_session_message(msg, str(err), opening)
            return
        if not msg.reply:
            await self._bad_session_message(msg, "a session message needs a reply subject (use request/reply)", opening)
            return
        self.count(f"session_{type(message).__name__}")
        answer: Message
        try:
            if isinstance(message, SessionOpen):
                answer = self.sessions.open(message, self.bus.subjects.new_session_id(self.ident.actor_id))
            elif isinstance(message, ToolCall):
                answer = await self.sessions.call(message)
                self.count("tool_calls")
            else:
                assert isinstance(message, SessionClose)
                answer = SessionClosed(session_id=message.session_id,
                                       existed=await self.sessions.close(message.session_id))
        except Exception as err:            # a fault of ours: answer it, never die of one message
            log.exception("sandbox_session_message_failed", kind=type(message).__name__)
            self.last_error = f"session: {err!r}"[:500]
            answer = self._session_error(message, f"sandbox supervisor error: {err!r}")
        await self._send(msg, answer)

    def _session_error(self, message: Message | None, why: str) -> Message:
        if isinstance(message, SessionOpen) or message is None:
            return SessionOpened(ok=False, error=why, isolation=self.isolation or "")
        return ToolResult(session_id=getattr(message, "session_id", ""), call_id=getattr(message, "call_id", ""),
                          ok=False, error=why, status="error")

    async def _bad_session_message(self, msg: Msg, reason: str, opening: bool) -> None:
        self.count("bad_requests")
        if msg.reply:
            answer = (SessionOpened(ok=False, error=f"bad session request: {reason}", isolation=self.isolation or "")
                      if opening else ToolResult(session_id="", call_id="", ok=False, status="error",
                                                 error=f"bad tool call message: {reason}"))
            await self._send(msg, answer)
        await self.bus.store_dead_letter(msg.data, reason=reason, source=self.kind, subject=msg.subject,
                                         headers=msg.headers)

    async def _send(self, msg: Msg, answer: Message) -> None:
        data, headers = codec.encode(answer)
        if len(data) > self.bus.nc.max_payload and isinstance(answer, ToolResult):
            answer = ToolResult(session_id=answer.session_id, call_id=answer.call_id, ok=False, status="error",
                                error=f"the result is {len(data)} bytes, past the bus's message limit of "
                                      f"{self.bus.nc.max_payload} bytes (ask for less)")
            data, headers = codec.encode(answer)
        try:
            await self.bus.nc.publish(msg.reply, data, headers=headers or None)
            self.count("replies")
        except (nats.errors.Error, OSError) as err:
            log.warning("sandbox_session_reply_not_sent", kind=type(answer).__name__, error=repr(err))

    # ---- replies and bad requests ---------------------------------------------------------------
    async def _reply(self, msg: Msg, result: SandboxResult) -> None:
        data, headers = codec.encode(result)
        try:
            await self.bus.nc.publish(msg.reply, data, headers=headers or None)
            self.count("replies")
        except (nats.errors.Error, OSError) as err:
            log.warning("sandbox_reply_not_sent", request_id=result.request_id, error=repr(err))

    async def _bad_request(self, msg: Msg, reason: str) -> None:
        """Answer (if it can be answered) with an error verdict, and dead-letter the raw bytes."""
        self.count("bad_requests")
        if msg.reply:
            await self._reply(msg, self._error("", f"bad sandbox request: {reason}"))
        await self.bus.store_dead_letter(msg.data, reason=reason, source=self.kind, subject=msg.subject,
                                         headers=msg.headers)


def build_sandbox(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                  launch: SandboxLaunch | None = None) -> SandboxSupervisor:
    """`actors/kinds.py` entry: the topology's `[sandbox]` section as plain values.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return SandboxSupervisor(ident, bus, decode_config("sandbox", settings, SandboxConfig), limits, launch)


__all__ = ["Breaker", "SandboxConfig", "SandboxLaunch", "SandboxSupervisor", "build_sandbox"]
