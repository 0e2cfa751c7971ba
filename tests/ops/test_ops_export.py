"""`rlbus export` (ops/export.py, model/policies/export.py): a checkpoint becomes a directory that `transformers` loads
alone. A built-in policy as a LlamaForCausalLM whose float32 logits match within the stated tolerance, with a
tokenizer of the same ids and chat layout; a Hugging Face policy bit-exact; a durable checkpoint as its published
bf16 weights; MoE and MTP refused with the reason; bad paths exit 2 with one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.hf import build_family, random_state
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.actors.checkpointer import write_durable
from rlbus.actors.trainer.core import TrainerCore, state_policy
from rlbus.messages.bus import digest
from rlbus.messages.schemas import CheckpointMark
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.export import BYTE_CHAT_TEMPLATE, llama_tensors
from rlbus.model.policies.interface import Policy, frame_turn, load_policy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.generate import generate
from rlbus.model.training.pretrain import CHECKPOINT_NAME
from rlbus.ops.cli import main

TOK = ByteTokenizer()
LOGIT_ATOL = 1e-4
"""`export_policy`'s stated bound on |logits(export) - logits(built-in)| in float32 (measured: ~2e-5, RoPE only)."""
TEXTS = ("def add(x, y):\n    return x + y\n", "héllo wörld — 日本語 🎉\ttabs\r\n  spaces", "")


def _model(seed: int = 0, **overrides: object) -> Transformer:
    """A tiny transformer with N(0, 0.2^2) added to every weight: logits with enough spread for greedy decoding
    to be well defined (the 0.02 init repeats one token)."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=128, **overrides))  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _pretrained(folder: Path, model: Transformer) -> Path:
    folder.mkdir(parents=True)
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": TOK.info(), "meta": {}}, folder / CHECKPOINT_NAME)
    return folder / CHECKPOINT_NAME


def _checkpoint(state_dir: Path, step: int, policy: Policy) -> bytes:
    blob = TrainerCore(policy, policy.clone(), lr=1e-3).state_blob({"step": step})
    name = f"state-step-{step}-test"
    write_durable(state_dir, CheckpointMark(step=step, policy_version=step, objects=[name], digests=[digest(blob)]),
                  {name: blob})
    return blob


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["export", *argv])
    return code, capsys.readouterr().err


def test_a_builtin_policy_exports_as_a_llama_with_its_logits_tokenizer_and_greedy_decoding(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pretrain.pt (untied head, RoPE theta 5000) exported and loaded with transformers alone in float32: logits
    within LOGIT_ATOL of the built-in policy's (its bf16 weights in float32), the same greedy tokens, and a
    tokenizer whose ids, decoding and chat template are the byte tokenizer's."""
    model = _model(tie_embeddings=False, rope_theta=5000.0)
    out = tmp_path / "hf"
    code, err = _export(capsys, str(_pretrained(tmp_path / "base", model)), "-o", str(out))
    assert code == 0, err
    assert "(pretrained base)" in err and f"wrote {out}: LlamaForCausalLM, 0.12M parameters" in err
    assert "MiB bfloat16 (config.json, generation_config.json, model.safetensors" in err

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config    # no custom code
    assert (config["num_key_value_heads"], config["head_dim"], config["rms_norm_eps"]) == (4, 16, 1e-6)
    assert (config["rope_theta"], config["max_position_embeddings"], config["tie_word_embeddings"]) == \
        (5000.0, 128, False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and type(hf).__module__.startswith("transformers.")
    ours = BuiltinPolicy(model).to_(dtype=torch.bfloat16).to_(dtype=torch.float32).eval()   # as published
    prompt = TOK.prompt_ids(TEXTS[0] + TEXTS[1] + TEXTS[0])
    with torch.no_grad():
        want = ours(torch.tensor([prompt])).logits
        got = hf(torch.tensor([prompt])).logits
    diff = float((got - want).abs().max())
    assert 0 < diff < LOGIT_ATOL, diff               # not 0: the two RoPE computations differ in the last bits

    start = TOK.prompt_ids("def add(x, y):")
    rlbus = generate(ours, [start], max_new_tokens=16, temperature=0.0, eos_id=TOK.stop_id)[0].tokens.tolist()
    with torch.no_grad():
        path = ours(torch.tensor([start + rlbus])).logits[0, len(start) - 1:-1]
    top2 = path.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * LOGIT_ATOL    # no near-tie that the tolerance could flip
    theirs = hf.generate(torch.tensor([start]), attention_mask=torch.ones(1, len(start), dtype=torch.long),
                         max_new_tokens=16, do_sample=False, eos_token_id=TOK.stop_id, pad_token_id=TOK.pad_id)
    assert theirs[0, len(start):].tolist() == rlbus and len(set(rlbus)) > 2

    tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == TOK.encode(text), text
        assert tokenizer.decode(TOK.encode(text)) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == \
        (TOK.stop_id, TOK.pad_id, TOK.bos_id)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[1]}], add_generation_prompt=True,
                                         tokenize=True)
    assert list(chat["input_ids"]) == TOK.prompt_ids(TEXTS[1])
    turns = [("user", "a"), ("assistant", "b"), ("observation", "ok"), ("summary", "s")]
    layout = [*TOK.bos()] + [i for role, text in turns for i in frame_turn(TOK, role, TOK.encode(text))[0]]  # type: ignore[arg-type]
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=True)
    assert list(rendered["input_ids"]) == layout
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == BYTE_CHAT_TEMPLATE


def test_a_state_directory_exports_the_published_bf16_weights_of_its_newest_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The newest durable checkpoint's fp32 master weights, rounded to bf16 as its version is published, are the
    export's tensors (qkv split into q/k/v rows; a tied head written once); transformers loads them as they are."""
    _checkpoint(tmp_path / "run", 3, BuiltinPolicy(_model(seed=3)))
    blob = _checkpoint(tmp_path / "run", 7, BuiltinPolicy(_model(seed=7)))
    code, err = _export(capsys, str(tmp_path / "run"), "-o", str(tmp_path / "hf"))
    assert code == 0 and "checkpoint step 7, policy version 7" in err, err

    policy = state_policy(blob)
    assert isinstance(policy, BuiltinPolicy)
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == llama_tensors(policy.transformer).keys() and "lm_head.weight" not in written
    published = TrainerCore(state_policy(blob, dtype=torch.float32), policy.clone(), lr=1e-3).bf16_state()
    q, k, v = published["blocks.1.attn.qkv.weight"].split(64)
    assert torch.equal(written["model.layers.1.self_attn.q_proj.weight"], q)
    assert torch.equal(written["model.layers.1.self_attn.v_proj.weight"], v)
    assert torch.equal(written["model.layers.1.mlp.down_proj.weight"], published["blocks.1.ffn.down.weight"])
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16 and torch.equal(hf.lm_head.weight, published["embed.weight"])
    assert torch.equal(hf.model.layers[1].self_attn.k_proj.weight, k)


def test_moe_is_refused_and_mtp_heads_only_with_drop_mtp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A built-in MoE policy has no Llama form (exit 2, keep the checkpoint); MTP heads are refused unless
    --drop-mtp, which exports without them and says so, next-token logits as before."""
    code, err = _export(capsys, str(_pretrained(tmp_path / "moe", _model(moe_layers=(1,)))), "-o",
                        str(tmp_path / "out"))
    assert code == 2 and "layers [1] are mixture-of-experts" in err and "keep the rlbus checkpoint" in err, err
    assert err.count("\n") == 2 and not (tmp_path / "out").exists()           # the progress line, the refusal

    mtp = _model(mtp_heads=2)
    with torch.no_grad():
        for p in mtp.mtp.parameters():
            p.add_(0.5)                                   # heads that would change something if they were kept
    file = _pretrained(tmp_path / "mtp", mtp)
    code, err = _export(capsys, str(file), "-o", str(tmp_path / "out"))
    assert code == 2 and "2 multi-token-prediction heads" in err and "pass --drop-mtp" in err, err
    code, err = _export(capsys, str(file), "-o", str(tmp_path / "out"), "--drop-mtp")
    assert code == 0 and "dropped 2 multi-token-prediction heads (4 tensors, --drop-mtp)" in err, err
    assert not any(".mtp" in name or name.startswith("mtp") for name in load_file(
        str(tmp_path / "out" / "model.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ours = BuiltinPolicy(mtp).to_(dtype=torch.bfloat16).to_(dtype=torch.float32)
    ids = torch.tensor([TOK.prompt_ids(TEXTS[0])])
    with torch.no_grad():
        assert float((hf(ids).logits - ours(ids).logits).abs().max()) < LOGIT_ATOL


@pytest.mark.parametrize("family", ["qwen2-tied", "qwen3_moe"])
def test_a_hugging_face_policy_exports_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 family: str) -> None:
    """A tiny Hugging Face policy (Qwen2, and Qwen3-MoE: same architecture, experts included) with perturbed
    weights, checkpointed and exported: transformers alone loads it in bf16 with logits bit-equal to the policy's,
    and its tokenizer files unchanged."""
    source = build_family(tmp_path, family)
    policy = load_policy(source, dtype=torch.float32)
    policy.load_tensors_(random_state(policy, seed=1, std=0.02))
    blob = _checkpoint(tmp_path / "run", 2, policy)
    code, err = _export(capsys, str(tmp_path / "run"), "-o", str(tmp_path / "out"))
    assert code == 0 and f"wrote {tmp_path / 'out'}: {policy.module.__class__.__name__}" in err, err

    ours = state_policy(blob)                              # bf16, as the version is published
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.dtype == torch.bfloat16 and type(hf) is type(ours.module)
    rows = [ours.tokenizer.prompt_ids(text) for text in ("def add(x, y):", "ok    return the reward")]
    ids = torch.tensor([row[:min(map(len, rows))] for row in rows])
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, ours(ids).logits)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("def add(x, y):")["input_ids"] == ours.tokenizer.encode("def add(x, y):")


def test_bad_checkpoints_and_outputs_are_exit_2_with_one_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing there, a file that is no checkpoint, or an output that already holds files: exit 2, one line
    naming the path and what was expected; nothing is written."""
    file = _pretrained(tmp_path / "base", _model())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine\n")
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02junk" * 10)
    for argv, fragment in (
            ([str(tmp_path / "nowhere"), "-o", str(tmp_path / "a")], "no such file or directory"),
            ([str(tmp_path / "junk.pt"), "-o", str(tmp_path / "a")], f"{tmp_path / 'junk.pt'}: not a"),
            ([str(file), "-o", str(tmp_path / "full")], "exists and is not an empty directory"),
            ([str(file), "-o", str(tmp_path / "full" / "keep.txt")], "exists and is not an empty directory")):
        code, err = _export(capsys, *argv)
        assert code == 2 and fragment in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "a").exists() and sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert _export(capsys, str(file), "-o", str(tmp_path / "empty"))[0] == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".*.tmp-*"))                                  # no temporary directory left
    with pytest.raises(SystemExit):
        main(["export", str(file)])                                            # -o is required
    assert "-o DIR" in capsys.readouterr().err
