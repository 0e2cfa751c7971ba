"""`rlbus bench agentic --quick --json` prints one object with the stable keys, and the invariants hold: every ratio
is a positive finite number, the episodes have the shape the bench names, and continuous batching keeps more of the
batch sampling than static batching on the quick shape's seeded tool delays (the quick shape is one where they
differ), the generator's two sampling paths report a mean decoding batch of at least one row, and MTP
speculative sampling gives the same tokens as plain greedy decoding for both policies. No speed is
asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlbus.ops.bench.agentic import QUICK, table
from rlbus.ops.cli import main


def test_quick_agentic_bench_keys_and_invariants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)   # the Qwen2 is built and cached under .rlbus/bench here
    assert main(["bench", "agentic", "--quick", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert set(r["turn_cache_speedup"]) == {"hf", "builtin"}
    ratios = [*r["turn_cache_speedup"].values(), r["vs_transformers_ratio"]]
    assert all(math.isfinite(x) and x > 0 for x in ratios)
    assert set(r["tokens_per_s"]["hf"]) == {"cached", "reprefill", "transformers"}
    assert set(r["tokens_per_s"]["builtin"]) == {"cached", "reprefill"}

    occ, steps = r["batch_occupancy"], r["occupancy_steps"]
    assert set(occ) == {"continuous", "static"} and all(0 < x <= 1 for x in occ.values())
    assert occ["continuous"] > occ["static"] and steps["continuous"] < steps["static"]
    for key in ("generator_batch_rows", "generator_tokens_per_s"):
        assert set(r[key]) == {"continuous", "batcher"} and all(math.isfinite(x) and x > 0 for x in r[key].values())
    assert all(x >= 1 for x in r["generator_batch_rows"].values())

    for key in ("spec_speedup", "mtp_acceptance"):
        assert set(r[key]) == {"hf", "builtin"}
    assert all(math.isfinite(x) and x > 0 for x in r["spec_speedup"].values())
    assert all(0 <= x <= 1 for x in r["mtp_acceptance"].values())
    race = r["speculative"]["race"]
    assert all(race[p]["exact"] and race[p]["tokens_per_forward"] >= 1 for p in ("hf", "builtin"))

    shape = r["episode_tokens"]
    assert shape["final"] == QUICK.prompt + QUICK.turns * QUICK.turn + (QUICK.turns - 1) * QUICK.observation
    assert r["quick"] is True and r["threads"] == 1 and len(r["loadavg"]) == 3
    assert (tmp_path / ".rlbus" / "bench").is_dir()

    assert "speedup" in table(r) and "mtp_acceptance" in table(r)   # the table renders from the same keys
