"""The chaos run's schedule and its accounting, as pure functions (no bus, no processes, no clock).

Owns: `ChaosSettings` (what `rlbus chaos` was asked for), `plan_faults` (the seeded schedule of actor
SIGKILLs, leaf-server SIGKILLs, partitions, link degradations and pauses over the run; with shaped links the
partitions take turns: a drop-all cut, the link taken down, the relay's connections closed), `pick_victim` (which live actor a
planned fault hits), `FaultRecord` (what happened), `recovery_after` (the first sign of life after a
fault in a time series) and `summarize` (count, median, max of recovery times per fault kind).
Does not: run anything (ops/chaos/run.py) or print (ops/chaos/report.py).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar

FaultKind = Literal["actor_kill", "server_kill", "partition", "pause", "link_drop", "link_down", "link_degrade"]
FAULT_KINDS: Final[tuple[FaultKind, ...]] = ("actor_kill", "server_kill", "partition", "pause", "link_drop",
                                             "link_down", "link_degrade")
LINK_CUTS: Final[tuple[FaultKind, ...]] = ("link_drop", "link_down", "partition")
"""The partition of a leaf behind a shaped link, in turn: every packet dropped, the link down, the relay closed."""
REGION_KINDS: Final = frozenset({"server_kill", "partition", "link_drop", "link_down", "link_degrade"})
"""Faults aimed at a leaf region (the others hit an actor)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    """What a chaos run was asked for. Times in seconds."""

    duration_s: float
    """Length of the fault window (after warm-up); every fault starts and ends inside it."""
    kills: int
    """SIGKILLs in all: actor processes plus leaf servers (`server_kills` of them)."""
    server_kills: int
    """Leaf-region nats-server SIGKILLs (each followed by a restart on its store dir after `outage_s`)."""
    partitions: int
    """Leaf-to-hub link cuts (each healed after `outage_s`)."""
    pauses: int
    """SIGSTOP/SIGCONT of actor processes (each resumed after `pause_s`)."""
    outage_s: float = 30.0
    """How long a killed leaf server stays down, and how long a partition lasts."""
    pause_s: float = 5.0
    """How long a paused actor stays stopped."""
    seed: int = 0
    links: bool = False
    """The leaves sit behind shaped links (topology/network/links.py): partitions cut them in turn (`LINK_CUTS`)."""
    degrades: int = 0
    """Link degradations (needs `links`): `degrade_loss` of the packets dropped and `degrade_spike_s` added to each
    direction for `outage_s`."""
    degrade_loss: float = 0.05
    degrade_spike_s: float = 0.2

    def check(self) -> list[str]:
        """Every problem with these numbers, in words (empty: fine)."""
        problems = []
        if self.duration_s <= 0:
            problems.append(f"the fault window must be positive, got {self.duration_s:g}s")
        for name in ("kills", "server_kills", "partitions", "pauses", "degrades"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.server_kills > self.kills:
            problems.append(f"server kills ({self.server_kills}) are part of the kills ({self.kills}); "
                            f"ask for at least as many kills")
        if self.outage_s <= 0 or self.pause_s <= 0:
            problems.append(f"outage ({self.outage_s:g}s) and pause ({self.pause_s:g}s) must be positive")
        if self.degrades and not self.links:
            problems.append(f"{self.degrades} link degradations need shaped links ([regions.link]) on a host that "
                            f"can make network namespaces")
        if not (0.0 <= self.degrade_loss < 1.0 and self.degrade_spike_s >= 0):
            problems.append(f"degrade loss ({self.degrade_loss:g}) must be a fraction in [0, 1) and the latency "
                            f"spike ({self.degrade_spike_s:g}s) >= 0")
        region_faults = self.server_kills + self.partitions + self.degrades
        if region_faults and self.duration_s / region_faults < self.outage_s * 1.5:
            problems.append(f"{region_faults} server kills, partitions and degradations of {self.outage_s:g}s each do not fit "
                            f"one after another in {self.duration_s:g}s (each needs {self.outage_s * 1.5:g}s); "
                            f"run longer, ask for fewer, or shorten --outage-s")
        return problems


@dataclass(frozen=True, slots=True)
class Fault:
    """One planned fault: at `at_s` into the window, of `kind`, aimed at an actor kind or a leaf region."""

    at_s: float
    kind: FaultKind
    target: str
    """Actor kind (actor_kill, pause) or leaf region (server_kill, partition)."""
    length_s: float = 0.0
    """Outage or pause length; 0 for an actor kill."""
    pick: float = 0.0
    """In [0, 1): which of the live actors of `target` is hit (`pick_victim`)."""


def plan_faults(settings: ChaosSettings, kinds: Sequence[str], leaves: Sequence[str]) -> list[Fault]:
    """The seeded schedule, sorted by time.

    Region faults (server kills, partitions and link degradations alternating, each kind going round the leaves; with
    `links` the partitions take turns over `LINK_CUTS`) get equal slots of the window,
    one after another, each starting at a random point of its slot that lets it end inside the slot, so no
    two overlap. Actor kills and pauses fall uniformly in the window; actor kills cycle through `kinds` in a
    shuffled order per round, so every kind is hit once before any is hit twice.

    :raises ValueError: the settings do not fit (see `ChaosSettings.check`) or region faults without leaves.
    """
    if problems := settings.check():
        raise ValueError("; ".join(problems))
    if not kinds and settings.kills > settings.server_kills:
        raise ValueError("actor kills need at least one actor kind to kill")
    region_kinds: list[FaultKind] = []          # alternating: server kill, partition, server kill, ...
    for i in range(max(settings.server_kills, settings.partitions, settings.degrades)):
        cut: FaultKind = LINK_CUTS[i % len(LINK_CUTS)] if settings.links else "partition"
        region_kinds += (["server_kill"] if i < settings.server_kills else []) + \
                        ([cut] if i < settings.partitions else []) + \
                        (["link_degrade"] if i < settings.degrades else [])
    if region_kinds and not leaves:
        raise ValueError("server kills and partitions need a leaf region; the topology has none")
    rng = random.Random(f"rlbus-chaos:{settings.seed}")
    faults: list[Fault] = []
    cuts = iter(_rounds(rng, list(leaves), settings.partitions))
    targets = {"server_kill": iter(_rounds(rng, list(leaves), settings.server_kills)),
               **dict.fromkeys(LINK_CUTS, cuts),
               "link_degrade": iter(_rounds(rng, list(leaves), settings.degrades))}
    slot = settings.duration_s / len(region_kinds) if region_kinds else 0.0
    for i, kind in enumerate(region_kinds):
        start = i * slot + rng.uniform(0.0, max(0.0, slot - settings.outage_s * 1.25))
        faults.append(Fault(at_s=round(start, 3), kind=kind, target=next(targets[kind]), length_s=settings.outage_s))
    victims = _rounds(rng, list(kinds), settings.kills - settings.server_kills)
    times = sorted(rng.uniform(0.0, settings.duration_s * 0.95) for _ in victims)
    for at, kind in zip(times, victims, strict=True):
        faults.append(Fault(at_s=round(at, 3), kind="actor_kill", target=kind, pick=rng.random()))
    for _ in range(settings.pauses):
        at = rng.uniform(0.0, max(0.0, settings.duration_s - settings.pause_s))
        faults.append(Fault(at_s=round(at, 3), kind="pause", target=rng.choice(list(kinds)),
                            length_s=settings.pause_s, pick=rng.random()))
    return sorted(faults, key=lambda f: (f.at_s, f.kind, f.target))


def _rounds(rng: random.Random, items: list[T], n: int) -> list[T]:
    """`n` items drawn in rounds: each round is a fresh shuffle of `items`."""
    out: list[T] = []
    while len(out) < n and items:
        batch = items[:]
        rng.shuffle(batch)
        out.extend(batch)
    return out[:n]


def pick_victim(fault: Fault, live: Mapping[str, tuple[str, str]], *, exclude_regions: set[str],
                busy: set[str]) -> str | None:
    """The actor a planned actor fault hits: among `live` (actor id → (kind, region)) of the planned kind,
    outside `exclude_regions` (their server is down or cut off) and not `busy` (paused now), the one at
    `fault.pick` of the sorted ids; if none of that kind can be hit, the same among every kind. None: no
    actor can be hit."""
    def candidates(kind: str | None) -> list[str]:
        return sorted(a for a, (k, region) in live.items()
                      if (kind is None or k == kind) and region not in exclude_regions and a not in busy)

    pool = candidates(fault.target) or candidates(None)
    if not pool:
        return None
    return pool[min(len(pool) - 1, int(fault.pick * len(pool)))]


@dataclass(slots=True)
class FaultRecord:
    """One fault as it happened. Times are seconds since the fault window began."""

    kind: FaultKind
    target: str
    """Actor id, or leaf region."""
    at_s: float
    restored_s: float | None = None
    """When the fault was undone: SIGCONT, the server restarted, the link healed (None: a kill, or never)."""
    recovery_s: float | None = None
    """Fault start → the victim heartbeats again (actor kill: a new process; pause: after SIGCONT), or the
    region's rollouts reach the hub again (server kill, partition, link cut or degradation). None: not seen before
    the end."""
    pid: int = 0
    """The victim's process id (actor faults)."""
    note: str = ""

    @property
    def after_restore_s(self) -> float | None:
        """Recovery counted from the moment the fault was undone (server restarted, link healed, SIGCONT)."""
        if self.recovery_s is None or self.restored_s is None:
            return None
        return self.recovery_s - (self.restored_s - self.at_s)

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "target": self.target, "at_s": round(self.at_s, 2),
                "restored_s": _round(self.restored_s), "recovery_s": _round(self.recovery_s),
                "after_restore_s": _round(self.after_restore_s), "pid": self.pid, "note": self.note}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def recovery_after(series: Sequence[tuple[float, int]], since: float, ok: Callable[[int], bool]) -> float | None:
    """The first time in `series` ((time, value) in time order) after `since` whose value passes `ok`."""
    for at, value in series:
        if at > since and ok(value):
            return at
    return None


@dataclass(frozen=True, slots=True)
class RecoveryStats:
    """Recovery times of one fault kind: how many faults, how many recovered, median and max seconds."""

    faults: int
    recovered: int
    median_s: float | None
    max_s: float | None
    times_s: list[float] = field(default_factory=list)
    median_after_restore_s: float | None = None
    """Median counted from when the fault was undone (region faults and pauses; None for kills)."""

    def as_dict(self) -> dict[str, object]:
        return {"faults": self.faults, "recovered": self.recovered, "median_s": _round(self.median_s),
                "max_s": _round(self.max_s), "median_after_restore_s": _round(self.median_after_restore_s)}


def summarize(records: Sequence[FaultRecord]) -> dict[str, RecoveryStats]:
    """Per fault kind (only kinds that happened): counts and recovery median/max."""
    out: dict[str, RecoveryStats] = {}
    for kind in FAULT_KINDS:
        mine = [r for r in records if r.kind == kind]
        if not mine:
            continue
        times = sorted(r.recovery_s for r in mine if r.recovery_s is not None)
        after = [r.after_restore_s for r in mine if r.after_restore_s is not None]
        out[kind] = RecoveryStats(faults=len(mine), recovered=len(times),
                                  median_s=statistics.median(times) if times else None,
                                  max_s=times[-1] if times else None, times_s=times,
                                  median_after_restore_s=statistics.median(after) if after else None)
    return out
