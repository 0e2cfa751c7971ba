"""The Hugging Face policy: a local model directory (`config.json`, safetensors, `tokenizer.json`) behind `Policy`.

- Owns: `HFPolicy` (load, spec, the built-in transformer's forward semantics, Qwen3-MoE router record and
  replay; SDPA attention by default; MTP draft heads loaded from `mtp_heads.safetensors` when the files hold it) and `HFCache` (a DynamicCache with per-row key masks and positions).
- Does not: check directories (model/policies/hf_checks.py), frame chat turns (model/policies/hf_chat.py),
  sample (model/sampling/generate.py) or build directories (model/policies/hf_recipe.py).
- `transformers` is imported inside functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import Tensor, nn

from rlbus.model.policies.hf_chat import HFChatTokenizer, one_line
from rlbus.model.policies.hf_checks import (
    OPTIONAL,
    ROUTED,
    SHIPPED,
    inspect_dir,
    load_tokenizer,
    read_config,
    read_files,
)
from rlbus.model.policies.interface import (
    Policy,
    PolicyCache,
    PolicyError,
    PolicyOutput,
    RowKV,
    resolve_device,
)
from rlbus.model.policies.transformer import plausible_replay

if TYPE_CHECKING:
    from transformers import DynamicCache

DEFAULT_ATTENTION: Final = "sdpa"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

    def row_kv(self, row: int) -> RowKV:
        """Row `row`'s keys and values of its real slots, (H_kv, n, Dh) per layer, copied out of the batch."""
        real = self.key_mask[row].nonzero()[:, 0]
        layers = list(self._layers())
        return RowKV([layer.keys[row].index_select(1, real) for layer in layers],
                     [layer.values[row].index_select(1, real) for layer in layers])

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
    router's softmax for exactly those experts, renormalised when the config's `norm_topk_prob` says so. The
    router's `replay_threshold` (set by `set_numerics`; 0: replay as recorded) checks plausibility first, as the
    built-in MoE does (`transformer.plausible_replay`); `chosen` holds the experts used."""

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
        threshold = float(getattr(module, "replay_threshold", 0.0))
        if threshold > 0:
            experts = plausible_replay(probs.detach(), experts, experts.shape[-1], threshold)
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
            module.gate.replay_threshold = 0.0
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
    """A transformers causal LM of `hf_checks.SUPPORTED` and its `HFChatTokenizer`.

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
        from rlbus.model.training.mtp import heads_from_files

        self.mtp_heads: nn.Module | None = heads_from_files(self._files, model)
        """Draft heads for speculative sampling (model/training/mtp.py), from `mtp_heads.safetensors`."""

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
        config, tokenizer = inspect_dir(path)
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=_dtype(config, dtype), attn_implementation=attn_implementation or DEFAULT_ATTENTION
            )
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise PolicyError(f"{path}: transformers cannot load the model ({type(err).__name__}: "
                              f"{one_line(err)})") from None
        policy = cls(model, tokenizer, read_files(path))
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
            config = read_config(root / "config.json")
            if spec.get("architecture", config["architectures"][0]) != config["architectures"][0]:
                raise PolicyError(f"policy spec key 'architecture' is {spec.get('architecture')!r}; its config.json "
                                  f"says {config['architectures'][0]!r}")
            tokenizer = load_tokenizer(root, config)
            try:
                hf_config = AutoConfig.from_pretrained(tmp)
                model = AutoModelForCausalLM.from_config(
                    hf_config, dtype=torch.float32,
                    attn_implementation=str(spec.get("attn_implementation") or DEFAULT_ATTENTION),
                )
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
                raise PolicyError(f"policy spec file config.json: transformers cannot build the model "
                                  f"({type(err).__name__}: {one_line(err)})") from None
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

    def cache_from_rows(self, rows: list[RowKV], extra: int, dtype: torch.dtype | None = None) -> HFCache:
        """`rows` right-aligned in a fresh `HFCache` (left padding before the shorter ones) with a budget of `extra`
        more slots; `dtype` is not used (see `HFCache`)."""
        width = max((r.length for r in rows), default=0)
        if width + extra > self.max_seq_len:
            raise ValueError(f"cache max_len {width + extra} exceeds the model's max_seq_len {self.max_seq_len}")
        cache = self.new_cache(len(rows), width + extra)
        if width:
            held = [(b, r) for b, r in enumerate(rows) if r.length]
            for i, layer in enumerate(cache.kv.layers):
                k0 = held[0][1].keys[i]
                keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[2]))
                values = keys.clone()
                for b, r in held:
                    keys[b, :, width - r.length:] = r.keys[i]
                    values[b, :, width - r.length:] = r.values[i]
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=self.device)
        for b, r in enumerate(rows):
            mask[b, width - r.length:] = True
        cache.key_mask = mask
        cache.next_pos = torch.tensor([r.length for r in rows], dtype=torch.long, device=self.device)
        return cache

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

    def set_mtp_heads(self, heads: nn.Module | None) -> None:
        """Replace the draft heads (None: none); they go among `files()` as `mtp_heads.safetensors`."""
        from rlbus.model.training.mtp import MTP_FILE, heads_to_bytes

        self._files.pop(MTP_FILE, None)
        if heads is not None:
            self._files[MTP_FILE] = heads_to_bytes(heads)  # type: ignore[arg-type]
            p = next(self.module.parameters())
            heads = heads.to(device=p.device, dtype=p.dtype).eval()
        self.mtp_heads = heads

    # ---- placement ------------------------------------------------------------------------------------
    def to_(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> HFPolicy:
        """Move (and cast) in place; RoPE inverse frequencies stay fp32 (only their device follows)."""
        rope = {(id(m), name): (m, name, buf.detach().float().clone())
                for m in self.module.modules() for name, buf in m.named_buffers(recurse=False)
                if name.endswith("inv_freq")}
        self.module.to(device=device, dtype=dtype)
        if self.mtp_heads is not None:
            self.mtp_heads.to(device=device, dtype=dtype)
        for m, name, saved in rope.values():
            setattr(m, name, saved.to(getattr(m, name).device))
        return self
