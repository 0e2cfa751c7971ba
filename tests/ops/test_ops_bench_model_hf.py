"""`rlbus bench model --model-policy hf --quick --json`: one JSON object with every key of the HF model bench, each
number positive and finite, a model directory built into the working directory's cache, and a table that
names each metric. No speed is asserted (benchmarks report numbers; the suite checks outcomes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.ops.bench.hf_model import table

pytestmark = pytest.mark.slow

NUMBERS = ("hf_generate_ratio", "rlbus_tokens_per_s", "hf_tokens_per_s", "rlbus_len_mean", "hf_len_mean",
           "trainer_tokens_per_s", "sft_tokens_per_s", "trainer_sft_ratio", "swap_model_bytes", "swap_blob_bytes")
SHARES = ("rlbus_len_std", "hf_len_std", "rlbus_stop_fraction", "hf_stop_fraction", "greedy_stop_fraction",
          # rises of the memory high-water mark: a tiny model's buffers may fit in pages the process already held
          "swap_peak_ratio", "swap_fetch_peak_ratio")


def test_quick_hf_model_bench_prints_every_key_with_finite_positive_numbers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from rlbus.ops.cli import main; sys.exit(main())",
         "bench", "model", "--model-policy", "hf", "--quick", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pretraining steps" in proc.stderr                      # progress while the model is built
    result = json.loads(proc.stdout)
    for key in NUMBERS:
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    for key in SHARES:
        assert math.isfinite(result[key]) and result[key] >= 0, (key, result[key])
    assert result["policy"] == "hf" and result["architecture"] == "Qwen2ForCausalLM"
    assert result["trainer_tokens"] > 0 and result["trainer_rollouts"] == result["prompts"] * result["group"]
    assert result["swap_at_step"] is not None
    cached = tmp_path / result["model_dir"]
    assert (cached / "config.json").is_file() and json.loads((cached / "pretrain.json").read_text())["final"]
    text = table(result)
    assert all(name in text for name in ("hf_generate_ratio", "trainer_tokens_per_s", "swap_peak_ratio"))
