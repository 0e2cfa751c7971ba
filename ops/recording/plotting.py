"""Per-version curves of a recording and their PNGs: reward, pass rate, KL, staleness, throughput, held-out
accuracy against cost, and held-out pass@1, mean@K and pass@k.

Owns: `collect()` (what the plots need from a recording's entries), the per-version series as pure
functions over that data (each documented with its formula), and `render_all()` (one PNG per series
with matplotlib's Agg backend; a series with no data becomes a PNG that says so).
Does not: read files or the bus (ops/recording/plot.py does).

The version of a rollout is the newest policy version among its tokens (`max(policy_versions)`): the
weights that finished it. A rollout is "passed" when its sandbox verdict passed every test (total > 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.messages.schemas import EvalReport, Rollout, TrainStep, WeightManifest
from rlbus.ops.recording.playback import Entry


@dataclass(frozen=True, slots=True)
class RolloutPoint:
    """What the plots use of one rollout."""

    time: float
    vmin: int
    vmax: int
    reward: float
    graded: bool
    passed: bool
    tokens: int


@dataclass(slots=True)
class PlotData:
    run: str = ""
    rollouts: list[RolloutPoint] = field(default_factory=list)
    steps: list[TrainStep] = field(default_factory=list)
    evals: list[EvalReport] = field(default_factory=list)
    manifests: list[tuple[float, int]] = field(default_factory=list)
    """(recorded time, version) of every WeightManifest."""
    base: EvalReport | None = None
    """The starting policy scored at the end of a run, apart from the evaluator's reports (`rlbus up`'s closing
    evaluations; a recording has none)."""
    final: EvalReport | None = None
    """The final checkpoint scored after the run (`rlbus up`'s closing evaluation; a recording has none)."""


def collect(entries: Iterable[Entry], run: str = "") -> PlotData:
    """One pass over a recording's entries (time order) into `PlotData`."""
    data = PlotData(run=run)
    for e in entries:
        m = e.message
        if isinstance(m, Rollout):
            versions = m.policy_versions.numpy() if len(m.policy_versions.data) else None
            vmin = int(versions.min()) if versions is not None else 0
            vmax = int(versions.max()) if versions is not None else 0
            graded = m.verdict.total > 0
            data.rollouts.append(RolloutPoint(e.time, vmin, vmax, m.reward, graded,
                                              graded and m.verdict.passed == m.verdict.total,
                                              len(m.completion_tokens)))
        elif isinstance(m, TrainStep):
            data.steps.append(m)
        elif isinstance(m, EvalReport):
            data.evals.append(m)
        elif isinstance(m, WeightManifest):
            data.manifests.append((e.time, m.version))
    return data


def group_stats(keys: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float], list[float], list[int]]:
    """Per distinct key (sorted): mean, population std and count of its values."""
    groups: dict[int, list[float]] = {}
    for k, v in zip(keys, values, strict=True):
        groups.setdefault(k, []).append(v)
    ks = sorted(groups)
    means = [sum(groups[k]) / len(groups[k]) for k in ks]
    stds = [math.sqrt(sum((v - mu) ** 2 for v in groups[k]) / len(groups[k])) for k, mu in zip(ks, means, strict=True)]
    return ks, means, stds, [len(groups[k]) for k in ks]


def reward_series(data: PlotData) -> dict[str, Any]:
    """Rollouts: mean ± std of reward per version. TrainSteps: reward_mean per produced version (mean over steps)."""
    out: dict[str, Any] = {}
    if data.rollouts:
        out["rollouts"] = group_stats([r.vmax for r in data.rollouts], [r.reward for r in data.rollouts])
    if data.steps:
        out["steps"] = group_stats([s.policy_version for s in data.steps], [s.reward_mean for s in data.steps])
    return out


def pass_rate_series(data: PlotData) -> dict[str, Any]:
    """EvalReports: pass@1 with its interval per version (the latest report per version). Rollouts: fraction
    of graded rollouts that passed every test, per version."""
    out: dict[str, Any] = {}
    if data.evals:
        latest = {e.policy_version: e for e in sorted(data.evals, key=lambda e: e.created_at)}
        vs = sorted(latest)
        out["evals"] = (vs, [latest[v].pass_at_1 for v in vs], [latest[v].ci_low for v in vs],
                        [latest[v].ci_high for v in vs])
    graded = [r for r in data.rollouts if r.graded]
    if graded:
        out["rollouts"] = group_stats([r.vmax for r in graded], [float(r.passed) for r in graded])
    return out


def accuracy_cost_series(data: PlotData) -> dict[int, dict[str, Any]]:
    """EvalReports of agentic episodes (those with `policy_tokens_mean`), the latest per version: {version:
    {"greedy": (policy tokens per task, pass@1, ci low, ci high), and with samples "sampled": (ks, k x policy
    tokens of a sampled episode, pass@k, low, high)}}: what a task costs against how often it passes."""
    latest = {e.policy_version: e for e in sorted(data.evals, key=lambda e: e.created_at)
              if e.policy_tokens_mean is not None}
    out: dict[int, dict[str, Any]] = {}
    for v in sorted(latest):
        e = latest[v]
        out[v] = {"greedy": (e.policy_tokens_mean, e.pass_at_1, e.ci_low, e.ci_high)}
        ks = sorted(int(k) for k in e.pass_at_k)
        if ks and e.sampled_policy_tokens_mean is not None:
            out[v]["sampled"] = (ks, [k * e.sampled_policy_tokens_mean for k in ks],
                                 [e.pass_at_k[str(k)] for k in ks],
                                 [e.pass_at_k_ci95.get(str(k), [0.0, 1.0])[0] for k in ks],
                                 [e.pass_at_k_ci95.get(str(k), [0.0, 1.0])[1] for k in ks])
    return out


def pass_at_k_series(data: PlotData) -> dict[str, dict[str, Any]]:
    """The held-out scores per evaluated version: {"evals": S} of the evaluator's reports (the latest per version),
    and {"base": S}, {"final": S} of the closing evaluations when there are any, each S = {"pass@1": (versions,
    greedy pass@1, low, high) with its Wilson interval; with samples "mean@k": (versions, the mean pass rate of the
    K samples, low, high) with the bootstrap interval of the sampled pass@1 (the same number), and "pass@k": {k:
    (versions, unbiased pass@k, low, high)} for every k >= 2 a report carries, with its bootstrap interval}. A
    version whose report lacks a k is not in that k's series; a greedy-only report gives only "pass@1"."""
    def scores(reports: Sequence[EvalReport]) -> dict[str, Any]:
        latest = {e.policy_version: e for e in sorted(reports, key=lambda e: e.created_at)}
        vs = sorted(latest)
        out: dict[str, Any] = {"pass@1": (vs, [latest[v].pass_at_1 for v in vs], [latest[v].ci_low for v in vs],
                                          [latest[v].ci_high for v in vs])}
        sampled = [v for v in vs if latest[v].mean_at_k is not None]
        if sampled:
            bounds = [latest[v].pass_at_k_ci95.get("1", [latest[v].mean_at_k] * 2) for v in sampled]
            out["mean@k"] = (sampled, [latest[v].mean_at_k for v in sampled], [b[0] for b in bounds],
                             [b[1] for b in bounds])
        ks = sorted({int(k) for v in vs for k in latest[v].pass_at_k if int(k) >= 2})
        if ks:
            out["pass@k"] = {}
            for k in ks:
                at = [v for v in vs if str(k) in latest[v].pass_at_k]
                bounds = [latest[v].pass_at_k_ci95.get(str(k), [0.0, 1.0]) for v in at]
                out["pass@k"][k] = (at, [latest[v].pass_at_k[str(k)] for v in at], [b[0] for b in bounds],
                                    [b[1] for b in bounds])
        return out

    series: dict[str, dict[str, Any]] = {}
    for key, reports in (("evals", data.evals), ("base", [data.base] if data.base else []),
                         ("final", [data.final] if data.final else [])):
        if reports:
            series[key] = scores(reports)
    return series


def kl_series(data: PlotData) -> dict[str, Any]:
    """TrainSteps: mean KL and mean loss per produced version."""
    if not data.steps:
        return {}
    versions = [s.policy_version for s in data.steps]
    return {"kl": group_stats(versions, [s.kl for s in data.steps]),
            "loss": group_stats(versions, [s.loss for s in data.steps])}


def mean_staleness(histogram: dict[str, int]) -> float | None:
    """Mean versions behind of a TrainStep's staleness histogram {"k": count}: Σ k·n / Σ n."""
    total = sum(histogram.values())
    if total == 0:
        return None
    return sum(int(k) * n for k, n in histogram.items()) / total


def generation_lag(data: PlotData) -> list[tuple[int, int]]:
    """(version, lag) per rollout: newest manifest version recorded by the rollout's time − its oldest token
    version (rollouts recorded before any manifest are left out)."""
    manifests = sorted(data.manifests)
    out: list[tuple[int, int]] = []
    i, newest = 0, None
    for r in sorted(data.rollouts, key=lambda r: r.time):
        while i < len(manifests) and manifests[i][0] <= r.time:
            newest = manifests[i][1] if newest is None else max(newest, manifests[i][1])
            i += 1
        if newest is not None:
            out.append((r.vmax, max(0, newest - r.vmin)))
    return out


def staleness_series(data: PlotData) -> dict[str, Any]:
    """TrainSteps: mean staleness of the rollouts each version was trained on, and rollouts dropped per version.
    Rollouts + manifests: mean generation lag per version (see `generation_lag`)."""
    out: dict[str, Any] = {}
    trained = [(s.policy_version, m) for s in data.steps if (m := mean_staleness(s.staleness)) is not None]
    if trained:
        out["trained"] = group_stats([v for v, _ in trained], [m for _, m in trained])
    if data.steps:
        dropped: dict[int, int] = {}
        for s in data.steps:
            dropped[s.policy_version] = dropped.get(s.policy_version, 0) + len(s.dropped)
        if any(dropped.values()):
            vs = sorted(dropped)
            out["dropped"] = (vs, [dropped[v] for v in vs])
    lag = generation_lag(data)
    if lag:
        out["generation"] = group_stats([v for v, _ in lag], [float(x) for _, x in lag])
    return out


def throughput_series(data: PlotData) -> dict[str, Any]:
    """Per version: rollouts/s and completion tokens/s = count (tokens) / span of their recorded times
    (versions with one rollout or a zero span are left out); and rollouts/s over time in 20 bins."""
    if not data.rollouts:
        return {}
    by_version: dict[int, list[RolloutPoint]] = {}
    for r in data.rollouts:
        by_version.setdefault(r.vmax, []).append(r)
    vs, rps, tps = [], [], []
    for v in sorted(by_version):
        group = by_version[v]
        span = max(r.time for r in group) - min(r.time for r in group)
        if len(group) > 1 and span > 0:
            vs.append(v)
            rps.append(len(group) / span)
            tps.append(sum(r.tokens for r in group) / span)
    t0 = min(r.time for r in data.rollouts)
    t1 = max(r.time for r in data.rollouts)
    bins = 20
    width = max((t1 - t0) / bins, 1e-9)
    counts = [0] * bins
    for r in data.rollouts:
        counts[min(int((r.time - t0) / width), bins - 1)] += 1
    centres = [(i + 0.5) * width for i in range(bins)]
    out: dict[str, Any] = {"over_time": (centres, [c / width for c in counts])}
    if vs:
        out["per_version"] = (vs, rps, tps)
    return out


# ---- rendering --------------------------------------------------------------------------------------
def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=ax.transAxes, fontsize=12,
            color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_reward(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = reward_series(data)
    if not s:
        return _no_data(ax, "the recording holds no Rollouts or TrainSteps")
    if "rollouts" in s:
        vs, mean, std, n = s["rollouts"]
        ax.errorbar(vs, mean, yerr=std, marker="o", capsize=3, label=f"rollouts (mean ± std, n={sum(n)})")
    if "steps" in s:
        vs, mean, _, _ = s["steps"]
        ax.plot(vs, mean, marker="s", label="TrainStep reward_mean")
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward")
    ax.legend()


def _plot_pass(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = pass_rate_series(data)
    if not s:
        return _no_data(ax, "the recording holds no EvalReports and no graded Rollouts")
    if "evals" in s:
        vs, p, lo, hi = s["evals"]
        ax.errorbar(vs, p, yerr=[[a - b for a, b in zip(p, lo, strict=True)], [b - a for a, b in zip(p, hi, strict=True)]],
                    marker="o", capsize=3, label="held-out pass@1 (interval)")
    if "rollouts" in s:
        vs, mean, _, n = s["rollouts"]
        ax.plot(vs, mean, marker="s", label=f"rollouts passing all tests (n={sum(n)})")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("policy version")
    ax.set_ylabel("pass rate")
    ax.legend()


def _plot_kl(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = kl_series(data)
    if not s:
        return _no_data(ax, "the recording holds no TrainSteps")
    vs, kl, _, _ = s["kl"]
    ax.plot(vs, kl, marker="o", color="C0", label="KL (k1) vs reference")
    ax.set_xlabel("policy version")
    ax.set_ylabel("KL", color="C0")
    ax2 = ax.twinx()
    vs, loss, _, _ = s["loss"]
    ax2.plot(vs, loss, marker="s", color="C1", label="loss")
    ax2.set_ylabel("loss", color="C1")


def _plot_staleness(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = staleness_series(data)
    if not s:
        return _no_data(ax, "no TrainSteps with staleness and no WeightManifests to measure rollouts against")
    for key, label, marker in (("trained", "trained on: mean versions behind", "o"),
                               ("generation", "rollouts: newest version − oldest token version", "s")):
        if key in s:
            vs, mean, std, _ = s[key]
            ax.errorbar(vs, mean, yerr=std, marker=marker, capsize=3, label=label)
    if "dropped" in s:
        vs, n = s["dropped"]
        ax.bar(vs, n, alpha=0.3, color="C3", label="dropped as stale")
    ax.set_xlabel("policy version")
    ax.set_ylabel("versions")
    ax.legend()


def _plot_throughput(fig: Any, data: PlotData) -> None:
    s = throughput_series(data)
    if not s:
        return _no_data(fig.add_subplot(1, 1, 1), "the recording holds no Rollouts")
    top = fig.add_subplot(2, 1, 1)
    t, rate = s["over_time"]
    top.plot(t, rate, drawstyle="steps-mid")
    top.set_xlabel("seconds since the first rollout")
    top.set_ylabel("rollouts / s")
    top.set_ylim(bottom=0)
    bottom = fig.add_subplot(2, 1, 2)
    if "per_version" in s:
        vs, rps, tps = s["per_version"]
        bottom.bar([str(v) for v in vs], tps, color="C2")
        bottom.set_xlabel("policy version")
        bottom.set_ylabel("completion tokens / s")
        bottom.set_ylim(0, max(tps) * 1.2)
        for x, (r, tok) in enumerate(zip(rps, tps, strict=True)):
            bottom.annotate(f"{r:.1f} rollouts/s", (x, tok), ha="center", va="bottom", fontsize=8)
    else:
        _no_data(bottom, "too few rollouts per version for a rate")


def _plot_accuracy_cost(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = accuracy_cost_series(data)
    if not s:
        return _no_data(ax, "the recording holds no EvalReports of agentic episodes (policy tokens per task)")
    from matplotlib import colormaps

    colors = colormaps["viridis"]
    last = max(1, len(s) - 1)
    for i, (v, series) in enumerate(s.items()):
        color = colors(0.9 * i / last)
        x, p, lo, hi = series["greedy"]
        ax.errorbar([x], [p], yerr=[[p - lo], [hi - p]], marker="o", capsize=3, color=color, linestyle="none",
                    label=f"v{v} greedy pass@1")
        if "sampled" in series:
            ks, xs, ps, los, his = series["sampled"]
            ax.fill_between(xs, los, his, color=color, alpha=0.12)
            ax.plot(xs, ps, marker=".", color=color, label=f"v{v} pass@k, k = {ks[0]}..{ks[-1]} sampled episodes")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(left=0)
    ax.set_xlabel("policy tokens per task")
    ax.set_ylabel("held-out pass rate")
    ax.legend(fontsize=8)


def _plot_pass_at_k(fig: Any, data: PlotData) -> None:
    ax = fig.add_subplot(1, 1, 1)
    s = pass_at_k_series(data)
    if not s:
        return _no_data(ax, "the recording holds no EvalReports")
    versions = sorted({v for scores in s.values() for v in scores["pass@1"][0]})
    dodge = 0.012 * max(1, versions[-1] - versions[0])     # the scores of one version side by side
    ks = sorted({k for scores in s.values() for k in scores.get("pass@k", {})})
    names: list[tuple[Any, str]] = [("pass@1", "greedy pass@1 (95% Wilson)"),
                                    ("mean@k", "mean@K = sampled pass@1 (95% bootstrap)")]
    names += [(k, f"pass@{k} (95% bootstrap)") for k in ks]
    styles = {"evals": ("o", "-", None), "base": ("s", "none", "base, scored after the run"),
              "final": ("*", "none", "final weights, scored after the run")}
    labelled: set[Any] = set()
    for key, scores in s.items():
        marker, line, what = styles[key]
        for i, (name, label) in enumerate(names):
            curve = scores.get("pass@k", {}).get(name) if isinstance(name, int) else scores.get(name)
            if curve is None:
                continue
            vs, p, lo, hi = curve
            ax.errorbar([v + (i - 1) * dodge for v in vs], p,
                        yerr=[[a - b for a, b in zip(p, lo, strict=True)], [b - a for a, b in zip(p, hi, strict=True)]],
                        marker=marker, markersize=11 if marker == "*" else 5, linestyle=line, capsize=3,
                        color=f"C{i}", label=None if name in labelled else label)
            labelled.add(name)
        if what is not None:
            ax.plot([], [], marker=marker, color="0.3", linestyle="none", markersize=11 if marker == "*" else 5,
                    label=what)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out pass rate")
    ax.legend(fontsize=8)


PLOTS = {"reward": ("reward per policy version", _plot_reward),
         "pass_rate": ("pass rate per policy version", _plot_pass),
         "kl": ("KL and loss per policy version", _plot_kl),
         "staleness": ("staleness per policy version", _plot_staleness),
         "throughput": ("throughput", _plot_throughput),
         "accuracy_cost": ("held-out pass rate against policy tokens per task, per evaluated version",
                           _plot_accuracy_cost),
         "pass_at_k": ("held-out greedy pass@1, mean@K and pass@k per evaluated version", _plot_pass_at_k)}


def render_all(data: PlotData, out_dir: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Write `<name>.png` for every plot (or those `names` names) into `out_dir`; returns the paths."""
    from matplotlib.figure import Figure  # the Agg canvas, no pyplot state

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (title, draw) in PLOTS.items():
        if names is not None and name not in names:
            continue
        fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
        draw(fig, data)
        fig.suptitle(f"{data.run}: {title}" if data.run else title)
        path = out_dir / f"{name}.png"
        fig.savefig(path, format="png")
        paths.append(path)
    return paths
