"""`rlbus pretrain`: continued pretraining of a policy (built-in or Hugging Face), then held-out pass@1.

Owns: the command line and its progress lines (`PretrainPrinter`, shared with `rlbus up`). Does not own the
training (`model/training/pretrain.py`) or the corpus (`model/training/corpus.py`). A built-in run writes DIR/pretrain.pt
(state_dict, model config, tokenizer info, meta), DIR/pretrain.json and DIR/loss.png; a Hugging Face run
(`--hf ARCH`, or `--from` a model directory) makes DIR a model directory that `transformers` loads, with
pretrain.json and loss.png inside. `--phases FILE` runs the `[[pretrain.phases]]` of a TOML file's `[pretrain]`
table (model/training/phases.py) into the one output, a marker file per finished phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rlbus.model.training.phases import Phase
    from rlbus.model.training.pretrain import PretrainProgress
    from rlbus.topology.file.schema import PretrainSettings

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
        help="pretrain a policy (built-in or Hugging Face) on coding-task solutions and Python source, "
             "report held-out pass@1",
        description="Train a policy on prompts + canonical solutions of the built-in coding-task family (some "
                    "documents retry after test feedback), mixed with real Python source (the standard library's "
                    "own files and any --corpus folder, decontaminated against the held-out tasks), checkpoint "
                    "it, then greedy-decode the held-out tasks and print pass@1 with its 95% Wilson interval. "
                    "By default a fresh built-in transformer (the small preset takes a few minutes on 2 CPU "
                    "cores); --hf ARCH builds a Hugging Face model from scratch (its BPE tokenizer trained on "
                    "the corpus); --from DIR continues a Hugging Face model directory (or a pretrain.pt folder).",
    )
    p.add_argument("--out", type=Path, default=Path(".rlbus/pretrain"), metavar="DIR",
                   help="output folder (default: .rlbus/pretrain); a Hugging Face run makes it a model directory")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--hf", metavar="ARCH", default=None,
                       help="build a Hugging Face model of this architecture from scratch (qwen2, llama, qwen3, "
                            "qwen3_moe) at the --config size")
    start.add_argument("--from", dest="from_dir", type=Path, default=None, metavar="DIR",
                       help="continue pretraining the policy in DIR: a Hugging Face model directory, or a folder "
                            "with a pretrain.pt; the step count continues from its pretrain.json")
    p.add_argument("--config", choices=("small", "tiny", "m30"), default=None,
                   help="model and schedule preset: small (the real built-in run, the default), tiny (seconds, "
                        "for tests; the default with --hf) or m30 (~30M parameters); with --hf it also picks the "
                        "recipe's model size of that name")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--phases", type=Path, default=None, metavar="FILE",
                   help="run the [[pretrain.phases]] of FILE's [pretrain] table (a topology file, or one holding only "
                        "that table) in order into --out: main, long_context and sft phases, a marker per finished "
                        "phase, so a run started again resumes after the last one; its preset, seed, threads, "
                        "eval_n and max_seq_len apply unless given here")
    p.add_argument("--seed", type=int, default=None, help="seed of initialisation and training data (default 0)")
    p.add_argument("--task-seed", type=int, default=0,
                   help="seed of the held-out task set; training never sees its prompts (default 0)")
    p.add_argument("--eval-n", type=int, default=None, help="held-out tasks to evaluate (default: the preset's)")
    p.add_argument("--corpus", type=Path, action="append", default=[], metavar="DIR",
                   help="a folder of .py files to train on besides the standard library (repeatable)")
    p.add_argument("--no-stdlib", action="store_true", help="leave the standard library's sources out of the corpus")
    p.add_argument("--code-fraction", type=float, default=None, metavar="F",
                   help="share of documents that are Python source, 0..1 (default 0.5 for a Hugging Face "
                        "policy, 0 for the built-in one)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write an intermediate checkpoint every N steps (default: the preset's)")
    p.add_argument("--device", choices=("cpu", "auto", "cuda"), default="cpu",
                   help="where to train: cpu (the default; deterministic per thread count), auto or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 2)")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.set_defaults(handler=_handler)


def _quiet_transformers() -> None:
    """No transformers progress bars (loading and writing weights) between the step lines; this process only."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:     # HFPolicy.load names the missing package
        return
    hf_logging.disable_progress_bar()


HF_CODE_FRACTION = 0.5
"""Default share of code documents for a Hugging Face policy (the built-in one trains on task documents only)."""


def _handler(args: argparse.Namespace) -> int:
    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.training.corpus import CorpusError
    from rlbus.model.training.pretrain import (
        PretrainConfig,
        check_hf_out,
        load_start,
        new_hf_policy,
        pretrain,
    )

    settings: PretrainSettings | None = None
    if args.phases is not None:
        settings = load_phases(args.phases)
        if args.steps is not None:
            print("rlbus pretrain: --steps with --phases: each phase has its own steps", file=sys.stderr)
            return 2
        args.eval_n = args.eval_n if args.eval_n is not None else settings.eval_n
    seed_default, threads_default = (settings.seed, settings.threads) if settings is not None else (0, 2)
    args.seed = seed_default if args.seed is None else args.seed
    args.threads = threads_default if args.threads is None else args.threads
    preset = args.config or ("tiny" if args.hf else settings.preset if settings is not None else "small")
    overrides: dict[str, Any] = {"task_seed": args.task_seed, "stdlib": not args.no_stdlib,
                                 "corpus_dirs": tuple(str(d) for d in args.corpus)}
    for key, value in (("eval_n", args.eval_n), ("lr", args.lr), ("checkpoint_every", args.checkpoint_every)):
        if value is not None:
            overrides[key] = value
    try:
        config = PretrainConfig.preset(preset, **overrides)
    except ValueError as err:
        print(f"rlbus pretrain: {err}", file=sys.stderr)
        return 2
    if settings is not None and settings.max_seq_len is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=settings.max_seq_len))
    steps = args.steps if args.steps is not None else config.steps
    if steps < 1 or args.threads < 1 or not 1 <= config.eval_n <= 2000:
        print("rlbus pretrain: --steps and --threads must be >= 1 and --eval-n in 1..2000", file=sys.stderr)
        return 2
    if not config.lr > 0 or config.checkpoint_every < 1 or not 0.0 <= (args.code_fraction or 0.0) <= 1.0:
        print("rlbus pretrain: --lr must be > 0, --checkpoint-every >= 1 and --code-fraction in 0..1",
              file=sys.stderr)
        return 2
    missing = [str(d) for d in args.corpus if not d.is_dir()]
    if missing:
        print(f"rlbus pretrain: --corpus {missing[0]} is not a folder; pass a folder of .py files", file=sys.stderr)
        return 2

    start_step, origin, policy, what = 0, "", None, f"config {preset}"
    if args.hf is not None or args.from_dir is not None:
        _quiet_transformers()
    if args.from_dir is not None:
        policy, start_step = load_start(args.from_dir, device=args.device)
        origin, what = str(args.from_dir), f"{policy.kind} policy from {args.from_dir} (step {start_step})"
    elif args.hf is not None:
        check_hf_out(args.out)                  # before the tokenizer and model are built
        policy = new_hf_policy(config, args.hf, preset, args.seed, max_seq_len=config.model.max_seq_len,
                               device=args.device)
        what = f"hf {args.hf} {preset}"
    hf = policy is not None and not isinstance(policy, BuiltinPolicy)
    fraction = args.code_fraction if args.code_fraction is not None else HF_CODE_FRACTION if hf else 0.0
    config = dataclasses.replace(config, code_fraction=fraction)
    if fraction > 0 and args.no_stdlib and not args.corpus:
        print("rlbus pretrain: --code-fraction > 0 with --no-stdlib needs a --corpus folder", file=sys.stderr)
        return 2

    if settings is not None:
        return _run_phases(args, config, phases_of(settings), policy, start_step, origin, what)
    print(f"pretrain: {what}, {steps} steps, seed {args.seed}, task seed {args.task_seed}, "
          f"code fraction {fraction:g}, {args.threads} threads -> {args.out}", flush=True)
    try:
        result = pretrain(config, steps, args.seed, args.out, args.threads,
                          progress=None if args.json else PretrainPrinter(sys.stdout), policy=policy,
                          start_step=start_step, origin=origin, device=args.device)
    except CorpusError as err:
        print(f"\nrlbus pretrain: {err}", file=sys.stderr)
        return 2
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


def load_phases(path: Path) -> PretrainSettings:
    """The `[pretrain]` table of the TOML file `path` (a topology file's, or a file holding only that table).

    :raises RlbusError: the file cannot be read, is not TOML, has no phases, or a key is wrong (named).
    """
    import tomllib

    import msgspec

    from rlbus.messages.errors import RlbusError
    from rlbus.topology.file.schema import PretrainSettings

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise RlbusError(f"{path}: cannot read a TOML file ({type(err).__name__}: {err})") from None
    table = doc.get("pretrain")
    if not isinstance(table, dict):
        raise RlbusError(f"{path}: pretrain: missing; expected a [pretrain] table with [[pretrain.phases]]")
    try:
        settings = msgspec.convert(table, PretrainSettings)
    except msgspec.ValidationError as err:
        message, _, where = str(err).partition(" - at `$")
        key = "pretrain" + where.rstrip("`")
        raise RlbusError(f"{path}: {key}: {message}") from None
    if not settings.phases:
        raise RlbusError(f"{path}: pretrain.phases: none; expected [[pretrain.phases]] tables (name, kind, steps)")
    return settings


def phases_of(settings: PretrainSettings) -> list[Phase]:
    """The `[[pretrain.phases]]` of `settings` as the phases `run_phases` runs."""
    from rlbus.model.training.phases import Phase

    return [Phase(name=p.name, kind=p.kind, steps=p.steps, seq_len=p.seq_len, lr=p.lr, warmup_steps=p.warmup_steps,
                  min_lr_ratio=p.min_lr_ratio, batch_size=p.batch_size, data=p.data, rope_theta=p.rope_theta,
                  mtp_heads=p.mtp_heads, mtp_steps=p.mtp_steps)
            for p in settings.phases]


def _run_phases(args: argparse.Namespace, config: Any, phases: list[Phase], policy: Any, start_step: int,
                origin: str, what: str) -> int:
    from rlbus.model.training.corpus import CorpusError
    from rlbus.model.training.phases import run_phases

    listed = ", ".join(f"{p.name} ({p.kind}, {p.steps})" for p in phases)
    print(f"pretrain: {what}, phases {listed}, seed {args.seed}, task seed {args.task_seed}, {args.threads} "
          f"threads -> {args.out}", flush=True)
    try:
        result = run_phases(config, phases, args.seed, args.out, args.threads,
                            progress=None if args.json else PretrainPrinter(sys.stdout), policy=policy,
                            start_step=start_step, origin=origin, device=args.device)
    except CorpusError as err:
        print(f"\nrlbus pretrain: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json.loads(result.summary.read_text())))
        return 0
    for record in result.phases:
        losses = record.get("losses") or [float("nan")]
        line = f"  phase {record['index']} {record['name']:<12} {record['kind']:<12} steps {record['start_step'] + 1}-" \
               f"{record['start_step'] + record['steps']}  loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        held = record.get("held_out")
        if held:
            line += f"  held-out loss at {record['seq_len']} tokens {held['before']:.3f} -> {held['after']:.3f}"
        print(line)
    ev = result.eval
    print(f"held-out greedy pass@1 {ev.pass_at_1:.3f} ({ev.passed}/{ev.n}), 95% Wilson CI "
          f"[{ev.ci_low:.3f}, {ev.ci_high:.3f}]")
    print(f"checkpoint {result.checkpoint}  summary {result.summary}  wall {result.wall_s:.1f}s")
    return 0
