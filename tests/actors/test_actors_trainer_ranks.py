"""Trainer ranks on real gloo groups of 2 and 3 processes on loopback (actors/trainer/ranks.py): two ranks train
as one rank does (within an fp32 tolerance) on the built-in tiny policy and a tiny Hugging Face Qwen2 with tied
embeddings, a world size reproduces itself bit for bit, sharded checkpoints resume at 2 and 1 ranks and a
one-rank state loads into 2, the published version is the gathered bf16 state; a rank that never joins is
named, a stalled rank times every collective out, a killed leader breaks its followers' wait.

One group runs every step and checkpoint check (`steps_case` in tests/helpers/ranks.py); the test process
trains the same batches on one `TrainerCore` and reads the group's checkpoints back with `shards_to_payload`.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any, Final

import pytest
import torch
from helpers.hf import build_family
from helpers.ranks import build, saved, write_rollouts
from helpers.rollouts import sample_rollouts

from rlbus.actors.common.errors import CheckpointError
from rlbus.actors.trainer.core import Objective
from rlbus.actors.trainer.ranks import (
    RankError,
    RankSpec,
    is_sharded,
    join,
    shards_to_payload,
    state_bytes,
)
from rlbus.kernels.delta.state import encode_state
from rlbus.ops.local_ranks import LocalGroup, free_port

TOLERANCE: Final = 1e-6
"""Largest |w_2 ranks - w_1 rank| allowed after 3 AdamW steps at lr 1e-4 in fp32 (seen: about 1e-8 built-in,
6e-8 Hugging Face): the two sum a step's gradients in another order, so they are not bit-exact."""
SHAPES: Final = ((2, 2), (1, 3), (1, 1), (2, 2))
"""(tasks, group size) of steps 1-4: the second splits 2 + 1 rollouts, the third leaves rank 1 without any."""
AGGREGATIONS: Final = ("token_mean", "sequence_mean", "token_sum_norm", "token_mean")
TESTS_DIR: Final = str(Path(__file__).resolve().parents[1])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a)


def _equal_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else
        _equal_state(a[k], b[k]) if isinstance(a[k], dict) else a[k] == b[k] for k in a)


def _one_rank(policy: str, steps: list[list[Any]]) -> dict[str, Any]:
    core = build(policy)
    blob0 = core.state_blob({"tag": "blob0"})
    stats = [core.train_step(steps[i], Objective(aggregation=AGGREGATIONS[i])) for i in range(3)]
    w3 = {k: t.detach().clone() for k, t in core.policy.named_tensors().items()}
    blob3 = core.state_blob({"tag": "blob3"})
    core.train_step(steps[3], Objective(aggregation=AGGREGATIONS[3]))
    w4 = {k: t.detach().clone() for k, t in core.policy.named_tensors().items()}
    return {"blob0": blob0, "blob3": blob3, "stats": stats, "w3": w3, "w4": w4}


@pytest.fixture(scope="module")
def group_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both cases (built-in, Hugging Face) through one 2-rank group, beside their one-rank references."""
    root = tmp_path_factory.mktemp("ranks")
    policies = {"builtin": "builtin", "hf": str(build_family(root, "qwen2-tied"))}
    cases, ones = [], {}
    for name, policy in policies.items():
        sampler = build(policy)
        steps = [sample_rollouts(sampler.policy, tasks=t, group_size=g, seed=i, tag=f"{name}{i}")
                 for i, (t, g) in enumerate(SHAPES)]
        write_rollouts(root / f"{name}.rollouts", steps)
        ones[name] = _one_rank(policy, steps) | {"steps": steps, "policy": policy, "out": root / name}
        for blob in ("blob0", "blob3"):
            (root / f"{name}.{blob}").write_bytes(ones[name][blob])
        cases.append({"policy": policy, "rollouts": str(root / f"{name}.rollouts"), "aggregations": AGGREGATIONS,
                      "out": str(root / name), "blob0": str(root / f"{name}.blob0"),
                      "blob3": str(root / f"{name}.blob3")})
    job = {"cases": cases, "result": str(root / "result.json"), "marks": str(root)}
    with LocalGroup(2, "helpers.ranks:steps_case", job, timeout_s=60, env={"PYTHONPATH": TESTS_DIR}) as group:
        deadline = time.monotonic() + 240
        while not (root / "pinged-1").exists():
            assert time.monotonic() < deadline, "the group did not finish its steps"
            assert all(p.poll() is None for p in group.procs), "\n".join(r.error for r in group.wait(0))
            time.sleep(0.2)
        group.kill(0)           # the leader, pinging: see test_a_killed_leader_breaks_the_wait_of_its_follower
        _, follower = group.wait(120)
    assert follower.returncode == 0, follower.error
    results = json.loads((root / "result.json").read_text())
    for i, name in enumerate(policies):
        ones[name]["group"] = results[i]
    ones["follower"] = follower.result | {"port": group.port}
    return ones


@pytest.mark.parametrize("case", ["builtin", "hf"])
def test_two_ranks_train_as_one_rank_within_the_fp32_tolerance(group_run: dict[str, Any], case: str) -> None:
    """After steps 1-3 (token_mean, sequence_mean, token_sum_norm; a step where rank 1 has no rollout) the 2-rank
    weights and AdamW moments are the 1-rank ones within TOLERANCE and the stats agree; so is step 4 after a
    one-rank state was loaded into 2 ranks (1 -> 2)."""
    run = group_run[case]
    s3 = shards_to_payload(saved(run["out"], "s3"))
    weights = _max_diff(s3["model"], run["w3"])
    assert weights <= TOLERANCE, f"{case}: max |w2 - w1| {weights:.3g} after 3 steps"
    one = build(run["policy"])
    one.load_state_blob(run["blob3"])
    moments = one.optimizer.state_dict()["state"]
    assert moments.keys() == s3["optimizer"]["state"].keys()
    for i, values in moments.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(values[key], s3["optimizer"]["state"][i][key], rtol=1e-4, atol=1e-9), (i, key)
        assert torch.equal(values["step"], s3["optimizer"]["state"][i]["step"])
    for mine, theirs in zip(run["group"]["stats"], run["stats"], strict=True):
        for key in ("loss", "kl", "reward_mean", "reward_std", "mean_weight", "truncated_fraction", "grad_norm"):
            assert mine[key] == pytest.approx(getattr(theirs, key), rel=1e-4, abs=1e-6), key
        assert (mine["tokens"], mine["applied"]) == (theirs.tokens, theirs.applied)
    after_load = _max_diff(shards_to_payload(saved(run["out"], "f4"))["model"], run["w4"])
    assert after_load <= TOLERANCE, f"{case}: step 4 after loading the one-rank state: {after_load:.3g}"


@pytest.mark.parametrize("case", ["builtin", "hf"])
def test_a_world_size_reproduces_itself_and_its_checkpoints_bit_for_bit(group_run: dict[str, Any],
                                                                        case: str) -> None:
    """Steps 1-3 again from the initial state give the same bits (weights and AdamW state); step 4 after
    loading the step-3 shards equals step 4 after saving them (2 -> 2)."""
    out = group_run[case]["out"]
    first, again = shards_to_payload(saved(out, "s3")), shards_to_payload(saved(out, "r3"))
    assert (first.pop("meta"), again.pop("meta")) == ({"tag": "s3"}, {"tag": "r3"})
    assert _equal_state(first, again)
    original, resumed = shards_to_payload(saved(out, "s4a")), shards_to_payload(saved(out, "s4b"))
    assert _equal_state(original["model"], resumed["model"])
    assert _equal_state(original["optimizer"], resumed["optimizer"])


def test_two_rank_shards_resume_on_one_rank(group_run: dict[str, Any]) -> None:
    """2 -> 1: the step-3 shards as a one-rank state blob load into a `TrainerCore` (weights and AdamW state as
    saved) and its step 4 matches the 2-rank step 4 within TOLERANCE."""
    run = group_run["builtin"]
    payload = shards_to_payload(saved(run["out"], "s3"))
    core = build("builtin")
    assert core.load_state_blob(state_bytes(payload)) == {"tag": "s3"}
    assert _equal_state(core.optimizer.state_dict(), payload["optimizer"])
    assert _max_diff(core.policy.named_tensors(), payload["model"]) == 0.0
    core.train_step(run["steps"][3], Objective(aggregation=AGGREGATIONS[3]))
    two = shards_to_payload(saved(run["out"], "s4a"))["model"]
    assert _max_diff(core.policy.named_tensors(), two) <= TOLERANCE


@pytest.mark.parametrize("case", ["builtin", "hf"])
def test_the_published_version_is_the_gathered_bf16_state(group_run: dict[str, Any], case: str) -> None:
    """The leader's published version (gathered one tensor at a time) has the digest of the bf16 cast of the
    full fp32 state saved at the same step, and its raw size."""
    run = group_run[case]
    model = shards_to_payload(saved(run["out"], "f4"))["model"]
    bf16 = {k: t.to(torch.bfloat16) for k, t in model.items()}
    index, _ = encode_state(bf16, None)
    assert run["group"]["digest"] == index.version_digest.hex()
    assert run["group"]["raw"] == sum(t.numel() * 2 for t in bf16.values())


def test_every_rank_uploads_its_own_files_and_the_leader_lists_them_rank_by_rank(group_run: dict[str, Any]) -> None:
    """save_shards returns rank 0's objects (metadata, leader file, its shard) then rank 1's, each digest the
    sha256 of the stored bytes; the names make a sharded checkpoint, and one missing file is refused."""
    out = group_run["builtin"]["out"]
    listing = json.loads((out / "s3.json").read_text())
    files = [name.partition("-")[2] for name in listing["objects"]]
    assert files == ["dcp.metadata", "dcp__0_0.distcp", "trainer-state.pt", "dcp__1_0.distcp"]
    for name, digest in zip(listing["objects"], listing["digests"], strict=True):
        assert hashlib.sha256((out / "store" / name).read_bytes()).hexdigest() == digest
    assert is_sharded(listing["objects"]) and not is_sharded(["state-step-3-abcd1234"])
    partial = {k: v for k, v in saved(out, "s3").items() if k != "dcp__1_0.distcp"}
    with pytest.raises(CheckpointError, match="does not load"):
        shards_to_payload(partial)
    with pytest.raises(CheckpointError, match=re.escape("lacks trainer-state.pt")):
        shards_to_payload({k: v for k, v in saved(out, "s3").items() if k != "trainer-state.pt"})


def test_a_rank_that_never_joins_is_named() -> None:
    """Rank 0 of 2 alone: RankError naming rank 1 and the address after the timeout; rank 1 alone: rank 0."""
    port = free_port()
    with pytest.raises(RankError, match=re.escape(f"trainer rank 1 did not join the rendezvous at 127.0.0.1:{port} "
                                                  f"within 1.5 s")):
        join(RankSpec(rank=0, world_size=2, addr="127.0.0.1", port=port, timeout_s=1.5), torch.device("cpu"))
    with pytest.raises(RankError, match=re.escape("trainer rank 0 did not open the rendezvous at 127.0.0.1:")):
        join(RankSpec(rank=1, world_size=2, addr="127.0.0.1", port=free_port(), timeout_s=1.5), torch.device("cpu"))


def test_rank_spec_from_the_environment() -> None:
    """RLBUS_* variables -> RankSpec; none or world size 1 -> None; a bad value named."""
    env = {"RLBUS_RANK": "1", "RLBUS_WORLD_SIZE": "2", "RLBUS_RENDEZVOUS": "10.0.0.5:29400",
           "RLBUS_COLLECTIVE_TIMEOUT_S": "20"}
    spec = RankSpec.from_env(env)
    assert spec == RankSpec(rank=1, world_size=2, addr="10.0.0.5", port=29400, timeout_s=20.0)
    assert RankSpec.from_env(spec.env()) == spec
    assert RankSpec.from_env({}) is None and RankSpec.from_env({"RLBUS_WORLD_SIZE": "1"}) is None
    with pytest.raises(RankError, match="RLBUS_RENDEZVOUS='nowhere': expected host:port"):
        RankSpec.from_env({**env, "RLBUS_RENDEZVOUS": "nowhere"})
    with pytest.raises(RankError, match="RLBUS_RANK=2, RLBUS_WORLD_SIZE=2"):
        RankSpec.from_env({**env, "RLBUS_RANK": "2"})


@pytest.mark.chaos
def test_a_stalled_rank_times_out_the_collectives_of_the_leader(tmp_path: Path) -> None:
    """Rank 1 of 2 stops (SIGSTOP: alive, silent) as step 1 starts: the leader's train_step raises RankError once
    the collective timeout has passed (gloo's "Timed out"), naming rank 0 and the address."""
    torch.manual_seed(0)
    steps = [sample_rollouts(build("builtin").policy, tasks=2, group_size=2)]
    write_rollouts(tmp_path / "rollouts", steps)
    job = {"rollouts": str(tmp_path / "rollouts"), "out": str(tmp_path)}
    with LocalGroup(2, "helpers.ranks:stall_case", job, timeout_s=4, env={"PYTHONPATH": TESTS_DIR}) as group:
        leader, stalled = group.wait(120, ranks=(0,))
        assert stalled.returncode is None            # still stopped; close() kills it
    assert leader.returncode == 0, leader.error
    assert leader.result["error"] == "RankError", leader.result
    message = leader.result["message"]
    assert f"trainer rank 0: the group at 127.0.0.1:{group.port} broke while running a train step" in message
    assert "Timed out" in message


@pytest.mark.chaos
def test_a_killed_leader_breaks_the_wait_of_its_follower(group_run: dict[str, Any]) -> None:
    """SIGKILL of rank 0 while it pings (after the step checks) and rank 1 waits in follow(): rank 1 raises
    RankError at once (its peer's connection closed), not after the 60 s collective timeout."""
    follower = group_run["follower"]
    assert follower["error"] == "RankError", follower
    message = follower["message"]
    assert f"trainer rank 1: the group at 127.0.0.1:{follower['port']} broke while waiting for the leader" in message
    assert "Timed out" not in message
