"""The Hugging Face policy: cached padded forward, sampling vs transformers, swaps, specs, router replay, checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf import DENSE, FAMILIES, build_family, prompts, random_state

from rlbus.model.policies.hf import HFCache, HFPolicy
from rlbus.model.policies.hf_chat import HFChatTokenizer
from rlbus.model.policies.hf_checks import check_dir
from rlbus.model.policies.interface import (
    ChatTokenizer,
    PolicyCache,
    PolicyError,
    frame_turn,
    policy_from_spec,
)
from rlbus.model.sampling.generate import generate, left_pad

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: build_family(root, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def policies(dirs: dict[str, Path]) -> dict[str, HFPolicy]:
    """Each family loaded once, with random weights of more signal than the init (see helpers.hf)."""
    out = {}
    for family, path in dirs.items():
        policy = HFPolicy.load(path)
        policy.load_tensors_(random_state(policy, seed=1))
        out[family] = policy
    return out


def _fresh(dirs: dict[str, Path], family: str, seed: int) -> HFPolicy:
    policy = HFPolicy.load(dirs[family])
    policy.load_tensors_(random_state(policy, seed=seed))
    return policy


def _alone(policy: HFPolicy, ids: list[int]) -> torch.Tensor:
    """Last-position logits of one uncached, unpadded forward of `ids`."""
    with torch.no_grad():
        return policy(torch.tensor([ids])).logits[0, -1]


# ---- forward and cache -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_left_padded_forward_matches_each_row_alone(policies: dict[str, HFPolicy], family: str) -> None:
    """Prefill of a left-padded batch, then token-by-token decoding, gives each row's uncached logits."""
    policy = policies[family]
    rows = prompts(policy)
    tokens, mask = left_pad(rows, policy.tokenizer.pad_id, policy.device)
    cache = policy.new_cache(len(rows), tokens.shape[1] + 4)
    assert isinstance(cache, PolicyCache)
    with torch.no_grad():
        out = policy(tokens, cache=cache, attention_mask=mask)
        for step in range(4):
            for b, row in enumerate(rows):
                torch.testing.assert_close(out.logits[b, -1], _alone(policy, row), atol=1e-5, rtol=0)
                if out.routing is not None:  # the experts of the real tokens are those the row alone runs
                    alone = policy(torch.tensor([row])).routing
                    assert alone is not None
                    assert torch.equal(out.routing[b, -1], alone[0, -1])
            nxt = [40 + 7 * b + step for b in range(len(rows))]
            rows = [[*row, t] for row, t in zip(rows, nxt, strict=True)]
            out = policy(torch.tensor(nxt)[:, None], cache=cache)
    assert cache.length == tokens.shape[1] + 4
    assert cache.next_pos.tolist() == [len(row) for row in rows]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_keep_rows_and_truncate_keep_each_row_exact(policies: dict[str, HFPolicy], family: str) -> None:
    """keep_rows copies and drops rows (and padding no kept row needs); truncate rolls slots back."""
    policy = policies[family]
    rows = prompts(policy)
    longest = max(range(len(rows)), key=lambda b: len(rows[b]))
    tokens, mask = left_pad(rows, policy.tokenizer.pad_id, policy.device)
    cache = policy.new_cache(len(rows), tokens.shape[1] + 8)
    keep = [*[b for b in range(len(rows)) if b != longest][::-1], 0]  # a row twice: a group's copy
    with torch.no_grad():
        policy(tokens, cache=cache, attention_mask=mask)
        cache.keep_rows(torch.tensor(keep), 8)
        assert cache.batch == len(keep)
        assert cache.length == max(len(rows[b]) for b in keep)  # the longest row's padding went with it
        kept = [rows[b] for b in keep]
        out = policy(torch.tensor([[50]] * len(keep)), cache=cache)
        for b, row in enumerate(kept):
            torch.testing.assert_close(out.logits[b, -1], _alone(policy, [*row, 50]), atol=1e-5, rtol=0)
        cache.truncate(cache.length - 1)  # forget token 50, feed 60 instead
        out = policy(torch.tensor([[60]] * len(keep)), cache=cache)
        for b, row in enumerate(kept):
            torch.testing.assert_close(out.logits[b, -1], _alone(policy, [*row, 60]), atol=1e-5, rtol=0)


# ---- sampling -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_equals_transformers_generate(policies: dict[str, HFPolicy], family: str) -> None:
    """rlbus `generate` at temperature 0 equals transformers' greedy `generate` token for token, for prompts of
    different lengths and a group of identical ones in one batch."""
    policy = policies[family]
    tok = policy.tokenizer
    base = prompts(policy)
    batch = [base[0], base[1], base[0], base[2], base[0]]
    out = generate(policy, batch, max_new_tokens=10, temperature=0, eos_id=tok.stop_id, pad_id=tok.pad_id)
    tokens, mask = left_pad(batch, tok.pad_id, policy.device)
    with torch.no_grad():
        theirs = policy.module.generate(input_ids=tokens, attention_mask=mask.long(), max_new_tokens=10,
                                        do_sample=False, eos_token_id=tok.stop_id, pad_token_id=tok.pad_id)
    assert len({tuple(seq.tokens.tolist()) for seq in out}) > 1  # rows differ: the comparison means something
    for b, seq in enumerate(out):
        mine = seq.tokens.tolist()
        ref = theirs[b, tokens.shape[1]:].tolist()
        assert mine == ref[: len(mine)]
        assert seq.finish_reason == "length" or mine[-1] == tok.stop_id
        assert all(t == tok.pad_id for t in ref[len(mine):])


def _staggered_eos(rows: list[list[int]]) -> int:
    """A token that ends the rows at two or more different steps (so rows leave the batch one by one)."""
    for token in sorted({t for row in rows for t in row}):
        if len({row.index(token) for row in rows if token in row}) >= 2:
            return token
    raise AssertionError("no token ends the rows at different steps")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_rows_leaving_the_batch_keep_every_row_and_its_routing(policies: dict[str, HFPolicy], family: str) -> None:
    """Rows ending at different steps leave the batch (keep_rows inside generate): each row is its eos-free
    decode cut at its eos, and a routed row's record still replays to its behaviour logprobs."""
    policy = policies[family]
    base = prompts(policy)
    batch = [base[0], base[1], base[0], base[2], base[1], base[0], base[2], base[0], base[1]]
    free = [s.tokens.tolist() for s in generate(policy, batch, max_new_tokens=12, temperature=0,
                                                pad_id=policy.tokenizer.pad_id)]
    eos = _staggered_eos(free)
    out = generate(policy, batch, max_new_tokens=12, temperature=0, eos_id=eos, pad_id=policy.tokenizer.pad_id)
    assert len({len(seq.tokens) for seq in out}) >= 2
    for prompt, row, seq in zip(batch, free, out, strict=True):
        assert seq.tokens.tolist() == (row[: row.index(eos) + 1] if eos in row else row)
        if seq.routing is not None:
            assert seq.routing.shape == (len(prompt) + len(seq.tokens), 2, 2)
            torch.testing.assert_close(seq.logprobs, _full_logp(policy, prompt, seq.tokens, seq.routing),
                                       atol=1e-5, rtol=0)


def test_importing_the_policy_modules_does_not_import_transformers() -> None:
    """transformers loads in seconds: importing rlbus.model.policies.interface, hf_policy and hf_recipe leaves it unloaded."""
    code = ("import sys, rlbus.model.policies.interface, rlbus.model.policies.hf, rlbus.model.policies.hf_recipe; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_in_flight_swap_changes_version_at_the_right_token(dirs: dict[str, Path], family: str) -> None:
    """Weights loaded in at step 5 give versions [7]*5 + [8]*rest and equal a manual old-then-new decode over the
    same kept cache; the first 5 tokens are those of the old weights alone."""
    policy = _fresh(dirs, family, seed=1)
    old_state = {name: t.clone() for name, t in policy.published_state(torch.float32).items()}  # not aliases
    new_state = random_state(policy, seed=2)
    prompt = prompts(policy)[1]

    def on_step(step: int) -> int | None:
        if step == 5:
            policy.load_tensors_(new_state)
            return 8
        return None

    seq = generate(policy, [prompt], max_new_tokens=12, temperature=0, version=7, on_step=on_step)[0]
    assert seq.versions.tolist() == [7] * 5 + [8] * 7

    ref = _fresh(dirs, family, seed=0)
    ref.load_tensors_(old_state)
    tokens: list[int] = []
    with torch.no_grad():
        cache = ref.new_cache(1, len(prompt) + 12)
        logits = ref(torch.tensor([prompt]), cache=cache).logits[0, -1]
        for step in range(12):
            if step == 5:
                ref.load_tensors_(new_state)  # same kept cache, new weights
            if step > 0:
                logits = ref(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert seq.tokens.tolist() == tokens
    ref.load_tensors_(old_state)
    old_only = generate(ref, [prompt], max_new_tokens=12, temperature=0)[0]
    assert seq.tokens[:5].tolist() == old_only.tokens[:5].tolist()
    assert seq.tokens[5:].tolist() != old_only.tokens[5:].tolist()  # the swap mattered


# ---- weights and specs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_policy_from_spec_and_published_state_gives_identical_logits(
    policies: dict[str, HFPolicy], family: str
) -> None:
    """A policy built from spec + files with the published fp32 state computes bit-identical logits."""
    policy = policies[family]
    spec = policy.spec()
    assert json.loads(json.dumps(spec)) == spec and spec["policy"] == "hf"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(spec["files"])
    joiner = policy_from_spec(spec, policy.files(), dtype=torch.float32)
    assert isinstance(joiner, HFPolicy) and joiner.spec() == spec
    joiner.load_tensors_(policy.published_state(torch.float32))
    tokens, mask = left_pad(prompts(policy), policy.tokenizer.pad_id, policy.device)
    with torch.no_grad():
        assert torch.equal(joiner(tokens, attention_mask=mask).logits, policy(tokens, attention_mask=mask).logits)
    assert joiner.tokenizer.prompt_ids("hi") == policy.tokenizer.prompt_ids("hi")


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "chat_template.jinja"])
def test_policy_from_spec_refuses_a_tampered_file(policies: dict[str, HFPolicy], name: str) -> None:
    """A file whose sha256 differs from the spec's is refused, naming it; so is one the spec lists but lacks."""
    policy = policies["llama"]
    files = policy.files()
    files[name] = files[name] + b" "
    with pytest.raises(PolicyError, match=name.replace(".", r"\.")):
        HFPolicy.from_spec(policy.spec(), files)
    del files[name]
    with pytest.raises(PolicyError, match=name.replace(".", r"\.")):
        HFPolicy.from_spec(policy.spec(), files)


def test_policy_from_spec_refuses_a_file_name_outside_the_shipped_set(policies: dict[str, HFPolicy]) -> None:
    """A spec cannot make a joiner write a file of any other name (a path out of the temporary directory)."""
    policy = policies["llama"]
    spec = policy.spec()
    spec["files"] = {**spec["files"], "../escape.json": "0" * 64}
    with pytest.raises(PolicyError, match=r"escape\.json"):
        HFPolicy.from_spec(spec, {**policy.files(), "../escape.json": b"{}"})


@pytest.mark.parametrize("family", ["qwen2-tied", "qwen2-untied"])
def test_named_tensors_list_a_tied_weight_once(dirs: dict[str, Path], family: str) -> None:
    """Tied embeddings appear once (as model.embed_tokens.weight); writing into it changes the output head too."""
    policy = HFPolicy.load(dirs[family])
    names = policy.named_tensors()
    tied = FAMILIES[family]["tie_embeddings"]
    assert ("lm_head.weight" in names) is not tied and "model.embed_tokens.weight" in names
    state = policy.published_state(torch.float32)
    state["model.embed_tokens.weight"] = torch.full_like(state["model.embed_tokens.weight"], 0.5)
    policy.load_tensors_(state)
    head = policy.module.get_output_embeddings().weight
    assert bool((head == 0.5).all()) is tied


# ---- router replay ----------------------------------------------------------------------------------------
def _full_logp(policy: HFPolicy, prompt: list[int], tokens: torch.Tensor, routing: torch.Tensor | None
               ) -> torch.Tensor:
    """Reference: one uncached forward over prompt + tokens (routing replayed if given), logprob of each token."""
    seq = torch.tensor(prompt + tokens.tolist())[None]
    with torch.no_grad():
        logits = policy(seq, routing=None if routing is None else routing[None]).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(-1, tokens[:, None])[:, 0]


def test_router_replay_reproduces_the_behaviour_logprobs(policies: dict[str, HFPolicy]) -> None:
    """The routing `generate` records covers prompt + completion; replayed it reproduces the behaviour logprobs,
    and replaying other experts does not."""
    policy = policies["qwen3_moe"]
    assert policy.moe == (2, 2) and policy.n_experts == 4
    rows = prompts(policy)
    out = generate(policy, rows, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(3),
                   pad_id=policy.tokenizer.pad_id)
    for prompt, seq in zip(rows, out, strict=True):
        assert seq.routing is not None and seq.routing.shape == (len(prompt) + len(seq.tokens), 2, 2)
        with torch.no_grad():
            natural = policy(torch.tensor(prompt + seq.tokens.tolist())[None]).routing
        assert natural is not None and torch.equal(natural[0], seq.routing)
        torch.testing.assert_close(seq.logprobs, _full_logp(policy, prompt, seq.tokens, seq.routing),
                                   atol=1e-5, rtol=0)
        other = (seq.routing + 1) % policy.config.num_experts
        assert (seq.logprobs - _full_logp(policy, prompt, seq.tokens, other)).abs().max() > 1e-3


def test_replayed_routing_is_what_the_experts_run(policies: dict[str, HFPolicy]) -> None:
    """A forward with routing given reports exactly that routing, and its gradients reach the router."""
    policy = policies["qwen3_moe"]
    ids = torch.tensor([prompts(policy)[0]])
    forced = torch.randint(0, policy.config.num_experts, (1, ids.shape[1], 2, 1)).expand(-1, -1, -1, 2).clone()
    forced[..., 1] = (forced[..., 0] + 1) % policy.config.num_experts
    out = policy(ids, routing=forced)
    assert out.routing is not None and torch.equal(out.routing, forced)
    out.logits.sum().backward()
    routers = [m.gate.weight for m in policy.module.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert routers and all(w.grad is not None and bool(w.grad.abs().sum() > 0) for w in routers)
    policy.module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", DENSE)
def test_dense_policy_refuses_routing(policies: dict[str, HFPolicy], family: str) -> None:
    """routing= on a dense architecture is a PolicyError; a dense policy reports no moe and no routing."""
    policy = policies[family]
    assert policy.moe is None and policy.n_experts is None
    ids = torch.tensor([prompts(policy)[2]])
    assert policy(ids).routing is None
    with pytest.raises(PolicyError, match="dense"):
        policy(ids, routing=torch.zeros(1, ids.shape[1], 1, 1, dtype=torch.long))


# ---- checking directories ---------------------------------------------------------------------------------
def _rewrite_json(name: str, **changes: object) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = json.loads((path / name).read_text())
        data.update(changes)
        (path / name).write_text(json.dumps(data))
    return edit


def _truncate(name: str, keep: float) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: int(len(data) * keep)])
    return edit


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda path: (path / name).write_text(text)


BAD_DIRS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # case: (edit, the file the message names, a phrase of what was expected)
    "no directory": (lambda path: shutil.rmtree(path), "model", "no such directory"),
    "no config": (lambda path: (path / "config.json").unlink(), "config.json", "no such file"),
    "no weights": (lambda path: (path / "model.safetensors").unlink(), "model", "safetensors"),
    "no tokenizer": (lambda path: (path / "tokenizer.json").unlink(), "tokenizer.json", "no such file"),
    "config not json": (_write("config.json", '{"architectures": ['), "config.json", "not JSON"),
    "architecture": (_rewrite_json("config.json", architectures=["GPT2LMHeadModel"]), "config.json",
                     "Qwen3MoeForCausalLM"),
    "other moe": (_rewrite_json("config.json", architectures=["MixtralForCausalLM"], num_local_experts=8),
                  "config.json", "routing"),
    "truncated weights": (_truncate("model.safetensors", 0.5), "model.safetensors", "truncated"),
    "corrupt weights": (_write("model.safetensors", "not a tensor file at all, not even close"),
                        "model.safetensors", "corrupt"),
    "truncated tokenizer": (_truncate("tokenizer.json", 0.5), "tokenizer.json", "invalid"),
    "vocab too big": (_rewrite_json("config.json", vocab_size=300), "tokenizer.json", "vocab_size"),
    "template error": (_write("chat_template.jinja", "{% for m in messages %}{{ m.content }"),
                       "chat_template.jinja", "does not render"),
    "template raises": (_write("chat_template.jinja", "{{ raise_exception('roles must alternate') }}"),
                        "chat_template.jinja", "roles must alternate"),
    "no special closing": (_write("chat_template.jinja",
                                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
                                  "{% if add_generation_prompt %}assistant: {% endif %}"),
                           "chat_template.jinja", "special token"),
}


@pytest.mark.parametrize("case", BAD_DIRS)
def test_check_dir_names_the_file_of_each_defect(dirs: dict[str, Path], tmp_path: Path, case: str) -> None:
    """Each defect of a directory is one PolicyError line naming its file; HFPolicy.load refuses it alike."""
    edit, file, expected = BAD_DIRS[case]
    path = shutil.copytree(dirs["llama"], tmp_path / "model")
    edit(path)
    with pytest.raises(PolicyError) as caught:
        check_dir(path)
    message = str(caught.value)
    assert "\n" not in message and file in message and expected in message, message
    with pytest.raises(PolicyError, match=file):
        HFPolicy.load(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_check_dir_accepts_what_the_recipe_builds(dirs: dict[str, Path], family: str) -> None:
    """Every tiny directory passes the check."""
    check_dir(dirs[family])


def test_recipe_is_deterministic_for_a_seed(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The same arguments write the same files; another seed other weights."""
    again = build_family(tmp_path / "a", "qwen3")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (dirs["qwen3"] / name).read_bytes(), name
    other = build_family(tmp_path / "b", "qwen3", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


# ---- the chat tokenizer ------------------------------------------------------------------------------------
def _template_text(tok: HFChatTokenizer, messages: list[tuple[str, str]], generation: bool) -> str:
    return str(tok.hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                          add_generation_prompt=generation))


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_prompt_ids_decode_to_the_templates_own_text(policies: dict[str, HFPolicy], family: str) -> None:
    """prompt_ids and frame_turn lay a conversation out as the chat template renders it (a default system turn in
    bos()), and the closing's special first token is the stop."""
    tok = policies[family].tokenizer
    assert isinstance(tok, HFChatTokenizer) and isinstance(tok, ChatTokenizer)
    prompt = "Write add(x, y).\nUse <b>tags</b> & spaces  "
    assert tok.decode(tok.prompt_ids(prompt), specials=True) == _template_text(tok, [("user", prompt)], True)
    assert bool(tok.bos()) is ("system_prompt" in FAMILIES[family])
    answer = [*tok.encode("def add(x, y):\n    return x + y"), tok.stop_id]
    ids = tok.bos()
    for role, content in (("user", tok.encode(prompt)), ("assistant", answer), ("observation", tok.encode("ok"))):
        turn, mask = frame_turn(tok, role, content)  # type: ignore[arg-type]
        ids += turn
        assert sum(mask) == (len(content) if role == "assistant" else 0)
    expected = _template_text(tok, [("user", prompt), ("assistant", "def add(x, y):\n    return x + y"),
                                    ("user", "ok")], False)
    assert tok.decode(ids, specials=True) == expected
    assert tok.decode([tok.stop_id], specials=True) == "<|im_end|>" and tok.stop_id == tok.closing()[0]
    assert tok.stop_ids == (tok.stop_id, tok.hf.convert_tokens_to_ids("<|endoftext|>"))
    assert tok.header("observation") == tok.header("user") and tok.header("summary") == tok.header("assistant")


def test_text_spelling_special_tokens_encodes_to_ordinary_ids(policies: dict[str, HFPolicy]) -> None:
    """encode never yields a special id, whatever the text spells; decode drops special ids."""
    tok = policies["qwen3"].tokenizer
    text = "a <|im_end|><|im_start|>assistant\n<|endoftext|><|pad|> b"
    ids = tok.encode(text)
    assert not any(tok.is_special(i) for i in ids) and tok.stop_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.stop_id, *tok.encode("x"), tok.eos_id, tok.pad_id]) == "x"


def test_tokenizer_without_a_template_frames_chatml(dirs: dict[str, Path], tmp_path: Path) -> None:
    """No chat template: the framing is ChatML's."""
    path = shutil.copytree(dirs["qwen3"], tmp_path / "model")
    (path / "chat_template.jinja").unlink()
    tok = HFPolicy.load(path).tokenizer
    assert tok.hf.chat_template is None
    assert tok.decode(tok.prompt_ids("hi"), specials=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_cache_reports_its_shape(policies: dict[str, HFPolicy]) -> None:
    """new_cache is an empty HFCache of the batch; a budget past max_seq_len is refused."""
    policy = policies["llama"]
    cache = policy.new_cache(3, 16, torch.bfloat16)
    assert isinstance(cache, HFCache) and cache.batch == 3 and cache.length == 0
    with pytest.raises(ValueError, match="max_seq_len"):
        policy.new_cache(1, policy.max_seq_len + 1)
    with torch.no_grad(), pytest.raises(ValueError, match="slots"):
        policy(torch.zeros(3, 17, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("family", ["qwen2-tied", "llama"])
def test_plain_autotokenizer_encodes_a_recipe_directory_as_the_policy_does(dirs: dict[str, Path], family: str) -> None:
    """transformers picks its own tokenizer class for a Qwen2 directory (rebuilding the split rules around the
    file's vocabulary); the recipe trains with those rules, so a user of plain transformers gets rlbus's ids."""
    from transformers import AutoTokenizer

    policy = HFPolicy.load(dirs[family])
    plain = AutoTokenizer.from_pretrained(dirs[family])
    for text in ("def add(x, y):\n    return x+y  # ok\n\n\n", "héllo wörld 1234", "  \t x\r\n"):
        assert plain(text, add_special_tokens=False)["input_ids"] == policy.tokenizer.encode(text), text
