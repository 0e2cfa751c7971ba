"""The checks of a Hugging Face model directory that `rlbus validate` runs, and reading its files; no model built.

- Owns: `check_dir` (config.json, the safetensors weights, tokenizer.json and the chat template, each refused
  in one line naming the file, the key and what was expected), `inspect_dir`, `read_files`, `SUPPORTED`.
- Does not: build or run the model (model/policies/hf.py) or frame turns (model/policies/hf_chat.py).
- Importing it leaves `transformers` unloaded; only the tokenizer check loads it, to render the chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from rlbus.model.policies.hf_chat import HFChatTokenizer, one_line
from rlbus.model.policies.interface import PolicyError

SUPPORTED: Final = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ROUTED: Final = "Qwen3MoeForCausalLM"
"""The one routed family: its router's choices are recorded and replayed."""
SHIPPED: Final = ("config.json", "tokenizer.json", "tokenizer_config.json")
"""Files a joiner always gets (`HFPolicy.files`)."""
OPTIONAL: Final = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja", "mtp_heads.safetensors")
"""Files a joiner gets when the directory has them (`mtp_heads.safetensors`: model/training/mtp.py)."""
_MOE_KEYS: Final = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


# ---- the directory ----------------------------------------------------------------------------------------
def read_config(file: Path) -> dict[str, Any]:
    """config.json as a dict with a supported architecture, a vocab_size and a max_position_embeddings.

    :raises PolicyError: missing, not JSON, or a key missing or not what rlbus supports.
    """
    if not file.is_file():
        raise PolicyError(f"{file}: no such file; expected the model's transformers config")
    try:
        config = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PolicyError(f"{file}: not JSON ({one_line(err)}); expected the model's transformers config") from None
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


def check_weights(path: Path) -> None:
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
            raise PolicyError(f"{index}: not a safetensors index ({one_line(err)}); expected key 'weight_map' "
                              f"mapping tensor names to shard files") from None
        for shard in sorted(shards):
            if not (path / str(shard)).is_file():
                raise PolicyError(f"{index}: key 'weight_map' names shard {shard!r}, which is missing")
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
            raise PolicyError(f"{file}: not a readable safetensors file ({one_line(err)}); expected the complete "
                              f"weights (the file is corrupt or truncated)") from None


def template_source(path: Path) -> str:
    """Where the chat template comes from, for messages."""
    jinja = path / "chat_template.jinja"
    return str(jinja) if jinja.is_file() else f"{path / 'tokenizer_config.json'} key 'chat_template'"


def load_tokenizer(path: Path, config: Mapping[str, Any]) -> HFChatTokenizer:
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
        raise PolicyError(f"{file}: not a tokenizers tokenizer ({one_line(err)}); the file is truncated or "
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
            raise PolicyError(f"{settings}: not JSON ({one_line(err)}); expected the tokenizer's settings") from None
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as err:  # transformers raises many kinds on a bad tokenizer_config.json
        raise PolicyError(f"{settings}: the tokenizer does not load ({type(err).__name__}: {one_line(err)})") from None
    return HFChatTokenizer(hf, name=f"hf:{path.name}", template_source=template_source(path))


def check_dir(path: Path) -> None:
    """Check a Hugging Face model directory without building the model (what `rlbus validate` runs).

    :raises PolicyError: one line naming the file, the key and what was expected: a missing directory; a missing
        config.json, *.safetensors or tokenizer.json; a config.json that is not JSON or names an architecture
        outside `SUPPORTED`; a corrupt or truncated safetensors file; an invalid tokenizer.json; a vocabulary
        larger than config.json's `vocab_size`; a chat template that does not render or frame turns.
    """
    inspect_dir(path)


def inspect_dir(path: Path) -> tuple[dict[str, Any], HFChatTokenizer]:
    if not path.is_dir():
        raise PolicyError(f"{path}: no such directory; expected a Hugging Face model directory (config.json, "
                          f"*.safetensors weights, tokenizer.json)")
    config = read_config(path / "config.json")
    check_weights(path)
    return config, load_tokenizer(path, config)


def read_files(path: Path) -> dict[str, bytes]:
    files = {name: (path / name).read_bytes() for name in SHIPPED if (path / name).is_file()}
    files.update({name: (path / name).read_bytes() for name in OPTIONAL if (path / name).is_file()})
    return files

