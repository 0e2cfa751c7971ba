"""How an ops command finds a run: shared options and their resolution into a `Target`.

- Owns: `add_target_options(parser)`, `resolve(args)` → `Target` (run id, hub, region URLs and JetStream
  domains, credentials), `Target.connect()`, `for_state_dir(state)`, `on_signal(act)` (Ctrl-C ends a
  command's reading), and `opened(...)`, which lets a command read a stopped run.
- Guarantee: imports only stdlib at module top.
- Does not: read streams or render anything (the commands do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbus.messages.bus import Bus

DEFAULT_ROLE = "observer"
"""Read-only commands connect as the observer: it may subscribe and use the JetStream API, not publish data."""


def add_target_options(p: argparse.ArgumentParser, *, run_positional: bool = True, role: str = DEFAULT_ROLE) -> None:
    """The options every command that talks to a run's bus shares: RUN, --state-dir, --url, --run, --hub,
    --user/--password, --credentials/--role."""
    if run_positional:
        p.add_argument("run", nargs="?", default=None, metavar="RUN",
                       help="run id (its state directory ./.rlbus/RUN holds run.json, written by `rlbus up`)")
    g = p.add_argument_group("where the run is")
    g.add_argument("--state-dir", type=Path, default=None,
                   help="state directory of the run (default ./.rlbus/RUN); its run.json names the hub URL")
    g.add_argument("--url", action="append", default=None,
                   help="hub NATS URL (repeatable); with --url, --run (or RUN) names the run and run.json is not read")
    g.add_argument("--run", dest="run_opt", default=None, metavar="RUN",
                   help="run id (same as RUN; for `replay publish`: the run to publish to)")
    g.add_argument("--hub", default=None, help="hub region name (default: from run.json, else 'hub')")
    g.add_argument("--user", default=None, help="NATS user (default: the role's entry of the credentials file)")
    g.add_argument("--password", default=None, help="NATS password")
    g.add_argument("--credentials", type=Path, default=None,
                   help="credentials.json ({role: {user, password}}; default: the one run.json names)")
    g.add_argument("--role", default=role, help=f"role to connect as (default {role})")
    g.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM file of the CA to trust for TLS servers (default: the one run.json names)")


@dataclass(frozen=True, slots=True)
class Target:
    """A run's buses: hub name, region → URLs and JetStream domains (None: the server connected to)."""

    run: str
    hub: str
    urls: dict[str, tuple[str, ...]]
    domains: dict[str, str | None]
    role: str = DEFAULT_ROLE
    user: str | None = None
    password: str | None = None
    region_auth: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    """Per-region (user, password) where regions have their own credentials files."""
    tls_ca: str | None = None
    """CA to trust for TLS (topology `[tls]`: run.json's `tls_ca`, or --tls-ca); None: plaintext."""

    @property
    def hub_urls(self) -> tuple[str, ...]:
        return self.urls[self.hub]

    @property
    def hub_domain(self) -> str | None:
        return self.domains.get(self.hub)

    def auth(self, region: str) -> tuple[str | None, str | None]:
        return self.region_auth.get(region, (self.user, self.password))

    async def connect(self, *, name: str = "rlbus-ops", retry_for_s: float = 5.0, region: str | None = None) -> Bus:
        """A bus at the hub (or `region`), bound to the run, with this target's role.

        :raises BusUnavailable: no server answered within `retry_for_s`.
        """
        import anyio

        from rlbus.messages.bus import Bus, ConnectOptions, Identity
        from rlbus.messages.errors import BusUnavailable

        where = region or self.hub
        user, password = self.auth(where)
        if not await any_listening(self.urls[where]):
            raise BusUnavailable(f"nothing listens at {list(self.urls[where])}; is the run {self.run!r} up "
                                 f"(`rlbus up`)? Its run.json may be stale")
        # nats-py's first connect never gives up while reconnects are unlimited: bound it here
        with anyio.move_on_after(retry_for_s + 2.0) as scope:
            return await Bus.connect(list(self.urls[where]), run=self.run,
                                     identity=Identity(actor_id=name, kind="ops", region=where),
                                     domain=self.domains.get(where),
                                     options=ConnectOptions(user=user, password=password, retry_for_s=retry_for_s,
                                                            connect_timeout_s=2.0, tls_ca_file=self.tls_ca))
        assert scope.cancelled_caught
        raise BusUnavailable(f"no NATS server answered at {list(self.urls[where])} within {retry_for_s:.0f}s; is the "
                             f"run {self.run!r} up (`rlbus up`)? Its run.json may be stale")


async def any_listening(urls: tuple[str, ...], timeout_s: float = 1.0) -> bool:
    """True when a TCP connection to at least one of the NATS URLs succeeds (a quick, quiet pre-check)."""
    from urllib.parse import urlsplit

    import anyio

    for url in urls:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        with anyio.move_on_after(timeout_s):
            try:
                stream = await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 4222)
            except OSError:
                continue
            await stream.aclose()
            return True
    return False


def resolve(args: argparse.Namespace) -> Target:
    """Turn the shared options into a `Target`.

    A run started by `rlbus up` is found through the `run.json` that topology/backends/launch.py writes into
    its state directory (default `./.rlbus/<run>`).

    :raises RlbusError: when the run cannot be found (no run id, no run.json, unreadable credentials).
    """
    from rlbus.messages.errors import RlbusError

    run = getattr(args, "run_opt", None) or getattr(args, "run", None)
    role = args.role
    if args.url:
        if not run:
            raise RlbusError("--url needs the run id too: pass RUN or --run")
        hub = args.hub or "hub"
        target = Target(run=run, hub=hub, urls={hub: tuple(args.url)}, domains={hub: None}, role=role,
                        tls_ca=_tls_ca(args, None))
        creds_file = args.credentials
        region_files: dict[str, Any] = {}
    else:
        state = args.state_dir or (Path(".rlbus") / run if run else None)
        if state is None:
            raise RlbusError("which run? pass RUN (state in ./.rlbus/RUN), --state-dir DIR, or --url and --run")
        doc = read_run_file(state)
        if run and run != doc["run"]:
            raise RlbusError(f"{state}/run.json is run {doc['run']!r}, not {run!r}; pass the right --state-dir")
        urls = {r: tuple(u) for r, u in doc["urls"].items()}
        hub = args.hub or doc["hub"]
        target = Target(run=doc["run"], hub=hub, urls=urls, domains=dict(doc.get("domains") or {}), role=role,
                        tls_ca=_tls_ca(args, doc.get("tls_ca")))
        creds = doc.get("credentials") or {}
        region_files = creds if isinstance(creds, dict) else {r: creds for r in urls}
        creds_file = args.credentials or (Path(region_files[hub]) if region_files.get(hub) else None)
    if args.user is not None:
        return _with(target, args.user, args.password or "", {})
    if creds_file is not None:
        user, password = _credential(Path(creds_file), role)
        per_region = {r: _credential(Path(f), role) for r, f in region_files.items()
                      if f and Path(f) != Path(creds_file) and args.credentials is None}
        return _with(target, user, password, per_region)
    if os.environ.get("RLBUS_NATS_USER"):
        return _with(target, os.environ["RLBUS_NATS_USER"], os.environ.get("RLBUS_NATS_PASSWORD", ""), {})
    return target


def for_state_dir(state: Path, *, role: str = DEFAULT_ROLE) -> Target:
    """The target of the run whose state directory is `state` (its run.json and credentials file), as `role`.

    :raises RlbusError: as `resolve`.
    """
    parser = argparse.ArgumentParser()
    add_target_options(parser, role=role)
    return resolve(parser.parse_args(["--state-dir", str(state)]))


def state_dir_of(args: argparse.Namespace) -> Path | None:
    """The state directory the shared options point at (None with --url)."""
    if getattr(args, "url", None):
        return None
    run = getattr(args, "run_opt", None) or getattr(args, "run", None)
    return args.state_dir or (Path(".rlbus") / run if run else None)


@asynccontextmanager
async def opened(target: Target, args: argparse.Namespace, *, command: str,
                 refuse: str | None = None) -> AsyncIterator[Target]:
    """`target` while the block runs, its run up or stopped.

    When nothing listens at the hub and the state directory holds the embedded servers of `rlbus up` (a run
    that has stopped), those servers are started again from their stores, as `rlbus up` would start them but
    with no actor, while the state directory's lock is held (so no `rlbus up` can start on it meanwhile);
    the target then points at them, and they are stopped when the block ends. Anything else (a live run,
    --url, servers the run only joined) is left to `Target.connect`. `refuse`: why the command as asked
    makes no sense on a stopped run (it would wait for new messages); given, a stopped run is refused with it.

    :raises RlbusError: the run is stopped and `refuse` is set, or another command holds the state directory.
    """
    import anyio

    from rlbus.messages.errors import RlbusError

    state = state_dir_of(args)
    stored = None if state is None or await any_listening(target.hub_urls) else _stored_servers(state, target)
    if stored is None:
        yield target
        return
    if refuse is not None:
        raise RlbusError(f"run {target.run!r} is stopped (nothing listens at {list(target.hub_urls)}); {refuse}, "
                         f"or start it again with `rlbus up`")
    from rlbus.ops.up import hold_state_dir
    from rlbus.topology.network.regions import RegionSet

    lock = hold_state_dir(state, holder=f"{command} (read-only)")
    try:
        print(f"{command}: run {target.run!r} is stopped: opened read-only from {state} (its stored servers "
              f"started again, no actor; stopped when this command ends)", file=sys.stderr, flush=True)
        regions, hub, tls = stored
        nodes = len(target.urls[hub])      # run.json names every node of a clustered region
        servers = await anyio.to_thread.run_sync(lambda: RegionSet.start(
            state / "nats", regions, hub, run=target.run, tls=tls, nodes=nodes))
        try:
            yield replace(target, urls={r: servers.urls(r) for r in regions},
                          tls_ca=str(servers.tls.ca) if servers.tls is not None else target.tls_ca)
        finally:
            await anyio.to_thread.run_sync(servers.stop)
    finally:
        lock.close()


def _stored_servers(state: Path, target: Target) -> tuple[list[str], str, bool] | None:
    """(regions, hub, tls) of the embedded servers whose stores `rlbus up` left under `state/nats`, or None
    when the run did not start its own servers (it joined `nats_urls`) or left nothing to start."""
    from rlbus.topology.network.regions import CREDENTIALS_NAME, TLS_DIR

    base = (state / "nats").resolve()
    regions = list(target.urls)
    if not (base / CREDENTIALS_NAME).is_file() or not all((base / r).is_dir() for r in regions):
        return None
    if target.tls_ca is not None and not Path(target.tls_ca).resolve().is_relative_to(base / TLS_DIR):
        return None         # its servers used the operator's own certificate: only `rlbus up` knows it
    return regions, target.hub, target.tls_ca is not None


def read_run_file(state: Path) -> dict[str, Any]:
    """The run.json of a state directory, checked for the keys ops commands need."""
    from rlbus.messages.errors import RlbusError
    from rlbus.topology.backends.launch import RUN_FILE

    path = state / RUN_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise RlbusError(f"{path} does not exist: start the run with `rlbus up` (it writes run.json), "
                         f"pass the right --state-dir, or give --url and --run") from None
    except (OSError, ValueError) as err:
        raise RlbusError(f"{path}: not readable as JSON ({err})") from None
    missing = [k for k in ("run", "hub", "urls") if k not in doc]
    if missing or not isinstance(doc.get("urls"), dict) or doc.get("hub") not in doc.get("urls", {}):
        raise RlbusError(f"{path}: expected {{run, hub, urls: {{region: [url]}}, domains, credentials}} with the hub "
                         f"among urls; missing or wrong: {missing or ['hub/urls']}")
    return dict(doc)


def _credential(path: Path, role: str) -> tuple[str, str]:
    from rlbus.actors.host import credentials_from_file

    return credentials_from_file(path, role)


def _with(target: Target, user: str, password: str, per_region: dict[str, tuple[str, str]]) -> Target:
    return Target(run=target.run, hub=target.hub, urls=target.urls, domains=target.domains, role=target.role,
                  user=user, password=password, region_auth=dict(per_region), tls_ca=target.tls_ca)


def _tls_ca(args: argparse.Namespace, from_run_file: object) -> str | None:
    given = getattr(args, "tls_ca", None)
    if given is not None:
        return str(given)
    return str(from_run_file) if from_run_file else None


def parse_duration(text: str) -> float:
    """`90`, `90s`, `10m`, `2h`, `1d` → seconds.

    :raises RlbusError: anything else.
    """
    from rlbus.messages.errors import RlbusError

    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    value = text.strip().lower()
    scale = 1.0
    if value and value[-1] in units:
        scale, value = units[value[-1]], value[:-1]
    try:
        seconds = float(value) * scale
    except ValueError:
        raise RlbusError(f"duration {text!r}: expected a number with an optional unit s, m, h or d "
                         f"(e.g. 10m)") from None
    if seconds < 0:
        raise RlbusError(f"duration {text!r} is negative")
    return seconds


async def on_signal(act: Callable[[], object]) -> None:
    """On SIGINT or SIGTERM call `act()` once (cancel a scope, set an event) and return. Signals reach only the
    main thread, so called from another one (a test's worker thread) it returns at once."""
    import signal
    import threading

    import anyio

    if threading.current_thread() is not threading.main_thread():
        return
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            act()
            return
