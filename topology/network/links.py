"""Shaped links between regions on one machine: a network namespace per leaf region, joined to the root one.

- Owns: `LinkShape` (parsed from the topology's `[regions.link]` strings), `namespaces_unavailable()`, and
  `LinkSet`: per leaf a namespace with a shaped *link* and an unshaped *console* to the root namespace,
  faults (`cut`, `degrade`), per-link byte counters, and removing it all (`clean_leftovers`).
- Guarantee: every name carries a hash of the state directory, so what a killed run left is found and removed.
- Does not: make latency or jitter (topology/network/relay.py, wired by topology/network/regions.py), start
  servers (topology/network/servers.py) or read topology files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final, Literal

import structlog

from rlbus.messages.errors import ServerError

log = structlog.get_logger()

TOOLS: Final = ("ip", "tc", "nft")
"""The programs a `LinkSet` runs (iproute2's ip and tc, nftables' nft)."""
POOL: Final = ipaddress.ip_network("10.77.0.0/16")
"""Where link and console addresses come from: two /30s per leaf, the root side `.1`, the namespace side `.2`."""
MANIFEST_NAME: Final = "links.json"
LOCK_PATH: Final = Path("/run/rlbus-links.lock")
"""Held while addresses are chosen and links made, so two runs never take the same /30."""
NFT_TABLE: Final = "rlbus_link"
NS_PREFIX: Final = "rlbus-"
IF_PREFIX: Final = "rl"

RATE_PATTERN: Final = r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit)$"
TIME_PATTERN: Final = r"^([0-9]+(?:\.[0-9]+)?)(us|ms|s)$"
PERCENT_PATTERN: Final = r"^([0-9]+(?:\.[0-9]+)?)%$"
_RATE: Final = re.compile(RATE_PATTERN)
_TIME: Final = re.compile(TIME_PATTERN)
_PERCENT: Final = re.compile(PERCENT_PATTERN)
_RATE_UNITS: Final = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
_TIME_UNITS: Final = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
RATE_WORDS: Final = "a rate like '100mbit' (units bit, kbit, mbit, gbit; bits per second)"
TIME_WORDS: Final = "a time like '30ms' (units us, ms, s)"
PERCENT_WORDS: Final = "a percentage like '0.1%' (below 100%)"
_CMD_TIMEOUT_S: Final = 10.0

CutMode = Literal["drop", "down"]
CUT_MODES: Final[tuple[CutMode, ...]] = ("drop", "down")


def parse_rate(text: str) -> int:
    """Bits per second in '100mbit', '1gbit', '512kbit'. :raises ValueError: anything else (or zero)."""
    match = _RATE.fullmatch(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not {RATE_WORDS}")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def parse_time(text: str) -> float:
    """Seconds in '30ms', '250us', '1.5s'. :raises ValueError: anything else."""
    match = _TIME.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not {TIME_WORDS}")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def parse_percent(text: str) -> float:
    """A fraction in [0, 1) from '0.1%'. :raises ValueError: anything else, or 100% and more."""
    match = _PERCENT.fullmatch(text)
    if match is None or float(match.group(1)) >= 100:
        raise ValueError(f"{text!r} is not {PERCENT_WORDS}")
    return float(match.group(1)) / 100


@dataclass(frozen=True, slots=True)
class LinkShape:
    """What a leaf's link to the hub is like: bandwidth (bits/s, None: unshaped), one-way latency and jitter
    (seconds; the round trip is twice the latency), and the fraction of packets lost in each direction."""

    bandwidth_bps: int | None = None
    latency_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, *, bandwidth: str | None = None, latency: str = "0ms", jitter: str = "0ms",
              loss: str = "0%") -> LinkShape:
        """From the topology's strings. :raises ValueError: naming the value and what was expected."""
        return cls(bandwidth_bps=parse_rate(bandwidth) if bandwidth is not None else None,
                   latency_s=parse_time(latency), jitter_s=parse_time(jitter), loss=parse_percent(loss))


def namespaces_unavailable() -> str | None:
    """Why this host cannot make shaped links (not root, a tool missing), in one phrase; None when it can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not found (install iproute2 for ip/tc, nftables for nft)")
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    return None


def run_tag(base_dir: str | os.PathLike[str]) -> str:
    """Six hex digits naming every namespace and interface of the run on `base_dir` (a hash of its path)."""
    return hashlib.sha1(str(Path(base_dir).resolve()).encode()).hexdigest()[:6]


def _run(*argv: str, check: bool = True, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), input=input_text, capture_output=True, text=True,
                              timeout=_CMD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServerError(f"link setup: `{' '.join(argv)}` failed: {err}") from err
    if check and done.returncode != 0:
        raise ServerError(f"link setup: `{' '.join(argv)}` exited {done.returncode}: "
                          f"{(done.stderr or done.stdout).strip()}")
    return done


def _in_ns(ns: str, *argv: str, check: bool = True,
           input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    return _run("ip", "netns", "exec", ns, *argv, check=check, input_text=input_text)


@dataclass(slots=True)
class Link:
    """One leaf region's namespace and its two veth pairs. Addresses: the link's root side `hub_addr`
    (where the hub is reached from the namespace), its namespace side; the console's root side and
    `server_addr` (the namespace side, where the region's server listens)."""

    region: str
    index: int
    tag: str
    block: int
    """Index of the link's /30 in `POOL`; the console has the next one."""
    shape: LinkShape
    cut_mode: CutMode | None = None
    extra_loss: float = 0.0
    created: bool = field(default=False)

    # ---- names and addresses --------------------------------------------------------------------
    @property
    def netns(self) -> str:
        return f"{NS_PREFIX}{self.tag}-{self.region}"

    @property
    def veth_root(self) -> str:
        """The link's end in the root namespace (its counters are the link's bytes)."""
        return f"{IF_PREFIX}{self.tag}{self.index}h"

    @property
    def veth_ns(self) -> str:
        return f"{IF_PREFIX}{self.tag}{self.index}l"

    @property
    def console_root(self) -> str:
        return f"{IF_PREFIX}{self.tag}{self.index}c"

    @property
    def console_ns(self) -> str:
        return f"{IF_PREFIX}{self.tag}{self.index}n"

    def _addr(self, block: int, host: int) -> str:
        return str(POOL.network_address + block * 4 + host)

    @property
    def hub_addr(self) -> str:
        return self._addr(self.block, 1)

    @property
    def leaf_addr(self) -> str:
        return self._addr(self.block, 2)

    @property
    def console_addr(self) -> str:
        return self._addr(self.block + 1, 1)

    @property
    def server_addr(self) -> str:
        """Where the region's server listens: reachable from the namespace and, unshaped, from the root one."""
        return self._addr(self.block + 1, 2)

    # ---- making and removing --------------------------------------------------------------------
    def create(self) -> None:
        """Make the namespace, both veth pairs, their addresses, the shaping and the nftables table."""
        ns = self.netns
        _run("ip", "netns", "add", ns)
        self.created = True
        _in_ns(ns, "ip", "link", "set", "lo", "up")
        for root, inner, root_addr, inner_addr in (
                (self.veth_root, self.veth_ns, self.hub_addr, self.leaf_addr),
                (self.console_root, self.console_ns, self.console_addr, self.server_addr)):
            _run("ip", "link", "add", root, "type", "veth", "peer", "name", inner, "netns", ns)
            _run("ip", "addr", "add", f"{root_addr}/30", "dev", root)
            _run("ip", "link", "set", root, "up")
            _in_ns(ns, "ip", "addr", "add", f"{inner_addr}/30", "dev", inner)
            _in_ns(ns, "ip", "link", "set", inner, "up")
        if self.shape.bandwidth_bps is not None:
            qdisc = ["root", "tbf", "rate", f"{self.shape.bandwidth_bps}bit", "burst", str(_burst(self.shape)),
                     "latency", "50ms"]
            _run("tc", "qdisc", "replace", "dev", self.veth_root, *qdisc)
            _in_ns(ns, "tc", "qdisc", "replace", "dev", self.veth_ns, *qdisc)
        self._apply_rules()
        log.info("link_created", region=self.region, netns=ns, hub_addr=self.hub_addr,
                 server_addr=self.server_addr, bandwidth_bps=self.shape.bandwidth_bps, loss=self.shape.loss)

    def destroy(self) -> None:
        """Remove both veth pairs (their qdiscs go with them) and the namespace (its nftables table goes with it)."""
        remove_names([self.veth_root, self.console_root], [self.netns])
        self.created = False

    # ---- faults ---------------------------------------------------------------------------------
    def cut(self, mode: CutMode = "drop") -> None:
        """'drop': every packet of the link is dropped (TCP stalls and retransmits, nothing is reset);
        'down': the link's root end is taken down (no carrier on either end)."""
        if mode not in CUT_MODES:
            raise ServerError(f"link {self.region}: cut mode {mode!r} is not one of {', '.join(CUT_MODES)}")
        if mode == "down":
            _run("ip", "link", "set", self.veth_root, "down")
        self.cut_mode = mode
        self._apply_rules()
        log.info("link_cut", region=self.region, mode=mode)

    def heal(self) -> None:
        """End a cut: packets flow again (connections resume, or reconnect on their own schedule)."""
        if self.cut_mode == "down":
            _run("ip", "link", "set", self.veth_root, "up")
        self.cut_mode = None
        self._apply_rules()
        log.info("link_healed", region=self.region)

    def degrade(self, loss: float) -> None:
        """Drop `loss` (a fraction) of the link's packets in each direction on top of its shaped loss;
        0 restores it."""
        if not 0.0 <= loss < 1.0:
            raise ServerError(f"link {self.region}: loss {loss!r} must be a fraction in [0, 1)")
        self.extra_loss = loss
        self._apply_rules()
        log.info("link_degraded", region=self.region, extra_loss=loss)

    def _apply_rules(self) -> None:
        """Replace the namespace's nftables table in one transaction: a drop-all while cut, else random drops
        of the shaped plus degraded loss (numgen random, per million), in both directions of the link."""
        rules: list[str] = []
        loss = 1.0 - (1.0 - self.shape.loss) * (1.0 - self.extra_loss)
        for chain, match in (("input", "iifname"), ("output", "oifname")):
            if self.cut_mode == "drop":
                body = f'{match} "{self.veth_ns}" counter drop'
            elif loss > 0:
                body = f'{match} "{self.veth_ns}" numgen random mod 1000000 < {round(loss * 1e6)} counter drop'
            else:
                body = ""
            rules += [f"  chain {chain} {{", f"    type filter hook {chain} priority 0; policy accept;",
                      *([f"    {body}"] if body else []), "  }"]
        script = "\n".join([f"table inet {NFT_TABLE} {{}}", f"delete table inet {NFT_TABLE}",
                            f"table inet {NFT_TABLE} {{", *rules, "}"]) + "\n"
        _in_ns(self.netns, "nft", "-f", "-", input_text=script)

    # ---- counters -------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Bytes and packets that crossed the link so far, seen from its root end: `tx_bytes` went towards the
        leaf, `rx_bytes` came from it (the console's traffic is not counted)."""
        stats = Path("/sys/class/net") / self.veth_root / "statistics"
        out: dict[str, int] = {}
        for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            try:
                out[name] = int((stats / name).read_text())
            except (OSError, ValueError) as err:
                raise ServerError(f"link {self.region}: cannot read {stats / name}: {err}") from err
        return out

    def dropped(self) -> int:
        """Packets the link's nftables rules have dropped (loss, degradation and drop-all cuts) since its
        rules were last replaced (each `cut`, `heal` and `degrade` replaces them)."""
        listing = _in_ns(self.netns, "nft", "list", "table", "inet", NFT_TABLE).stdout
        return sum(int(n) for n in re.findall(r"counter packets (\d+) bytes \d+ drop", listing))

    def manifest(self) -> dict[str, object]:
        return {"region": self.region, "netns": self.netns, "interfaces": [self.veth_root, self.console_root],
                "hub_addr": self.hub_addr, "server_addr": self.server_addr}


def _burst(shape: LinkShape) -> int:
    """tbf bucket: 5 ms at the rate, at least 64 KiB (a GSO segment on a veth)."""
    assert shape.bandwidth_bps is not None
    return max(shape.bandwidth_bps // 8 // 200, 64 * 1024)


def remove_names(interfaces: Iterable[str], namespaces: Iterable[str]) -> list[str]:
    """Delete these root-namespace interfaces (a veth pair goes with either end) and namespaces, those that
    exist; returns what was removed."""
    removed = []
    existing_ifs = set(_root_interfaces())
    for name in interfaces:
        if name in existing_ifs and _run("ip", "link", "del", name, check=False).returncode == 0:
            removed.append(name)
    existing_ns = set(_namespaces())
    for ns in namespaces:
        if ns in existing_ns and _run("ip", "netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    return removed


def _root_interfaces() -> list[str]:
    return [p.name for p in Path("/sys/class/net").iterdir()]


def _namespaces() -> list[str]:
    try:
        return [p.name for p in Path("/run/netns").iterdir()]
    except OSError:
        return []


def _used_blocks() -> set[int]:
    """/30 blocks of `POOL` that an address of the root namespace sits in (another run's links)."""
    done = _run("ip", "-4", "-o", "addr", "show", check=False)
    used = set()
    for addr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", done.stdout):
        ip = ipaddress.ip_address(addr)
        if ip in POOL:
            used.add((int(ip) - int(POOL.network_address)) // 4)
    return used


def leftovers(base_dir: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """(interfaces, namespaces) in this machine's root namespace named for the run on `base_dir`: what a
    killed run left; another run's (another tag) are never listed."""
    tag = run_tag(base_dir)
    interfaces = [n for n in _root_interfaces() if n.startswith(f"{IF_PREFIX}{tag}") and len(n) > len(tag) + 2]
    namespaces = [n for n in _namespaces() if n.startswith(f"{NS_PREFIX}{tag}-")]
    return interfaces, namespaces


def clean_leftovers(base_dir: str | os.PathLike[str]) -> list[str]:
    """Remove what a killed run on `base_dir` left (namespaces, veths and with them their qdiscs and nftables
    tables) and its manifest; returns the names removed. Stop the run's processes first: a namespace's
    interfaces go at once, the namespace itself when its last process has exited."""
    if namespaces_unavailable() is not None:
        return []
    interfaces, namespaces = leftovers(base_dir)
    removed = remove_names(interfaces, namespaces) if interfaces or namespaces else []
    with contextlib.suppress(OSError):
        (Path(base_dir) / MANIFEST_NAME).unlink()
    if removed:
        log.info("links_leftovers_removed", base_dir=str(base_dir), removed=removed)
    return removed


@contextlib.contextmanager
def _pool_lock() -> Iterator[None]:
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class LinkSet:
    """The links of one run: `LinkSet.create(base_dir, {"eu": shape, ...})` makes a namespace and its links per
    leaf (removing first what a killed run on `base_dir` left), writes `base_dir/links.json`, and `stop()`
    removes everything. `cut`/`heal`/`degrade`/`counters` per region.

    Per leaf a network namespace `rlbus-<tag>-<region>` holds that region's nats-server and actors, with two
    veth pairs to the root namespace: the *link*, shaped (`tbf` on both ends for bandwidth, an nftables table
    in the namespace for loss and drop-all cuts), and the *console*, unshaped (how this machine's own
    clients, monitoring and provisioning reach the region's server, like an operator's access to a
    datacentre). Addresses come from 10.77.0.0/16 (two /30s per leaf, never routed off the machine). Faults:
    `cut` by dropping every packet or by taking the link down, `degrade` by loss. Everything is removed on
    stop, and so is what a killed run on the same state directory left: every name carries `<tag>`, a hash
    of that directory. Latency and jitter are not made here (this kernel has no `netem`):
    topology/network/relay.py delays each direction of the leaf link in userspace, inside the shaped path.
    """

    def __init__(self, base_dir: Path, links: dict[str, Link]) -> None:
        self.base_dir: Final = base_dir
        self.links: Final = links

    @classmethod
    def create(cls, base_dir: str | os.PathLike[str], shapes: dict[str, LinkShape]) -> LinkSet:
        """:raises ServerError: namespaces cannot be made here (the reason), or a command failed (nothing is
        left behind)."""
        if (why := namespaces_unavailable()) is not None:
            raise ServerError(f"shaped links need network namespaces: {why}")
        base = Path(base_dir).resolve()
        base.mkdir(parents=True, exist_ok=True)
        clean_leftovers(base)
        tag = run_tag(base)
        links: dict[str, Link] = {}
        made = cls(base, links)
        try:
            with _pool_lock():
                used = _used_blocks()
                block = 0
                for index, (region, shape) in enumerate(shapes.items()):
                    while block in used or block + 1 in used:
                        block += 2
                    if block + 1 >= POOL.num_addresses // 4:
                        raise ServerError(f"no free addresses left in {POOL} for the link of {region}")
                    links[region] = Link(region=region, index=index, tag=tag, block=block, shape=shape)
                    used |= {block, block + 1}
                    links[region].create()
            made._write_manifest()
        except BaseException:
            made.stop()
            raise
        return made

    def _write_manifest(self) -> None:
        (self.base_dir / MANIFEST_NAME).write_text(
            json.dumps({"tag": run_tag(self.base_dir), "links": [link.manifest() for link in self.links.values()]},
                       indent=2))

    def link(self, region: str) -> Link:
        try:
            return self.links[region]
        except KeyError:
            raise ServerError(f"region {region!r} has no shaped link; linked regions: "
                              f"{', '.join(self.links) or 'none'}") from None

    def cut(self, region: str, mode: CutMode = "drop") -> None:
        self.link(region).cut(mode)

    def heal(self, region: str) -> None:
        self.link(region).heal()

    def degrade(self, region: str, loss: float) -> None:
        self.link(region).degrade(loss)

    def counters(self) -> dict[str, dict[str, int]]:
        """Region → the link's byte and packet counters (`Link.counters`)."""
        return {region: link.counters() for region, link in self.links.items()}

    def stop(self) -> None:
        """Remove every namespace, veth, qdisc and nftables table of this set, and the manifest. Idempotent."""
        links = [link for link in self.links.values() if link.created]
        remove_names([n for link in links for n in (link.veth_root, link.console_root)],
                     [link.netns for link in links])
        for link in links:
            link.created = False
        with contextlib.suppress(OSError):
            (self.base_dir / MANIFEST_NAME).unlink()
        if links:
            log.info("links_removed", base_dir=str(self.base_dir), regions=[link.region for link in links])

    def __enter__(self) -> LinkSet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
