"""`rlbus replay FILE train`: feed a recording to a fresh trainer and check that it reproduces every
WeightManifest digest the live run published (CPU, same seed, settings and thread count).

- Owns: `retrain(path, ...)` → `RetrainResult` (the Python API), `restore_points` (pure: where abandoned
  branches restart), `held_version`, where the settings come from (`recorded_setup`, `topology_setup`) and
  the command's output (`handle`: one line per version, a summary, `--json`, exit 0 / 1 / 2).
- Does not: build or step the model differently from the trainer (actors/trainer/actor.py
  `build_trainer_core`, `objective`) or read the file format (ops/recording/format.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from rlbus.actors.trainer.actor import SETTINGS_KEY, THREADS_KEY, build_trainer_core, objective
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch, from_record
from rlbus.actors.trainer.core import TrainerCore
from rlbus.messages.errors import RlbusError
from rlbus.messages.schemas import Event, Rollout, TrainStep, WeightManifest
from rlbus.ops.recording.playback import Playback, open_playback

log = structlog.get_logger()


class ReplayInputError(RlbusError):
    """The recording (or the options) lack what a replay needs; the text says what and how to supply it."""


# ---- the trainer's settings ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TrainerSetup:
    """How the live trainer was built: its settings, what the launcher passed beside them, torch thread count,
    and where they came from."""

    config: TrainerConfig
    threads: int = 1
    source: str = ""
    launch: TrainerLaunch = TrainerLaunch()  # noqa: RUF009 - a frozen Struct: one shared default is safe


def recorded_setup(events: Iterable[Event]) -> TrainerSetup | None:
    """The settings in the first trainer `started` event that carries them (actors/trainer/actor.py
    `started_data`); None when the recording has none (recorded before they were, or EVENTS aged out)."""
    for ev in events:
        if ev.event == "started" and ev.actor_kind == "trainer" and SETTINGS_KEY in ev.data:
            try:
                config, launch = from_record(msgspec.json.decode(ev.data[SETTINGS_KEY], type=dict[str, Any]))
            except msgspec.DecodeError as err:
                raise ReplayInputError(f"the trainer settings in the recorded started event of {ev.actor_id} do "
                                       f"not decode ({err}); pass --topology FILE") from None
            threads = int(ev.data.get(THREADS_KEY, "1") or 1)
            return TrainerSetup(config, threads, f"recorded started event of {ev.actor_id}", launch)
    return None


def topology_setup(path: str | Path) -> TrainerSetup:
    """The trainer settings `rlbus up` would pass for this topology file (topology/backends/launch.py
    `kind_settings` and `kind_launch`, pretrained checkpoint under its state directory) and the trainer's
    `torch_threads`.

    :raises ReplayInputError: the topology has no trainer.
    """
    from rlbus.topology.backends.launch import kind_launch
    from rlbus.topology.file.load import load

    topology = load(path)
    trainers = [i for i in topology.instances() if i.kind == "trainer"]
    if not trainers:
        raise ReplayInputError(f"{path}: the topology has no trainer")
    launch = kind_launch(topology, "trainer")
    assert isinstance(launch, TrainerLaunch)
    return TrainerSetup(topology.trainer, trainers[0].torch_threads, f"topology {path}", launch)


def resolve_setup(recorded: TrainerSetup | None, *, topology: str | Path | None = None,
                  pretrained: str | Path | None = None, seed: int | None = None,
                  threads: int | None = None) -> TrainerSetup:
    """Topology file over recorded settings; --pretrained, --seed and --threads over both.

    :raises ReplayInputError: no settings at all, or the pretrained checkpoint is not there.
    """
    if topology is not None:
        setup = topology_setup(topology)
        if pretrained is None and recorded is not None and recorded.launch.pretrained:
            setup = _with_launch(setup, pretrained=recorded.launch.pretrained)
    elif recorded is not None:
        setup = recorded
    else:
        raise ReplayInputError("the recording holds no trainer settings (no trainer `started` event with them: "
                               "recorded by an older rlbus, or EVENTS aged out) and no --topology was given; "
                               "pass --topology FILE (and --pretrained PATH)")
    if pretrained is not None:
        setup = _with_launch(setup, pretrained=str(pretrained))
    if seed is not None:
        setup = _with(setup, seed=seed)
    if threads is not None:
        setup = TrainerSetup(setup.config, threads, setup.source, setup.launch)
    where = setup.launch.pretrained
    if where and not Path(where).exists():
        raise ReplayInputError(f"the run's pretrained checkpoint {where} does not exist here; pass --pretrained "
                               f"PATH (the run's <state-dir>/pretrained/pretrain.pt)")
    return setup


def check_world_size(steps: Sequence[TrainStep], setup: TrainerSetup) -> None:
    """Replay-retrain runs one rank: refuse steps recorded at another world size, or settings asking for one.

    :raises ReplayInputError: naming the world sizes found (a sum over another number of ranks rounds
        differently, so the digests could not be reproduced).
    """
    worlds = sorted({step.world_size for step in steps} | {setup.config.world_size})
    if worlds != [1]:
        raise ReplayInputError(f"the recorded steps were computed by a trainer of world size "
                               f"{'/'.join(map(str, worlds))} ([trainer] world_size, {setup.source}); replay-retrain "
                               f"runs one rank, and a sum over another number of ranks rounds differently, so it "
                               f"cannot reproduce those digests; retrain a recording of a one-rank trainer")


def _with(setup: TrainerSetup, **changes: Any) -> TrainerSetup:
    return TrainerSetup(msgspec.structs.replace(setup.config, **changes), setup.threads, setup.source, setup.launch)


def _with_launch(setup: TrainerSetup, **changes: Any) -> TrainerSetup:
    return TrainerSetup(setup.config, setup.threads, setup.source, msgspec.structs.replace(setup.launch, **changes))


# ---- the walk (pure) ----------------------------------------------------------------------------------
def restore_points(steps: Sequence[TrainStep]) -> list[int | None]:
    """For each TrainStep (stream order): the step whose state to restore before it, or None to go on.

    A record whose step is at or below the last step walked restarts from the state after `step - 1`
    (a trainer resumed from that checkpoint; actors/common/ledger.py `final_lineage` drops the same records).

    :raises ReplayInputError: step numbers jump (records missing from the recording's TRAINLOG).
    """
    points: list[int | None] = []
    current = 0
    for record in steps:
        if record.step <= current:
            points.append(record.step - 1)
        elif record.step == current + 1:
            points.append(None)
        else:
            raise ReplayInputError(f"TRAINLOG goes from step {current} to step {record.step}: the recording misses "
                                   f"TrainSteps (aged out of TRAINLOG?); a replay needs every step from 1")
        current = record.step
    return points


def held_version(record: TrainStep) -> int:
    """The version the trainer held before `record`: a step with rollouts produced `policy_version` from the
    one before; a record of drops alone (no optimizer step) keeps `policy_version`."""
    return record.policy_version - 1 if record.rollout_ids else record.policy_version


# ---- results ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VersionCheck:
    """One recorded manifest digest against the replay's digest of the same version."""

    version: int
    recorded: str
    replayed: str
    step: int
    """The TrainStep that produced the version (0: before the first step, or held when a record began)."""

    @property
    def match(self) -> bool:
        return self.recorded == self.replayed


@dataclass(slots=True)
class RetrainResult:
    """What a replay compared; `ok` when every recorded digest was reproduced and none is left unverified."""

    checks: list[VersionCheck] = field(default_factory=list)
    unverified: list[int] = field(default_factory=list)
    """Recorded versions no replayed state corresponds to (their TrainStep is not in the recording)."""
    steps: int = 0
    """Optimizer steps replayed."""
    drop_records: int = 0
    restores: int = 0
    loss_mismatches: list[int] = field(default_factory=list)
    """Steps whose replayed loss differs from the recorded one (diagnostic)."""
    settings_source: str = ""
    stopped_early: bool = False

    @property
    def matched(self) -> int:
        return sum(c.match for c in self.checks)

    @property
    def mismatched(self) -> int:
        return len(self.checks) - self.matched

    @property
    def first_mismatch(self) -> int | None:
        return min((c.version for c in self.checks if not c.match), default=None)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.mismatched and not self.unverified

    def as_json(self) -> dict[str, Any]:
        return {"versions": len(self.checks), "matched": self.matched, "mismatched": self.mismatched,
                "first_mismatch": self.first_mismatch, "unverified": self.unverified, "steps": self.steps,
                "drop_records": self.drop_records, "restores": self.restores,
                "loss_mismatches": self.loss_mismatches, "settings": self.settings_source,
                "results": [{"version": c.version, "step": c.step, "recorded": c.recorded, "replayed": c.replayed,
                             "match": c.match} for c in sorted(self.checks, key=lambda c: c.version)]}


# ---- reading the recording ----------------------------------------------------------------------------
@dataclass(slots=True)
class Inputs:
    """What a replay takes from a recording."""

    steps: list[TrainStep]
    manifests: dict[int, list[str]]
    """Version → distinct recorded version digests (normally one)."""
    rollouts: dict[str, Rollout]
    recorded: TrainerSetup | None


def read_inputs(pb: Playback) -> Inputs:
    """TrainSteps in stream order, manifest digests, the rollouts the steps name (first stored copy), settings.

    :raises ReplayInputError: no TrainStep, no manifest, or a named rollout missing.
    """
    steps = [e.message for e in sorted(pb.entries(kinds={"train_step"}), key=lambda e: e.seq)
             if isinstance(e.message, TrainStep)]
    if not steps:
        missing = "TRAINLOG was not recorded" if "TRAINLOG" not in pb.header.get("streams", {}) else "it is empty"
        raise ReplayInputError(f"{pb.path}: no TrainStep to replay ({missing}); record the run with TRAINLOG")
    manifests: dict[int, list[str]] = {}
    for entry in pb.entries(kinds={"weight_manifest"}):
        m = entry.message
        if isinstance(m, WeightManifest) and m.version_digest and m.version_digest not in manifests.get(m.version, []):
            manifests.setdefault(m.version, []).append(m.version_digest)
    if not manifests:
        raise ReplayInputError(f"{pb.path}: no WeightManifest with a version digest to compare against; record "
                               f"the run with WEIGHTS")
    wanted = {rid for s in steps for rid in s.rollout_ids}
    found: dict[str, tuple[int, Rollout]] = {}
    for entry in pb.entries(kinds={"rollout"}):
        r = entry.message
        if isinstance(r, Rollout) and r.rollout_id in wanted and (
                r.rollout_id not in found or entry.seq < found[r.rollout_id][0]):
            found[r.rollout_id] = (entry.seq, r)
    if missing_ids := sorted(wanted - set(found)):
        at = next(s.step for s in steps if missing_ids[0] in s.rollout_ids)
        raise ReplayInputError(f"{pb.path}: {len(missing_ids)} rollout(s) the TrainSteps name are not in the "
                               f"recording, e.g. {missing_ids[0]!r} of step {at} (ROLLOUTS aged out or not recorded)")
    events = (e.message for e in sorted(pb.entries(kinds={"event"}), key=lambda e: e.seq)
              if isinstance(e.message, Event))
    return Inputs(steps, manifests, {rid: r for rid, (_, r) in found.items()}, recorded_setup(events))


# ---- the replay ---------------------------------------------------------------------------------------
def replay_steps(core: TrainerCore, inputs: Inputs, config: TrainerConfig, launch: TrainerLaunch | None = None,
                 *,
                 on_check: Callable[[VersionCheck], None] | None = None,
                 on_step: Callable[[int, int, TrainStep], None] | None = None,
                 fail_fast: bool = False) -> RetrainResult:
    """Walk the TrainSteps on `core` (fresh, as the trainer built it) and compare every manifest digest;
    the steps and versions are the trainer's own (`TrainerCore.train_step`, `published_version`)."""
    result = RetrainResult()
    points = restore_points(inputs.steps)
    snapshot_at = {p for p in points if p is not None}
    snapshots: dict[int, bytes] = {}
    if 0 in snapshot_at:
        snapshots[0] = core.state_blob({})
    digest: str | None = None
    replayed: dict[int, str] = {}

    def note(version: int, step: int) -> None:
        nonlocal digest
        if version in replayed or version not in inputs.manifests:
            return
        if digest is None:
            digest = core.published_version()[1]
        replayed[version] = digest
        for recorded in inputs.manifests[version]:
            check = VersionCheck(version, recorded, digest, step)
            result.checks.append(check)
            if on_check is not None:
                on_check(check)

    loss = objective(config, launch)
    for i, (record, point) in enumerate(zip(inputs.steps, points, strict=True)):
        if point is not None:
            core.load_state_blob(snapshots[point])
            digest = None
            result.restores += 1
        note(held_version(record), record.step - 1)
        if record.rollout_ids:
            stats = core.train_step([inputs.rollouts[rid] for rid in record.rollout_ids], loss,
                                    lr=config.lr_at(record.step))
            digest = None
            result.steps += 1
            if not (stats.loss == record.loss or (math.isnan(stats.loss) and math.isnan(record.loss))):
                result.loss_mismatches.append(record.step)
            note(record.policy_version, record.step)
        else:
            result.drop_records += 1
        if record.step in snapshot_at:
            snapshots[record.step] = core.state_blob({})
        if on_step is not None:
            on_step(i + 1, len(inputs.steps), record)
        if fail_fast and any(not c.match for c in result.checks):
            result.stopped_early = True
            break
    if not result.stopped_early:
        result.unverified = sorted(set(inputs.manifests) - set(replayed))
    return result


def retrain(path: str | Path, *, topology: str | Path | None = None, pretrained: str | Path | None = None,
            seed: int | None = None, threads: int | None = None, setup: TrainerSetup | None = None,
            on_check: Callable[[VersionCheck], None] | None = None,
            on_step: Callable[[int, int, TrainStep], None] | None = None, fail_fast: bool = False) -> RetrainResult:
    """Replay the recording at `path` on a fresh trainer core and compare every recorded WeightManifest digest.

    Settings: `setup` if given, else a `topology` file's, else the trainer's recorded `started` event;
    `pretrained`, `seed`, `threads` override them. Torch's thread count is restored afterwards.

    :raises ReplayInputError: the recording lacks TrainSteps, manifests, rollouts or settings.
    """
    with open_playback(path) as pb:
        inputs = read_inputs(pb)
    if setup is None:
        setup = resolve_setup(inputs.recorded, topology=topology, pretrained=pretrained, seed=seed, threads=threads)
    check_world_size(inputs.steps, setup)
    log.info("retrain_start", steps=len(inputs.steps), versions=len(inputs.manifests), settings=setup.source,
             threads=setup.threads, pretrained=setup.launch.pretrained or None)
    before = torch.get_num_threads()
    try:
        core = build_trainer_core(setup.config, threads=setup.threads, pretrained=setup.launch.pretrained)
        result = replay_steps(core, inputs, setup.config, setup.launch, on_check=on_check, on_step=on_step,
                              fail_fast=fail_fast)
    finally:
        torch.set_num_threads(before)
    result.settings_source = setup.source
    return result


# ---- the command --------------------------------------------------------------------------------------
def handle(args: argparse.Namespace) -> int:
    """Run the replay for the command line: 0 every digest reproduced, 1 a mismatch, 2 (raised) missing inputs.

    Prints one line per version and a summary, or the result as JSON with `--json`.
    """
    started = time.monotonic()
    quiet = bool(args.json)

    def show(check: VersionCheck) -> None:
        if not quiet:
            print(f"v{check.version:<5} step {check.step:<5} recorded {check.recorded}  replayed {check.replayed}  "
                  f"{'match' if check.match else 'MISMATCH'}", flush=True)

    def progress(i: int, n: int, record: TrainStep) -> None:
        what = f"{len(record.rollout_ids)} rollouts" if record.rollout_ids else f"{len(record.dropped)} drops only"
        print(f"rlbus replay: step {record.step} ({i}/{n} records, {what}) {time.monotonic() - started:.1f}s",
              file=sys.stderr, flush=True)

    result = retrain(args.file, topology=args.topology, pretrained=args.pretrained, seed=args.seed,
                     threads=args.threads, on_check=show, on_step=progress, fail_fast=args.fail_fast)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        print(summary(result, time.monotonic() - started))
    if result.mismatched:
        print(f"rlbus replay: version {result.first_mismatch} was not reproduced: the replayed weights differ from "
              f"the recorded manifest ({result.mismatched} of {len(result.checks)} versions differ)", file=sys.stderr)
        return 1
    if result.unverified:
        raise ReplayInputError(f"versions {_span(result.unverified)} have manifests but no TrainStep in the recording "
                               f"that produced them (recorded mid-step, or TRAINLOG incomplete); record the run again")
    return 0


def summary(result: RetrainResult, seconds: float) -> str:
    """The closing lines of the command."""
    verdict = ("every recorded version digest reproduced" if result.ok else
               f"first mismatch at version {result.first_mismatch}" if result.mismatched else "incomplete")
    lines = [(f"rlbus replay: {len(result.checks)} versions compared, {result.matched} matched, "
              f"{result.mismatched} mismatched: {verdict}"),
             (f"  {result.steps} optimizer steps, {result.drop_records} drop-only records, {result.restores} restarts "
              f"replayed in {seconds:.1f}s; settings from {result.settings_source}")]
    if result.loss_mismatches:
        lines.append(f"  replayed loss differs from the recorded one at steps {_span(result.loss_mismatches)}")
    if result.unverified:
        lines.append(f"  not verifiable (no TrainStep produced them in the recording): {_span(result.unverified)}")
    return "\n".join(lines)


def _span(values: Sequence[int]) -> str:
    shown = ", ".join(str(v) for v in values[:10])
    return shown + (f" … ({len(values)} in all)" if len(values) > 10 else "")
