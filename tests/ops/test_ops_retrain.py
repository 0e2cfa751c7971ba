"""`rlbus replay FILE train`: a recording fed to a fresh trainer reproduces every WeightManifest digest.

Pure tests write recordings from a trainer core stepped the way the live trainer steps it (drop-only
records, a restart from an older checkpoint that abandons a step; a fresh built-in model or a tiny Hugging Face
directory) and check the walk and that a tampered reward is caught at the right version; the slow test
replays the shared finished `rlbus up` on the tiny topology, recorded with `--record` while it ran."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
from helpers.hf import build_family
from helpers.ops import json_in, run_cli
from helpers.runs import FinishedRun

from rlbus.actors.trainer.actor import SETTINGS_KEY, THREADS_KEY, TrainerConfig, build_trainer_core, objective
from rlbus.actors.trainer.config import TrainerLaunch, settings_record
from rlbus.actors.trainer.core import TrainerCore
from rlbus.messages import codec
from rlbus.messages.schemas import (
    DroppedRollout,
    Event,
    Message,
    Rollout,
    TensorBlob,
    TrainStep,
    WeightManifest,
)
from rlbus.ops.cli import main
from rlbus.ops.recording.format import RecordingWriter
from rlbus.ops.recording.retrain import (
    ReplayInputError,
    TrainerSetup,
    check_world_size,
    held_version,
    restore_points,
    retrain,
)
from rlbus.topology.examples import example_path

CONFIG = TrainerConfig(lr=1e-3, batch_rollouts=4, seed=3)
"""A fresh seeded tiny model (no pretrained file) with a learning rate that moves bf16 weights every step."""


def group(task: str, rewards: list[float], seed: int, behaviour: float = -2.0) -> list[Rollout]:
    """One task's group: prompt of 6 and completion of 8 byte tokens drawn from `seed`, behaviour logprob
    `behaviour` on every token (NaN makes the loss non-finite: the step is not applied)."""
    rng = np.random.default_rng(seed)
    out = []
    for g, reward in enumerate(rewards):
        prompt, completion = rng.integers(32, 127, 6), rng.integers(32, 127, 8)
        out.append(Rollout(rollout_id=f"{task}-{g}", task_id=task, group_index=g, group_size=len(rewards),
                           prompt_tokens=TensorBlob.of(prompt.tolist(), "int32"),
                           completion_tokens=TensorBlob.of(completion.tolist(), "int32"),
                           behaviour_logprobs=TensorBlob.of([behaviour] * 8, "float32"),
                           policy_versions=TensorBlob.of([0] * 8, "int32"), reward=reward))
    return out


@dataclass
class Live:
    """A trainer core stepped like actors/trainer/actor.py, writing what a recording of it holds."""

    path: Path
    tamper: str | None = None
    """Rollout id whose reward is flipped in the recording (the live core trains on the true one)."""
    pretrained: str = ""
    """What the trainer starts from (`TrainerLaunch.pretrained`): empty, a fresh seeded tiny built-in model."""
    core: TrainerCore = field(init=False)
    writer: RecordingWriter = field(init=False)
    seq: dict[str, int] = field(default_factory=dict)
    step: int = 0
    version: int = 0
    digests: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.core = build_trainer_core(CONFIG, threads=1, pretrained=self.pretrained)
        self.writer = RecordingWriter(self.path, run="t", header={"streams": {"TRAINLOG": "TRAINLOG_t"}})
        record = settings_record(CONFIG, TrainerLaunch(pretrained=self.pretrained))
        settings = {SETTINGS_KEY: msgspec.json.encode(record).decode(), THREADS_KEY: "1"}
        self.add("EVENTS", Event(event="started", actor_id="hub-trainer-0", actor_kind="trainer", data=settings))
        self.announce()

    def add(self, stream: str, message: Message) -> None:
        self.seq[stream] = self.seq.get(stream, 0) + 1
        data = codec.encode(message, compress_above=1 << 40)[0]
        self.writer.add(stream, self.seq[stream], time.time(), "s", data, kind=type(message).__struct_config__.tag)

    def announce(self) -> None:
        digest = self.core.published_version()[1]
        self.digests[self.version] = digest
        self.add("WEIGHTS", WeightManifest(version=self.version, version_digest=digest))

    def train(self, rollouts: list[Rollout], dropped: tuple[str, ...] = ()) -> bool:
        """One step as the trainer takes it (records, then announces); returns whether it was applied."""
        for r in rollouts:
            flipped = msgspec.structs.replace(r, reward=1.0 - r.reward) if r.rollout_id == self.tamper else r
            self.add("ROLLOUTS", flipped)
        stats = self.core.train_step(rollouts, objective(CONFIG))
        self.step += 1
        self.version += 1
        self.add("TRAINLOG", TrainStep(step=self.step, policy_version=self.version,
                                       rollout_ids=[r.rollout_id for r in rollouts],
                                       dropped=[DroppedRollout(rollout_id=d, reason="stale: 3") for d in dropped],
                                       loss=stats.loss))
        self.announce()
        return stats.applied

    def drops_only(self, ids: tuple[str, ...]) -> None:
        self.step += 1
        self.add("TRAINLOG", TrainStep(step=self.step, policy_version=self.version,
                                       dropped=[DroppedRollout(rollout_id=d, reason="incomplete: 1 of 2") for d in ids]))

    def restart(self, blob: bytes, step: int) -> None:
        """A new incarnation resumes from the checkpoint of `step` and announces it as the next version."""
        self.core = build_trainer_core(CONFIG, threads=1, pretrained=self.pretrained)
        self.core.load_state_blob(blob)
        self.step = step
        self.version += 1
        self.announce()


def record_run(path: Path, tamper: str | None = None, pretrained: str = "") -> dict[int, str]:
    """v0; step 1 → v1; step 2 drops only; step 3 → v2 (checkpoint); step 4 → v3 (abandoned); restart from
    step 3 announcing v4; step 4 again (other groups) → v5; step 5 → v6; step 6 with a non-finite loss → v7
    (v6's weights). Returns the live digests by version."""
    live = Live(path, tamper, pretrained)
    live.train(group("a", [1.0, 0.0], 1) + group("b", [0.0, 0.0], 2))
    live.drops_only(("x-0",))
    live.train(group("c", [0.0, 1.0], 3) + group("d", [1.0, 1.0], 4), dropped=("y-0", "y-1"))
    checkpoint = live.core.state_blob({"step": 3})
    live.train(group("e", [1.0, 0.0], 5) + group("f", [0.0, 1.0], 6))
    live.restart(checkpoint, 3)
    live.train(group("g", [0.0, 1.0], 7) + group("e", [1.0, 0.0], 5))
    live.train(group("f", [0.0, 1.0], 6) + group("h", [1.0, 0.0], 8))
    assert not live.train(group("i", [1.0, 0.0], 9, behaviour=float("nan")))
    live.writer.close()
    return live.digests


def test_walk_restores_where_a_step_repeats_and_drop_records_hold_their_version() -> None:
    """Steps 1,2,3,4 then 3,4 then 2: restore before the second 3 (to 2) and before the last 2 (to 1)."""
    steps = [TrainStep(step=s, policy_version=s, rollout_ids=["r"]) for s in (1, 2, 3, 4, 3, 4, 2)]
    assert restore_points(steps) == [None, None, None, None, 2, None, 1]
    assert held_version(TrainStep(step=5, policy_version=7, rollout_ids=["r"])) == 6
    assert held_version(TrainStep(step=5, policy_version=7, dropped=[DroppedRollout(rollout_id="r", reason="x")])) == 7
    with pytest.raises(ReplayInputError, match="from step 1 to step 3"):
        restore_points([TrainStep(step=1, policy_version=1), TrainStep(step=3, policy_version=2)])


def test_steps_or_settings_of_another_world_size_are_refused_naming_it() -> None:
    """Replay-retrain runs one rank: steps recorded by a two-rank trainer, or settings of world size 2, are
    refused before anything is trained (the sums of two ranks round differently)."""
    one = TrainerSetup(TrainerConfig(), 1, "recorded started event")
    check_world_size([TrainStep(step=1, policy_version=1)], one)
    with pytest.raises(ReplayInputError, match="world size 1/2"):
        check_world_size([TrainStep(step=1, policy_version=1, world_size=2)], one)
    with pytest.raises(ReplayInputError, match=r"world size 1/2 \(\[trainer\] world_size, topology t.toml\)"):
        check_world_size([TrainStep(step=1, policy_version=1)],
                         TrainerSetup(TrainerConfig(world_size=2), 1, "topology t.toml"))


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_replay_reproduces_every_version_across_drops_and_a_restart(tmp_path: Path, kind: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """All 8 versions (v0 … v7, the abandoned v3, the resumed v4 and the unapplied v7 too) match; exit 0. The
    trainer starts from a fresh built-in model, or from a tiny Hugging Face directory (the recorded launch
    names it, and the replay builds its trainer from it)."""
    pretrained = str(build_family(tmp_path / "models", "qwen2-tied")) if kind == "hf" else ""
    live = record_run(tmp_path / "run.rlrec", pretrained=pretrained)
    assert build_trainer_core(CONFIG, threads=1, pretrained=pretrained).policy.kind == kind
    assert live[4] == live[2] and live[7] == live[6] and len(set(live.values())) == 6   # the others all differ
    result = retrain(tmp_path / "run.rlrec")
    assert [(c.version, c.replayed) for c in sorted(result.checks, key=lambda c: c.version)] == sorted(live.items())
    assert (result.matched, result.mismatched, result.unverified) == (8, 0, [])
    assert (result.steps, result.drop_records, result.restores, result.loss_mismatches) == (6, 1, 1, [])
    assert run_cli(["replay", str(tmp_path / "run.rlrec"), "train", "--json"]) == 0
    out = json_in(capsys.readouterr().out)
    assert {k: out[k] for k in ("versions", "matched", "mismatched", "first_mismatch")} == {
        "versions": 8, "matched": 8, "mismatched": 0, "first_mismatch": None}


def test_a_flipped_reward_is_a_mismatch_at_the_version_of_its_step(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Rollout c-0 (step 3, version 2) recorded with its reward flipped: v0, v1 match; v2 is the first mismatch."""
    record_run(tmp_path / "tampered.rlrec", tamper="c-0")
    result = retrain(tmp_path / "tampered.rlrec")
    assert result.first_mismatch == 2
    assert sorted(c.version for c in result.checks if c.match) == [0, 1]
    assert result.loss_mismatches[0] == 3
    assert run_cli(["replay", str(tmp_path / "tampered.rlrec"), "train"]) == 1
    captured = capsys.readouterr()
    assert "version 2 was not reproduced" in captured.err
    assert "v2     step 3     recorded" in captured.out and "MISMATCH" in captured.out


def test_missing_rollout_settings_or_pretrained_is_exit_2(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A TrainStep naming an unrecorded rollout, no settings and no --topology, or a missing pretrained file:
    ReplayInputError, exit 2."""
    path = tmp_path / "gap.rlrec"
    with RecordingWriter(path, run="t") as w:
        w.add("TRAINLOG", 1, 1.0, "s", codec.encode(TrainStep(step=1, policy_version=1, rollout_ids=["gone"]))[0])
        w.add("WEIGHTS", 1, 1.0, "s", codec.encode(WeightManifest(version=1, version_digest="ab" * 16))[0])
    with pytest.raises(ReplayInputError, match="'gone' of step 1"):
        retrain(path)
    path = tmp_path / "nosettings.rlrec"
    with RecordingWriter(path, run="t") as w:
        w.add("TRAINLOG", 1, 1.0, "s", codec.encode(TrainStep(step=1, policy_version=0, dropped=[]))[0])
        w.add("WEIGHTS", 1, 1.0, "s", codec.encode(WeightManifest(version=0, version_digest="ab" * 16))[0])
    with pytest.raises(ReplayInputError, match="no trainer settings"):
        retrain(path)
    assert main(["replay", str(path), "train"]) == 2
    assert main(["replay", str(path), "train", "--topology", str(example_path("tiny")), "--pretrained",
                 str(tmp_path / "none.pt")]) == 2
    assert "pretrained checkpoint" in capsys.readouterr().err


# ---- a recorded run ----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_recorded_while_it_ran_reproduces_every_weight_manifest(finished_run: FinishedRun) -> None:
    """The shared finished `rlbus up` (recorded with `--record` as it ran; every step moves the bf16 weights
    under a falling learning rate) replays digest for digest from the settings it recorded."""
    assert finished_run.proc.returncode == 0, finished_run.proc.stdout[-3000:] + finished_run.proc.stderr[-3000:]
    replay = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "replay", str(finished_run.recording), "train",
                             "--json"], capture_output=True, text=True, timeout=120, check=False,
                            cwd=finished_run.base)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    out = json_in(replay.stdout)
    assert out["versions"] >= 4 and out["matched"] == out["versions"] and out["mismatched"] == 0
    assert out["first_mismatch"] is None and out["loss_mismatches"] == [] and out["unverified"] == []
    digests = [r["recorded"] for r in out["results"]]
    assert len(set(digests)) == len(digests)          # every step moved the bf16 weights: no version repeats one
    assert out["settings"] == "recorded started event of hub-trainer-0"
