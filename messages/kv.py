"""Compare-and-set on JetStream KV keys, in the connection's own domain or through another's API.

- Owns: `read_key` (a key's last value and revision), `put_at` (the one compare-and-set of rlbus: the
  feeder's position, the generators' partials, the publisher's LATEST key) and `advance` (read, decide,
  compare-and-set, and read again after a lost race).
- Guarantee: a read or write that no server answers or that times out is tried again for `NO_LEADER_S`,
  or as long as the caller says (`give_up_after_s`); a write stored before its ack was lost counts as done.
- Does not: create buckets (messages/streams.py) or decode values (callers do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.client import KV_STREAM_TEMPLATE

from rlbus.messages.errors import NO_LEADER_ERRORS, NO_LEADER_S
from rlbus.messages.retry import retry_policy
from rlbus.messages.subjects import Subjects

WRONG_LAST_SEQUENCE: Final = (10071, 10164)
"""JetStream err_codes of a write whose expected last subject sequence is stale."""
_OPERATION_HEADER: Final = "KV-Operation"
_REMOVED: Final = ("DEL", "PURGE")
RETRIED: Final = (*NO_LEADER_ERRORS, nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
                  nats.errors.OutboundBufferLimitError)
"""What a read or write is asked again on: no leader, or the connection's server gone while it reconnects."""


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """A key's last entry as read."""

    value: bytes | None
    """None: never written, deleted or purged."""
    revision: int
    """Stream sequence of the key's last entry (0: never written): what `put_at` expects."""


async def read_key(js: JetStreamContext, bucket: str, key: str, *, give_up_after_s: float = NO_LEADER_S) -> KeyEntry:
    """The last entry of `key` in `bucket` (reached through `js`'s domain). A read that times out or that no
    server answers (a clustered bucket electing its next leader, a server down that the connection waits to
    reconnect to) is asked again for up to `give_up_after_s` (default `NO_LEADER_S`; an actor that cannot work
    without the bucket rides out an outage with messages/retry.py `GIVE_UP_S`)."""
    retry = retry_policy("kv_read_retry", on=RETRIED, initial_s=0.2, max_s=2.0,
                         give_up_after_s=give_up_after_s, bucket=bucket)
    try:
        async for attempt in retry:
            with attempt:
                last = await js.get_last_msg(KV_STREAM_TEMPLATE.format(bucket=bucket), Subjects.kv_key(bucket, key))
    except nats.js.errors.NotFoundError:
        return KeyEntry(None, 0)
    revision = int(last.seq or 0)
    if (last.headers or {}).get(_OPERATION_HEADER) in _REMOVED:
        return KeyEntry(None, revision)
    return KeyEntry(last.data or b"", revision)


async def put_at(js: JetStreamContext, bucket: str, key: str, value: bytes, *, revision: int | None,
                 domain: str | None = None, give_up_after_s: float = NO_LEADER_S) -> int:
    """Write `key` = `value` only if its last entry is still `revision`; None: only if it holds no value
    (never written, deleted or purged, as nats-py's `KeyValue.create`). -> the new revision.

    `domain`: the bucket's domain when it is not `js`'s connection's own (the write then goes through
    `$JS.<domain>.API.$KV.>`: nats-py's `KeyValue` writes only to `$KV.>`, which does not cross leaf links;
    `js` must reach that domain for the reads). `give_up_after_s`: as `read_key`'s; a write
    that timed out is read back before it is sent again, so a write stored before its ack was lost is taken as
    done rather than refused by its own compare-and-set.

    :raises nats.js.errors.KeyWrongLastSequenceError: another writer got there first.
    """
    try:
        return await _put(js, bucket, key, value, revision or 0, domain, give_up_after_s)
    except nats.js.errors.KeyWrongLastSequenceError:
        if revision is not None:
            raise
        entry = await read_key(js, bucket, key, give_up_after_s=give_up_after_s)
        if entry.value is not None or entry.revision == 0:
            raise
        return await _put(js, bucket, key, value, entry.revision, domain, give_up_after_s)   # over its delete marker


async def advance(js: JetStreamContext, bucket: str, key: str, decide: Callable[[KeyEntry], bytes | None], *,
                  domain: str | None = None) -> int | None:
    """Read `key`, ask `decide` for its new value (None: leave it), compare-and-set it, and on a lost race
    read again and ask again. -> the revision written, None when `decide` left the key."""
    while True:
        entry = await read_key(js, bucket, key)
        value = decide(entry)
        if value is None:
            return None
        try:
            return await _put(js, bucket, key, value, entry.revision, domain, NO_LEADER_S)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue                                  # someone moved it meanwhile: read again


async def _put(js: JetStreamContext, bucket: str, key: str, value: bytes, revision: int,
               domain: str | None, give_up_after_s: float) -> int:
    subject = Subjects.kv_key(bucket, key, domain=domain)
    # Through a clustered bucket's leader election: no responders means no server took the write, so it is
    # sent again; after a timeout it may have been stored, so the key is read first and a write found there
    # is taken as done (sending it again would fail its own compare-and-set)
    retry = retry_policy("kv_put_retry", on=RETRIED, initial_s=0.2, max_s=2.0,
                         give_up_after_s=give_up_after_s, bucket=bucket)
    uncertain = False
    async for attempt in retry:
        with attempt:
            if uncertain:
                entry = await read_key(js, bucket, key, give_up_after_s=give_up_after_s)
                if entry.value == value and entry.revision > revision:
                    return entry.revision
            try:
                ack = await js.publish(subject, value,
                                       headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(revision)})
            except (TimeoutError, nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError):
                uncertain = True
                raise
            except nats.js.errors.APIError as err:
                if err.err_code in WRONG_LAST_SEQUENCE:
                    raise nats.js.errors.KeyWrongLastSequenceError(description=err.description) from None
                raise
    return int(ack.seq)
