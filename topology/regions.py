"""Regions on one machine: a hub plus leaf regions, each its own nats-server and JetStream domain.

Owns: starting the hub then the leaves joined to its leafnode port (optionally through a cuttable
`Relay` per leaf, for partition tests; or, for a leaf given a `LinkShape`, from its own network namespace
over a shaped link through a delaying `Relay`, topology/links.py), the state directory's credentials file,
waiting until links are up, cutting, degrading and healing them, and stopping/killing/restarting one
region by PID.
Does not: create streams (messages/streams.py) or read topology files (topology/load.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import structlog

from rlbus.messages.errors import ServerError, TopologyError
from rlbus.messages.subjects import ROLES, BucketScope, token
from rlbus.topology.links import CutMode, LinkSet, LinkShape, clean_leftovers, namespaces_unavailable
from rlbus.topology.relay import Relay
from rlbus.topology.servers import LEAF_ROLE, Credential, EmbeddedServer, generate_users
from rlbus.topology.tls import TlsFiles, generate_tls

log = structlog.get_logger()

CREDENTIALS_NAME: Final = "credentials.json"
TLS_DIR: Final = "tls"
"""Under a region set's base directory: its CA and server certificate (topology/tls.py)."""


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


class RegionSet:
    """A hub plus leaf regions on loopback: one `EmbeddedServer` per region, JetStream domain = region
    name, store directory `base_dir/<region>`, leaves joined to the hub's leafnode port as the `leaf` user.

    With `relay=True` each leaf reaches the hub through its own `Relay`, so `cut(region)` partitions that
    leaf and `heal(region)` rejoins it. A leaf with a link shape (`links=`) runs in its own network namespace
    and always has a relay (it makes the link's latency): `cut(region)` drops every packet of its link
    (`mode="down"` takes the link down, `mode="close"` closes the relay's connections as for loopback leaves). Starting on an existing `base_dir` resumes it: same passwords
    (credentials.json), same stores; ports are picked afresh.
    """

    def __init__(self, base_dir: Path, regions: tuple[str, ...], hub: str,
                 users: Mapping[str, Credential]) -> None:
        self.base_dir: Final = base_dir
        self.regions: Final = regions
        self.hub: Final = hub
        self.users: Final = dict(users)
        self.servers: dict[str, EmbeddedServer] = {}
        self.relays: dict[str, Relay] = {}
        self.links: LinkSet | None = None
        """The shaped links of the leaves started in namespaces (None: every region on loopback)."""
        self.links_skipped: str | None = None
        """Why leaves given link shapes run on loopback instead (this host cannot make namespaces)."""
        self._cut_modes: dict[str, str] = {}

    @classmethod
    def start(cls, base_dir: str | os.PathLike[str], regions: Iterable[str], hub: str, *,
              sync_interval: str | None = None, relay: bool = False, ready_timeout_s: float = 15.0,
              link_timeout_s: float = 15.0, binary: str | os.PathLike[str] | None = None,
              run: str | None = None, tls: bool | TlsFiles = False,
              links: Mapping[str, LinkShape] | None = None) -> RegionSet:
        """Start the hub, then every leaf (in parallel), and wait until every leaf is linked to the hub.

        `run`: the run whose KV/object-store buckets the role users may write (NATS cannot wildcard part
        of a bucket name); None grants no bucket writes except to admin.
        `tls`: True generates a CA and a server certificate into `base_dir/tls` (once; reused on restart);
        `TlsFiles` uses the operator's own CA, certificate and key. Either way every client connection and
        leaf link uses TLS (plaintext clients are refused); `connect_options` carries the client context.
        `links`: leaf → shape of its link to the hub; those leaves run in namespaces (removing first what a
        killed run on `base_dir` left). Where namespaces cannot be made they run on loopback and
        `links_skipped` says why. Not with `tls` (the generated certificate names loopback only).

        :raises TopologyError: `hub` is not one of `regions`, or a region name is repeated or invalid.
        :raises ServerError: a server did not start or a leaf did not link in time (nothing is left running).
        """
        names = tuple(token(r, "region") for r in regions)
        if len(set(names)) != len(names) or hub not in names:
            raise TopologyError(f"regions {list(names)} must be distinct and include the hub {hub!r}")
        shapes = dict(links or {})
        if unknown := sorted(set(shapes) - set(names) | ({hub} & set(shapes))):
            raise TopologyError(f"links {unknown}: only leaf regions ({', '.join(r for r in names if r != hub)}) "
                                f"have a link to the hub")
        if shapes and tls:
            raise TopologyError("shaped links and TLS together are not supported: the certificate names loopback "
                                "only; drop [tls] or the [regions.link] tables")
        base = Path(base_dir).resolve()
        rs = cls(base, names, hub, load_or_create_credentials(base))
        if not shapes:
            clean_leftovers(base)        # a killed run on this directory may have made links
        elif (why := namespaces_unavailable()) is not None:
            rs.links_skipped, shapes = why, {}
            clean_leftovers(base)
            log.warning("links_skipped", reason=why)
        scope = BucketScope(runs=(run,), regions=names) if run is not None else None
        files = tls if isinstance(tls, TlsFiles) else generate_tls(base / TLS_DIR) if tls else None
        common: dict[str, Any] = {"users": rs.users, "sync_interval": sync_interval, "scope": scope,
                                  "ready_timeout_s": ready_timeout_s, "binary": binary, "tls": files}
        leaf = rs.users[LEAF_ROLE]
        try:
            rs.servers[hub] = EmbeddedServer.start(base / hub, name=hub, domain=hub, leaf_listen=True,
                                                   **common)
            hub_leaf_port = rs.servers[hub].leaf_port
            assert hub_leaf_port is not None  # leaf_listen=True
            if shapes:
                rs.links = LinkSet.create(base, {r: shapes[r] for r in rs.leaves if r in shapes})
            for region in rs.leaves:
                port, host, placed = hub_leaf_port, "127.0.0.1", {}
                if rs.links is not None and region in rs.links.links:
                    link, shape = rs.links.links[region], shapes[region]
                    rs.relays[region] = Relay(("127.0.0.1", hub_leaf_port), host=link.hub_addr,
                                              name=f"link-{region}", latency_s=shape.latency_s,
                                              jitter_s=shape.jitter_s).start()
                    port, host = rs.relays[region].port, link.hub_addr
                    placed = {"host": link.server_addr, "netns": link.netns}
                elif relay:
                    rs.relays[region] = Relay(("127.0.0.1", hub_leaf_port), name=f"relay-{region}").start()
                    port = rs.relays[region].port
                rs.servers[region] = EmbeddedServer.spawn(
                    base / region, name=region, domain=region,
                    leaf_remote=(f"nats-leaf://{host}:{port}", leaf.user, leaf.password), **common, **placed)
            for region in rs.leaves:
                rs.servers[region].wait_ready()
            rs.wait_linked(timeout_s=link_timeout_s)
        except BaseException:
            rs.stop()
            raise
        log.info("regions_started", hub=hub, regions=list(names), base_dir=str(base), relay=relay,
                 linked=sorted(rs.links.links) if rs.links is not None else [])
        return rs

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def leaves(self) -> tuple[str, ...]:
        return tuple(r for r in self.regions if r != self.hub)

    @property
    def domains(self) -> dict[str, str]:
        """Region → JetStream domain (the region name)."""
        return {r: r for r in self.regions}

    def url(self, region: str) -> str:
        return self._server(region).url

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
        """Keyword arguments for `nats.connect` to `region`'s server as `role`."""
        return self._server(region).connect_options(role)

    def _server(self, region: str) -> EmbeddedServer:
        try:
            return self.servers[region]
        except KeyError:
            raise ServerError(f"unknown region {region!r}; regions: {', '.join(self.regions)}") from None

    # ---- links ----------------------------------------------------------------------------------
    def linked(self) -> set[str]:
        """Leaf regions whose link to the hub is up now (from the hub's `/leafz`)."""
        leafz = self.servers[self.hub].monitor("leafz")
        return {str(leaf.get("name")) for leaf in leafz.get("leafs") or ()}

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

    def netns(self, region: str) -> str | None:
        """The network namespace `region`'s server (and its actors) run in; None: this one."""
        return self._server(region).netns

    def is_cut(self, region: str) -> bool:
        """True while `region` is partitioned from the hub (by any `cut` mode)."""
        return region in self._cut_modes or (region in self.relays and self.relays[region].is_cut)

    def cut(self, region: str, mode: CutMode | str | None = None) -> None:
        """Partition a leaf from the hub. `mode`: 'close' closes the relay's connections and refuses reconnects
        (needs a relay); 'drop' drops every packet of its shaped link (TCP stalls, nothing is reset); 'down'
        takes the link down. Default: 'drop' for a leaf with a shaped link, else 'close'."""
        linked = self.links is not None and region in self.links.links
        chosen = mode if mode is not None else "drop" if linked else "close"
        if chosen == "close":
            self._relay(region).cut()
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
            self._relay(region).heal()
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
        self._relay(region).spike(extra_latency_s)

    def link_counters(self) -> dict[str, dict[str, int]]:
        """Leaf → bytes and packets its shaped link carried so far (`Link.counters`); empty without links."""
        return self.links.counters() if self.links is not None else {}

    def _relay(self, region: str) -> Relay:
        try:
            return self.relays[region]
        except KeyError:
            raise ServerError(f"region {region!r} has no relay; start the RegionSet with relay=True "
                              f"(leaves: {', '.join(self.leaves)})") from None

    # ---- process control ------------------------------------------------------------------------
    def kill(self, region: str) -> None:
        """SIGKILL one region's server (it keeps its store directory for `restart`)."""
        self._server(region).kill()

    def restart(self, region: str, *, wait: bool = True, timeout_s: float = 15.0) -> None:
        """Start a region's server again on its store dir and ports; with `wait`, until its links are up."""
        self._server(region).restart()
        if wait:
            if region == self.hub:
                self.wait_linked(timeout_s=timeout_s)
            elif not self.is_cut(region):
                self.wait_linked([region], timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop every leaf, then the hub, then the relays, then remove the links; each by its PID. Idempotent."""
        errors: list[BaseException] = []
        for region in [*self.leaves, self.hub]:
            if region in self.servers:
                try:
                    self.servers[region].stop()
                except (ServerError, OSError) as err:
                    errors.append(err)
        for relay in self.relays.values():
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
