"""Showing a health `Snapshot`: a rich table, a JSON object, and Prometheus metrics over HTTP.

Owns: `render_table(snapshot)` (rich renderable: actors problems first, a sandbox supervisor's sessions open and
tool latencies in a column of their own, then each region's bus),
`to_json(snapshot)`, `SnapshotCollector` (a prometheus-client custom collector over the latest snapshot)
and `serve_metrics()` (a small HTTP endpoint on anyio, so scrapes are answered inside the same
structured task group as the watcher — no thread of our own).
Does not: gather anything from the bus (ops/health/watch.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import anyio
import anyio.abc
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlbus.ops.health.model import PROBLEMS, SEVERITY, ActorHealth, Snapshot

_STYLE: Final = {"dead": "bold red", "failed": "red", "stalled": "yellow", "lagging": "magenta",
                 "restarting": "cyan", "ok": "green", "stopped": "dim"}
STATES: Final = ("starting", "ready", "busy", "draining", "stopped", "failed")


def to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as plain JSON values, with per-status counts under `summary`."""
    doc = dataclasses.asdict(snapshot)
    doc["summary"] = snapshot.counts()
    doc["dead"] = snapshot.anything_dead
    return doc


def _age(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def _num(value: int | float | None) -> str:
    return "-" if value is None else str(value)


def sandbox_cell(a: ActorHealth) -> str:
    """A sandbox supervisor's sessions open and each tool's median latency ("2 | read_file 0.8 run 4.1");
    "-" for an actor that holds no sessions."""
    if a.sessions_open is None and not a.tool_ms:
        return "-"
    tools = " ".join(f"{tool} {ms:g}" for tool, ms in a.tool_ms.items())
    return f"{_num(a.sessions_open)} | {tools}" if tools else _num(a.sessions_open)


def render_table(snapshot: Snapshot) -> Group:
    """Two tables: every actor (problems first) and every region's bus."""
    counts = snapshot.counts()
    head = Text(f"run {snapshot.run}  {time.strftime('%H:%M:%S', time.localtime(snapshot.at))}  "
                f"actors {len(snapshot.actors)}: " + ", ".join(f"{counts[s]} {s}" for s in SEVERITY if counts[s])
                + (f"  newest version {snapshot.newest_policy_version}" if snapshot.newest_policy_version is not None else ""))
    actors = Table(title="actors", title_justify="left", expand=False)
    for col in ("status", "region", "kind", "actor", "state", "last beat", "version", "lag", "restarts",
                "sessions, tool ms", "counters, gauges", "error"):
        actors.add_column(col, overflow="fold")
    for a in snapshot.actors:
        status = Text(a.status if len(a.problems) <= 1 else "+".join(a.problems), style=_STYLE[a.status])
        counters = " ".join([f"{k}={v}" for k, v in sorted(a.counters.items())]
                            + [f"{k}={v:g}" for k, v in sorted(a.gauges.items())])
        if "stalled" in a.problems:
            counters += f" (unchanged {_age(a.no_progress_s)})"
        actors.add_row(status, a.region, a.kind, a.actor_id, a.state, f"{_age(a.age_s)} / {_age(a.deadline_s)}",
                       _num(a.policy_version), _num(a.lag), str(a.restarts), sandbox_cell(a), counters,
                       a.last_error[:60])
    bus = Table(title="buses", title_justify="left", expand=False)
    for col in ("region", "server", "rtt ms", "jetstream", "tasks pending", "tasks unacked", "rollouts stored",
                "error"):
        bus.add_column(col, overflow="fold")
    for r in snapshot.bus.regions:
        reach = "unknown" if r.reachable is None else "up" if r.reachable else "DOWN"
        bus.add_row(Text(r.region, style="bold red" if r.down else ""), f"{reach} {r.url or ''}".strip(),
                    _num(r.rtt_ms), "yes" if r.jetstream else "no", _num(r.tasks_pending), _num(r.tasks_unacked),
                    _num(r.rollouts_stored), r.error[:60])
    b = snapshot.bus
    tail = Text(f"hub ROLLOUTS: stored {_num(b.rollouts_stored)}, trainer pending {_num(b.rollouts_pending)}, "
                f"unacked {_num(b.rollouts_unacked)}   dead letters {_num(b.dead_letters)}")
    return Group(head, actors, bus, tail)


class SnapshotCollector:
    """prometheus-client custom collector: exports whatever `latest()` returns at scrape time."""

    def __init__(self, latest: Callable[[], Snapshot | None]) -> None:
        self.latest = latest

    def describe(self) -> list[Metric]:
        return []           # not known before the first snapshot: skip registration-time collection

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()
        if snap is None:
            return
        labels = ["run", "region", "kind", "actor"]

        def family(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"rlbus_actor_{name}", doc, labels=[*labels, *extra])

        up = family("up", "1 when the actor heartbeats within its deadline and is not stopped or failed")
        flags = {p: family(p, f"1 when the actor is {p}") for p in PROBLEMS}
        state = family("state", "1 for the actor's current lifecycle state", ("state",))
        version = family("policy_version", "policy version the actor reports")
        lag = family("lag_versions", "policy versions behind the newest version seen")
        restarts = family("restarts", "restarts of the actor so far")
        age = family("heartbeat_age_seconds", "seconds since the actor's last heartbeat was seen")
        counter = family("counter", "the actor's progress counters (reset when it restarts)", ("counter",))
        gauge = family("gauge", "the actor's gauges", ("gauge",))
        for a in snap.actors:
            key = [snap.run, a.region, a.kind, a.actor_id]
            up.add_metric(key, float(a.status not in ("dead", "failed", "stopped")))
            for p, fam in flags.items():
                fam.add_metric(key, float(p in a.problems))
            for s in STATES:
                state.add_metric([*key, s], float(a.state == s))
            if a.policy_version is not None:
                version.add_metric(key, float(a.policy_version))
            if a.lag is not None:
                lag.add_metric(key, float(a.lag))
            restarts.add_metric(key, float(a.restarts))
            age.add_metric(key, a.age_s)
            for name, value in a.counters.items():
                counter.add_metric([*key, name], float(value))
            for name, fvalue in a.gauges.items():
                gauge.add_metric([*key, name], float(fvalue))
        yield from (up, *flags.values(), state, version, lag, restarts, age, counter, gauge)
        yield from self._bus(snap)

    @staticmethod
    def _bus(snap: Snapshot) -> Iterator[Metric]:
        labels = ["run", "region"]
        per_region = {
            "up": "1 when the region's server answers a ping and its JetStream answers",
            "tasks_pending": "tasks waiting in the region's TASKS work queue",
            "tasks_unacked": "tasks handed to generators and not yet acked",
            "rollouts_stored": "messages in the region's own ROLLOUTS stream",
            "rtt_seconds": "round trip of a ping to the region's server",
        }
        fams = {k: GaugeMetricFamily(f"rlbus_region_{k}", doc, labels=labels) for k, doc in per_region.items()}
        for r in snap.bus.regions:
            key = [snap.run, r.region]
            fams["up"].add_metric(key, float(not r.down))
            for name, value in (("tasks_pending", r.tasks_pending), ("tasks_unacked", r.tasks_unacked),
                                ("rollouts_stored", r.rollouts_stored),
                                ("rtt_seconds", None if r.rtt_ms is None else r.rtt_ms / 1000.0)):
                if value is not None:
                    fams[name].add_metric(key, float(value))
        yield from fams.values()
        b = snap.bus
        for name, doc, value in (
            ("rollouts_stored", "rollouts in the hub's aggregated ROLLOUTS stream", b.rollouts_stored),
            ("rollouts_pending", "hub rollouts not yet delivered to the trainer", b.rollouts_pending),
            ("rollouts_unacked", "hub rollouts delivered to the trainer and not yet acked", b.rollouts_unacked),
            ("dead_letters", "messages in the dead-letter stream", b.dead_letters),
            ("newest_policy_version", "newest policy version seen (actors, manifests)", snap.newest_policy_version),
        ):
            fam = GaugeMetricFamily(f"rlbus_{name}", doc, labels=["run"])
            if value is not None:
                fam.add_metric([snap.run], float(value))
            yield fam
        counts = GaugeMetricFamily("rlbus_actors", "actors per health status", labels=["run", "status"])
        for status, n in snap.counts().items():
            if status in SEVERITY:
                counts.add_metric([snap.run, status], float(n))
        yield counts


def registry_for(latest: Callable[[], Snapshot | None]) -> CollectorRegistry:
    """A registry holding only the snapshot collector (no process/platform metrics of this CLI)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(latest))
    return registry


async def serve_metrics(registry: CollectorRegistry, port: int, *, host: str = "0.0.0.0",
                        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """Answer every HTTP GET with the registry's exposition; `task_status` gets the bound port (0 = any)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
    task_status.started(bound)

    async def answer(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(5.0):
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < 16384:
                        request += await stream.receive(4096)
                    path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
                    if request.startswith(b"GET") and path.split(b"?")[0] in (b"/", b"/metrics"):
                        body, status, ctype = generate_latest(registry), b"200 OK", CONTENT_TYPE_LATEST.encode()
                    else:
                        body, status, ctype = b"GET /metrics\n", b"404 Not Found", b"text/plain"
                    await stream.send(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                                      + b"\r\nContent-Length: " + str(len(body)).encode()
                                      + b"\r\nConnection: close\r\n\r\n" + body)
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError, OSError):
                return

    await listener.serve(answer)
