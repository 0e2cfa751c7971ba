"""`rlbus bench precision --quick --json` prints one object with the stable keys, and the invariants hold: the
plain recipe drifts 0 from itself while the quantised ones drift, per-token NVFP4 is batch-invariant and the
per-tensor counter-case is not, the Qwen3-MoE's fused experts are quantised, router replay with a check that
replaced nothing is replay (and a higher threshold replaces no fewer), and the MXFP8 gradients differ from the plain ones. No speed is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlbus.ops.cli import main

pytestmark = pytest.mark.slow


def test_quick_precision_bench_keys_and_invariants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)   # the models are built and cached under .rlbus/bench here
    assert main(["bench", "precision", "--quick", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    drift = r["logprob_drift"]
    assert {"bf16", "mxfp8", "nvfp4"} <= set(drift)
    assert drift["bf16"] == {"mean": 0.0, "p99": 0.0}
    assert drift["mxfp8"]["mean"] > 0 and drift["nvfp4"]["mean"] > 0
    assert drift["nvfp4"]["p99"] >= drift["nvfp4"]["mean"]

    assert r["batch_invariant_nvfp4"] is True
    assert r["batch_variance_per_tensor"] > 0

    mismatch, routing = r["router_mismatch_p99"], r["routing"]
    assert set(mismatch) == {"off", "replay", "replay_checked"}
    assert all(math.isfinite(v) and v >= 0 for v in mismatch.values())
    if routing["replaced_experts"] == 0:   # the check changed no expert: the same forward as plain replay
        assert mismatch["replay_checked"] == mismatch["replay"]
    sweep = routing["sweep"]               # one MoE layer: a higher threshold marks a superset implausible
    assert r["policy"]["moe_layers"] == 1
    assert routing["replaced_experts"] <= sweep["0.9"]["replaced_experts"] <= sweep["1.0"]["replaced_experts"]

    grads = r["grad_check"]
    assert grads["per_tensor"] and grads["max"] == max(grads["per_tensor"].values())
    assert all(math.isfinite(e) for e in grads["per_tensor"].values())
    assert grads["max_experts"] > 0

    hf = r["qwen3_moe"]
    assert hf["architecture"] == "Qwen3MoeForCausalLM" and hf["quantised_layers"] > 0
    assert hf["logprob_drift"]["bf16"] == {"mean": 0.0, "p99": 0.0} and hf["logprob_drift"]["nvfp4"]["mean"] > 0
    assert set(hf["router_mismatch_p99"]) == {"off", "replay", "replay_checked"}

    for recipe in ("bf16", "nvfp4"):
        run = r["rl"][recipe]
        assert {"base", "base_ci95", "pass_at_1", "ci95", "mismatch_p99"} <= set(run)
        for value, (low, high) in ((run["base"], run["base_ci95"]), (run["pass_at_1"], run["ci95"])):
            assert 0 <= low <= value <= high <= 1
        assert math.isfinite(run["mismatch_p99"])
    assert set(r["rl"]["verdict"]) == {"bf16_learned", "nvfp4_overlaps_bf16"}
