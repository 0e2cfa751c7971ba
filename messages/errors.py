"""Errors rlbus raises on purpose: one root, `RlbusError`, and a named subclass per failure kind.

Owns: the exception hierarchy's root and the errors of the bus, digests, servers and topology. Lives in the
lowest layer so every other folder can raise these; what actors refuse in their inputs (a task, a partial group,
weights, a checkpoint) subclasses the root in actors/common/errors.py.
Each message says what went wrong, where, the bad value, and what to do.
"""

from __future__ import annotations


class RlbusError(Exception):
    """Root of every error rlbus raises on purpose."""


class BadMessage(RlbusError, ValueError):
    """A payload that does not decode into a supported message; the text names the field path."""


class UnsupportedSchema(BadMessage):
    """A message whose schema version this build cannot read; it is dead-lettered, not guessed at."""


class SubjectError(RlbusError, ValueError):
    """A value that cannot be used as a NATS subject token or stream name."""


class BusUnavailable(RlbusError, ConnectionError):
    """No NATS server answered within the retry budget."""


class ServerError(RlbusError):
    """An embedded nats-server could not be started or stopped (binary missing, port taken, bad config)."""


class PermissionDenied(RlbusError, PermissionError):
    """The server refused a publish or subscribe for this connection's role."""


class DigestMismatch(RlbusError, ValueError):
    """Bytes fetched from the object store do not match the digest that announced them."""


class TopologyError(RlbusError, ValueError):
    """A topology file that cannot be used; the text names the file, every bad key and what was expected."""


class ActorFailed(RlbusError):
    """An actor ended in the FAILED state."""


class SandboxCrashed(RlbusError):
    """A sandbox executor died; the supervisor replaces it."""
