"""The Hugging Face policy: a local model directory (`config.json`, safetensors, `tokenizer.json`) behind `Policy`.

Owns: `check_dir` (what `rlbus validate` runs; nothing built), `HFChatTokenizer` (turn framing cut out of the
model's chat template), `HFCache` (a DynamicCache with per-row key masks and positions), `HFPolicy` (load, spec,
the built-in transformer's forward semantics, Qwen3-MoE router record and replay). Attention: SDPA by default.
Does not own: sampling (`model/sampling/generate.py`), the interface (`model/policies/interface.py`), building directories
(`model/policies/hf_recipe.py`). `transformers` is imported inside functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import Tensor, nn

from rlbus.model.policies.interface import (
    Policy,
    PolicyCache,
    PolicyError,
    PolicyOutput,
    Role,
    default_prompt_ids,
    resolve_device,
)

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedTokenizerFast

SUPPORTED: Final = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ROUTED: Final = "Qwen3MoeForCausalLM"
"""The one routed family: its router's choices are recorded and replayed."""
DEFAULT_ATTENTION: Final = "sdpa"
SHIPPED: Final = ("config.json", "tokenizer.json", "tokenizer_config.json")
"""Files a joiner always gets (`HFPolicy.files`)."""
OPTIONAL: Final = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")
"""Files a joiner gets when the directory has them."""
DEFAULT_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n`): the framing of a tokenizer without a chat template."""
TEMPLATE_ROLES: Final[dict[Role, str]] = {
    "user": "user",
    "assistant": "assistant",
    "observation": "user",  # test feedback is what the harness tells the policy: a user turn
    "summary": "assistant",  # the policy's own words about its history
}
_SENTINELS: Final = ("rlbusSentinelUserOne", "rlbusSentinelAssistantTwo", "rlbusSentinelUserThree")
_MOE_KEYS: Final = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _line(err: BaseException | str) -> str:
    """An exception (or text) as one short line."""
    text = " ".join(str(err).split())
    return text if len(text) <= 240 else text[:237] + "..."


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the directory ----------------------------------------------------------------------------------------
def _read_config(file: Path) -> dict[str, Any]:
    """config.json as a dict with a supported architecture, a vocab_size and a max_position_embeddings.

    :raises PolicyError: missing, not JSON, or a key missing or not what rlbus supports.
    """
    if not file.is_file():
        raise PolicyError(f"{file}: no such file; expected the model's transformers config")
    try:
        config = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PolicyError(f"{file}: not JSON ({_line(err)}); expected the model's transformers config") from None
    if not isinstance(config, dict):
        raise PolicyError(f"{file}: holds a {type(config).__name__}; expected a JSON object (the model's config)")
    names = config.get("architectures")
    expected = f"expected one of {', '.join(SUPPORTED)}"
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise PolicyError(f"{file}: key 'architectures' is {names!r}; {expected} (a list of one name)")
    if names[0] not in SUPPORTED:
        if any(config.get(key) for key in _MOE_KEYS):
            raise PolicyError(f"{file}: key 'architectures' is {names[0]!r}, a mixture of experts whose routing "
                              f"rlbus cannot record and replay; {expected} ({ROUTED} is the routed one)")
        raise PolicyError(f"{file}: key 'architectures' is {names[0]!r}; {expected}")
    for key in ("vocab_size", "max_position_embeddings"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PolicyError(f"{file}: key {key!r} is {value!r}; expected a positive integer")
    return config


def _check_weights(path: Path) -> None:
    """Every safetensors file readable (its header parses and covers the file); an index's shards present.

    :raises PolicyError: naming the file.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PolicyError(f"{path}: no *.safetensors weights; expected model.safetensors (or the shards "
                          f"model.safetensors.index.json lists)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_bytes())["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise PolicyError(f"{index}: not a safetensors index ({_line(err)}); expected key 'weight_map' "
                              f"mapping tensor names to shard files") from None
        for shard in sorted(shards):
            if not (path / str(shard)).is_file():
                raise PolicyError(f"{index}: key 'weight_map' names shard {shard!r}, which is missing")
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
            raise PolicyError(f"{file}: not a readable safetensors file ({_line(err)}); expected the complete "
                              f"weights (the file is corrupt or truncated)") from None


def _template_source(path: Path) -> str:
    """Where the chat template comes from, for messages."""
    jinja = path / "chat_template.jinja"
    return str(jinja) if jinja.is_file() else f"{path / 'tokenizer_config.json'} key 'chat_template'"


def _load_tokenizer(path: Path, config: Mapping[str, Any]) -> HFChatTokenizer:
    """tokenizer.json (and tokenizer_config.json, the chat template) as an `HFChatTokenizer`.

    The tokenizer is tokenizer.json as written, through transformers' generic fast tokenizer (a model-specific
    class may rebuild parts of the pipeline).

    :raises PolicyError: a file missing or invalid, a vocabulary larger than config.json's `vocab_size`, or a
        chat template that does not render or frames turns without a special closing token.
    """
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise PolicyError(f"{file}: no such file; expected the tokenizer (tokenizers' JSON format)")
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise PolicyError(f"{file}: not a tokenizers tokenizer ({_line(err)}); the file is truncated or "
                          f"invalid") from None
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(len(vocab), max(vocab.values(), default=-1) + 1)
    if size > config["vocab_size"]:
        raise PolicyError(f"{file}: {size} token ids (added tokens included) exceed config.json key 'vocab_size' "
                          f"{config['vocab_size']}; expected at most that many (the embedding's rows)")
    settings = path / "tokenizer_config.json"
    if settings.is_file():
        try:
            json.loads(settings.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PolicyError(f"{settings}: not JSON ({_line(err)}); expected the tokenizer's settings") from None
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as err:  # transformers raises many kinds on a bad tokenizer_config.json
        raise PolicyError(f"{settings}: the tokenizer does not load ({type(err).__name__}: {_line(err)})") from None
    return HFChatTokenizer(hf, name=f"hf:{path.name}", template_source=_template_source(path))


def check_dir(path: Path) -> None:
    """Check a Hugging Face model directory without building the model (what `rlbus validate` runs).

    :raises PolicyError: one line naming the file, the key and what was expected: a missing directory; a missing
        config.json, *.safetensors or tokenizer.json; a config.json that is not JSON or names an architecture
        outside `SUPPORTED`; a corrupt or truncated safetensors file; an invalid tokenizer.json; a vocabulary
        larger than config.json's `vocab_size`; a chat template that does not render or frame turns.
    """
    _inspect(path)


def _inspect(path: Path) -> tuple[dict[str, Any], HFChatTokenizer]:
    if not path.is_dir():
        raise PolicyError(f"{path}: no such directory; expected a Hugging Face model directory (config.json, "
                          f"*.safetensors weights, tokenizer.json)")
    config = _read_config(path / "config.json")
    _check_weights(path)
    return config, _load_tokenizer(path, config)


def _read_files(path: Path) -> dict[str, bytes]:
    files = {name: (path / name).read_bytes() for name in SHIPPED if (path / name).is_file()}
    files.update({name: (path / name).read_bytes() for name in OPTIONAL if (path / name).is_file()})
    return files


# ---- the tokenizer ------------------------------------------------------------------------------------------
class HFChatTokenizer:
    """A transformers fast tokenizer as a `ChatTokenizer`; turns framed as the model's chat template frames them.

    The framing is cut out of the template once: a one-turn conversation with and without the generation
    prompt and a user/assistant/user conversation are rendered with sentinel contents, and the fixed text around
    them gives `bos()` (whatever precedes the first user header, such as a default system turn), each role's
    header and the closing, each tokenized once. Without a template, ChatML (`DEFAULT_CHAT_TEMPLATE`).
    Roles map as `TEMPLATE_ROLES` says. The closing must start with one special token, the stop.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, *, name: str, template_source: str) -> None:
        self.hf = tokenizer
        self._name = name
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        bos, user, assistant, closing = _framing(tokenizer, template, template_source)
        self._bos = self._fixed(bos)
        self._headers = {"user": self._fixed(user), "assistant": self._fixed(assistant)}
        self._closing = self._fixed(closing)
        if not self._closing or self._closing[0] not in self._special:
            first = tokenizer.convert_ids_to_tokens(self._closing[:1])
            raise PolicyError(f"{template_source}: the chat template closes a turn with {closing!r}, whose first "
                              f"token {first} is not one special token; expected a closing that starts with a "
                              f"special token such as <|im_end|> (the stop of a policy turn)")
        self._stop = self._closing[0]
        eos = tokenizer.eos_token_id
        self._eos = self._stop if eos is None else int(eos)
        pad = tokenizer.pad_token_id
        self._pad = self._eos if pad is None else int(pad)

    def _fixed(self, text: str) -> list[int]:
        """Ids of template text: special tokens spelled in it are those tokens."""
        return list(self.hf(text, add_special_tokens=False).input_ids) if text else []

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def stop_id(self) -> int:
        return self._stop

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((self._stop, self._eos)))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as data: a special token's spelling is split into ordinary tokens."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def decode(self, ids: Iterable[int], *, specials: bool = False) -> str:
        """Text of ids; special ids dropped, or rendered as their text with `specials=True`."""
        return str(self.hf.decode(list(ids), skip_special_tokens=not specials, clean_up_tokenization_spaces=False))

    def bos(self) -> list[int]:
        return list(self._bos)

    def header(self, role: Role) -> list[int]:
        return list(self._headers[TEMPLATE_ROLES[role]])

    def closing(self) -> list[int]:
        return list(self._closing)

    def prompt_ids(self, prompt: str) -> list[int]:
        return default_prompt_ids(self, prompt)


def _framing(tokenizer: PreTrainedTokenizerFast, template: str, source: str) -> tuple[str, str, str, str]:
    """(bos, user header, assistant header, closing) text of a chat template.

    :raises PolicyError: the template does not render, or its turns are not header + content + closing.
    """
    one, two, three = _SENTINELS

    def render(messages: list[tuple[str, str]], generation: bool) -> str:
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            return str(tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     add_generation_prompt=generation))
        except Exception as err:  # jinja2 errors of every kind, the template's raise_exception
            raise PolicyError(f"{source}: the chat template does not render ({type(err).__name__}: "
                              f"{_line(err)}); expected one that renders user and assistant turns") from None

    single = render([("user", one)], False)
    prompt = render([("user", one)], True)
    full = render([("user", one), ("assistant", two), ("user", three)], False)

    def refuse(what: str) -> PolicyError:
        return PolicyError(f"{source}: the chat template {what}; expected turns rendered as header + content + "
                           f"closing (ChatML: <|im_start|>role\\n...<|im_end|>\\n)")

    if not prompt.startswith(single) or len(prompt) == len(single):
        raise refuse("adds no assistant header after the conversation with add_generation_prompt")
    assistant = prompt[len(single):]
    if any(full.count(s) != 1 for s in _SENTINELS):
        raise refuse("does not render each message's content verbatim once")
    before, rest = full.split(one)
    between, rest = rest.split(two)
    middle, after = rest.split(three)
    if not between.endswith(assistant):
        raise refuse(f"renders an assistant turn's header unlike its generation prompt {assistant!r}")
    closing = between[: len(between) - len(assistant)]
    if not closing or not middle.startswith(closing) or not after.startswith(closing):
        raise refuse(f"closes user and assistant turns differently ({closing!r})")
    user = middle[len(closing):]
    if not user or not before.endswith(user):
        raise refuse(f"renders the first user turn's header unlike a later one's ({user!r})")
    return before[: len(before) - len(user)], user, assistant, closing


# ---- the cache ---------------------------------------------------------------------------------------------
class HFCache:
    """A `transformers.DynamicCache` plus what left-padded batches need: `key_mask` (B, length) bool, True on
    every slot holding a real token, and `next_pos` (B,) each row's next position (its count of real tokens).

    DynamicCache grows by concatenation, so `max_len` is only the budget `forward` checks, and it keeps keys and
    values in the dtype attention computes them in (the model's): the dtype `new_cache` is given is not used.
    """

    def __init__(self, kv: DynamicCache, batch: int, max_len: int, device: torch.device) -> None:
        self.kv = kv
        self.key_mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def length(self) -> int:
        return int(self.key_mask.shape[1])

    @property
    def batch(self) -> int:
        return int(self.key_mask.shape[0])

    def _layers(self) -> Iterator[Any]:
        return (layer for layer in self.kv.layers if getattr(layer, "is_initialized", False))

    def keep_rows(self, rows: Tensor, extra: int) -> None:
        """Keep rows `rows` (in that order) and drop the leading slots no kept row has a real token in; room for
        `extra` more slots. Positions live in `next_pos`, so no row's attention or positions change."""
        keys = self.key_mask.index_select(0, rows)
        any_real = keys.any(0)
        first = int(any_real.int().argmax()) if bool(any_real.any()) else self.length
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, rows)[:, :, first:]
            layer.values = layer.values.index_select(0, rows)[:, :, first:]
        self.key_mask = keys[:, first:]
        self.next_pos = self.next_pos.index_select(0, rows)
        self.max_len = self.length + extra

    def truncate(self, length: int) -> None:
        """Forget every slot at or after `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        for layer in self._layers():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
        self.key_mask = self.key_mask[:, :length]
        self.next_pos = self.key_mask.sum(dim=1)


# ---- routing ------------------------------------------------------------------------------------------------
class _RouterTap:
    """Forward hook on one Qwen3-MoE router (`Qwen3MoeTopKRouter`, output (logits, gates, experts) over the
    block's B*T rows): records the experts chosen, or forces `forced` (B*T, k) with the gates recomputed from the
    router's softmax for exactly those experts, renormalised when the config's `norm_topk_prob` says so."""

    def __init__(self, norm_topk_prob: bool) -> None:
        self.norm_topk_prob = norm_topk_prob
        self.forced: Tensor | None = None
        self.chosen: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
        logits, _, experts = output
        if self.forced is None:
            self.chosen = experts
            return None
        experts = self.forced.to(experts.device)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top = probs.gather(-1, experts)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        self.chosen = experts
        return logits, top.to(logits.dtype), experts


def _router_taps(model: nn.Module) -> list[_RouterTap]:
    """A tap on each sparse block's router of a Qwen3-MoE model, in layer order; none for a dense model."""
    if type(model).__name__ != ROUTED:
        return []
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    taps = []
    for module in model.modules():
        if isinstance(module, Qwen3MoeSparseMoeBlock):
            tap = _RouterTap(bool(model.config.norm_topk_prob))
            module.gate.register_forward_hook(tap)
            taps.append(tap)
    return taps


# ---- the policy ---------------------------------------------------------------------------------------------
def _dtype(config: Mapping[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    """`dtype`, else the config's `dtype` / `torch_dtype` when it names a floating torch dtype, else float32."""
    if dtype is not None:
        return dtype
    name = config.get("dtype") or config.get("torch_dtype")
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32


def _device(device: torch.device | str) -> torch.device:
    return resolve_device(device) if device in ("auto", "cpu", "cuda") else torch.device(device)


class HFPolicy(Policy):
    """A transformers causal LM of `SUPPORTED` and its `HFChatTokenizer`.

    `forward` has the built-in transformer's semantics: left padding with a mask, each row's positions from 0 at
    its first real token (passed as `position_ids`), padded slots never attended (a 2-D mask over past and
    current slots), an `HFCache` carrying per-row masks and positions across calls. RoPE inverse frequencies
    stay fp32 whatever dtype the model is cast to.
    """

    kind = "hf"

    def __init__(self, model: nn.Module, tokenizer: HFChatTokenizer, files: Mapping[str, bytes]) -> None:
        self.module = model
        self.tokenizer = tokenizer
        self._files = dict(files)
        self._taps = _router_taps(model)

    @property
    def config(self) -> Any:
        """The transformers config."""
        return self.module.config

    @property
    def architecture(self) -> str:
        return type(self.module).__name__

    @property
    def attn_implementation(self) -> str:
        return str(self.config._attn_implementation)

    # ---- building -------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
             attn_implementation: str | None = None) -> HFPolicy:
        """The model and tokenizer of directory `path` (checked by `check_dir` first), in eval mode.

        dtype None: the config's `dtype` (or `torch_dtype`), else float32. attn_implementation None: "sdpa".

        :raises PolicyError: what `check_dir` refuses, or weights transformers cannot load.
        """
        config, tokenizer = _inspect(path)
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=_dtype(config, dtype), attn_implementation=attn_implementation or DEFAULT_ATTENTION
            )
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise PolicyError(f"{path}: transformers cannot load the model ({type(err).__name__}: "
                              f"{_line(err)})") from None
        policy = cls(model, tokenizer, _read_files(path))
        return policy.to_(device=_device(device)).eval()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], files: Mapping[str, bytes], *, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> HFPolicy:
        """The architecture `spec` describes, built from `files` (each checked against the spec's sha256), with
        weights as initialised: a version's tensors follow. dtype None: the config's.

        :raises PolicyError: a file missing, not one the spec may list, or differing from its digest; or files
            `check_dir` would refuse.
        """
        listed = spec.get("files")
        if not isinstance(listed, Mapping) or "config.json" not in listed or "tokenizer.json" not in listed:
            raise PolicyError(f"policy spec key 'files' is {listed!r}; expected a map of file name to sha256 "
                              f"naming at least config.json and tokenizer.json")
        for name, digest in listed.items():
            if name not in SHIPPED + OPTIONAL:
                raise PolicyError(f"policy spec file {name!r}: not a file a policy ships; expected names among "
                                  f"{', '.join(SHIPPED + OPTIONAL)}")
            if name not in files:
                raise PolicyError(f"policy spec file {name}: not among the files given ({sorted(files)}); "
                                  f"expected every file the spec lists")
            if (actual := _sha256(files[name])) != digest:
                raise PolicyError(f"policy spec file {name}: sha256 {actual} differs from the spec's {digest}; the "
                                  f"file was changed or corrupted")
        from transformers import AutoConfig, AutoModelForCausalLM

        with tempfile.TemporaryDirectory(prefix="rlbus-hf-") as tmp:
            root = Path(tmp)
            for name in listed:
                (root / name).write_bytes(files[name])
            config = _read_config(root / "config.json")
            if spec.get("architecture", config["architectures"][0]) != config["architectures"][0]:
                raise PolicyError(f"policy spec key 'architecture' is {spec.get('architecture')!r}; its config.json "
                                  f"says {config['architectures'][0]!r}")
            tokenizer = _load_tokenizer(root, config)
            try:
                hf_config = AutoConfig.from_pretrained(tmp)
                model = AutoModelForCausalLM.from_config(
                    hf_config, dtype=torch.float32,
                    attn_implementation=str(spec.get("attn_implementation") or DEFAULT_ATTENTION),
                )
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
                raise PolicyError(f"policy spec file config.json: transformers cannot build the model "
                                  f"({type(err).__name__}: {_line(err)})") from None
        policy = cls(model, tokenizer, {name: files[name] for name in listed})
        return policy.to_(device=_device(device), dtype=_dtype(config, dtype)).eval()

    # ---- shape ----------------------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def moe(self) -> tuple[int, int] | None:
        return (len(self._taps), int(self.config.num_experts_per_tok)) if self._taps else None

    @property
    def n_experts(self) -> int | None:
        """Experts per routed layer (routing ids are below it), None for a dense policy."""
        return int(self.config.num_experts) if self._taps else None

    # ---- compute --------------------------------------------------------------------------------------
    def forward(self, tokens: Tensor, *, cache: PolicyCache | None = None, attention_mask: Tensor | None = None,
                routing: Tensor | None = None) -> PolicyOutput:
        """See `Policy.forward`; `cache` must come from `new_cache`.

        :raises PolicyError: another implementation's cache, or routing this policy refuses (`_routing`).
        """
        B, T = tokens.shape
        real = (attention_mask.bool() if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=tokens.device))
        if cache is not None:
            if not isinstance(cache, HFCache):
                raise PolicyError(f"an HF policy takes the cache of its new_cache, got {type(cache).__name__}")
            if cache.length + T > cache.max_len:
                raise ValueError(f"cache holds {cache.max_len} slots; {cache.length} used, {T} more do not fit")
            base = cache.next_pos[:, None]
            mask = torch.cat([cache.key_mask, real], dim=1)
        else:
            if T > self.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.max_seq_len}")
            base = torch.zeros(B, 1, dtype=torch.long, device=tokens.device)
            mask = real
        positions = (base + real.long().cumsum(1) - 1).clamp_min(0)
        with self._routing(routing, B, T) as chosen:
            out = self.module(input_ids=tokens, attention_mask=mask, position_ids=positions,
                              cache=cache.kv if cache is not None else None, use_cache=cache is not None)
        if cache is not None:
            cache.key_mask = mask
            cache.next_pos = cache.next_pos + real.sum(dim=1)
        return PolicyOutput(out.logits, torch.stack(chosen, dim=2) if chosen else None)

    @contextlib.contextmanager
    def _routing(self, routing: Tensor | None, B: int, T: int) -> Iterator[list[Tensor]]:
        """Force `routing` (B, T, n_moe_layers, top_k) on the routers for one forward; yields the list that holds
        each sparse layer's (B, T, top_k) experts afterwards.

        :raises PolicyError: routing for a dense policy, or of the wrong shape or expert range.
        """
        if routing is not None:
            if self.moe is None:
                raise PolicyError(f"{self.architecture} is dense: it has no routing to replay (routing= is for "
                                  f"{ROUTED})")
            if tuple(routing.shape) != (B, T, *self.moe):
                raise PolicyError(f"routing shape {tuple(routing.shape)} != {(B, T, *self.moe)} "
                                  f"(B, T, n_moe_layers, top_k)")
            experts = self.n_experts or 0
            if routing.numel() and not 0 <= int(routing.min()) <= int(routing.max()) < experts:
                raise PolicyError(f"routing names experts outside [0, {experts})")
        chosen: list[Tensor] = []
        try:
            for i, tap in enumerate(self._taps):
                tap.forced = None if routing is None else routing[:, :, i].reshape(B * T, -1).long()
                tap.chosen = None
            yield chosen
            for tap in self._taps:
                assert tap.chosen is not None, "a sparse block's router did not run"
                chosen.append(tap.chosen.reshape(B, T, -1))
        finally:
            for tap in self._taps:
                tap.forced = tap.chosen = None

    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> HFCache:
        """An empty cache of `batch` rows and up to `max_len` slots (default max_seq_len); `dtype` is not used
        (see `HFCache`)."""
        from transformers import DynamicCache

        length = max_len or self.max_seq_len
        if length > self.max_seq_len:
            raise ValueError(f"cache max_len {length} exceeds the model's max_seq_len {self.max_seq_len}")
        kv = DynamicCache(config=self.config)
        if any(getattr(layer, "is_sliding", False) for layer in kv.layers):
            raise PolicyError(f"{self.architecture} config uses sliding-window attention; rlbus caches only full "
                              f"attention (set use_sliding_window false)")
        return HFCache(kv, batch, length, self.device)

    def shard_units(self) -> list[nn.Module]:
        """The decoder layers (`model.layers` of every supported family); the root keeps the embedding, which a
        tied head shares, the final norm and the head."""
        return list(getattr(getattr(self.module, "model", None), "layers", None) or [])

    # ---- description ----------------------------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        return {
            "policy": "hf",
            "architecture": self.architecture,
            "files": {name: _sha256(data) for name, data in self._files.items()},
            "attn_implementation": self.attn_implementation,
        }

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    # ---- placement ------------------------------------------------------------------------------------
    def to_(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> HFPolicy:
        """Move (and cast) in place; RoPE inverse frequencies stay fp32 (only their device follows)."""
        rope = {(id(m), name): (m, name, buf.detach().float().clone())
                for m in self.module.modules() for name, buf in m.named_buffers(recurse=False)
                if name.endswith("inv_freq")}
        self.module.to(device=device, dtype=dtype)
        for m, name, saved in rope.values():
            setattr(m, name, saved.to(getattr(m, name).device))
        return self
