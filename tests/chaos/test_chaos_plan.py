"""The chaos schedule and its accounting, as pure functions: counts, rounds over kinds and leaves, region faults
that never overlap, victims outside faulted regions, recovery read off a time series, and the stats."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from rlbus.ops.chaos.plan import (
    ChaosSettings,
    Fault,
    FaultRecord,
    pick_victim,
    plan_faults,
    recovery_after,
    summarize,
)
from rlbus.ops.chaos.report import exit_code

KINDS = ["checkpointer", "evaluator", "feeder", "generator", "publisher", "sandbox", "trainer"]


def test_plan_has_the_asked_counts_and_hits_every_kind_before_any_twice() -> None:
    """50 kills (3 of them leaf servers), 3 partitions, 10 pauses over 10 minutes: 47 actor kills spread 7,7,7,7,7,6,6
    over the kinds, every fault inside the window, sorted by time, the same plan for the same seed."""
    settings = ChaosSettings(duration_s=600, kills=50, server_kills=3, partitions=3, pauses=10, seed=7)
    plan = plan_faults(settings, KINDS, ["eu", "us"])
    assert Counter(f.kind for f in plan) == {"actor_kill": 47, "server_kill": 3, "partition": 3, "pause": 10}
    assert sorted(Counter(f.target for f in plan if f.kind == "actor_kill").values()) == [6, 6, 7, 7, 7, 7, 7]
    first_round = [f.target for f in sorted(plan, key=lambda f: f.at_s) if f.kind == "actor_kill"]
    assert all(0 <= f.at_s and f.at_s + f.length_s <= 600 for f in plan)
    assert [f.at_s for f in plan] == sorted(f.at_s for f in plan)
    assert plan == plan_faults(settings, KINDS, ["eu", "us"])
    assert sorted(first_round[:7]) == KINDS


def test_region_faults_alternate_take_turns_over_leaves_and_never_overlap() -> None:
    """4 server kills and 4 partitions of 30 s in 8 minutes: kill, cut, kill, cut...; each kind visits both leaves
    twice; each fault ends before the next begins."""
    settings = ChaosSettings(duration_s=480, kills=4, server_kills=4, partitions=4, pauses=0, outage_s=30, seed=3)
    region = [f for f in plan_faults(settings, KINDS, ["eu", "us"]) if f.kind in ("server_kill", "partition")]
    assert [f.kind for f in region] == ["server_kill", "partition"] * 4
    assert Counter((f.kind, f.target) for f in region) == {(k, leaf): 2 for k in ("server_kill", "partition")
                                                           for leaf in ("eu", "us")}
    assert all(a.at_s + a.length_s < b.at_s for a, b in itertools.pairwise(region))


def test_behind_shaped_links_partitions_take_turns_and_degradations_join_the_region_faults() -> None:
    """With links, 3 partitions of 30 s are a drop-all cut, a link taken down and a relay cut; 2 degradations go
    round the leaves; with a server kill, every region fault ends before the next begins."""
    settings = ChaosSettings(duration_s=600, kills=1, server_kills=1, partitions=3, pauses=0, outage_s=30, seed=5,
                             links=True, degrades=2)
    region = [f for f in plan_faults(settings, KINDS, ["eu", "us"]) if f.kind != "actor_kill"]
    assert [f.kind for f in region] == ["server_kill", "link_drop", "link_degrade", "link_down", "link_degrade",
                                        "partition"]
    assert sorted(f.target for f in region if f.kind == "link_degrade") == ["eu", "us"]
    assert all(a.at_s + a.length_s < b.at_s for a, b in itertools.pairwise(region))


@pytest.mark.parametrize(("settings", "words"), [
    (ChaosSettings(duration_s=60, kills=2, server_kills=2, partitions=2, pauses=0, outage_s=30),
     "do not fit one after another in 60s"),
    (ChaosSettings(duration_s=600, kills=0, server_kills=0, partitions=0, pauses=0, degrades=1),
     "degradations need shaped links"),
    (ChaosSettings(duration_s=60, kills=1, server_kills=2, partitions=0, pauses=0), "ask for at least as many kills"),
])
def test_settings_that_cannot_work_are_refused_with_the_reason(settings: ChaosSettings, words: str) -> None:
    """Too many outages for the window, or more server kills than kills: a ValueError saying so."""
    with pytest.raises(ValueError, match=words):
        plan_faults(settings, KINDS, ["eu"])


def test_victims_skip_faulted_regions_and_paused_actors_and_fall_back_to_any_kind() -> None:
    """pick 0.99 of the two live generators outside 'us' picks the last one; with no generator left, another kind."""
    live = {"eu-generator-0": ("generator", "eu"), "hub-generator-0": ("generator", "hub"),
            "us-generator-0": ("generator", "us"), "hub-trainer-0": ("trainer", "hub")}
    fault = Fault(at_s=1.0, kind="actor_kill", target="generator", pick=0.99)
    assert pick_victim(fault, live, exclude_regions={"us"}, busy=set()) == "hub-generator-0"
    assert pick_victim(fault, live, exclude_regions={"us"}, busy={"hub-generator-0"}) == "eu-generator-0"
    assert pick_victim(fault, live, exclude_regions={"us", "eu"}, busy={"hub-generator-0"}) == "hub-trainer-0"
    assert pick_victim(fault, {}, exclude_regions=set(), busy=set()) is None


def test_recovery_is_the_first_matching_sign_after_the_fault_and_stats_are_per_kind() -> None:
    """Heartbeats (t, pid): killed pid 7 at t=10, the old pid's late beat at 10.5 does not count, pid 9 at 14 does;
    stats: median of 4 and 8 is 6, max 8, one unrecovered partition, a server back 3.5 s after its restart."""
    beats = [(9.0, 7), (10.5, 7), (14.0, 9), (15.0, 9)]
    assert recovery_after(beats, 10.0, lambda pid: pid != 7) == 14.0
    assert recovery_after(beats, 15.0, lambda pid: True) is None
    records = [FaultRecord("actor_kill", "a", 0.0, recovery_s=4.0), FaultRecord("actor_kill", "b", 1.0, recovery_s=8.0),
               FaultRecord("partition", "eu", 2.0, restored_s=32.0),
               FaultRecord("server_kill", "us", 40.0, restored_s=70.0, recovery_s=33.5)]
    stats = summarize(records)
    assert stats["actor_kill"].as_dict() == {"faults": 2, "recovered": 2, "median_s": 6.0, "max_s": 8.0,
                                             "median_after_restore_s": None}
    assert stats["partition"].as_dict() == {"faults": 1, "recovered": 0, "median_s": None, "max_s": None,
                                            "median_after_restore_s": None}
    assert stats["server_kill"].median_after_restore_s == 3.5     # down 30 s, rollouts back 3.5 s after the restart
    assert set(stats) == {"actor_kill", "partition", "server_kill"}


def test_exit_code_is_one_only_for_a_lost_or_twice_trained_rollout_or_a_lost_task() -> None:
    """Pending or dropped rollouts and pending tasks are not failures; one lost or one trained twice is, and so is
    one lost fed task."""
    assert exit_code({"lost": 0, "duplicated": 0, "pending": 3}) == 0
    assert exit_code({"lost": 1, "duplicated": 0}) == 1
    assert exit_code({"lost": 0, "duplicated": 2}) == 1
    assert exit_code({"lost": 0, "duplicated": 0, "tasks_lost": 1}) == 1
    assert exit_code({"lost": 0, "duplicated": 0, "tasks_lost": 0, "tasks_pending": 4}) == 0
