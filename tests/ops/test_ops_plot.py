"""`rlbus plot`: the per-version series on hand-made data, and PNGs written for a full recording and for an
empty one (which says "no data" instead of failing)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from helpers.ops import run_cli

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
    generation_lag,
    group_stats,
    mean_staleness,
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
    """Five non-trivial PNGs for a recording with every kind, and for an empty one (each says no data)."""
    path = tmp_path / f"{content}.rlrec"
    _write(path, _full() if content == "full" else [])
    out = tmp_path / "plots"
    assert run_cli(["plot", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"{name}.png") for name in PLOTS]
    for name in PLOTS:
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 5000, name
