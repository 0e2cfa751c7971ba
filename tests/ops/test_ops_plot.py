"""`rlbus plot`: the per-version series on hand-made data, and PNGs written for a full recording and for an
empty one (which says "no data" instead of failing)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from helpers.ops import run_cli

from rlbus.actors.common.agentic_eval import EpisodeResult
from rlbus.actors.common.eval_report import episodes_report
from rlbus.messages.schemas import (
    DroppedRollout,
    EvalReport,
    Message,
    Rollout,
    SandboxVerdict,
    TensorBlob,
    TrainStep,
    WeightManifest,
)
from rlbus.ops.recording.format import RecordingWriter
from rlbus.ops.recording.plotting import (
    PLOTS,
    PlotData,
    RolloutPoint,
    accuracy_cost_series,
    generation_lag,
    group_stats,
    mean_staleness,
    pass_at_k_series,
    throughput_series,
)
from rlbus.ops.recording.recorder import versions_of

PNG = b"\x89PNG\r\n\x1a\n"


def test_series_by_hand() -> None:
    """Group mean/std, staleness histogram mean, generation lag and per-version throughput on small inputs."""
    assert group_stats([1, 0, 1], [2.0, 5.0, 4.0]) == ([0, 1], [5.0, 3.0], [0.0, 1.0], [1, 2])
    assert mean_staleness({"0": 2, "3": 2}) == 1.5 and mean_staleness({}) is None
    points = [RolloutPoint(time=t, vmin=vmin, vmax=vmax, reward=0.0, graded=False, passed=False, tokens=10)
              for t, vmin, vmax in ((1.0, 0, 0), (3.0, 0, 1), (5.0, 1, 1), (6.0, 1, 2))]
    data = PlotData(rollouts=points, manifests=[(2.0, 1), (5.5, 2)])
    assert generation_lag(data) == [(1, 1), (1, 0), (2, 1)]       # t=1 precedes every manifest
    per_version = throughput_series(data)["per_version"]
    assert per_version == ([1], [2 / 2.0], [20 / 2.0])            # v1: t=3 and t=5 → 2 rollouts in 2 s


def _write(path: Path, messages: list[tuple[str, Message, float]]) -> None:
    enc = msgspec.msgpack.Encoder()
    with RecordingWriter(path, run="plotrun") as w:
        for seq, (stream, m, at) in enumerate(messages, 1):
            w.add(stream, seq, at, "subject", enc.encode(m), kind=str(type(m).__struct_config__.tag),
                  versions=versions_of(m))


def _full() -> list[tuple[str, Message, float]]:
    out: list[tuple[str, Message, float]] = []
    t = 1000.0
    for v in range(4):
        out.append(("WEIGHTS", WeightManifest(version=v), t))
        for i in range(12):
            t += 0.1
            out.append(("ROLLOUTS", Rollout(
                rollout_id=f"r{v}-{i}", task_id=f"t{i}", group_index=0, group_size=1,
                prompt_tokens=TensorBlob.of([1], "int32"), completion_tokens=TensorBlob.of([2] * 8, "int32"),
                behaviour_logprobs=TensorBlob.of([-1.0] * 8, "float32"),
                policy_versions=TensorBlob.of([max(0, v - i % 2)] * 4 + [v] * 4, "int32"), reward=(i % 3) / 2,
                verdict=SandboxVerdict(passed=i % 2, total=1, status="ok")), t))
        out.append(("TRAINLOG", TrainStep(step=v, policy_version=v + 1, kl=0.01 * v, loss=1 / (v + 1),
                                          reward_mean=0.5, staleness={"0": 8, "1": 4},
                                          dropped=[DroppedRollout(rollout_id="x", reason="stale")]), t))
        out.append(("EVALS", EvalReport(policy_version=v, task_seed=1, n=20, pass_at_1=0.1 * v, ci_low=0.0,
                                        ci_high=0.2 * v + 0.1), t))
    return out


@pytest.mark.parametrize("content", ["full", "empty"])
def test_plot_writes_every_png(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Six non-trivial PNGs for a recording with every kind, and for an empty one (each says no data)."""
    path = tmp_path / f"{content}.rlrec"
    _write(path, _full() if content == "full" else [])
    out = tmp_path / "plots"
    assert run_cli(["plot", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"{name}.png") for name in PLOTS]
    for name in PLOTS:
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 5000, name


def _episode(task: str, level: int, passed: bool, tokens: int) -> EpisodeResult:
    return EpisodeResult(task, level, passed, float(passed), turns=2, ended="submit", tool_calls=1,
                         policy_tokens=tokens, wall_s=1.0)


def test_accuracy_against_cost_per_evaluated_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """EvalReports of agentic episodes (as the evaluator scores them: greedy, two samples per task) give one
    point per version at its policy tokens per task, and its pass@k at k sampled episodes' tokens; reports of
    function-writing tasks give none. `rlbus plot` writes accuracy_cost.png from such a recording; with no
    agentic report it says so instead."""
    reports = []
    for v, tokens in ((0, 40), (4, 30)):
        greedy = [_episode("a", 1, v > 0, tokens), _episode("b", 2, False, tokens + 20)]
        sampled = [_episode(t, lv, p, tokens) for t, lv, p in
                   (("a", 1, True), ("a", 1, False), ("b", 2, False), ("b", 2, v > 0))]
        reports.append(episodes_report(v, 1, "repo", greedy, sampled, 2))
    function = EvalReport(policy_version=2, task_seed=1, n=20, pass_at_1=0.5, ci_low=0.3, ci_high=0.7)
    series = accuracy_cost_series(PlotData(evals=[*reports, function]))
    assert list(series) == [0, 4]
    assert series[0]["greedy"][:2] == (50.0, 0.0) and series[4]["greedy"][:2] == (40.0, 0.5)
    ks, xs, ps, _, _ = series[4]["sampled"]
    assert (ks, xs) == ([1, 2], [30.0, 60.0]) and ps == [0.5, 1.0]
    for content, messages in (("agentic", [("EVALS", r, 1000.0 + i) for i, r in enumerate(reports)]),
                              ("function", [("EVALS", function, 1000.0)])):
        path = tmp_path / f"{content}.rlrec"
        _write(path, messages)
        out = tmp_path / content
        assert run_cli(["plot", str(path), "-o", str(out)]) == 0
        assert str(out / "accuracy_cost.png") in capsys.readouterr().out.split()
        data = (out / "accuracy_cost.png").read_bytes()
        assert data[:8] == PNG and len(data) > 5000
    assert (tmp_path / "agentic" / "accuracy_cost.png").read_bytes() != data


def _reports(versions: list[int], samples: int) -> list[EvalReport]:
    """Agentic reports as the evaluator scores them: three tasks, greedy and `samples` sampled episodes each; the
    later the version, the more pass."""
    out = []
    for v in versions:
        greedy = [_episode(t, 1, i < v // 10, 30) for i, t in enumerate("abc")]
        sampled = [_episode(t, 1, (i + j) % 3 < v // 10, 30) for i, t in enumerate("abc") for j in range(samples)]
        out.append(episodes_report(v, 1, "repo", greedy, sampled if samples else [], samples))
    return out


def test_pass_at_k_curves_over_a_run(tmp_path: Path) -> None:
    """What `rlbus up` draws beside progress.png: pass_at_k.png holds, per evaluated version, greedy pass@1, mean@4
    and pass@k for k = 2..4 with their intervals, the final weights apart; greedy-only reports (single-turn runs)
    give no pass_at_k.png, and progress.png as before."""
    from rlbus.ops.final_eval import FinalEval
    from rlbus.ops.runview import RunView, write_png
    from rlbus.ops.up import closing_plots

    evals = _reports([0, 10, 20], 4)
    (final,) = _reports([30], 4)
    view = RunView(evals={r.policy_version: r for r in evals},
                   final=FinalEval(step=30, policy_version=30, result=None, report=final))  # type: ignore[arg-type]
    series = pass_at_k_series(PlotData(evals=evals, final=final))
    assert set(series) == {"evals", "final"} and set(series["evals"]["pass@k"]) == {2, 3, 4}
    vs, p, lo, hi = series["evals"]["pass@k"][4]
    assert vs == [0, 10, 20] and p == [r.pass_at_k["4"] for r in evals] == [0.0, 1.0, 1.0]
    assert [lo[1], hi[1]] == evals[1].pass_at_k_ci95["4"]
    assert series["evals"]["pass@1"][:2] == ([0, 10, 20], [0.0, 1 / 3, 2 / 3])
    assert series["evals"]["mean@k"][1] == [0.0, 1 / 3, 2 / 3] and series["final"]["pass@1"][:2] == ([30], [1.0])
    plots = closing_plots(view, evals[0], tmp_path, run="r")
    assert plots == {"accuracy against cost": tmp_path / "accuracy_cost.png",
                     "pass@1 and pass@k per version": tmp_path / "pass_at_k.png"}
    drawn = (tmp_path / "pass_at_k.png").read_bytes()
    assert drawn[:8] == PNG and len(drawn) > 5000

    greedy = [EvalReport(policy_version=v, task_seed=1, n=20, pass_at_1=0.1, ci_low=0.0, ci_high=0.3) for v in (0, 5)]
    view = RunView(evals={r.policy_version: r for r in greedy})
    assert pass_at_k_series(PlotData(evals=greedy)) == {"evals": {"pass@1": ([0, 5], [0.1, 0.1], [0.0, 0.0],
                                                                               [0.3, 0.3])}}
    assert closing_plots(view, None, tmp_path / "greedy", run="r") == {}
    assert not (tmp_path / "greedy").exists()
    assert write_png(view, tmp_path / "greedy" / "progress.png").read_bytes()[:8] == PNG
