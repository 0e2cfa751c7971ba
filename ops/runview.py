"""What `rlbus up` shows of an RL run: live progress lines, the closing summary, and the progress PNG.

Owns: following TRAINLOG steps, evaluation reports and heartbeats on the hub while the run goes on
(`RunView.watch`), one progress line per optimizer step (version, reward, KL, staleness, throughput,
the latest pass rate), and at the end the summary (with the ledger) and `progress.png` (reward and
pass rate per version); every followed message also goes to the TensorBoard sink when there is one
(ops/tensorboard.py). Does not: launch anything (topology/backends/launch.py) or keep state of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import EvalReport, Heartbeat, TrainStep

log = structlog.get_logger()


@dataclass
class RunView:
    """Live state of an RL run as seen from the hub."""

    base_pass: dict[str, Any] | None = None
    """The pretraining summary (pass@1 of the base on its held-out set), when known."""
    steps: list[TrainStep] = field(default_factory=list)
    evals: dict[int, EvalReport] = field(default_factory=dict)
    beats: dict[str, Heartbeat] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    step_reached: anyio.Event = field(default_factory=anyio.Event)
    target_steps: int | None = None
    final: Any = None
    """The closing evaluation of the final checkpoint (ops/final_eval.py `FinalEval`), once made."""
    sink: Any = None
    """Where followed messages are also written (ops/tensorboard.py `TensorBoardSink`); None: nowhere."""

    async def watch(self, bus: Bus) -> None:
        """Follow TRAINLOG, EVALS and HEALTH on the hub's core subjects until cancelled."""
        s = bus.subjects
        subs = [await bus.nc.subscribe(s.trainlog()), await bus.nc.subscribe(s.evals()),
                await bus.nc.subscribe(s.all_health())]
        try:
            async with anyio.create_task_group() as tg:
                for sub in subs:
                    tg.start_soon(self._follow, sub)
        finally:
            with anyio.move_on_after(1, shield=True):
                for sub in subs:
                    await sub.unsubscribe()

    async def _follow(self, sub: Any) -> None:
        async for msg in sub.messages:
            try:
                message = codec.decode(msg.data, msg.headers)
            except BadMessage:
                continue
            if self.sink is not None:
                self.sink.write(message)
            match message:
                case TrainStep() as step:
                    self.steps.append(step)
                    print(self.line(step), flush=True)
                    if self.target_steps is not None and step.step >= self.target_steps:
                        self.step_reached.set()
                case EvalReport() as report:
                    self.evals[report.policy_version] = report
                    print(f"  eval v{report.policy_version}: {scores_text(report)}", flush=True)
                case Heartbeat() as beat:
                    self.beats[beat.actor_id] = beat
                case _:
                    pass

    def line(self, step: TrainStep) -> str:
        elapsed = time.monotonic() - self.started
        trained = sum(len(s.rollout_ids) for s in self.steps)
        stale = _mean_staleness(step.staleness)
        latest = self.evals[max(self.evals)] if self.evals else None
        pass_text = f"pass@1 {latest.pass_at_1:.3f}@v{latest.policy_version}" if latest else "pass@1 -"
        return (f"v{step.policy_version:<4} step {step.step:<4} reward {step.reward_mean:5.3f} "
                f"kl {step.kl:7.4f} loss {step.loss:7.4f} staleness {stale:4.2f} "
                f"dropped {len(step.dropped):<3} {trained / max(elapsed, 1e-9):5.2f} rollouts/s  {pass_text}")


def scores_text(report: EvalReport) -> str:
    """A report's scores on one line: greedy pass@1 with its interval on n tasks; with samples mean@K and pass@K
    with its interval; for agentic episodes the mean turns, tool calls and policy tokens of a greedy one."""
    text = f"pass@1 {report.pass_at_1:.3f} [{report.ci_low:.3f}, {report.ci_high:.3f}] on {report.n} held-out tasks"
    k = report.samples
    if k and report.mean_at_k is not None and str(k) in report.pass_at_k:
        low, high = report.pass_at_k_ci95.get(str(k), [0.0, 1.0])
        text += f"; mean@{k} {report.mean_at_k:.3f}, pass@{k} {report.pass_at_k[str(k)]:.3f} [{low:.3f}, {high:.3f}]"
    if report.turns_mean is not None:
        text += (f"; per episode {report.turns_mean:.1f} turns, {report.tool_calls_mean or 0.0:.1f} tool calls, "
                 f"{report.policy_tokens_mean or 0.0:.0f} policy tokens")
    return text


def _mean_staleness(histogram: dict[str, int]) -> float:
    total = sum(histogram.values())
    return sum(int(k) * v for k, v in histogram.items()) / total if total else 0.0


def summary(view: RunView, book: Any | None, tasks: Any | None = None) -> str:
    """The closing summary: steps, rollouts, reward, pass rate first → last, the ledger of rollouts and that of
    the fed tasks (`tasks`, actors/common/ledger.py `TaskLedger`; None: not read)."""
    lines = ["rlbus up: summary"]
    if view.base_pass is not None:
        lines.append(f"  pretrained base: held-out pass@1 {view.base_pass['pass_at_1']:.3f} "
                     f"[{view.base_pass['ci_low']:.3f}, {view.base_pass['ci_high']:.3f}] "
                     f"(n={view.base_pass['n']}, at the end of pretraining)")
    if view.steps:
        last = view.steps[-1]
        lines.append(f"  optimizer steps {len(view.steps)}, final version {last.policy_version}, rollouts trained "
                     f"{sum(len(s.rollout_ids) for s in view.steps)}, dropped {sum(len(s.dropped) for s in view.steps)}")
        first_r = sum(s.reward_mean for s in view.steps[:5]) / min(5, len(view.steps))
        last_r = sum(s.reward_mean for s in view.steps[-5:]) / min(5, len(view.steps))
        lines.append(f"  reward (mean of 5 steps): first {first_r:.3f} → last {last_r:.3f}")
    else:
        lines.append("  no optimizer step was taken")
    if view.evals:
        first, last_e = view.evals[min(view.evals)], view.evals[max(view.evals)]
        lines.append(f"  evaluator pass@1: v{first.policy_version} {first.pass_at_1:.3f} "
                     f"[{first.ci_low:.3f}, {first.ci_high:.3f}] → v{last_e.policy_version} {last_e.pass_at_1:.3f} "
                     f"[{last_e.ci_low:.3f}, {last_e.ci_high:.3f}] (n={last_e.n})")
        if last_e.samples or last_e.turns_mean is not None:
            lines.append(f"  evaluator v{last_e.policy_version}: {scores_text(last_e)}")
    end = _end_point(view)
    if end is not None:
        label, rate, low, high = end
        lines.append(f"  {label}: pass@1 {rate:.3f} [{low:.3f}, {high:.3f}]")
        report = getattr(view.final, "report", None)
        if report is not None and (report.samples or report.turns_mean is not None):
            lines.append(f"  final weights v{report.policy_version}: {scores_text(report)}")
        v0 = view.evals.get(0)
        if v0 is not None:
            ratio = f"{rate / v0.pass_at_1:.2f}x" if v0.pass_at_1 > 0 else "n/a"
            lines.append(f"  versus v0 (the pretrained base, same tasks): {ratio}; " + (
                "the held-out pass rate rose clearly: the 95% intervals do not overlap" if low > v0.ci_high
                else "the 95% intervals overlap"))
    if book is not None:
        verdict = "clean" if book.clean else "NOT CLEAN"
        lines.append(f"  ledger ({verdict}): produced {book.produced}, trained {book.trained}, "
                     f"dropped {dict(book.dropped)}, pending {len(book.pending)}, lost {len(book.lost)}, "
                     f"trained twice {len(book.trained_twice)}, abandoned steps {book.abandoned_steps}")
    if tasks is not None:
        verdict = "clean" if tasks.clean else "NOT CLEAN"
        lost = f"lost {len(tasks.lost)}" + (f" ({', '.join(tasks.lost[:5])}{', ...' if len(tasks.lost) > 5 else ''})"
                                            if tasks.lost else "")
        lines.append(f"  tasks ({verdict}): fed {tasks.fed}, rolled out {tasks.rolled_out}, dead-lettered "
                     f"{tasks.dead_lettered}, pending {tasks.pending}, {lost}")
    return "\n".join(lines)


def _end_point(view: RunView) -> tuple[str, float, float, float] | None:
    """(label, pass@1, ci low, ci high) of where the run ended: the final checkpoint's closing evaluation,
    else the evaluator's last report (None: neither)."""
    final = view.final
    if final is not None:
        r = final.result
        label = (f"final weights v{final.policy_version} (checkpoint step {final.step}, evaluated after the run, "
                 f"n={r.n})")
        return label, r.pass_at_1, r.ci_low, r.ci_high
    if view.evals:
        last = view.evals[max(view.evals)]
        return f"last evaluation v{last.policy_version} (n={last.n})", last.pass_at_1, last.ci_low, last.ci_high
    return None


def write_png(view: RunView, path: Path) -> Path:
    """Reward (per step, by version) and held-out pass@1 with 95% intervals (by version), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if view.steps:
        top.plot([s.policy_version for s in view.steps], [s.reward_mean for s in view.steps], marker=".",
                 label="mean reward of the step's rollouts")
        top.legend(loc="lower right")
    else:
        top.text(0.5, 0.5, "no optimizer step yet", ha="center", va="center", transform=top.transAxes)
    top.set_ylabel("reward")
    top.set_title("rlbus: reward and held-out pass@1 per policy version")
    if view.evals:
        versions = sorted(view.evals)
        rates = [view.evals[v].pass_at_1 for v in versions]
        errors = [[view.evals[v].pass_at_1 - view.evals[v].ci_low for v in versions],
                  [view.evals[v].ci_high - view.evals[v].pass_at_1 for v in versions]]
        bottom.errorbar(versions, rates, yerr=errors, marker="o", capsize=3, label="greedy pass@1 (95% Wilson)")
    if view.final is not None:
        r = view.final.result
        bottom.errorbar([view.final.policy_version], [r.pass_at_1],
                        yerr=[[r.pass_at_1 - r.ci_low], [r.ci_high - r.pass_at_1]], marker="*", markersize=12, capsize=3, color="tab:red", linestyle="none",
                        label="final weights, after the run")
    if view.evals or view.final is not None:
        bottom.legend(loc="lower right")
    else:
        bottom.text(0.5, 0.5, "no evaluation report yet", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_xlabel("policy version")
    bottom.set_ylabel("pass@1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
