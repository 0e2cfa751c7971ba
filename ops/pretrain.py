"""`rlbus pretrain`: continued pretraining of the policy on solved coding tasks, then held-out pass@1.

Owns: the command line and its progress lines (`PretrainPrinter`, shared with `rlbus up`). Does not own the
training (`model/pretrain.py`). Writes DIR/pretrain.pt (state_dict, model config, tokenizer info, meta) and
DIR/pretrain.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rlbus.model.pretrain import PretrainProgress

PROGRESS_EVERY = 10
"""Off a terminal, a progress line every this many optimizer steps (and at the first and the last)."""


class PretrainPrinter:
    """Progress lines of one pretraining run, for `pretrain(progress=...)`.

    On a terminal the step line is rewritten in place after every step; elsewhere (a pipe, a log file, CI)
    a line is printed at the first step, every `every` steps and the last, so a long run shows it is alive.
    Checkpoints are named with their step, and no line is printed twice.
    """

    def __init__(self, out: TextIO, *, prefix: str = "", every: int = PROGRESS_EVERY, tty: bool | None = None) -> None:
        self.out = out
        self.prefix = prefix
        self.every = max(1, every)
        self.tty = out.isatty() if tty is None else tty
        self._shown: set[str] = set()
        self._open = False

    def __call__(self, p: PretrainProgress) -> None:
        if p.phase == "train":
            line = (f"step {p.step:>5}/{p.steps}  loss {p.loss or 0.0:.4f}  lr {p.lr or 0.0:.2e}  "
                    f"{p.tokens_per_s or 0.0:,.0f} tok/s  {p.elapsed_s:6.1f}s")
            if self.tty:
                self.out.write(f"\r{self.prefix}{line}")
                self._open = p.step < p.steps
                if not self._open:
                    self.out.write("\n")
                self.out.flush()
            elif p.step == 1 or p.step % self.every == 0 or p.step == p.steps:
                self._line(line)
        elif p.phase == "checkpoint":
            final = " (final)" if p.step == p.steps else ""
            self._line(f"checkpoint at step {p.step}/{p.steps}{final}: {p.note}")
        else:
            self._line(f"{p.phase}: {p.note}  ({p.elapsed_s:.1f}s)")

    def _line(self, text: str) -> None:
        if text in self._shown:
            return
        self._shown.add(text)
        if self._open:          # end the in-place step line first
            self.out.write("\n")
            self._open = False
        self.out.write(f"{self.prefix}{text}\n")
        self.out.flush()


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
    from rlbus.model.pretrain import PretrainConfig, pretrain

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

    print(f"pretrain: config {args.config}, {steps} steps, seed {args.seed}, task seed {args.task_seed}, "
          f"{args.threads} threads -> {args.out}", flush=True)
    result = pretrain(config, steps, args.seed, args.out, args.threads,
                      progress=None if args.json else PretrainPrinter(sys.stdout))
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
