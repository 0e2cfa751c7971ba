"""Private reply inboxes: each connection's inbox prefix is `_INBOX.<role>.<random>` and a role may subscribe
only under `_INBOX.<role>.>`, so a generator cannot read a trainer's replies (JetStream API answers, pull
deliveries, KV reads) nor forge replies into them; responders still answer requests (`allow_responses`)."""

from __future__ import annotations

import anyio
import nats
import nats.errors
import pytest
from helpers import eventually, new_run
from nats.aio.client import Client as NATS

from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.subjects import Subjects, inbox_prefix
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio


async def _connect(server: EmbeddedServer, role: str, errors: list[Exception]) -> NATS:
    async def on_error(err: Exception) -> None:
        errors.append(err)

    return await nats.connect(**server.connect_options(role), error_cb=on_error, allow_reconnect=False)


async def _wait_errors(errors: list[Exception], n: int) -> list[str]:
    await eventually(lambda: len(errors) >= n, what=f"{n} errors", timeout_s=20, poll_s=0.02)
    return sorted(str(e) for e in errors)


async def test_generator_cannot_subscribe_to_other_inboxes(nats_server: EmbeddedServer) -> None:
    """`_INBOX.trainer.>`, `_INBOX.>` and a live trainer connection's own prefix are refused to a generator;
    the trainer's JetStream replies reach only the trainer."""
    s = Subjects(new_run())
    errors: list[Exception] = []
    admin = await _connect(nats_server, "admin", [])
    trainer = await _connect(nats_server, "trainer", [])
    generator = await _connect(nats_server, "generator", errors)
    try:
        trainer_prefix = bytes(trainer._inbox_prefix).decode()
        assert trainer_prefix.startswith(inbox_prefix("trainer") + ".")
        assert bytes(generator._inbox_prefix).decode().startswith(inbox_prefix("generator") + ".")
        await admin.jetstream().add_stream(name=s.trainlog_stream(), subjects=[s.trainlog()])
        stolen = [await generator.subscribe(subject) for subject in
                  ("_INBOX.trainer.>", "_INBOX.>", f"{trainer_prefix}.>", "_INBOX.*.*.*")]
        await generator.flush()
        refused = await _wait_errors(errors, 4)
        assert refused == sorted(f'nats: permissions violation for subscription to "{sub.subject.lower()}"'
                                 for sub in stolen)          # nats-py lower-cases the server's error text
        info = await trainer.jetstream().stream_info(s.trainlog_stream())   # a request answered on its inbox
        assert info.config.name == s.trainlog_stream()
        for sub in stolen:
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.2)
        assert generator.is_connected
    finally:
        await admin.jetstream().delete_stream(s.trainlog_stream())
        for nc in (generator, trainer, admin):
            await nc.close()


async def test_no_role_publishes_into_an_inbox_unasked(nats_server: EmbeddedServer) -> None:
    """A sandbox can answer a generator's request once (allow_responses), but cannot push a forged reply into
    a generator's or a trainer's inbox that asked it nothing."""
    s = Subjects(new_run())
    errors: list[Exception] = []
    generator = await _connect(nats_server, "generator", [])
    trainer = await _connect(nats_server, "trainer", [])
    sandbox = await _connect(nats_server, "sandbox", errors)
    try:
        listener = await sandbox.subscribe(s.sandbox("hub"))
        await sandbox.flush()
        async with anyio.create_task_group() as tg:
            async def answer() -> None:
                request = await listener.next_msg(timeout=20)
                await sandbox.publish(request.reply, b"verdict")
            tg.start_soon(answer)
            with anyio.fail_after(20):                 # under load the new interest can lag the flush
                while True:
                    try:
                        reply = await generator.request(s.sandbox("hub"), b"code", timeout=20)
                        break
                    except nats.errors.NoRespondersError:
                        await anyio.sleep(0.1)
        assert reply.data == b"verdict"
        victims = [f"{bytes(nc._inbox_prefix).decode()}.forged" for nc in (generator, trainer)]
        watchers = [await nc.subscribe(victim) for nc, victim in zip((generator, trainer), victims, strict=True)]
        for nc in (generator, trainer):
            await nc.flush()
        for victim in victims:
            await sandbox.publish(victim, b"forged verdict")
        await sandbox.flush()
        assert await _wait_errors(errors, 2) == sorted(
            f'nats: permissions violation for publish to "{victim.lower()}"' for victim in victims)
        for watcher in watchers:
            with pytest.raises(nats.errors.TimeoutError):
                await watcher.next_msg(timeout=0.2)
    finally:
        for nc in (sandbox, trainer, generator):
            await nc.close()


async def test_bus_connections_use_their_role_inbox(nats_server: EmbeddedServer) -> None:
    """`Bus.connect` gives each connection a fresh `_INBOX.<role>.<random>` prefix (the role, else the user),
    and JetStream and KV work through it for a non-admin role."""
    cred = nats_server.credential("observer")
    run = new_run()
    admin_cred = nats_server.credential("admin")
    async with await Bus.connect(nats_server.url, run=run, options=ConnectOptions(
            user=admin_cred.user, password=admin_cred.password)) as admin:
        await admin.js.add_stream(name=admin.subjects.events_stream(), subjects=[admin.subjects.all_events()])
        try:
            buses = [await Bus.connect(nats_server.url, run=run, identity=Identity(actor_id=f"o{i}"),
                                       options=ConnectOptions(user=cred.user, password=cred.password, **extra))
                     for i, extra in enumerate([{}, {"role": "observer"}])]
            prefixes = [bytes(bus.nc._inbox_prefix).decode() for bus in buses]
            assert all(p.startswith("_INBOX.observer.") for p in prefixes) and prefixes[0] != prefixes[1]
            for bus in buses:
                info = await bus.js.stream_info(admin.subjects.events_stream())
                assert info.config.name == admin.subjects.events_stream()
                await bus.close()
        finally:
            await admin.js.delete_stream(admin.subjects.events_stream())
