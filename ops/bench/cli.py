"""`rlbus bench NAME`: run one benchmark, print its table, or with `--json` one JSON object.

Owns: the dispatch to the `ops/bench/` modules named in `BENCHES` (`add_arguments`, `run`, `table`). Benchmarks
compare against their own baseline in the same run and report ratios; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any, Final

BENCHES: Final = {
    "bus": ("bus", "typed rlbus publish/consume of ~50 KB Rollouts vs raw nats-py on the same bytes"),
    "model": ("model", "KV cache, MTP speculative decoding, in-place weight swap and MXFP8 drift of the policy"),
    "delta": ("delta", "lossless weight-delta compression of real AdamW updates vs raw bf16 and the entropy bound"),
    "sync": ("sync", "delta vs full-snapshot weight sync to generators on the 3-region embedded bus"),
    "async": ("async_pipeline", "async pipeline vs synchronous generate-then-train schedule"),
    "sandbox": ("sandbox", "per-execution sandbox overhead by isolation level"),
    "trainer": ("trainer", "the trainer at world size 1 and 2 (FSDP2 ranks): step time, memory per rank, publish"),
    "precision": ("precision", "MoE numerics: NVFP4/MXFP8 logprob drift, batch invariance, router replay mismatch, "
                               "MXFP8 gradients and a short RL run per precision"),
    "agentic": ("agentic", "multi-turn episodes: the KV cache kept across turns vs re-prefill and transformers "
                           "generate, continuous vs static batching while tools run"),
    "peer": ("peer", "TRL's GRPOTrainer vs rlbus up on the same Hugging Face model, tasks, reward and budget"),
}
"""Benchmark name → (its module in `ops/bench/`, what it measures)."""


def _module(name: str) -> Any:
    return importlib.import_module(f"rlbus.ops.bench.{BENCHES[name][0]}")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark and print its table (or --json)",
                       description="Run a benchmark. " + "; ".join(f"{k}: {v}" for k, (_, v) in BENCHES.items()))
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (smoke test)")
    p.set_defaults(handler=_handler)
    for name in BENCHES:
        module = _module(name)
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)


def _handler(args: argparse.Namespace) -> int:
    module = _module(args.name)
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=None, sort_keys=False))
    else:
        print(module.table(result))
    return 0
