"""The policy interface: all that the actors, `rlbus eval`, replay-retrain and the benchmarks see of a model.

- Owns: `ChatTokenizer` (text <-> ids and the framing of turns), `Policy` (forward with a KV cache, routing
  record and replay, the named tensors a version publishes, in-place loads, placement, a serialisable spec),
  `PolicyCache`, `RowKV` (one row's cache outside a batch), `PolicyError`, device resolution, and the two
  entry points that pick an implementation: `policy_from_spec` (what a joiner builds from a manifest) and
  `load_policy` (a file or a Hugging Face dir).
- Does not: implement a policy (model/policies/builtin.py, model/policies/hf.py), sample
  (model/sampling/generate.py) or compute losses.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from rlbus.messages.errors import RlbusError

Role = Literal["user", "assistant", "observation", "summary"]
ROLES: Final[tuple[Role, ...]] = ("user", "assistant", "observation", "summary")
POLICY_ROLES: Final[tuple[Role, ...]] = ("assistant", "summary")
"""Roles whose content is the ids the policy sampled (trained on); the others are context."""
DeviceName = Literal["auto", "cpu", "cuda"]
KINDS: Final = ("builtin", "hf")


class PolicyError(RlbusError, ValueError):
    """A policy that cannot be built or loaded: the message names the file (or spec key) and what was expected."""


@runtime_checkable
class ChatTokenizer(Protocol):
    """Text <-> ids, and how a conversation is laid out as ids.

    A turn is `header(role) + content + closing`, except that a policy turn whose content already ends with
    `stop_id` (the policy closed it itself) gets only `closing[1:]`: its content is kept verbatim, so the
    loss mask covers exactly the sampled ids. A conversation starts with `bos()`; the context handed to the
    policy ends with `header("assistant")`.
    """

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int:
        """The end of a document (pretraining); also a stop."""
        ...
    @property
    def stop_id(self) -> int:
        """The id that ends a policy turn (pass it as `eos_id` to `generate`); `closing()[0]`."""
        ...
    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a turn's text (`completion_text` cuts at the first)."""
        ...
    def encode(self, text: str) -> list[int]:
        """Ids of `text` as data: never a special id, whatever the text spells."""
        ...
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; special ids dropped."""
        ...
    def bos(self) -> list[int]: ...
    def header(self, role: Role) -> list[int]: ...
    def closing(self) -> list[int]: ...
    def prompt_ids(self, prompt: str) -> list[int]:
        """A one-turn conversation ready for the policy: bos, the user turn, the assistant header."""
        ...


def frame_turn(tokenizer: ChatTokenizer, role: Role, content: Iterable[int]) -> tuple[list[int], list[int]]:
    """One turn as (ids, mask): header, content, closing (see `ChatTokenizer`); mask is 1 exactly on a
    policy turn's content."""
    body = list(content)
    policy = role in POLICY_ROLES
    closing = tokenizer.closing()
    if policy and body and body[-1] == tokenizer.stop_id:
        closing = closing[1:]
    header = tokenizer.header(role)
    ids = [*header, *body, *closing]
    mask = [0] * len(header) + [1 if policy else 0] * len(body) + [0] * len(closing)
    return ids, mask


def default_prompt_ids(tokenizer: ChatTokenizer, prompt: str) -> list[int]:
    """`ChatTokenizer.prompt_ids` from its parts (implementations may share it)."""
    ids, _ = frame_turn(tokenizer, "user", tokenizer.encode(prompt))
    return [*tokenizer.bos(), *ids, *tokenizer.header("assistant")]


class PolicyOutput(NamedTuple):
    logits: Tensor
    """(B, T, V) next-token logits."""
    routing: Tensor | None
    """(B, T, n_moe_layers, top_k) int64 experts each token ran through; None for a dense policy."""


@runtime_checkable
class PolicyCache(Protocol):
    """A batch's KV cache. Rows may be left-padded; each row's positions start at 0 whatever its padding."""

    @property
    def length(self) -> int:
        """Slots filled (shared by every row)."""
        ...
    @property
    def batch(self) -> int: ...
    def keep_rows(self, rows: Tensor, extra: int) -> None:
        """Keep only batch rows `rows` (int64, in that order), with room for `extra` more slots."""
        ...
    def truncate(self, length: int) -> None:
        """Forget every slot at or after `length`."""
        ...
    def row_kv(self, row: int) -> RowKV:
        """Row `row`'s keys and values of its real slots (pads dropped), copied out of the batch."""
        ...


class RowKV(NamedTuple):
    """One row's keys and values outside any batch cache: per layer (heads, n, head_dim) of its n real tokens, in
    order, at positions 0..n-1 (`PolicyCache.row_kv` takes them out, `Policy.cache_from_rows` batches them again).
    The turn engine (model/sampling/engine.py) keeps a resting episode's context this way across turns."""

    keys: list[Tensor]
    values: list[Tensor]

    @property
    def length(self) -> int:
        """Tokens held."""
        return int(self.keys[0].shape[1]) if self.keys else 0

    def truncated(self, length: int) -> RowKV:
        """The first `length` tokens only (a context that diverges after them)."""
        return RowKV([k[:, :length] for k in self.keys], [v[:, :length] for v in self.values])


class Policy(ABC):
    """A language-model policy and its tokenizer, on one device.

    `module` is the torch module whose parameters train (the trainer's optimizer holds them); everything
    else goes through the methods below, so callers never depend on an implementation's forward signature.
    """

    kind: str = ""
    tokenizer: ChatTokenizer
    module: nn.Module

    # ---- shape ----------------------------------------------------------------------------------
    @property
    @abstractmethod
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + completion) the policy takes."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the embedding: every token id must be below it."""

    @property
    def moe(self) -> tuple[int, int] | None:
        """(n_moe_layers, top_k) of a routing record, None for a dense policy (or one not replayed)."""
        return None

    @property
    def n_experts(self) -> int | None:
        """Experts per routed layer (routing ids are below it), None for a dense policy."""
        return None

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def describe(self) -> str:
        """One line for logs and `--help` output: kind, size, device."""
        params = sum(p.numel() for p in self.module.parameters())
        return f"{self.kind} policy, {params / 1e6:.1f}M parameters, {self.device} {self.dtype}"

    # ---- compute --------------------------------------------------------------------------------
    @abstractmethod
    def forward(self, tokens: Tensor, *, cache: PolicyCache | None = None, attention_mask: Tensor | None = None,
                routing: Tensor | None = None) -> PolicyOutput:
        """tokens (B, T) int64 -> PolicyOutput.

        cache: tokens fill slots [cache.length, cache.length + T) and attend to everything before; each
        row's positions continue from its own count of real tokens. attention_mask (B, T) bool, True = real
        token: False slots (left padding) are never attended to and do not advance positions. Without a
        cache and mask, right padding needs nothing (causality hides it). routing (B, T, n_moe_layers, top_k)
        forces the experts (router replay); a dense policy refuses it.
        """

    @abstractmethod
    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> PolicyCache:
        """An empty cache for `batch` rows of up to `max_len` slots (default `max_seq_len`), on this device."""

    def cache_from_rows(self, rows: list[RowKV], extra: int, dtype: torch.dtype | None = None) -> PolicyCache:
        """A cache holding `rows` (`PolicyCache.row_kv`), one batch row each, left-padded to the longest, with room
        for `extra` more slots; each row's positions go on from its own length. Equal to a cache that fed each
        row's tokens itself: forward over it attends exactly to those keys and values.

        :raises NotImplementedError: a policy whose cache cannot be rebuilt from rows.
        """
        raise NotImplementedError(f"{self.kind} policy: no cache_from_rows")

    def __call__(self, tokens: Tensor, **kwargs: Any) -> PolicyOutput:
        return self.forward(tokens, **kwargs)

    # ---- weights ----------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, Tensor]:
        """The live tensors a version publishes, by name, as this policy holds them (a tied weight once).
        Writing into them (in place) changes the policy."""
        seen: set[int] = set()
        out: dict[str, Tensor] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            key = t.data_ptr() if t.numel() else id(t)
            if key in seen:
                continue
            seen.add(key)
            out[name] = t
        return out

    def published_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        """`named_tensors` detached, cast to `dtype`, contiguous, on the CPU: what the trainer publishes."""
        return {name: t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
                for name, t in self.named_tensors().items()}

    @torch.no_grad()
    def load_tensors_(self, state: Mapping[str, Tensor]) -> None:
        """Copy `state` (names of `named_tensors`) into the live tensors in place.

        :raises PolicyError: names or shapes differ from this policy's.
        """
        live = self.named_tensors()
        if set(live) != set(state):
            raise PolicyError(f"tensors differ from the policy's: missing {sorted(set(live) - set(state))[:5]}, "
                              f"extra {sorted(set(state) - set(live))[:5]}")
        for name, t in state.items():
            if tuple(t.shape) != tuple(live[name].shape):
                raise PolicyError(f"tensor {name}: shape {tuple(t.shape)}, the policy's is {tuple(live[name].shape)}")
            live[name].data.copy_(t)

    def shard_units(self) -> list[nn.Module]:
        """Submodules a sharded trainer wraps one by one (FSDP2 `fully_shard`, gathered and freed one at a time),
        in forward order; the root wraps the rest. None by default: the root alone."""
        return []

    # ---- description --------------------------------------------------------------------------
    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """Plain values from which `policy_from_spec` (with `files()`) builds the same architecture."""

    def files(self) -> dict[str, bytes]:
        """Files a joiner needs besides the tensors (config, tokenizer), by file name; none by default."""
        return {}

    # ---- placement --------------------------------------------------------------------------
    def to_(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Policy:
        """Move (and cast) in place; returns self."""
        self.module.to(device=device, dtype=dtype)
        return self

    def clone(self) -> Policy:
        """An independent deep copy (the trainer's frozen reference)."""
        return copy.deepcopy(self)

    def train(self, mode: bool = True) -> Policy:
        self.module.train(mode)
        return self

    def eval(self) -> Policy:
        return self.train(False)


def resolve_device(name: str) -> torch.device:
    """"auto" -> CUDA when present, else CPU; "cuda" fails here when there is none (at the actor, not at validate).

    :raises PolicyError: "cuda" without a CUDA device, or an unknown name.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise PolicyError("policy device 'cuda': torch sees no CUDA device on this machine "
                              f"(torch {torch.__version__}); use device = \"auto\" or \"cpu\"")
        return torch.device("cuda")
    raise PolicyError(f"policy device {name!r}: expected 'auto', 'cpu' or 'cuda'")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA device that supports bf16, or a CPU with
    AMX-BF16 or AVX512-BF16 (Linux `/proc/cpuinfo` flags). Elsewhere bf16 matmuls are emulated and slower than
    float32."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    try:
        flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def reference_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype the trainer holds its frozen reference in (`[trainer] reference_dtype`): "auto" is bfloat16
    where `device` has native bf16 matmuls (`native_bf16`), float32 elsewhere.

    :raises PolicyError: an unknown name.
    """
    match name:
        case "auto":
            return torch.bfloat16 if native_bf16(device) else torch.float32
        case "bfloat16":
            return torch.bfloat16
        case "float32":
            return torch.float32
    raise PolicyError(f"reference dtype {name!r}: expected 'auto', 'bfloat16' or 'float32'")


def spec_kind(spec: Mapping[str, Any]) -> str:
    """The implementation a spec names ("builtin" when it names none)."""
    return str(spec.get("policy", "builtin"))


def spec_files(spec: Mapping[str, Any]) -> dict[str, str]:
    """The files a spec lists: file name -> sha256 hex (none for the built-in policy).

    :raises PolicyError: a `files` entry that is not a map of names to sha256 hex digests.
    """
    files = spec.get("files", {})
    if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
            for k, v in files.items()):
        raise PolicyError(f"policy spec key 'files': expected file name -> sha256 hex, got {str(files)[:120]}")
    return dict(files)


def estimate_params(spec: Mapping[str, Any]) -> int | None:
    """Roughly how many parameters the spec's policy has, where the spec alone tells (None: it does not).

    :raises PolicyError: a spec its implementation refuses before building anything.
    """
    kind = spec_kind(spec)
    if kind == "builtin":
        from rlbus.model.policies.builtin import config_from_spec, estimated_params

        return estimated_params(config_from_spec(spec))
    if kind == "hf":
        spec_files(spec)
        return None
    raise PolicyError(f"policy spec names kind {kind!r}; expected one of {', '.join(KINDS)}")


def policy_from_spec(spec: Mapping[str, Any], files: Mapping[str, bytes] | None = None, *,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Policy:
    """A policy of the spec's architecture (weights as initialised: a version's tensors follow), running the
    forward precision the spec's "numerics" names (`model/policies/quant.py`; none: the plain forward).

    A policy's spec is plain values (it travels in VersionReady and WeightManifest as `model_config`): its
    `"policy"` key names the implementation ("builtin" when absent, as older manifests are), the rest is the
    implementation's own. `files` are the few small files (config, tokenizer) a joiner needs besides the
    tensors, by name (`Policy.files()`); the trainer uploads them beside version 0 and the spec lists them.

    :raises PolicyError: an unknown kind, or a spec (or files) its implementation refuses.
    """
    from rlbus.model.policies.quant import NUMERICS_KEY, apply_spec_numerics

    kind = spec_kind(spec)
    numerics = spec.get(NUMERICS_KEY)
    spec = {k: v for k, v in spec.items() if k != NUMERICS_KEY}
    policy: Policy
    if kind == "builtin":
        from rlbus.model.policies.builtin import BuiltinPolicy

        policy = BuiltinPolicy.from_spec(spec).to_(device=device, dtype=dtype).eval()
    elif kind == "hf":
        from rlbus.model.policies.hf import HFPolicy

        policy = HFPolicy.from_spec(spec, files or {}, device=device, dtype=dtype).eval()
    else:
        raise PolicyError(f"policy spec names kind {kind!r}; expected one of {', '.join(KINDS)}")
    if numerics is not None:
        try:
            apply_spec_numerics(policy.module, numerics)
        except ValueError as err:
            raise PolicyError(str(err)) from None
    return policy


def set_policy_numerics(policy: Policy, precision: str, scope: str, replay_threshold: float = 0.0) -> dict[str, Any]:
    """Run `policy`'s forward at `precision` on `scope` (expert or all Linear layers, `model/policies/quant.py`
    `set_numerics`) with MoE router replay checked at `replay_threshold`; returns what its published spec adds so
    that every actor building it from the spec runs the same forward (nothing for bf16).

    :raises PolicyError: an unknown precision or scope, or a threshold outside [0, 1].
    """
    from rlbus.model.policies.quant import numerics_spec, set_numerics

    try:
        set_numerics(policy.module, precision, scope, replay_threshold)
        return numerics_spec(precision, scope)
    except ValueError as err:
        raise PolicyError(str(err)) from None


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: it holds a config.json."""
    return path.is_dir() and (path / "config.json").is_file()


def load_policy(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Policy:
    """A trained policy from `path`: a built-in `pretrain.pt` (or its folder), or a Hugging Face directory.

    :raises PolicyError: naming the file and what is wrong.
    """
    if is_hf_dir(path):
        from rlbus.model.policies.hf import HFPolicy

        return HFPolicy.load(path, device=device, dtype=dtype).eval()
    from rlbus.model.policies.builtin import BuiltinPolicy

    policy = BuiltinPolicy.load(path)
    return policy.to_(device=device, dtype=dtype).eval()


def fresh_builtin() -> Policy:
    """A freshly initialised tiny built-in policy (a trainer started without a pretrained checkpoint: tests);
    seed torch first for a reproducible one."""
    from rlbus.model.policies.builtin import BuiltinPolicy, fresh_config
    from rlbus.model.policies.transformer import Transformer

    return BuiltinPolicy(Transformer(fresh_config()))


def as_policy(model: Policy | nn.Module) -> Policy:
    """A policy as it is; a bare built-in `Transformer` (tests and benchmarks build one) as a `BuiltinPolicy`."""
    if isinstance(model, Policy):
        return model
    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.policies.transformer import Transformer

    if not isinstance(model, Transformer):
        raise TypeError(f"expected a Policy or the built-in Transformer, got {type(model).__name__}")
    return BuiltinPolicy(model)


def check_policy_dir(kind: str, path: Path) -> None:
    """Check, without building anything, that `path` holds a policy of `kind` ("builtin": a `pretrain.pt` or
    its folder; "hf": a Hugging Face directory whose config, weights, tokenizer and chat template are usable).

    :raises PolicyError: one line naming the file, the key and what was expected.
    """
    if kind == "hf":
        from rlbus.model.policies.hf_checks import check_dir

        check_dir(path)
        return
    if kind == "builtin":
        from rlbus.model.training.pretrain import CHECKPOINT_NAME

        file = path / CHECKPOINT_NAME if path.is_dir() else path
        if not file.is_file():
            raise PolicyError(f"{file}: no such file; expected a built-in {CHECKPOINT_NAME} (`rlbus pretrain` writes "
                              f"one) or its folder")
        return
    raise PolicyError(f"policy kind {kind!r}: expected one of {', '.join(KINDS)}")


def is_moe_dir(kind: str, path: Path) -> bool:
    """Whether the policy at `path` routes tokens through experts (read from its config, nothing built)."""
    if kind == "hf":
        import json

        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return any("Moe" in a for a in config.get("architectures", [])) or bool(config.get("num_experts"))
    if kind == "builtin":
        import torch

        from rlbus.model.training.pretrain import CHECKPOINT_NAME

        file = path / CHECKPOINT_NAME if path.is_dir() else path
        try:
            payload = torch.load(file, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError):
            return False
        return bool(payload.get("model_config", {}).get("moe_layers"))
    return False
