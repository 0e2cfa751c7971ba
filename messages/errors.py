"""Errors rlbus raises on purpose: one root, `RlbusError`, and a named subclass per failure kind.

Owns: the exception hierarchy's root and the errors of the bus, digests, servers and topology, and what the
NATS client raises while a clustered stream has no leader (`NO_LEADER_ERRORS`, asked again for `NO_LEADER_S`).
Lives in the lowest layer so every other folder can raise these; what actors refuse in their inputs (a task, a
partial group, weights, a checkpoint) subclasses the root in actors/common/errors.py.
Each message says what went wrong, where, the bad value, and what to do.
"""

from __future__ import annotations

from typing import Final

import nats.errors
import nats.js.errors

NO_LEADER_S: Final = 15.0
"""How long a read or write that no server answers, or that times out, is tried again before it raises (a
clustered stream or bucket elects its next leader within seconds)."""
NO_LEADER_ERRORS: Final = (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError, TimeoutError,
                           nats.js.errors.ServiceUnavailableError)
"""What a request to a clustered stream without a leader raises (a write that timed out may have been stored:
the caller decides whether sending it again is safe)."""


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
