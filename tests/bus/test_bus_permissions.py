"""Every connection authenticates as its role: other roles' subjects are refused, bad credentials too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest
from helpers import new_run
from nats.aio.client import Client as NATS

from rlbus.messages.streams import StreamSettings, provision_hub, provision_region
from rlbus.messages.subjects import BucketScope, Subjects
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio


async def _connect(server: EmbeddedServer, role: str, errors: list[Exception]) -> NATS:
    async def on_error(err: Exception) -> None:
        errors.append(err)

    return await nats.connect(**server.connect_options(role), error_cb=on_error, allow_reconnect=False)


CASES: list[tuple[str, Callable[[Subjects], list[str]], Callable[[Subjects], str]]] = [
    ("generator", lambda s: [s.trainlog(), s.weights(), s.tasks("hub"), s.checkpoints()],
     lambda s: s.rollouts("hub")),
    ("feeder", lambda s: [s.rollouts("hub"), s.trainlog()], lambda s: s.tasks("hub")),
    ("trainer", lambda s: [s.tasks("hub"), s.rollouts("hub"), s.checkpoints()], lambda s: s.trainlog()),
    ("sandbox", lambda s: [s.rollouts("hub"), s.evals()], lambda s: s.health("hub", "sandbox", "s1")),
    ("observer", lambda s: [s.weights(), s.tasks("hub")], lambda s: s.events("hub", "observer")),
]


@pytest.mark.parametrize(("role", "forbidden", "allowed"), CASES, ids=[c[0] for c in CASES])
async def test_role_is_refused_other_roles_subjects(nats_server: EmbeddedServer, role: str,
                                                    forbidden: Callable[[Subjects], list[str]],
                                                    allowed: Callable[[Subjects], str]) -> None:
    """Publishes on another role's subjects raise a permissions violation and reach nobody; its own arrive."""
    s = Subjects(new_run())
    watcher_errors: list[Exception] = []
    errors: list[Exception] = []
    watcher = await _connect(nats_server, "admin", watcher_errors)
    conn = await _connect(nats_server, role, errors)
    try:
        sub = await watcher.subscribe(s.everything())
        await watcher.flush()
        for subject in forbidden(s):
            await conn.publish(subject, subject.encode())
        got = None
        for _ in range(10):     # core NATS is at-most-once: a loaded machine may drop one, so send it again
            await conn.publish(allowed(s), allowed(s).encode())
            await conn.flush()
            try:
                got = await sub.next_msg(timeout=2)
                break
            except nats.errors.TimeoutError:
                pass
        assert got is not None, f"own subject never arrived (connected {conn.is_connected}, errors {errors})"
        with anyio.fail_after(20):                      # hang guard only (a loaded CI machine is slow)
            while len(errors) < len(forbidden(s)):
                await anyio.sleep(0.02)
        arrived = [got.subject]
        while True:                                     # nothing else was let through (repeats of its own only)
            try:
                arrived.append((await sub.next_msg(timeout=0.2)).subject)
            except nats.errors.TimeoutError:
                break
        assert set(arrived) == {allowed(s)}
        assert sorted(str(e) for e in errors) == sorted(
            f'nats: permissions violation for publish to "{subject}"' for subject in forbidden(s))
        assert conn.is_connected and watcher_errors == []
    finally:
        await conn.close()
        await watcher.close()


async def test_jetstream_publish_on_forbidden_subject_gets_no_ack(nats_server: EmbeddedServer) -> None:
    """A generator's js.publish to TRAINLOG is never stored or acked, though the stream exists."""
    s = Subjects(new_run())
    errors: list[Exception] = []
    admin = await _connect(nats_server, "admin", [])
    generator = await _connect(nats_server, "generator", errors)
    try:
        await admin.jetstream().add_stream(name=s.trainlog_stream(), subjects=[s.trainlog()])
        with pytest.raises(nats.errors.TimeoutError):
            await generator.jetstream().publish(s.trainlog(), b"step", timeout=1.0)
        assert (await admin.jetstream().stream_info(s.trainlog_stream())).state.messages == 0
        assert any("permissions violation" in str(e) for e in errors)
    finally:
        await admin.jetstream().delete_stream(s.trainlog_stream())
        await generator.close()
        await admin.close()


@pytest.mark.parametrize("who", ["wrong password", "unknown user", "leaf credential"])
async def test_bad_credentials_are_refused(nats_server: EmbeddedServer, who: str) -> None:
    """A wrong password, an unknown user, and the leaf-link credential are all refused for clients."""
    good = nats_server.credential("generator")
    user, password = {"wrong password": (good.user, good.password + "x"),
                      "unknown user": ("mallory", good.password),
                      "leaf credential": tuple(nats_server.credential("leaf"))}[who]
    errors: list[Exception] = []

    async def on_error(err: Exception) -> None:
        errors.append(err)

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.url, user=user, password=password, allow_reconnect=False,
                           max_reconnect_attempts=0, error_cb=on_error)


async def test_roles_write_the_buckets_they_are_granted(tmp_path: Path) -> None:
    """On a server started for the run: publisher writes WEIGHTS and LATEST, generator PARTIALS,
    checkpointer CKPT — and a generator may not write WEIGHTS or LATEST (bucket rights name each bucket)."""
    s = Subjects(new_run())
    nats_server = EmbeddedServer.start(tmp_path / "js", ServerOptions(
        name="scoped", scope=BucketScope(runs=(s.run,), regions=("hub",))))
    admin = await _connect(nats_server, "admin", [])
    conns = {role: await _connect(nats_server, role, [])
             for role in ("publisher", "generator", "checkpointer")}
    try:
        settings = StreamSettings.tiny()
        await provision_region(admin, s, "hub", domain=None, settings=settings)
        await provision_hub(admin, s, "hub", {"hub": None}, settings)
        js = {role: nc.jetstream(timeout=1.0) for role, nc in conns.items()}
        await (await js["publisher"].object_store(s.weights_bucket("hub"))).put("v1", b"w" * 1000)
        await (await js["publisher"].key_value(s.latest_bucket("hub"))).put("latest", b"v1")
        await (await js["generator"].key_value(s.partials_bucket("hub"))).put("r1", b"partial")
        await (await js["checkpointer"].object_store(s.checkpoint_bucket())).put("step-1", b"c" * 1000)
        with pytest.raises(nats.errors.TimeoutError):      # the server drops the refused publish: no ack
            await (await js["generator"].key_value(s.latest_bucket("hub"))).put("latest", b"evil")
        with pytest.raises(nats.errors.TimeoutError):
            await (await js["generator"].object_store(s.weights_bucket("hub"))).put("v9", b"evil")
    finally:
        for nc in (admin, *conns.values()):
            await nc.close()
        nats_server.stop()
