"""TensorBoard event files of a run, for researchers who read their curves in TensorBoard.

Owns: `TensorBoardSink` (followed messages → scalars in `events.out.tfevents.*` under one directory: each
TrainStep keyed by optimizer step, each EvalReport by policy version, the generators' throughput and MTP acceptance
per step, every Heartbeat's counters and gauges at its wall time), `tensorboard_dir` (where the directory of
`--tensorboard` / `[logging] tensorboard` lies) and `require_writer` (the one-line error when the `metrics`
extra is missing). Does not: follow the bus (ops/runview.py `RunView`), read event files, or draw (`rlbus plot`).
Uses tensorboard's own event writer, so nothing here imports torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Final

from rlbus.messages.errors import RlbusError
from rlbus.messages.schemas import EvalReport, Heartbeat, TrainStep

INSTALL_HINT: Final = "pip install 'rlbus[metrics]'"
FLUSH_S: Final = 5
"""Seconds between flushes of the event file: a TensorBoard open on a live run sees it this late at most."""


class TensorBoardUnavailable(RlbusError):
    """TensorBoard output was asked for, but the `tensorboard` package (the `metrics` extra) is not installed."""


def require_writer() -> None:
    """Import tensorboard's event writer, so that a missing extra stops a run before anything starts.

    :raises TensorBoardUnavailable: it does not import (the message names the extra to install).
    """
    try:
        from tensorboard.summary.writer import event_file_writer  # noqa: F401
    except ImportError as err:
        raise TensorBoardUnavailable(f"TensorBoard output needs the tensorboard package ({err}): "
                                     f"{INSTALL_HINT}") from None


def tensorboard_dir(flag: Path | None, configured: str | None, state: Path) -> Path | None:
    """Where the event files go: `--tensorboard DIR` (relative: to the working directory, like every path given on
    the command line) wins over `[logging] tensorboard` (relative: to the run's state directory `state`, so each
    state directory of one topology file gets its own); None when neither is given."""
    if flag is not None:
        return flag.resolve()
    if configured is not None:
        return (state / Path(configured).expanduser()).resolve()
    return None


class TensorBoardSink:
    """Writes the scalars of a run's messages into one event file (a new one per `rlbus up`) under `logdir`.

    Tags: `train/<figure>` and `throughput/<rate>` at the TrainStep's optimizer step (`throughput/mtp_acceptance`:
    drafts the generators' MTP heads had accepted over those checked since the step before, from their
    `mtp_drafted` / `mtp_accepted` heartbeat counters; absent when none were), `eval/<figure>` at the
    EvalReport's policy version, `health/<actor id>/<counter or gauge>` at the heartbeat's Unix second (plot
    them against TensorBoard's wall-time axis); every event carries its message's own wall time.
    """

    def __init__(self, logdir: Path) -> None:
        require_writer()
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._writer = EventFileWriter(str(logdir), flush_secs=FLUSH_S)
        self._opened = time.time()
        self._trained = 0
        self._generators: dict[str, float] = {}
        """Generator actor id → its latest `tokens_per_s` gauge."""
        self._drafts: dict[str, tuple[float, float]] = {}
        """Generator actor id → its latest (mtp_drafted, mtp_accepted) counters."""
        self._drafts_at_step: dict[str, tuple[float, float]] = {}
        """The same, as they were at the last TrainStep written."""

    def write(self, message: Any) -> None:
        """Write the scalars of a TrainStep, EvalReport or Heartbeat; any other message is ignored."""
        match message:
            case TrainStep() as step:
                self.train_step(step)
            case EvalReport() as report:
                self.eval_report(report)
            case Heartbeat() as beat:
                self.heartbeat(beat)
            case _:
                pass

    def train_step(self, step: TrainStep) -> None:
        if not step.rollout_ids:        # drops the trainer could not fold into a step: only their count
            self._scalars(step.step, step.created_at, {"train/dropped_unfolded": len(step.dropped)})
            return
        self._trained += len(step.rollout_ids)
        behind = sum(step.staleness.values())
        values = {"train/loss": step.loss, "train/kl": step.kl, "train/reward_mean": step.reward_mean,
                  "train/reward_std": step.reward_std, "train/policy_version": step.policy_version,
                  "train/rollouts": len(step.rollout_ids), "train/dropped": len(step.dropped),
                  "train/staleness_mean": (sum(int(k) * n for k, n in step.staleness.items()) / behind
                                           if behind else 0.0),
                  "throughput/trained_rollouts_per_s": self._trained / max(step.created_at - self._opened, 1e-9)}
        if self._generators:
            values["throughput/generator_tokens_per_s"] = sum(self._generators.values())
        drafted = accepted = 0.0
        for actor, (d, a) in self._drafts.items():
            d0, a0 = self._drafts_at_step.get(actor, (0.0, 0.0))
            if d < d0:                  # a restarted generator counts from 0 again
                d0 = a0 = 0.0
            drafted, accepted = drafted + d - d0, accepted + a - a0
        self._drafts_at_step = dict(self._drafts)
        if drafted > 0:
            values["throughput/mtp_acceptance"] = accepted / drafted
        self._scalars(step.step, step.created_at, values)

    def eval_report(self, report: EvalReport) -> None:
        self._scalars(report.policy_version, report.created_at,
                      {"eval/pass_at_1": report.pass_at_1, "eval/ci_low": report.ci_low,
                       "eval/ci_high": report.ci_high, "eval/n": report.n})

    def heartbeat(self, beat: Heartbeat) -> None:
        if beat.actor_kind == "generator" and "tokens_per_s" in beat.gauges:
            self._generators[beat.actor_id] = beat.gauges["tokens_per_s"]
        if beat.actor_kind == "generator" and "mtp_drafted" in beat.counters:
            self._drafts[beat.actor_id] = (beat.counters["mtp_drafted"], beat.counters.get("mtp_accepted", 0.0))
        prefix = f"health/{beat.actor_id}/"
        values: dict[str, float] = {prefix + name: value for name, value in beat.counters.items()}
        values.update({prefix + name: value for name, value in beat.gauges.items()})
        values[prefix + "restarts"] = beat.restarts
        self._scalars(int(beat.sent_at), beat.sent_at, values)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (the sink writes nothing after)."""
        self._writer.close()

    def _scalars(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))
                                       for tag, value in values.items()])
        self._writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))
