"""Chaos on agentic episodes: the topology `rlbus chaos --agentic` runs and what it adds to the ledger.

- Owns: `agentic_chaos_topology()`, `AGENTIC_KILL_KINDS`, `is_agentic`, and the agentic figures: `restore_checks`
  (the generators' workspace_restored events), `open_sessions` (the sandboxes' last `sessions_open` gauges),
  `session_roots_left` (on disk) and `agentic_verdict`.
- Guarantee: a run whose verdict is empty left no session open or on disk, restored every workspace it checked
  equal to its snapshot, and restarted only what was killed.
- Does not: inject faults or read the rollout ledger (ops/chaos/run.py), print (ops/chaos/report.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from rlbus.messages.schemas import Event
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load
from rlbus.topology.file.schema import RestartSettings, Topology

AGENTIC_KILL_KINDS: Final = ("generator", "sandbox", "trainer")
"""The actors an agentic chaos run SIGKILLs: the episode's driver, its sessions' holder, and the trainer."""
SESSION_LEASE_S: Final = 15.0
"""`[generator] session_lease_s` of the agentic chaos topology: a killed generator's sessions end this soon."""
RESTORED: Final = "workspace_restored"
"""`Event.data["what"]` of a generator's restore check (actors/generator/agentic.py `_check_restored`)."""


def agentic_chaos_topology() -> Topology:
    """`agentic` on the hub and a leaf `eu` (a generator and a sandbox supervisor each), its episodes scripted
    (`[generator] script = "edits"`: every turn changes the workspace, so every turn is snapshotted and a kill
    mid-episode means a restore), groups of 2, a 4096-token policy pretrained for 10 steps, leases of
    `SESSION_LEASE_S`, what a killed actor held redelivered after 20 s, room for 10 restarts a minute; without the
    example's evaluator (the run proves the ledger and the sessions, not a pass rate)."""
    from rlbus.ops.chaos.run import CHAOS_REDELIVER_AFTER

    agentic, three = load(example_path("agentic")), load(example_path("three_regions"))
    replace = msgspec.structs.replace
    g = agentic.generator
    generator = replace(g, group_size=2, max_tokens=600, concurrent_tasks=2, script="edits",
                        session_lease_s=SESSION_LEASE_S,
                        agentic=replace(g.agentic, max_turns=8, max_tokens=4096))
    leaf = next(r for r in three.regions if r.name == "eu")
    return replace(
        agentic, run="chaos-agentic",
        regions=[*(replace(r, actors=[a for a in r.actors if a.kind != "evaluator"]) for r in agentic.regions), leaf],
        feeder=replace(agentic.feeder, backlog_per_region=4, region_weights={"hub": 1, "eu": 1}),
        generator=generator, trainer=replace(agentic.trainer, batch_rollouts=4),
        pretrain=replace(agentic.pretrain, preset="tiny", steps=10, eval_n=4, max_seq_len=4096, phases=[], demos=None),
        restart=RestartSettings(max_restarts=10, window_s=60.0, backoff_initial_s=0.2, backoff_max_s=2.0),
        durability=replace(agentic.durability, redeliver_after=CHAOS_REDELIVER_AFTER))


def is_agentic(topology: Topology) -> bool:
    """Whether the run's tasks are repository tasks, built-in (any level or split) or from a file (its episodes hold
    sandbox sessions)."""
    from pathlib import Path

    from rlbus.model.tasks.sources import is_repo_file, is_repo_source, split_source

    tasks = topology.feeder.tasks
    path = Path(split_source(tasks)[0])
    return is_repo_source(tasks) or (path.is_file() and is_repo_file(path))


def restore_checks(events: Iterable[Event]) -> tuple[int, int]:
    """(restored sessions checked, those whose digest equalled the snapshotted workspace's) from the events."""
    checked = equal = 0
    for event in events:
        if event.data.get("what") == RESTORED:
            checked += 1
            equal += event.data.get("equal") == "true"
    return checked, equal


def open_sessions(gauges: Mapping[str, Mapping[str, float]], sandboxes: Iterable[str]) -> int:
    """Sessions the sandbox supervisors `sandboxes` hold, by their last heartbeat's `sessions_open` gauge."""
    return sum(int(gauges.get(actor, {}).get("sessions_open", 0)) for actor in sandboxes)


def session_roots_left(pids: Iterable[int], scratch: str | None = None) -> list[str]:
    """Session roots (actors/sandbox/sessions.py `ROOT_PREFIX`) still on disk that processes `pids` made."""
    from rlbus.actors.sandbox.sessions import ROOT_PREFIX, scratch_dir

    where = Path(scratch or scratch_dir())
    prefixes = tuple(f"{ROOT_PREFIX}{pid}-" for pid in set(pids))
    if not prefixes:
        return []
    try:
        return sorted(str(where / name) for name in os.listdir(where) if name.startswith(prefixes))
    except OSError:
        return []


def agentic_verdict(figures: Mapping[str, Any]) -> list[str]:
    """What is wrong with an agentic run's figures, in words (empty: clean)."""
    wrong = []
    if figures["sessions_open"]:
        wrong.append(f"{figures['sessions_open']} sessions still open")
    if figures["session_roots_left"]:
        wrong.append(f"{len(figures['session_roots_left'])} session roots left on disk")
    if figures["restores_equal"] != figures["restores_checked"]:
        wrong.append(f"{figures['restores_checked'] - figures['restores_equal']} restored workspaces differ from "
                     f"their snapshot")
    if figures["unplanned_restarts"]:
        wrong.append(f"{figures['unplanned_restarts']} restarts of actors nobody killed")
    return wrong


def kill_kinds(topology: Topology, kinds: Sequence[str]) -> list[str]:
    """The kinds of `kinds` the topology runs (an agentic run kills only these)."""
    present = {i.kind for i in topology.instances()}
    return [k for k in kinds if k in present]
