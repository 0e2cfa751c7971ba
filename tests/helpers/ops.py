"""Helpers shared by the ops tests: run a subcommand in-process, provision a single-server run, targets."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbus.messages.bus import Bus
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.ops.target import Target
from rlbus.topology.network.servers import EmbeddedServer


def json_in(out: str) -> Any:
    """The first JSON object printed at the start of a line in `out` (log lines around it are skipped)."""
    start = 0 if out.startswith("{") else out.index("\n{") + 1
    return json.JSONDecoder().raw_decode(out, start)[0]


def json_lines(out: str) -> list[Any]:
    """Every line of `out` that is a JSON object (log lines are skipped)."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_cli(argv: Sequence[str]) -> int:
    """Parse and run one `rlbus` subcommand without `main()` (which would configure logging globally)."""
    from rlbus.ops.cli import build_parser

    args = build_parser().parse_args(list(argv))
    return int(args.handler(args) or 0)


async def provision_single(bus: Bus) -> None:
    """A run's streams on one server without JetStream domains: one region, the hub, named `hub`."""
    await provision_run(bus.nc, bus.subjects, hub="hub", domains={"hub": None}, settings=StreamSettings.tiny())


def target_of(server: EmbeddedServer, run: str, role: str = "observer") -> Target:
    """A Target for `run` on the session server, authenticated as `role`."""
    cred = server.credential(role)
    return Target(run=run, hub="hub", urls={"hub": (server.url,)}, domains={"hub": None}, role=role,
                  user=cred.user, password=cred.password)


def url_args(server: EmbeddedServer, run: str, role: str = "observer") -> list[str]:
    """The command-line options that point a command at `run` on the session server as `role`."""
    cred = server.credential(role)
    return ["--url", server.url, "--run", run, "--user", cred.user, "--password", cred.password]


def write_credentials(server: EmbeddedServer, path: Path, roles: Sequence[str]) -> Path:
    """A credentials.json ({role: {user, password}}) for `roles` of the session server."""
    path.write_text(json.dumps({r: server.credential(r)._asdict() for r in roles}))
    return path
