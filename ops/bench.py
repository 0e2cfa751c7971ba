"""`rlbus bench NAME`: run one benchmark, print its table, or with `--json` one JSON object.

Owns: the dispatch to `ops/bench_<name>.py` modules (`add_arguments`, `run`, `table`). Benchmarks
compare against their issue's baseline in the same run and report ratios; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Final

BENCHES: Final = {
    "bus": "typed rlbus publish/consume of ~50 KB Rollouts vs raw nats-py on the same bytes",
    "model": "KV cache, MTP speculative decoding, in-place weight swap and MXFP8 drift of the policy",
    "delta": "lossless weight-delta compression of real AdamW updates vs raw bf16 and the entropy bound",
    "sync": "delta vs full-snapshot weight sync to generators on the 3-region embedded bus",
    "async": "async pipeline vs synchronous generate-then-train schedule",
    "sandbox": "per-execution sandbox overhead by isolation level",
}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark and print its table (or --json)",
                       description="Run a benchmark. " + "; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (smoke test)")
    p.set_defaults(handler=_handler)
    for name in BENCHES:
        try:
            module = importlib.import_module(f"rlbus.ops.bench_{name}")
        except ModuleNotFoundError as err:
            if err.name != f"rlbus.ops.bench_{name}":
                raise
            continue
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)


def _handler(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(f"rlbus.ops.bench_{args.name}")
    except ModuleNotFoundError:
        print(f"rlbus bench: benchmark {args.name!r} is not built yet", file=sys.stderr)
        return 2
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=None, sort_keys=False))
    else:
        print(module.table(result))
    return 0
