"""`rlbus sft` end to end on tiny policies (built-in and a Hugging Face recipe directory): the loss on the
assistant's tokens falls, the output has the input's format and loads as a policy, the loss log and plot are
written, and a bad line is refused before any training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import pytest
import torch
import torch.nn.functional as F
from helpers.hf import build_family

from rlbus.model.policies.interface import Policy, load_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tools.calls import TOOL_SCHEMAS
from rlbus.model.training.pretrain import LOSS_PLOT, PretrainConfig, _save
from rlbus.model.training.sft import SFT_LOG, SFT_SUMMARY, read_conversations, render
from rlbus.ops.cli import main


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


ROWS: Final = [
    {"messages": [
        {"role": "user", "content": "Fix add in a.py."},
        {"role": "assistant", "content": "I will read it.", "tool_calls": [_call("read_file", path="a.py")]},
        {"role": "tool", "content": "def add(x, y):\n    return x - y\n"},
        {"role": "assistant", "content": "", "tool_calls": [_call("edit_file", path="a.py", old="x - y",
                                                                  new="x + y")]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "", "tool_calls": [_call("submit")]}],
     "tools": [s for s in TOOL_SCHEMAS if s["function"]["name"] in ("read_file", "edit_file", "submit")]},
    {"messages": [{"role": "user", "content": "def double(x):"}, {"role": "assistant", "content": "return 2 * x"}]},
]


def _data(tmp_path: Path, rows: list[Any]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _loss(policy: Policy, data: Path) -> float:
    """Mean cross-entropy on the trained tokens of every conversation in `data`."""
    total, count = 0.0, 0
    with torch.no_grad():
        for c in read_conversations(data):
            flat = render(c, policy.tokenizer)
            ids = torch.tensor([flat.ids])
            logits = policy.forward(ids[:, :-1]).logits.float()[0]
            mask = torch.tensor(flat.loss_mask[1:], dtype=torch.float32)
            total += float((F.cross_entropy(logits, ids[0, 1:], reduction="none") * mask).sum())
            count += int(mask.sum())
    return total / count


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=ByteTokenizer().vocab_size, max_seq_len=512))
    out = tmp_path_factory.mktemp("builtin")
    _save(out / "pretrain.pt", model, PretrainConfig(model=model.config), {"seed": 0, "step": 0, "final": True})
    return out


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_sft_lowers_the_assistant_loss_and_writes_a_policy_of_the_inputs_kind(
        tmp_path: Path, builtin_dir: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A few steps on two conversations (one with tool calls and results) lower the loss on the assistant's tokens;
    the output is the input's kind (a pretrain.pt folder, or a directory plain transformers loads) with sft.json,
    the per-step loss log and loss.png; progress lines are printed."""
    start = builtin_dir if kind == "builtin" else build_family(tmp_path, "qwen2-tied", max_seq_len=2048)
    data = _data(tmp_path, ROWS)
    out = tmp_path / "out"
    before = _loss(load_policy(start, dtype=torch.float32), data)
    assert main(["sft", str(data), "--from", str(start), "-o", str(out), "--steps", "6", "--lr", "3e-3",
                 "--batch", "2", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "sft step     1/6" in printed and "sft step     6/6" in printed and f"policy {out}" in printed
    after = load_policy(out, dtype=torch.float32)
    assert type(after) is type(load_policy(start)) and _loss(after, data) < before - 0.5
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(out) is not None
    else:
        assert (out / "pretrain.pt").is_file()
    summary = json.loads((out / SFT_SUMMARY).read_text())
    log = [json.loads(line) for line in (out / SFT_LOG).read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5, 6] and summary["losses"] == [e["loss"] for e in log]
    assert summary["conversations"] == 2 and (out / LOSS_PLOT).read_bytes().startswith(b"\x89PNG")


def test_a_bad_line_is_refused_before_training(tmp_path: Path, builtin_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A tool_calls that is not a list on line 2: exit 2, one line naming the file, the line and the key, no
    output folder."""
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": "ls"}]}
    data = _data(tmp_path, [ROWS[1], bad])
    out = tmp_path / "out"
    assert main(["sft", str(data), "--from", str(builtin_dir), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlbus sft: {data}:2: messages[1].tool_calls: expected a list, got str" and not out.exists()
