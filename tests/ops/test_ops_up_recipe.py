"""`rlbus up`'s recipe before RL: the pretraining phases before the demonstrations, the scripted expert's
demonstrations on the training split (a real sandbox), the SFT phase on them, in that order on a fresh state
directory; a second start on that directory reuses the base, and a fresh directory beside it takes it from the
cache. `--for`'s clock counts the run's seconds only while no evaluator is evaluating."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Final

import msgspec
import pytest

from rlbus.actors.common.config import FeederConfig
from rlbus.messages.schemas import Heartbeat
from rlbus.model.tasks.changes import split_of
from rlbus.ops.up import (
    RECIPE_LOG,
    RunClock,
    _ensure_pretrained,
    evaluating,
    feed_exhausted_line,
    read_stages,
)
from rlbus.topology.examples import __file__ as examples_init
from rlbus.topology.file.load import validate_text

RECIPE: Final = """
[[pretrain.phases]]
name = "main"
steps = 2
batch_size = 2

[[pretrain.phases]]
name = "long"
kind = "long_context"
steps = 1
seq_len = 2048
batch_size = 1
data = "{repos}"

[[pretrain.phases]]
name = "sft"
kind = "sft"
data = "demos"
steps = 1
batch_size = 1

[pretrain.demos]
source = "repo:1:train"
n = 1
summary_at = 0

[generator.agentic]
observation_chars = 200
"""
"""Tiny sizes of the recipe: two main steps at 128 tokens, one long-context step to 2048, one demonstration (its
tool results cut at 200 characters, as the generator's episodes are), one SFT step."""


def _repos(root: Path) -> Path:
    for name in ("alpha", "beta", "gamma"):
        (root / name).mkdir(parents=True)
        (root / name / "core.py").write_text("".join(f"def {name}_{i}(x):\n    return x + {i}\n\n\n"
                                                      for i in range(120)))
    return root


def test_the_recipe_runs_phases_demonstrations_and_sft_in_order_then_reuses_the_base(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fresh: phases main and long, then one demonstration of a training-split task that passed its hidden tests,
    then the phases again with the SFT phase trained on that file; the base lists all three phases. Again on the
    same directory: the base is found there (no stage runs); on a fresh one beside it: taken from the cache."""
    tiny = (Path(examples_init).parent / "tiny.toml").read_text().replace("steps = 30\n", "").replace(
        "eval_n = 8", "eval_n = 1\nmax_seq_len = 128")
    topology, problems = validate_text(tiny + RECIPE.format(repos=_repos(tmp_path / "repos")))
    assert topology is not None, problems
    state = tmp_path / "runs" / "a"
    state.mkdir(parents=True)
    assert _ensure_pretrained(topology, state) is not None
    stages = read_stages(state)
    assert [(s["stage"], [p["name"] for p in s.get("phases", [])]) for s in stages] == [
        ("phases", ["main", "long"]), ("demos", []), ("phases", ["main", "long", "sft"])], stages
    demos = stages[1]
    assert demos["demos"] == 1 and demos["attempted"] >= 1 and demos["rows"] == 1, demos
    rows = [json.loads(line) for line in Path(demos["path"]).read_text().splitlines()]
    assert Path(demos["path"]).parent == state / "demos" and rows[0]["meta"]["grade"] == "passed"
    assert rows[0]["task_id"].startswith("repo-L1") and [m["role"] for m in rows[0]["messages"]][:2] == [
        "user", "assistant"]
    results = [m["content"] for m in rows[0]["messages"] if m["role"] == "tool"]
    assert any("[output truncated:" in r for r in results), results            # the generator's budgets
    assert all(len(r.split("\n[output truncated:")[0]) <= 200 for r in results)
    sft = stages[2]["phases"][2]
    assert sft["kind"] == "sft" and sft["data"] == demos["path"] and sft["conversations"] == 1, sft
    base = json.loads((state / "pretrained" / "pretrain.json").read_text())
    assert [p["name"] for p in base["phases"]] == ["main", "long", "sft"] and base["final"]
    capsys.readouterr()

    _ensure_pretrained(topology, state)
    assert "pretrained policy found" in capsys.readouterr().out
    assert read_stages(state)[3:] == [{**read_stages(state)[3], "stage": "base", "found": "state"}]
    other = tmp_path / "runs" / "b"
    other.mkdir()
    _ensure_pretrained(topology, other)
    assert "reusing pretrained base" in capsys.readouterr().out
    assert [s["stage"] for s in read_stages(other)] == ["base"] and read_stages(other)[0]["found"] == "cache"
    assert not (other / "demos").exists() and (other / RECIPE_LOG).is_file()


def test_the_demonstrations_are_drawn_from_training_functions_only() -> None:
    """The tasks the recipe's demonstrations draw (`repo:1:train`) change functions of the training split."""
    from rlbus.ops.tasks_demos import training_tasks

    tasks = training_tasks("repo:1:train", 1, 6)
    assert tasks and all(split_of(t.function) == "train" for t in tasks)


def test_for_counts_the_run_only_while_no_evaluator_evaluates() -> None:
    """Seconds after a look that saw an evaluator busy are not counted; the limit is reached on counted seconds
    alone, and a busy heartbeat older than the freshness window does not stop the clock."""
    clock = RunClock(10.0)
    assert not clock.tick(0.0, False)
    assert not clock.tick(4.0, True)             # 0-4 counted
    assert not clock.tick(30.0, False)           # 4-30 evaluating
    assert not clock.tick(35.0, False)           # 30-35 counted: 9 of 10
    assert clock.tick(36.0, True)
    assert (clock.counted, clock.evaluating, clock.wall) == (10.0, 26.0, 36.0)
    assert not RunClock(None).tick(0.0, False)
    busy = Heartbeat(actor_id="hub-evaluator-0", actor_kind="evaluator", region="hub", state="busy", sent_at=100.0)
    ready = Heartbeat(actor_id="hub-trainer-0", actor_kind="trainer", region="hub", state="busy", sent_at=100.0)
    assert evaluating({"e": busy, "t": ready}, 101.0)
    assert not evaluating({"t": ready}, 101.0)
    assert not evaluating({"e": busy}, 200.0)


def test_up_says_when_the_feeder_has_fed_all_tasks_of_its_source() -> None:
    """The console line comes from a feeder's heartbeat gauge `exhausted` and names the count and the source."""
    topology = SimpleNamespace(feeder=FeederConfig(tasks_file="made.jsonl", epochs=2))
    feeding = Heartbeat(actor_id="hub-feeder-0", actor_kind="feeder", region="hub", state="ready",
                        gauges={"position": 5.0})
    other = Heartbeat(actor_id="hub-trainer-0", actor_kind="trainer", region="hub", state="busy",
                      gauges={"exhausted": 1.0})
    assert feed_exhausted_line({"f": feeding, "t": other}, topology) is None
    done = msgspec.structs.replace(feeding, gauges={"exhausted": 140.0})
    line = feed_exhausted_line({"f": done, "t": other}, topology)
    assert line == ("rlbus up: the feeder fed all 140 tasks of made.jsonl; no more follow: RL idles once they "
                    "are trained (feeder.epochs, feeder.max_tasks)")
