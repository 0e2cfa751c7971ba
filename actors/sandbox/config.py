"""The sandbox supervisor's settings: `SandboxConfig` (the topology's `[sandbox]`, composed by
topology/file/schema.py) and `SandboxLaunch` (knobs tests and benchmarks set that are no topology key).

Owns: those two Structs and `clamp` (a request's limits under the supervisor's ceiling). Imports only
msgspec, so the topology schema can compose it without the supervisor's dependencies.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rlbus.actors.common.config import NonNegativeInt, PositiveFloat, PositiveInt
from rlbus.messages.schemas import SandboxLimits


class SandboxConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[sandbox]`: the pool of isolated executors of each sandbox supervisor, and their limits."""

    pool_size: PositiveInt = 2
    """Pre-started executors per supervisor; a crashed one is replaced."""
    concurrency: PositiveInt = 2
    """Requests one supervisor runs at once (the rest wait in its queue); more than `pool_size` only queues.
    A region's quota is the sum over its sandbox supervisors: one per region in the examples."""
    cpu_seconds: PositiveFloat = 5.0
    """CPU time limit per snippet (RLIMIT_CPU)."""
    wall_seconds: PositiveFloat = 10.0
    """Wall-clock limit per snippet; the snippet is killed past it."""
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 256
    """Address-space limit per snippet, MiB (RLIMIT_AS)."""
    max_processes: PositiveInt = 16
    """Processes a snippet may have (RLIMIT_NPROC, enforced for the non-root sandbox uid)."""
    max_file_mb: NonNegativeInt = 16
    """Largest file a snippet may write, MiB (RLIMIT_FSIZE); 0 forbids writing."""
    max_open_files: Annotated[int, msgspec.Meta(ge=3)] = 64
    """Open file descriptors per snippet (RLIMIT_NOFILE); at least 3 for stdin, stdout, stderr."""
    max_output_kb: PositiveInt = 64
    """Captured stdout plus stderr per snippet, KiB; the snippet is killed past it."""
    max_sessions: PositiveInt = 64
    """Sessions (persistent workspaces for tool calls) one supervisor holds open; past it an open is refused.
    Their `run` calls share the `concurrency` quota with snippets."""
    max_lease_s: PositiveFloat = 600.0
    """Longest lease a session may ask for: it is destroyed this long after its last call at most."""
    session_spares: NonNegativeInt = 2
    """Session jails kept started ahead (from the first session on), each on an empty workspace, so an open does
    not wait for one (bwrap only; a session without one starts its jail at its first jailed call)."""
    workspace_mb: PositiveInt = 64
    """Total size of one session's files, MiB; a tool write past it is refused (a session may ask for less).
    Each file is capped by `max_file_mb`. A root supervisor makes each workspace a tmpfs of this size, so a
    command's writes stop there too."""

    def clamp(self, asked: SandboxLimits) -> SandboxLimits:
        """The request's limits, each capped by this supervisor's ceiling."""
        return SandboxLimits(
            cpu_seconds=min(asked.cpu_seconds, self.cpu_seconds), memory_mb=min(asked.memory_mb, self.memory_mb),
            max_processes=min(asked.max_processes, self.max_processes),
            max_file_mb=min(asked.max_file_mb, self.max_file_mb),
            max_open_files=max(3, min(asked.max_open_files, self.max_open_files)),
            wall_seconds=min(asked.wall_seconds, self.wall_seconds),
            max_output_kb=min(asked.max_output_kb, self.max_output_kb),
        )


class SandboxLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a sandbox supervisor gets beside `[sandbox]`: the isolation level to force, the circuit breaker
    and the queue bounds (tests and benchmarks set them; the launcher passes the defaults)."""

    isolation: Literal["auto", "bwrap", "unshare", "rlimits-only"] = "auto"
    """"auto" (best available) or one of "bwrap", "unshare", "rlimits-only"."""
    breaker_failures: PositiveInt = 3
    """Consecutive infrastructure failures (executor crashes, failed starts) that open the breaker."""
    breaker_cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """Seconds the open breaker answers "error" before it lets requests through again."""
    max_queued: NonNegativeInt = 64
    """Requests accepted beyond `concurrency`, waiting for an executor. Past that the supervisor stops reading:
    at most `pending_limit` more wait in the client's buffer, then NATS drops them (requesters time out
    and retry, or another supervisor of the queue group answers)."""
    pending_limit: PositiveInt = 256
    """Messages the subscription buffers while the supervisor is not reading."""


__all__ = ["SandboxConfig", "SandboxLaunch"]
