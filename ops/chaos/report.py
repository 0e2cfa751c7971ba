"""The closing report of `rlbus chaos`: the ledger, faults, restarts and recovery times as a text table.

Owns: `table(result)` (the human summary of the dict ops/chaos/run.py returns; `--json` prints the dict
itself) and `exit_code(result)` (1 when a rollout was lost or trained twice, or a fed task was lost; in an agentic
run also when a session was left open, a restored workspace differed from its snapshot or an actor nobody killed
restarted). Does not: measure anything.
"""

from __future__ import annotations

from typing import Any

_KIND_WORDS = {"actor_kill": "actor SIGKILL", "server_kill": "leaf server SIGKILL", "partition": "partition",
               "pause": "pause (SIGSTOP)", "link_drop": "link drops all", "link_down": "link down",
               "link_degrade": "link degraded"}


def exit_code(result: dict[str, Any]) -> int:
    """0 when nothing was lost (no rollout, no fed task), nothing trained twice and (agentic runs) nothing is wrong
    with the sessions, restores and restarts; else 1."""
    agentic = result.get("agentic") or {}
    return 1 if result["lost"] or result["duplicated"] or result.get("tasks_lost") or agentic.get("wrong") else 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def table(result: dict[str, Any]) -> str:
    """The summary printed at the end of a chaos run."""
    r = result
    verdict = "CLEAN" if exit_code(r) == 0 else "NOT CLEAN"
    by_region = ", ".join(f"{k} {n}" for k, n in sorted(r["produced_by_region"].items()))
    dropped = ", ".join(f"{k} {n}" for k, n in sorted(r["dropped"].items())) or "none"
    killed = ", ".join(f"{k} {n}" for k, n in sorted(r["killed_kinds"].items())) or "none"
    lines = [
        (f"rlbus chaos: {verdict} — run {r['run']!r}, {r['window_s']:.0f}s of faults, {r['wall_s']:.0f}s in all "
         f"(seed {r['seed']})"),
        (f"  faults      kills {r['kills']} (asked {r['kills_requested']}: actors {r['actor_kills']}, leaf servers "
         f"{r['server_kills']}), partitions {r['partitions']}, pauses {r['pauses']}"
         + (f", link cuts {r['link_cuts']}, link degradations {r['link_degrades']}" if r.get("links") else "")),
        f"  killed      {killed}",
        f"  rollouts    produced {r['produced']} ({by_region}), trained {r['trained']} in {r['steps']} steps",
        (f"  ledger      lost {r['lost']}, trained twice {r['duplicated']}, pending {r['pending']}, "
         f"stranded in a leaf {r['stranded']}, abandoned steps {r['abandoned_steps']}"),
        f"  dropped     {dropped}",
        (f"  tasks       fed {r.get('tasks_fed', 0)}: rolled out {r.get('tasks_rolled_out', 0)}, dead-lettered "
         f"{r.get('tasks_dead_lettered', 0)}, pending {r.get('tasks_pending', 0)}, lost {r.get('tasks_lost', 0)}"),
    ]
    for reason, n in r["drop_reasons"].items():
        lines.append(f"                {n:4d} x {reason}")
    if a := r.get("agentic"):
        lines.append(f"  agentic     sessions opened {a['sessions_opened']}, open at the end {a['sessions_open']}, "
                     f"roots left on disk {len(a['session_roots_left'])}; restored workspaces equal to their "
                     f"snapshot {a['restores_equal']}/{a['restores_checked']}; sandbox_error drops "
                     f"{a['sandbox_errors']}; unplanned restarts {a['unplanned_restarts']}")
        for wrong in a["wrong"]:
            lines.append(f"  WRONG       {wrong}")
    lines.append(f"  restarts    {r['restarts']}" + (
        " (" + ", ".join(f"{a} {n}" for a, n in r["restarts_by_actor"].items()) + ")" if r["restarts_by_actor"] else ""))
    if r["unplanned_restarts"]:
        lines.append("  unplanned   restarts not caused by a kill: " + ", ".join(
            f"{a} {n}" for a, n in r["unplanned_restarts"].items()) + " (see <state>/logs/<actor>.log)")
    if r["failed_actors"]:
        lines.append(f"  FAILED      {', '.join(r['failed_actors'])} (restart policy exhausted)")
    lines.append("  recovery    time from the fault until the victim heartbeats again / its region's rollouts reach "
                 "the hub again")
    for kind, stats in r["recovery"].items():
        after = stats.get("median_after_restore_s")
        lines.append(f"    {_KIND_WORDS.get(kind, kind):22s} {stats['recovered']}/{stats['faults']} recovered, "
                     f"median {_seconds(stats['median_s'])}, max {_seconds(stats['max_s'])}"
                     + ("" if after is None else f" (median {_seconds(after)} after it was undone)"))
    if not r["caught_up"]:
        lines.append("  note        the trainer had not caught up when the quiet period ended: pending counts what "
                     "was still on its way")
    for note in r["skipped"]:
        lines.append(f"  skipped     {note}")
    if r["lost_ids"]:
        lines.append(f"  lost ids    {', '.join(r['lost_ids'][:10])}")
    if r.get("tasks_lost_ids"):
        lines.append(f"  lost tasks  {', '.join(r['tasks_lost_ids'][:10])}")
    if r["duplicated_ids"]:
        lines.append(f"  twice ids   {', '.join(r['duplicated_ids'][:10])}")
    return "\n".join(lines)
