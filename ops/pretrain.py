"""`rlbus pretrain`: continued pretraining of the policy on solved coding tasks, then held-out pass@1.

Owns: the command line and its progress lines. Does not own the training (`model/pretrain.py`).
Writes DIR/pretrain.pt (state_dict, model config, tokenizer info, meta) and DIR/pretrain.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `pretrain` subcommand to the `rlbus` parser."""
    p = sub.add_parser(
        "pretrain",
        help="pretrain the policy on synthetic coding-task solutions and report held-out pass@1",
        description="Train a fresh policy on prompts + canonical solutions of the built-in coding-task "
                    "family (some documents retry after test feedback), checkpoint it, then greedy-decode the "
                    "held-out tasks and print pass@1 with its 95% Wilson interval. The small preset takes "
                    "a few minutes on 2 CPU cores.",
    )
    p.add_argument("--out", type=Path, default=Path(".rlbus/pretrain"), metavar="DIR",
                   help="output folder for pretrain.pt and pretrain.json (default: .rlbus/pretrain)")
    p.add_argument("--config", choices=("small", "tiny"), default="small",
                   help="model and schedule preset: small (the real run) or tiny (seconds, for tests)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and training data (default 0)")
    p.add_argument("--task-seed", type=int, default=0,
                   help="seed of the held-out task set; training never sees its prompts (default 0)")
    p.add_argument("--eval-n", type=int, default=None, help="held-out tasks to evaluate (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from rlbus.model.pretrain import PretrainConfig, PretrainProgress, pretrain

    overrides: dict[str, int] = {"task_seed": args.task_seed}
    if args.eval_n is not None:
        overrides["eval_n"] = args.eval_n
    try:
        config = PretrainConfig.preset(args.config, **overrides)
    except ValueError as err:
        print(f"rlbus pretrain: {err}", file=sys.stderr)
        return 2
    steps = args.steps if args.steps is not None else config.steps
    if steps < 1 or args.threads < 1 or not 1 <= config.eval_n <= 2000:
        print("rlbus pretrain: --steps and --threads must be >= 1 and --eval-n in 1..2000", file=sys.stderr)
        return 2

    def progress(p: PretrainProgress) -> None:
        if p.phase == "train":
            print(f"step {p.step:>5}/{p.steps}  loss {p.loss:.4f}  lr {p.lr:.2e}  "
                  f"{p.tokens_per_s:,.0f} tok/s  {p.elapsed_s:6.1f}s", flush=True)
        else:
            print(f"{p.phase}: {p.note}  ({p.elapsed_s:.1f}s)", flush=True)

    print(f"pretrain: config {args.config}, {steps} steps, seed {args.seed}, task seed {args.task_seed}, "
          f"{args.threads} threads -> {args.out}", flush=True)
    result = pretrain(config, steps, args.seed, args.out, args.threads, progress=None if args.json else progress)
    ev = result.eval
    if args.json:
        print(json.dumps(json.loads(result.summary.read_text())))
        return 0
    print(f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.train_s:.1f}s")
    for family, (k, n) in ev.by_family.items():
        print(f"  {family:<9} {k:>3}/{n:<3}")
    print(f"held-out greedy pass@1 {ev.pass_at_1:.3f} ({ev.passed}/{ev.n}), 95% Wilson CI "
          f"[{ev.ci_low:.3f}, {ev.ci_high:.3f}]")
    print(f"checkpoint {result.checkpoint}  summary {result.summary}  wall {result.wall_s:.1f}s")
    return 0
