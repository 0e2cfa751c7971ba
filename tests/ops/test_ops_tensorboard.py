"""TensorBoard event files: the sink turns real TrainStep, EvalReport and Heartbeat messages into scalars that
TensorBoard's own reader reads back with the messages' values; `rlbus up --tensorboard DIR` writes them for the
steps the run took (the session's shared finished run, tests/helpers/runs.py); a relative directory lies where
its source says; without the `metrics` extra the run stops with one line naming it, before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import FINISHED_STEPS, FinishedRun, tiny_topology
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlbus.messages.errors import TopologyError
from rlbus.messages.schemas import DroppedRollout, EvalReport, Heartbeat, TrainStep
from rlbus.ops.recording.playback import open_playback
from rlbus.ops.tensorboard import TensorBoardSink, tensorboard_dir
from rlbus.topology.file.load import load


def _read(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})       # 0: keep every point
    acc.Reload()
    return acc


def _points(acc: EventAccumulator, tag: str) -> dict[int, float]:
    """step → value of one scalar tag."""
    return {e.step: e.value for e in acc.Scalars(tag)}


def _f32(value: float) -> float:
    """What an event file holds of `value` (scalars are float32)."""
    return float(np.float32(value))


def test_sink_writes_steps_evals_and_heartbeats_that_tensorboard_reads_back(tmp_path: Path) -> None:
    """Steps keyed by optimizer step, evaluations by policy version, heartbeat counters and gauges by actor at
    their wall time, the generators' throughput at each step, a drop-only record apart from the step's figures;
    a second sink on the same directory (a resumed run) adds a file, and the reader sees both."""
    beat = Heartbeat(actor_id="hub-generator-0", actor_kind="generator", region="hub", state="busy",
                     counters={"tokens": 640, "rollouts": 20}, gauges={"tokens_per_s": 31.5}, restarts=1,
                     sent_at=1_800_000_000.25)
    other = Heartbeat(actor_id="eu-generator-0", actor_kind="generator", region="eu", state="ready",
                      gauges={"tokens_per_s": 8.5}, sent_at=1_800_000_001.5)
    steps = [TrainStep(step=1, policy_version=1, rollout_ids=["a", "b", "c"], loss=0.3125, kl=0.0123,
                       reward_mean=0.25, reward_std=0.5, staleness={"0": 2, "1": 1},
                       dropped=[DroppedRollout(rollout_id="z", reason="stale")], created_at=1_800_000_002.0),
             TrainStep(step=2, policy_version=2, rollout_ids=["d"], loss=-0.75, kl=0.5, reward_mean=1.0,
                       created_at=1_800_000_003.0)]
    unfolded = TrainStep(step=2, policy_version=2, dropped=[DroppedRollout(rollout_id=i, reason="buffer full")
                                                            for i in "xy"], created_at=1_800_000_004.0)
    report = EvalReport(policy_version=2, task_seed=7, n=40, pass_at_1=0.375, ci_low=0.2, ci_high=0.55,
                        created_at=1_800_000_005.0)
    sink = TensorBoardSink(tmp_path / "tb")
    for message in [beat, other, *steps, unfolded, report]:
        sink.write(message)
    sink.close()

    acc = _read(tmp_path / "tb")
    assert _points(acc, "train/loss") == {1: 0.3125, 2: -0.75}
    assert _points(acc, "train/kl") == {1: _f32(0.0123), 2: 0.5}
    assert _points(acc, "train/reward_mean") == {1: 0.25, 2: 1.0}
    assert _points(acc, "train/policy_version") == {1: 1.0, 2: 2.0}
    assert _points(acc, "train/rollouts") == {1: 3.0, 2: 1.0}
    assert _points(acc, "train/dropped") == {1: 1.0, 2: 0.0}
    assert _points(acc, "train/staleness_mean") == {1: _f32(1 / 3), 2: 0.0}
    assert _points(acc, "train/dropped_unfolded") == {2: 2.0}     # not a second loss of 0 at step 2
    assert [e.wall_time for e in acc.Scalars("train/loss")] == [s.created_at for s in steps]
    assert _points(acc, "throughput/generator_tokens_per_s") == {1: 40.0, 2: 40.0}   # both generators' latest
    assert _points(acc, "eval/pass_at_1") == {2: 0.375}
    assert _points(acc, "eval/n") == {2: 40.0}
    assert _points(acc, "health/hub-generator-0/tokens") == {1_800_000_000: 640.0}
    assert _points(acc, "health/hub-generator-0/tokens_per_s") == {1_800_000_000: 31.5}
    assert _points(acc, "health/hub-generator-0/restarts") == {1_800_000_000: 1.0}
    assert [e.wall_time for e in acc.Scalars("health/eu-generator-0/tokens_per_s")] == [other.sent_at]

    resumed = TensorBoardSink(tmp_path / "tb")
    resumed.write(TrainStep(step=3, policy_version=3, rollout_ids=["e"], loss=0.125))
    resumed.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    assert _points(_read(tmp_path / "tb"), "train/loss") == {1: 0.3125, 2: -0.75, 3: 0.125}


def test_each_step_shows_the_mtp_acceptance_of_the_drafts_checked_since_the_step_before(tmp_path: Path) -> None:
    """Pooled over generators from their mtp_drafted / mtp_accepted counters; a restarted generator counts from 0
    again; a step after which nothing was drafted has no point."""
    def beat(actor: str, drafted: int, accepted: int, at: float) -> Heartbeat:
        return Heartbeat(actor_id=actor, actor_kind="generator", region="hub", state="busy", sent_at=at,
                         counters={"mtp_drafted": drafted, "mtp_accepted": accepted})

    def step(n: int) -> TrainStep:
        return TrainStep(step=n, policy_version=n, rollout_ids=[str(n)], created_at=1_800_000_000.0 + 10 * n)

    sink = TensorBoardSink(tmp_path / "tb")
    for message in [beat("g0", 100, 60, 1), beat("g1", 100, 20, 2), step(1),       # (60 + 20) / 200
                    beat("g0", 200, 110, 11), beat("g1", 40, 30, 12), step(2),     # g1 restarted: (50 + 30) / 140
                    step(3)]:
        sink.write(message)
    sink.close()
    assert _points(_read(tmp_path / "tb"), "throughput/mtp_acceptance") == {1: _f32(0.4), 2: _f32(80 / 140)}


def test_a_relative_directory_lies_where_its_source_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tensorboard: against the working directory; `[logging] tensorboard`: against the state directory; the
    flag wins; an absolute one stays; neither: no event files. A key of the wrong type names file and key."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "runs" / "a"
    assert tensorboard_dir(Path("tb"), "metrics", state) == tmp_path / "tb"
    assert tensorboard_dir(None, "metrics", state) == state / "metrics"
    assert tensorboard_dir(None, str(tmp_path / "abs"), state) == tmp_path / "abs"
    assert tensorboard_dir(None, None, state) is None
    path = tiny_topology(tmp_path / "t.toml", evaluator=False)
    path.write_text(path.read_text() + "\n[logging]\ntensorboard = 3\n")
    with pytest.raises(TopologyError, match=r"t\.toml.*logging\.tensorboard"):
        load(path)
    path.write_text(path.read_text().replace("tensorboard = 3", 'tensorboard = "metrics"'))
    assert load(path).logging.tensorboard == "metrics"


BLOCKED = """import sys
sys.modules["tensorboard"] = None        # as if the metrics extra were not installed
from rlbus.ops.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("source", ["flag", "topology"])
def test_without_the_metrics_extra_up_stops_with_one_line_before_anything_starts(tmp_path: Path,
                                                                                  source: str) -> None:
    """TensorBoard output asked for by --tensorboard or by `[logging] tensorboard`, but tensorboard does not
    import: exit 2, one line on stderr naming the extra, and no state directory (no lock, no server, no
    pretraining)."""
    path = tiny_topology(tmp_path / "t.toml", evaluator=False)
    argv = ["up", str(path), "--state-dir", str(tmp_path / "state"), "--steps", "1"]
    if source == "flag":
        argv += ["--tensorboard", str(tmp_path / "tb")]
    else:
        path.write_text(path.read_text() + '\n[logging]\ntensorboard = "tb"\n')
    proc = subprocess.run([sys.executable, "-c", BLOCKED, *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rlbus up:")]   # (others: log lines)
    assert len(lines) == 1 and lines[0].startswith("rlbus up: TensorBoard output needs the tensorboard package")
    assert lines[0].endswith("pip install 'rlbus[metrics]'") and proc.stdout == ""
    assert not (tmp_path / "state").exists() and not (tmp_path / "tb").exists()


PROGRESS_STEP = re.compile(r"^v\d+ +step (\d+) ", re.M)
EVAL_LINE = re.compile(r"^  eval v(\d+): pass@1 ", re.M)


@pytest.mark.slow
def test_up_writes_the_figures_of_the_steps_it_ran(finished_run: FinishedRun) -> None:
    """`rlbus up ... --tensorboard tb` (the shared finished run, from its folder): one event file under `tb`
    beside it holding, for every step and evaluation the run showed, TRAINLOG's and EVALS' own figures (read
    from the run's recording), the generators' throughput at the last step, and heartbeat scalars of every
    actor of the topology."""
    proc = finished_run.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logdir = finished_run.base / "tb"
    assert f"rlbus up: TensorBoard event files in {logdir} " in proc.stdout
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    with open_playback(finished_run.recording) as playback:
        recorded = {m.step: m for m in playback.messages(kinds={"train_step"}) if isinstance(m, TrainStep)
                    and m.rollout_ids}
        reports = {m.policy_version: m for m in playback.messages(kinds={"eval_report"})
                   if isinstance(m, EvalReport)}
    acc = _read(logdir)

    shown = {int(s) for s in PROGRESS_STEP.findall(proc.stdout)}
    assert set(range(1, FINISHED_STEPS + 1)) <= shown
    for tag, figure in [("train/loss", "loss"), ("train/kl", "kl"), ("train/reward_mean", "reward_mean"),
                        ("train/policy_version", "policy_version")]:
        points = _points(acc, tag)
        assert set(points) == shown, tag
        assert points == {s: _f32(getattr(recorded[s], figure)) for s in shown}, tag
    assert _points(acc, "throughput/generator_tokens_per_s")[max(shown)] > 0

    evals = _points(acc, "eval/pass_at_1")
    assert set(evals) == {int(v) for v in EVAL_LINE.findall(proc.stdout)}
    assert evals == {v: _f32(reports[v].pass_at_1) for v in evals}

    health = {tag.split("/")[1] for tag in acc.Tags()["scalars"] if tag.startswith("health/")}
    assert health == {i.actor_id for i in load(finished_run.topology).instances()}
