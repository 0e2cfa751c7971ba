"""`rlbus export CHECKPOINT -o DIR`: a policy written out as a Hugging Face directory that plain `transformers` loads.

CHECKPOINT is anything `rlbus eval` scores (ops/eval.py `load_policy`): a run's state directory (its newest
durable checkpoint), one `checkpoints/step-N` directory, a `pretrain.pt` or a Hugging Face directory. The policy
is taken in bfloat16, as its version is published, and written by `model/policies/export.py`.

Owns: the `export` subcommand (arguments, progress lines on stderr).
Does not: map weights or build tokenizer files (model/policies/export.py), or find checkpoints (ops/eval.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face directory (transformers loads it without rlbus)",
        description="Write the policy of CHECKPOINT to DIR as a Hugging Face model directory that "
                    "`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` "
                    "load without rlbus: config.json, generation_config.json, model.safetensors (bfloat16, the "
                    "weights as a version is published), tokenizer.json and tokenizer_config.json with the chat "
                    "template. A Hugging Face policy keeps its architecture (save_pretrained) and tokenizer files. A "
                    "built-in policy becomes a LlamaForCausalLM, its byte tokenizer a tokenizer.json with the same "
                    "ids and its chat layout (<|bos|>, <|role|>content<|end_turn|>, <|assistant|>) as the template. "
                    "Refused: built-in mixture-of-experts layers (a Llama has no experts; keep the rlbus checkpoint) "
                    "and multi-token-prediction heads unless --drop-mtp. CHECKPOINT is what `rlbus eval` takes: a "
                    "run's state directory (its newest durable checkpoint), one checkpoints/step-N directory, a "
                    "pretrain.pt (or the directory holding it), or a Hugging Face directory. DIR must not exist yet "
                    "or be empty.")
    p.add_argument("checkpoint", type=Path,
                   help="state directory, checkpoints/step-N directory, pretrain.pt, or Hugging Face directory")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="the directory to write (new, or empty)")
    p.add_argument("--drop-mtp", action="store_true",
                   help="export a built-in policy without its multi-token-prediction heads (they only draft for "
                        "speculative decoding; next-token logits are unchanged)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from rlbus.model.policies.export import ExportError, export_policy
    from rlbus.ops.eval import load_policy

    out: Path = args.output
    if out.exists() and (not out.is_dir() or any(out.iterdir())):    # before the (slower) load
        raise ExportError(f"{out}: exists and is not an empty directory; choose a new directory (an export never "
                          f"overwrites files)")
    policy, label = load_policy(args.checkpoint, device="cpu")
    _progress(f"{label}: {policy.describe()}")
    done = export_policy(policy, out, drop_mtp=args.drop_mtp)
    if done.dropped:
        heads = sorted({name.split(".")[1] for name in done.dropped})
        _progress(f"dropped {len(heads)} multi-token-prediction heads ({len(done.dropped)} tensors, --drop-mtp)")
    dtype = str(done.dtype).removeprefix("torch.")
    _progress(f"wrote {out}: {done.architecture}, {done.parameters / 1e6:.2f}M parameters, "
              f"{done.nbytes / 2**20:.1f} MiB {dtype} ({', '.join(done.files)})")
    return 0


def _progress(text: str) -> None:
    print(f"rlbus export: {text}", file=sys.stderr, flush=True)
