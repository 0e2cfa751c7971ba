"""Optional TLS between regions: `RegionSet.start(..., tls=True)` generates a CA and a server certificate
(openssl) into the state directory; leaf links and clients speak TLS. A message published in a leaf
reaches a hub subscriber and a leaf's JetStream stream through TLS; a plaintext client and a client that
does not trust the CA are refused; the keys are private."""

from __future__ import annotations

import json
import shutil
import ssl
from collections.abc import Awaitable, Callable, Iterator

import anyio
import nats
import nats.errors
import pytest
from helpers import new_run

from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Event
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import Subjects
from rlbus.topology.network.regions import TLS_DIR, RegionSet
from rlbus.topology.network.tls import TlsFiles

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="TLS certificates need the openssl CLI")]
HUB, LEAF = "hub", "eu"


@pytest.fixture(scope="module")
def tls_regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegionSet]:
    """A hub and a leaf over TLS, the leaf linked through a cuttable relay."""
    rs = RegionSet.start(tmp_path_factory.mktemp("tls") / "regions", [HUB, LEAF], HUB, tls=True, relay=True)
    try:
        yield rs
    finally:
        rs.stop()


async def _info(port: int) -> dict[str, object]:
    """The INFO line a server sends on `port` before any handshake."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    try:
        line = await stream.receive()
    finally:
        await stream.aclose()
    return dict(json.loads(line.split(b" ", 1)[1]))


async def test_leaf_to_hub_over_tls(tls_regions: RegionSet) -> None:
    """Every listener requires TLS; a core message from a leaf client reaches a hub subscriber, and a hub
    JetStream publish is stored in the leaf's TASKS and served there, all across the TLS leaf link."""
    rs = tls_regions
    assert rs.linked() == {LEAF}
    assert rs.url(HUB).startswith("tls://") and rs.url(LEAF).startswith("tls://")
    hub_leaf_port = rs.servers[HUB].leaf_port
    assert hub_leaf_port is not None
    for port in (rs.servers[HUB].port, rs.servers[LEAF].port, hub_leaf_port):
        assert (await _info(port))["tls_required"] is True
    s = Subjects(new_run())
    admin = await nats.connect(**rs.connect_options(HUB, "admin"))
    leaf = await nats.connect(**rs.connect_options(LEAF, "admin"))
    try:
        await provision_run(admin, s, hub=HUB, domains=rs.domains, settings=StreamSettings.tiny())
        sub = await admin.subscribe(s.events(LEAF, "probe"))
        await admin.flush()
        with anyio.fail_after(10):                     # interest crosses the link a moment later
            while True:
                await leaf.publish(s.events(LEAF, "probe"), b"over tls")
                try:
                    got = await sub.next_msg(timeout=0.5)
                    break
                except nats.errors.TimeoutError:
                    continue
        assert got.data == b"over tls"
        ack = await admin.jetstream().publish(s.tasks(LEAF), b"task", timeout=10)
        assert ack.stream == s.tasks_stream(LEAF)
        psub = await leaf.jetstream().pull_subscribe_bind(durable=s.durable("generator", LEAF),
                                                           stream=s.tasks_stream(LEAF))
        [msg] = await psub.fetch(1, timeout=10)
        assert msg.data == b"task"
        await msg.ack()
    finally:
        await leaf.close()
        await admin.close()


async def test_bus_connects_with_the_ca(tls_regions: RegionSet) -> None:
    """The bus client (ConnectOptions.tls_ca_file) connects to a TLS region and publishes to JetStream."""
    rs = tls_regions
    cred = rs.credentials("admin")
    run = new_run()
    admin = await nats.connect(**rs.connect_options(HUB, "admin"))
    try:
        await provision_run(admin, Subjects(run), hub=HUB, domains=rs.domains, settings=StreamSettings.tiny())
    finally:
        await admin.close()
    ca = TlsFiles.under(rs.base_dir / TLS_DIR).ca
    async with await Bus.connect(rs.url(LEAF), run=run, domain=LEAF, options=ConnectOptions(
            user=cred.user, password=cred.password, tls_ca_file=str(ca), retry_for_s=5)) as bus:
        await wait_routable(bus.nc, bus.subjects.events(LEAF, "probe"))   # the hub stream's interest crosses the link
        ack = await bus.publish(bus.subjects.events(LEAF, "probe"), Event(event="incident", detail="tls"))
    assert ack.stream == Subjects(run).events_stream()


async def test_plaintext_and_untrusting_clients_are_refused(
        tls_regions: RegionSet, plaintext_refused: Callable[[int, str, str], Awaitable[bool]]) -> None:
    """A client that speaks plaintext is dropped without a reply; one that does not trust the run's CA fails
    the handshake; the generated keys are readable by the owner only."""
    rs = tls_regions
    cred = rs.credentials("admin")
    assert await plaintext_refused(rs.servers[HUB].port, cred.user, cred.password)
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(rs.url(HUB), user=cred.user, password=cred.password, tls=ssl.create_default_context(),
                           allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, error_cb=_ignore)
    files = TlsFiles.under(rs.base_dir / TLS_DIR)
    for key in (files.key, files.key.parent / "ca-key.pem"):
        assert (key.stat().st_mode & 0o777) == 0o600


async def _ignore(err: Exception) -> None:
    """error_cb: the refusal is asserted through the raised error."""
