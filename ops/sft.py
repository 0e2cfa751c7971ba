"""`rlbus sft`: supervised fine-tuning of a policy directory on a JSONL file of conversations.

Owns: the command line, its checks and progress lines. Does not own reading the file, the framing or the training
(model/training/sft.py), nor loading a policy (model/training/pretrain.py `load_start`). The output has the input's
format: a built-in folder (pretrain.pt) or a Hugging Face model directory, with sft.json, sft_loss.jsonl and loss.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `sft` subcommand to the `rlbus` parser."""
    p = sub.add_parser(
        "sft",
        help="fine-tune a policy directory on conversations (JSONL, the chat format of Hugging Face templates)",
        description="Fine-tune the policy in --from (a built-in folder with a pretrain.pt, or a Hugging Face model "
                    "directory) on DATA, one JSON conversation a line: {\"messages\": [{\"role\": \"system\" | "
                    "\"user\" | \"assistant\" | \"tool\", \"content\": ..., \"tool_calls\": [...]}], \"tools\": "
                    "[...]}. Each conversation is framed as the agentic generator frames its turns, and the loss "
                    "falls on the assistant's tokens only. Every line is checked first; a bad one is refused naming "
                    "the file, the line and the key. Writes a policy directory of the same kind to -o.",
    )
    p.add_argument("data", type=Path, metavar="DATA", help="JSONL file of conversations")
    p.add_argument("--from", dest="from_dir", type=Path, required=True, metavar="DIR",
                   help="the policy to fine-tune: a Hugging Face model directory, or a folder with a pretrain.pt")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="output policy directory")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--batch", type=int, default=8, help="conversations per step (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    p.add_argument("--tool-list", choices=("auto", "full", "compact"), default="auto",
                   help="the generator's tool list ([generator.agentic] tool_list): 'compact' never frames tools in "
                        "the chat template, 'auto' is compact for a context under 4096 tokens (default auto)")
    p.add_argument("--observation-tokens", type=int, default=1024, metavar="N",
                   help="cut a tool result past N tokens as the generator does ([generator.agentic] "
                        "observation_tokens; default 1024)")
    p.add_argument("--device", choices=("cpu", "auto", "cuda"), default="cpu", help="where to train (default cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.training.pretrain import check_hf_out, load_start
    from rlbus.model.training.sft import SFTConfig, read_conversations, rendered, save, sft
    from rlbus.ops.pretrain import PretrainPrinter, _quiet_transformers

    if args.steps < 1 or args.batch < 1 or args.threads < 1 or args.observation_tokens < 16 or not args.lr > 0:
        print("rlbus sft: --steps, --batch and --threads must be >= 1, --observation-tokens >= 16 and --lr > 0",
              file=sys.stderr)
        return 2
    conversations = read_conversations(args.data)          # SFTError: rlbus sft: FILE:LINE: KEY: ...
    _quiet_transformers()
    policy, _ = load_start(args.from_dir, device=args.device)
    if not isinstance(policy, BuiltinPolicy):
        check_hf_out(args.out)
    config = SFTConfig(steps=args.steps, lr=args.lr, batch_size=args.batch, tool_list=args.tool_list,
                       observation_tokens=args.observation_tokens)
    rendered(conversations, policy.tokenizer, policy.max_seq_len + 1, config.tool_list,   # refuse before training
             config.observation_tokens)
    print(f"sft: {policy.kind} policy from {args.from_dir}, {len(conversations)} conversations from {args.data}, "
          f"{args.steps} steps of {args.batch}, lr {args.lr:g}, seed {args.seed} -> {args.out}", flush=True)
    result = sft(policy, conversations, config, seed=args.seed, threads=args.threads,
                 progress=PretrainPrinter(sys.stdout, prefix="  sft "), device=args.device)
    checkpoint = save(args.out, policy, result, {"from": str(args.from_dir), "data": str(args.data),
                                                 "seed": args.seed, "lr": args.lr, "batch": args.batch,
                                                 "policy": policy.kind})
    print(f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.train_s:.1f}s on "
          f"{result.trained_tokens:,} assistant tokens of {result.conversations} conversations ({result.truncated} "
          f"cut at the context of {policy.max_seq_len}, {result.skipped} left out with no assistant token within it)")
    print(f"policy {checkpoint}", flush=True)
    return 0
