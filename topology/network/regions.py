"""Regions on one machine: a hub plus leaf regions, each its own nats-server (or JetStream cluster of
nats-servers) and JetStream domain.

- Owns: `RegionSet`: starting the hub then the leaves joined to its leafnode port (through a cuttable `Relay`,
  or a shaped link, topology/network/links.py), waiting until clusters have a meta leader and links are up,
  cutting, degrading and healing them, stopping/killing/restarting one region or node by PID; and the state
  directory's credentials file (`load_or_create_credentials`).
- Does not: create streams (messages/streams.py) or read topology files (topology/file/load.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import msgspec
import structlog

from rlbus.messages.errors import ServerError, TopologyError
from rlbus.messages.subjects import ROLES, BucketScope, token
from rlbus.topology.network.links import CutMode, LinkSet, LinkShape, clean_leftovers, namespaces_unavailable
from rlbus.topology.network.relay import Relay
from rlbus.topology.network.server_config import (
    LEAF_ROLE,
    ClusterSpec,
    Credential,
    ServerOptions,
    generate_users,
)
from rlbus.topology.network.servers import EmbeddedServer, free_ports, port_free
from rlbus.topology.network.tls import TlsFiles, generate_tls

log = structlog.get_logger()

CREDENTIALS_NAME: Final = "credentials.json"
CLUSTER_NODES: Final = 3
"""Nodes of an embedded region's JetStream cluster (`rlbus up` with `[durability] replicas` above 1)."""
CLUSTER_PORTS_NAME: Final = "cluster.json"
"""Under a clustered region's directory: the ports its nodes listen on, kept for the next start."""
TLS_DIR: Final = "tls"
"""Under a region set's base directory: its CA and server certificate (topology/network/tls.py)."""


def load_or_create_credentials(base_dir: Path, roles: Iterable[str] = ROLES) -> dict[str, Credential]:
    """`base_dir/credentials.json` (mode 0600) as role → credential; created, or completed with any role
    it lacks, with fresh random passwords. Re-opening a state directory keeps its passwords."""
    path = base_dir / CREDENTIALS_NAME
    users: dict[str, Credential] = {}
    if path.exists():
        try:
            raw = json.loads(path.read_text())
            users = {role: Credential(str(c["user"]), str(c["password"])) for role, c in raw.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ServerError(f"{path}: not a credentials file ({{role: {{user, password}}}}): {err!r}; "
                              f"move it away to generate new passwords") from None
    missing = [role for role in roles if role not in users]
    if missing or not path.exists():
        users |= generate_users(missing)
        base_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({role: c._asdict() for role, c in users.items()}, f, indent=2)
        os.replace(tmp, path)
    return users


def node_name(region: str, index: int) -> str:
    """The server name of node `index` (from 0) of `region`'s cluster: `<region>-n1`, `-n2`, ..."""
    return f"{region}-n{index + 1}"


def _check_layout(region_dir: Path, nodes: int) -> None:
    """Refuse a region directory whose stores were written for the other layout: a cluster would not see a
    single server's streams, nor a single server a cluster's."""
    single, clustered = (region_dir / "jetstream").exists(), (region_dir / "n1").exists()
    if (nodes > 1 and single) or (nodes == 1 and clustered):
        held, asked = ("a single server's", f"a {nodes}-node cluster") if single else ("a cluster's", "a single server")
        raise ServerError(f"{region_dir} holds {held} JetStream store, but this run asks for {asked} "
                          f"([durability] replicas): give it another state directory, or delete this one "
                          f"(`rlbus clean`)")


def _cluster_ports(region_dir: Path, nodes: int, *, leaf_listen: bool) -> list[dict[str, int]]:
    """Each node's client, route, monitor (and leafnode) port: those in `region_dir/cluster.json` while it has
    them all and they are free (a restarted run keeps its addresses), else fresh free ones (written there)."""
    keys = ["client", "cluster", "http", *(["leaf"] if leaf_listen else [])]
    path = region_dir / CLUSTER_PORTS_NAME
    try:
        saved = json.loads(path.read_text())
        if len(saved) == nodes and all(sorted(p) == sorted(keys) and all(isinstance(v, int) for v in p.values())
                                       for p in saved) and all(port_free(v) for p in saved for v in p.values()):
            return [{k: int(v) for k, v in p.items()} for p in saved]
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    fresh = iter(free_ports(nodes * len(keys)))
    ports = [{k: next(fresh) for k in keys} for _ in range(nodes)]
    region_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ports) + "\n")
    return ports


class RegionSet:
    """A hub plus leaf regions on loopback: one `EmbeddedServer` per region, JetStream domain = region
    name, store directory `base_dir/<region>`, leaves joined to the hub's leafnode port as the `leaf` user.
    With `nodes=3` each region is instead a JetStream cluster of three servers (`<region>-n1` .. `-n3`, store
    directories `base_dir/<region>/n1` .., routes between them authenticated as the `leaf` user, one domain);
    every node of a leaf solicits its own link, to any hub node (its remote lists them all), and
    `kill_node`/`restart_node` crash and bring back one node.

    With `relay=True` each leaf reaches the hub through its own `Relay`, so `cut(region)` partitions that
    leaf and `heal(region)` rejoins it. A leaf with a link shape (`links=`) runs in its own network namespace
    and always has a relay (it makes the link's latency): `cut(region)` drops every packet of its link
    (`mode="down"` takes the link down, `mode="close"` closes the relay's connections as for loopback leaves). Starting on an existing `base_dir` resumes it: same passwords
    (credentials.json), same stores; a single server's ports are picked afresh, a cluster's are kept
    (`<region>/cluster.json`) while they are free.
    """

    def __init__(self, base_dir: Path, regions: tuple[str, ...], hub: str,
                 users: Mapping[str, Credential]) -> None:
        self.base_dir: Final = base_dir
        self.regions: Final = regions
        self.hub: Final = hub
        self.users: Final = dict(users)
        self.nodes: dict[str, list[EmbeddedServer]] = {}
        """Region → its servers: one, or the nodes of its JetStream cluster (`start(nodes=3)`)."""
        self.servers: dict[str, EmbeddedServer] = {}
        """Region → its server (of a cluster: the first node)."""
        self.relays: dict[str, Relay] = {}
        """Leaf → its relay (to a clustered hub: the one to the hub's first node; all in `node_relays`)."""
        self.node_relays: dict[str, list[Relay]] = {}
        """Leaf → its relays, one per hub node."""
        self._region_of: dict[str, str] = {}
        self.links: LinkSet | None = None
        """The shaped links of the leaves started in namespaces (None: every region on loopback)."""
        self.links_skipped: str | None = None
        """Why leaves given link shapes run on loopback instead (this host cannot make namespaces)."""
        self._cut_modes: dict[str, str] = {}

    @staticmethod
    def nodes_for(replicas: int) -> int:
        """Servers per embedded region for streams of `replicas` replicas: 1, or a `CLUSTER_NODES` cluster."""
        return 1 if replicas <= 1 else CLUSTER_NODES

    @classmethod
    def start(cls, base_dir: str | os.PathLike[str], regions: Iterable[str], hub: str, *,
              sync_interval: str | None = None, relay: bool = False, ready_timeout_s: float = 15.0,
              link_timeout_s: float = 15.0, binary: str | os.PathLike[str] | None = None,
              run: str | None = None, tls: bool | TlsFiles = False,
              links: Mapping[str, LinkShape] | None = None, nodes: int = 1) -> RegionSet:
        """Start the hub, then every leaf (in parallel), and wait until every leaf is linked to the hub.

        `run`: the run whose KV/object-store buckets the role users may write (NATS cannot wildcard part
        of a bucket name); None grants no bucket writes except to admin.
        `tls`: True generates a CA and a server certificate into `base_dir/tls` (once; reused on restart);
        `TlsFiles` uses the operator's own CA, certificate and key. Either way every client connection and
        leaf link uses TLS (plaintext clients are refused); `connect_options` carries the client context.
        `links`: leaf → shape of its link to the hub; those leaves run in namespaces (removing first what a
        killed run on `base_dir` left). Where namespaces cannot be made they run on loopback and
        `links_skipped` says why. Not with `tls` (the generated certificate names loopback only).
        `nodes`: servers per region, 1 or an odd number; above 1 every region is a JetStream cluster of that
        many nodes (streams may then have up to `nodes` replicas), and it waits until each has a meta leader.
        Not with `links`.

        :raises TopologyError: `hub` is not one of `regions`, a region name is repeated or invalid, or
            `nodes` is even or given with `links`.
        :raises ServerError: a server did not start, a cluster elected no leader or a leaf did not link in time
            (nothing is left running), or the state directory holds stores of the other layout (single or
            clustered).
        """
        names = tuple(token(r, "region") for r in regions)
        if len(set(names)) != len(names) or hub not in names:
            raise TopologyError(f"regions {list(names)} must be distinct and include the hub {hub!r}")
        if nodes < 1 or nodes % 2 == 0:
            raise TopologyError(f"nodes per region must be 1 or odd (a majority must survive a node), got {nodes}")
        shapes = dict(links or {})
        if unknown := sorted(set(shapes) - set(names) | ({hub} & set(shapes))):
            raise TopologyError(f"links {unknown}: only leaf regions ({', '.join(r for r in names if r != hub)}) "
                                f"have a link to the hub")
        if shapes and tls:
            raise TopologyError("shaped links and TLS together are not supported: the certificate names loopback "
                                "only; drop [tls] or the [regions.link] tables")
        if shapes and nodes > 1:
            raise TopologyError(f"shaped links and clustered regions ({nodes} nodes) together are not supported: "
                                f"drop the [regions.link] tables or set [durability] replicas = 1")
        base = Path(base_dir).resolve()
        for region in names:
            _check_layout(base / region, nodes)
        rs = cls(base, names, hub, load_or_create_credentials(base))
        if not shapes:
            clean_leftovers(base)        # a killed run on this directory may have made links
        elif (why := namespaces_unavailable()) is not None:
            rs.links_skipped, shapes = why, {}
            clean_leftovers(base)
            log.warning("links_skipped", reason=why)
        scope = BucketScope(runs=(run,), regions=names) if run is not None else None
        files = tls if isinstance(tls, TlsFiles) else generate_tls(base / TLS_DIR) if tls else None
        common = ServerOptions(users=rs.users, sync_interval=sync_interval, scope=scope,
                               ready_timeout_s=ready_timeout_s, binary=binary, tls=files)
        leaf = rs.users[LEAF_ROLE]
        try:
            rs._spawn(hub, nodes, msgspec.structs.replace(common, leaf_listen=True))
            for server in rs.nodes[hub]:
                server.wait_ready()          # its leafnode ports are known now (a cluster's were chosen before)
            hub_leaf_ports = [port for server in rs.nodes[hub] if (port := server.leaf_port) is not None]
            if shapes:
                rs.links = LinkSet.create(base, {r: shapes[r] for r in rs.leaves if r in shapes})
            for region in rs.leaves:
                host, placed = "127.0.0.1", common
                if rs.links is not None and region in rs.links.links:
                    link, shape = rs.links.links[region], shapes[region]
                    rs.node_relays[region] = [Relay(("127.0.0.1", hub_leaf_ports[0]), host=link.hub_addr,
                                                    name=f"link-{region}", latency_s=shape.latency_s,
                                                    jitter_s=shape.jitter_s).start()]
                    host = link.hub_addr
                    placed = msgspec.structs.replace(common, host=link.server_addr, netns=link.netns)
                elif relay:      # one relay per hub node: a cut closes them all
                    rs.node_relays[region] = [Relay(("127.0.0.1", port), name=f"relay-{region}" + (f"-{k + 1}" if k else "")).start()
                                              for k, port in enumerate(hub_leaf_ports)]
                if region in rs.node_relays:
                    rs.relays[region] = rs.node_relays[region][0]
                ports = [r.port for r in rs.node_relays[region]] if region in rs.node_relays else hub_leaf_ports
                urls = tuple(f"nats-leaf://{host}:{port}" for port in ports)
                rs._spawn(region, nodes, msgspec.structs.replace(placed, leaf_remote=(urls, leaf.user, leaf.password)))
            for region in rs.leaves:
                for server in rs.nodes[region]:
                    server.wait_ready()
            for region in names:             # the clusters elect their meta leaders meanwhile
                rs.wait_clustered(region, timeout_s=link_timeout_s)
            rs.wait_linked(timeout_s=link_timeout_s)
        except BaseException:
            rs.stop()
            raise
        log.info("regions_started", hub=hub, regions=list(names), base_dir=str(base), relay=relay, nodes=nodes,
                 linked=sorted(rs.links.links) if rs.links is not None else [])
        return rs

    def _spawn(self, region: str, nodes: int, options: ServerOptions) -> None:
        """Launch `region`'s server, or its `nodes` cluster nodes (ports from `_cluster_ports`), not waiting."""
        if nodes == 1:
            self.nodes[region] = [EmbeddedServer.spawn(self.base_dir / region,
                                                       msgspec.structs.replace(options, name=region, domain=region))]
        else:
            ports = _cluster_ports(self.base_dir / region, nodes, leaf_listen=options.leaf_listen)
            routes = [f"nats-route://127.0.0.1:{p['cluster']}" for p in ports]
            self.nodes[region] = [
                EmbeddedServer.spawn(self.base_dir / region / f"n{k + 1}", msgspec.structs.replace(
                    options, name=node_name(region, k), domain=region, port=p["client"], http_port=p["http"],
                    leaf_port=p.get("leaf", -1),
                    cluster=ClusterSpec(region, p["cluster"], tuple(routes[:k] + routes[k + 1:]), self.users[LEAF_ROLE])))
                for k, p in enumerate(ports)]
        self.servers[region] = self.nodes[region][0]
        self._region_of.update({server.name: region for server in self.nodes[region]})

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def leaves(self) -> tuple[str, ...]:
        return tuple(r for r in self.regions if r != self.hub)

    @property
    def domains(self) -> dict[str, str]:
        """Region → JetStream domain (the region name)."""
        return {r: r for r in self.regions}

    def url(self, region: str) -> str:
        """The URL of `region`'s server (of a cluster: its first node; every node's in `urls`)."""
        return self._server(region).url

    def urls(self, region: str) -> tuple[str, ...]:
        """The client URL of every node of `region` (one for a single server)."""
        self._server(region)
        return tuple(server.url for server in self.nodes[region])

    def node(self, name: str) -> EmbeddedServer:
        """The server (node) named `name` (a single region's server is named after the region)."""
        for servers in self.nodes.values():
            for server in servers:
                if server.name == name:
                    return server
        raise ServerError(f"no server named {name!r}; servers: "
                          f"{', '.join(s.name for servers in self.nodes.values() for s in servers)}")

    def credentials(self, role: str) -> Credential:
        """(user, password) of `role`, the same on every region's server."""
        try:
            return self.users[role]
        except KeyError:
            raise ServerError(f"no credential for role {role!r}; roles: "
                              f"{', '.join(sorted(self.users))}") from None

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS files the servers use (None: plaintext)."""
        return self.servers[self.hub].tls if self.hub in self.servers else None

    def connect_options(self, region: str, role: str) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` to `region`'s server (every node of a cluster) as `role`."""
        return self._server(region).connect_options(role) | {"servers": list(self.urls(region))}

    def _server(self, region: str) -> EmbeddedServer:
        try:
            return self.servers[region]
        except KeyError:
            raise ServerError(f"unknown region {region!r}; regions: {', '.join(self.regions)}") from None

    # ---- links ----------------------------------------------------------------------------------
    def linked(self) -> set[str]:
        """Leaf regions whose link to the hub is up now: every running node of the leaf is linked to some
        hub node (from the running hub nodes' `/leafz`)."""
        names = {str(leaf.get("name")) for server in self.nodes[self.hub] if server.running
                 for leaf in server.monitor("leafz").get("leafs") or ()}
        return {r for r in self.leaves
                if (running := {s.name for s in self.nodes.get(r, ()) if s.running}) and running <= names}

    def wait_linked(self, regions: Iterable[str] | None = None, timeout_s: float = 15.0) -> None:
        """Block until every given leaf (default: all leaves not cut) is linked to the hub.

        :raises ServerError: not linked within `timeout_s`; names the missing leaves with their log tails.
        """
        want = set(regions) if regions is not None else {r for r in self.leaves if not self.is_cut(r)}
        deadline = time.monotonic() + timeout_s
        while not want <= (have := self.linked()):
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {r}:\n{self.servers[r].log_tail(8)}" for r in sorted(want - have))
                raise ServerError(f"leaves {sorted(want - have)} did not link to hub {self.hub} within "
                                  f"{timeout_s}s.\n{tails}")
            time.sleep(0.05)

    def wait_clustered(self, region: str, timeout_s: float = 15.0) -> str:
        """Block until every running node of `region` names the same running node as its JetStream meta
        leader, and every stream those nodes hold (restored from their stores) has a leader (a single server:
        at once); returns the meta leader's name.

        :raises ServerError: not so within `timeout_s`; the nodes' views and log tails included.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            running = [s for s in self.nodes[region] if s.running]
            views: dict[str, Any] = {s.name: s.meta_leader() for s in running}
            leaders = set(views.values())
            if running and len(leaders) == 1 and (leader := leaders.pop()) in {s.name for s in running}:
                try:
                    leaderless = sorted({name for s in running for name, at in s.stream_leaders().items()
                                         if at is None})
                except ServerError as err:
                    leaderless = [repr(err)]
                if not leaderless:
                    return leader
                views = {"meta leader": leader, "streams without a leader": leaderless}
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}:\n{s.log_tail(8)}" for s in running)
                raise ServerError(f"region {region}: its nodes agree on no JetStream meta leader, or a stream has no "
                                  f"leader, within {timeout_s}s ({views}).\n{tails}")
            time.sleep(0.05)

    def netns(self, region: str) -> str | None:
        """The network namespace `region`'s server (and its actors) run in; None: this one."""
        return self._server(region).netns

    def is_cut(self, region: str) -> bool:
        """True while `region` is partitioned from the hub (by any `cut` mode)."""
        return region in self._cut_modes or any(r.is_cut for r in self.node_relays.get(region, ()))

    def cut(self, region: str, mode: CutMode | str | None = None) -> None:
        """Partition a leaf from the hub. `mode`: 'close' closes the relay's connections and refuses reconnects
        (needs a relay); 'drop' drops every packet of its shaped link (TCP stalls, nothing is reset); 'down'
        takes the link down. Default: 'drop' for a leaf with a shaped link, else 'close'."""
        linked = self.links is not None and region in self.links.links
        chosen = mode if mode is not None else "drop" if linked else "close"
        if chosen == "close":
            for relay in self._relays(region):
                relay.cut()
        elif chosen in ("drop", "down"):
            if self.links is None:
                raise ServerError(f"cut mode {chosen!r} needs a shaped link; region {region!r} runs on loopback "
                                  f"(use mode 'close' with relay=True)")
            self.links.cut(region, chosen)  # type: ignore[arg-type]  # checked above
        else:
            raise ServerError(f"cut mode {chosen!r} is not one of close, drop, down")
        self._cut_modes[region] = chosen

    def heal(self, region: str, *, wait: bool = True, timeout_s: float = 15.0) -> None:
        """End a partition; with `wait`, block until the leaf has linked again."""
        mode = self._cut_modes.pop(region, "close")
        if mode == "close":
            for relay in self._relays(region):
                relay.heal()
        else:
            assert self.links is not None  # a drop/down cut was made on a link
            self.links.heal(region)
        if wait:
            self.wait_linked([region], timeout_s=timeout_s)

    def degrade(self, region: str, *, loss: float = 0.0, extra_latency_s: float = 0.0) -> None:
        """Degrade a leaf's shaped link: drop `loss` (a fraction) of its packets on top of its shape, and add
        `extra_latency_s` to each direction (a latency spike); `degrade(region)` restores it."""
        if self.links is None or region not in self.links.links:
            raise ServerError(f"region {region!r} has no shaped link to degrade; linked: "
                              f"{', '.join(self.links.links) if self.links else 'none'}")
        self.links.degrade(region, loss)
        for relay in self._relays(region):
            relay.spike(extra_latency_s)

    def link_counters(self) -> dict[str, dict[str, int]]:
        """Leaf → bytes and packets its shaped link carried so far (`Link.counters`); empty without links."""
        return self.links.counters() if self.links is not None else {}

    def _relays(self, region: str) -> list[Relay]:
        try:
            return self.node_relays[region]
        except KeyError:
            raise ServerError(f"region {region!r} has no relay; start the RegionSet with relay=True "
                              f"(leaves: {', '.join(self.leaves)})") from None

    # ---- process control ------------------------------------------------------------------------
    def kill(self, region: str) -> None:
        """SIGKILL one region's server, every node of a cluster (each keeps its store directory for `restart`)."""
        self._server(region)
        for server in self.nodes[region]:
            server.kill()

    def restart(self, region: str, *, wait: bool = True, timeout_s: float = 15.0) -> None:
        """Start a region's server (every node of a cluster) again on its store dirs and ports; with `wait`,
        until a cluster has its meta leader and its links are up."""
        self._server(region)
        for server in self.nodes[region]:
            server.restart()
        if wait:
            self._settled(region, timeout_s)

    def kill_node(self, name: str) -> None:
        """SIGKILL one server by its name (a node of a cluster: the others keep the region up)."""
        self.node(name).kill()

    def restart_node(self, name: str, *, wait: bool = True, timeout_s: float = 15.0) -> None:
        """Start the server `name` again on its store directory and ports; with `wait`, until its cluster
        agrees on a meta leader and its region's links are up. Catching up on streams is JetStream's (each
        stream's `cluster.replicas` says when the node is current)."""
        self.node(name).restart()
        if wait:
            self._settled(self._region_of[name], timeout_s)

    def _settled(self, region: str, timeout_s: float) -> None:
        self.wait_clustered(region, timeout_s=timeout_s)
        if region == self.hub:
            self.wait_linked(timeout_s=timeout_s)
        elif not self.is_cut(region):
            self.wait_linked([region], timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop every leaf, then the hub (every node), then the relays, then remove the links; each by its PID.
        Idempotent."""
        errors: list[BaseException] = []
        for region in [*self.leaves, self.hub]:
            for server in self.nodes.get(region, ()):
                try:
                    server.stop()
                except (ServerError, OSError) as err:
                    errors.append(err)
        for relay in (r for relays in self.node_relays.values() for r in relays):
            try:
                relay.stop()
            except ServerError as err:
                errors.append(err)
        if self.links is not None:
            try:
                self.links.stop()
            except ServerError as err:
                errors.append(err)
        if errors:
            raise ServerError(f"stopping regions under {self.base_dir}: " + "; ".join(map(str, errors)))

    def __enter__(self) -> RegionSet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
