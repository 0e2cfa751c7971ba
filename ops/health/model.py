"""The health model behind `rlbus health`: what heartbeats, events and manifests say about each actor.

- Owns: `HealthRules` (the thresholds), `HealthModel` (fed heartbeats with the time they were seen, lifecycle
  events and published versions), `ActorHealth` (one actor's verdict at a given `now`), the bus-side records
  (`RegionHealth`, `BusHealth`) and the `Snapshot` that `--json` prints and Prometheus exports.
- Guarantee: no I/O and no clock of its own: a verdict depends only on what was fed and `now`.
- Does not: read the bus (ops/health/watch.py) or render (ops/health/view.py).
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from rlbus.messages.schemas import Event, Heartbeat

Status: TypeAlias = Literal["dead", "failed", "stalled", "lagging", "restarting", "ok", "stopped"]
SEVERITY: Final[dict[str, int]] = {"dead": 0, "failed": 1, "stalled": 2, "lagging": 3, "restarting": 4, "ok": 5,
                                   "stopped": 6}
PROBLEMS: Final = ("dead", "failed", "stalled", "lagging", "restarting")
_TERMINAL: Final = ("stopped", "failed")
_GAPS_KEPT: Final = 8
SCHEDULE_GAUGE: Final = "every_versions"
"""Heartbeat gauge of an actor that works on one version per block of k (the evaluator): its k."""
SESSIONS_GAUGE: Final = "sessions_open"
"""Heartbeat gauge of a sandbox supervisor: the sessions it holds open."""
_TOOL_GAUGE: Final = re.compile(r"tool_(?P<tool>[a-z_]+?)_ms")


def tool_latency(gauges: dict[str, float]) -> dict[str, float]:
    """Each tool's median latency (ms) from a supervisor's `tool_<name>_ms` gauges (`tool_<name>_last_ms` is the
    latest call, left out)."""
    out = {}
    for name, value in gauges.items():
        match = _TOOL_GAUGE.fullmatch(name)
        if match and not name.endswith("_last_ms"):
            out[match["tool"]] = value
    return dict(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class HealthRules:
    """Thresholds of the verdicts (the `rlbus health` options)."""

    deadline_factor: float = 3.0
    """k: an actor is dead after k × its heartbeat interval without a heartbeat."""
    min_deadline_s: float = 3.0
    """The deadline is never shorter than this."""
    default_interval_s: float = 2.0
    """Interval assumed until two heartbeats of an actor have been seen (the actors' default)."""
    stall_s: float = 60.0
    """Alive with no counter change for this long = stalled (0 disables)."""
    lag_versions: int = 2
    """More than this many policy versions behind the newest = lagging."""
    restart_window_s: float = 300.0
    """A restart within this window = restarting."""

    def lag_allowed(self, every_versions: int = 0) -> int:
        """Versions an actor may be behind the newest and not lag: `lag_versions`, plus `every_versions` for
        an actor that works on one version per block of that many (0: no schedule)."""
        return self.lag_versions + max(0, every_versions)

    def deadline(self, interval_s: float) -> float:
        """deadline = max(k × interval, min_deadline_s)."""
        return max(self.deadline_factor * interval_s, self.min_deadline_s)


@dataclass(slots=True)
class _Track:
    last: Heartbeat
    seen_at: float
    first_seen: float
    progress_at: float
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=_GAPS_KEPT))
    restart_at: float | None = None
    failed_event_at: float | None = None
    failed_detail: str = ""


@dataclass(frozen=True, slots=True)
class ActorHealth:
    """One actor's verdict at a moment. A sandbox supervisor's also names its sessions open and each tool's
    median latency, read from its heartbeat gauges.

    Verdicts, most severe first (an actor shows its worst; `problems` lists all that apply):
      dead       not stopped/failed, and no heartbeat for longer than its deadline
                 (deadline = max(k × interval, min_deadline_s); interval = median gap of its recent heartbeats)
      failed     last heartbeat says failed, or the launcher reported it failed after its last heartbeat
      stalled    alive but no counter changed for `stall_s` (observed for at least that long)
      lagging    policy_version more than `lag_versions` behind the newest version seen (actors, manifests);
                 an actor on a schedule (a heartbeat gauge `every_versions` = k, the evaluator: it reports the
                 version it last scored, one per block of k) lags only more than k + `lag_versions` behind
      restarting its restart count or pid changed, or a `restarted` event came, within `restart_window_s`
      ok / stopped
    """

    actor_id: str
    kind: str
    region: str
    state: str
    status: Status
    problems: list[str]
    age_s: float
    """Seconds since its last heartbeat was seen."""
    interval_s: float
    deadline_s: float
    policy_version: int | None
    lag: int | None
    """Versions behind the newest version seen; None when the actor reports no version."""
    lag_allowed: int
    """The most versions behind it may be and not be lagging: `lag_versions`, plus its schedule's k if it has one."""
    restarts: int
    no_progress_s: float
    """Seconds since any of its counters last changed."""
    counters: dict[str, int]
    gauges: dict[str, float]
    last_error: str
    pid: int
    sessions_open: int | None = None
    """Sandbox sessions the actor holds open now (a sandbox supervisor's `sessions_open` gauge); None: it holds none
    by kind."""
    tool_ms: dict[str, float] = field(default_factory=dict)
    """Median latency (ms) of each tool over the actor's recent calls (its `tool_<name>_ms` gauges)."""


class HealthModel:
    """Latest heartbeat and progress history per actor; `verdicts(now)` judges them all."""

    def __init__(self, rules: HealthRules | None = None) -> None:
        self.rules = rules or HealthRules()
        self.tracks: dict[str, _Track] = {}
        self.newest_version: int | None = None

    def observe(self, hb: Heartbeat, seen_at: float) -> None:
        """Take a heartbeat seen at `seen_at` (unix s). Older or repeated heartbeats of an actor are ignored."""
        self.observe_version(hb.policy_version)
        track = self.tracks.get(hb.actor_id)
        if track is None:
            self.tracks[hb.actor_id] = _Track(last=hb, seen_at=seen_at, first_seen=seen_at, progress_at=seen_at)
            return
        prev = track.last
        if hb.sent_at <= prev.sent_at:
            return
        if prev.state not in _TERMINAL and hb.state not in _TERMINAL and hb.pid == prev.pid:
            track.gaps.append(hb.sent_at - prev.sent_at)       # regular beats only, same process
        if hb.counters != prev.counters:
            track.progress_at = seen_at
        if hb.restarts > prev.restarts or (hb.pid and prev.pid and hb.pid != prev.pid):
            track.restart_at = seen_at
            track.progress_at = seen_at
        track.last, track.seen_at = hb, seen_at

    def observe_event(self, event: Event, at: float) -> None:
        """Take a lifecycle event: `restarted` marks a restart, `failed` a launcher giving up on an actor."""
        track = self.tracks.get(event.actor_id)
        if track is None:
            return
        if event.event == "restarted":
            track.restart_at = max(at, track.restart_at or at)
        elif event.event == "failed":
            track.failed_event_at, track.failed_detail = at, event.detail

    def observe_version(self, version: int | None) -> None:
        """A policy version that exists (from a heartbeat or a WeightManifest)."""
        if version is not None and (self.newest_version is None or version > self.newest_version):
            self.newest_version = version

    def interval(self, actor_id: str) -> float:
        """Heartbeat interval of an actor: median of its recent regular gaps, else the default."""
        gaps = self.tracks[actor_id].gaps
        return statistics.median(gaps) if gaps else self.rules.default_interval_s

    def judge(self, actor_id: str, now: float) -> ActorHealth:
        """The verdict on one actor at `now`."""
        rules, track = self.rules, self.tracks[actor_id]
        hb = track.last
        interval = self.interval(actor_id)
        deadline = rules.deadline(interval)
        age = max(0.0, now - track.seen_at)
        no_progress = max(0.0, now - track.progress_at)
        lag = None if hb.policy_version is None or self.newest_version is None else self.newest_version - hb.policy_version
        allowed = rules.lag_allowed(int(hb.gauges.get(SCHEDULE_GAUGE, 0)))
        problems: list[str] = []
        failed = hb.state == "failed" or (track.failed_event_at is not None and track.failed_event_at >= track.seen_at)
        if failed:
            problems.append("failed")
        elif hb.state != "stopped":
            if age > deadline:
                problems.append("dead")
            elif rules.stall_s > 0 and no_progress >= rules.stall_s and now - track.first_seen >= rules.stall_s:
                problems.append("stalled")
            if lag is not None and lag > allowed and "dead" not in problems:
                problems.append("lagging")
        if track.restart_at is not None and now - track.restart_at <= rules.restart_window_s:
            problems.append("restarting")
        problems.sort(key=SEVERITY.__getitem__)
        status: Status
        if problems:
            status = problems[0]  # type: ignore[assignment]
        else:
            status = "stopped" if hb.state == "stopped" else "ok"
        error = hb.last_error or (track.failed_detail if failed else "")
        return ActorHealth(actor_id=hb.actor_id, kind=hb.actor_kind, region=hb.region, state=hb.state, status=status,
                           problems=problems, age_s=round(age, 3), interval_s=round(interval, 3),
                           deadline_s=round(deadline, 3), policy_version=hb.policy_version, lag=lag,
                           lag_allowed=allowed,
                           restarts=hb.restarts, no_progress_s=round(no_progress, 3), counters=dict(hb.counters),
                           gauges=dict(hb.gauges), last_error=error, pid=hb.pid,
                           sessions_open=int(hb.gauges[SESSIONS_GAUGE]) if SESSIONS_GAUGE in hb.gauges else None,
                           tool_ms=tool_latency(hb.gauges))

    def verdicts(self, now: float) -> list[ActorHealth]:
        """Every actor's verdict, problems first (by severity), then by region, kind and id."""
        found = [self.judge(a, now) for a in self.tracks]
        return sorted(found, key=lambda h: (SEVERITY[h.status], h.region, h.kind, h.actor_id))


@dataclass(frozen=True, slots=True)
class RegionHealth:
    """One region's bus: reachable (ping to its URL), JetStream answering, and its stream backlogs."""

    region: str
    url: str | None
    reachable: bool | None
    """None when the region's URL is unknown (only its JetStream domain was asked, through the hub)."""
    rtt_ms: float | None
    jetstream: bool
    tasks_pending: int | None
    """Messages in the region's TASKS work queue (not yet acked by a generator)."""
    tasks_unacked: int | None
    """Tasks handed to generators and not yet acked."""
    rollouts_stored: int | None
    """Messages in the region's own ROLLOUTS stream."""
    error: str = ""

    @property
    def down(self) -> bool:
        """Its server refused a ping, or answered but its JetStream did not (unknown URL: never down)."""
        return self.reachable is False or (self.reachable is True and not self.jetstream)


@dataclass(frozen=True, slots=True)
class BusHealth:
    """Hub-side numbers: the trainer's rollout backlog, dead letters, and every region."""

    regions: list[RegionHealth]
    rollouts_stored: int | None = None
    rollouts_pending: int | None = None
    """Rollouts in the hub's ROLLOUTS not yet delivered to the trainer's durable consumer."""
    rollouts_unacked: int | None = None
    """Rollouts delivered to the trainer and not yet acked (waiting for a checkpoint)."""
    dead_letters: int | None = None
    newest_manifest: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything `rlbus health` knows at one moment; `--json` prints it, Prometheus exports it."""

    run: str
    hub: str
    at: float
    actors: list[ActorHealth]
    bus: BusHealth
    newest_policy_version: int | None

    def counts(self) -> dict[str, int]:
        """Actors per status, plus `regions_down`."""
        out = {status: 0 for status in SEVERITY}
        for actor in self.actors:
            out[actor.status] += 1
        out["regions_down"] = sum(r.down for r in self.bus.regions)
        return out

    @property
    def anything_dead(self) -> bool:
        """True when an actor is dead or a region's bus is down (`--once` then exits 1)."""
        return any(a.status == "dead" for a in self.actors) or any(r.down for r in self.bus.regions)
