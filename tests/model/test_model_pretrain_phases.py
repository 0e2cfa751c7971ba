"""Pretraining in phases on tiny policies: main, long-context and SFT phases into one model directory; a run stopped
inside a phase, or between a phase's save and its marker, resumes and ends with the weights of an unbroken run; the
long-context phase extends the context and the RoPE base in the model's own config; `[pretrain]` refuses a
long-context phase shorter than 4x the main one, naming the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Final

import pytest
import torch
from helpers.hf import build_family

from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import load_policy
from rlbus.model.training.phases import Phase, marker_name, run_phases
from rlbus.model.training.pretrain import PretrainConfig, PretrainProgress
from rlbus.topology.examples import __file__ as examples_init
from rlbus.topology.file.load import validate_text

SFT_ROW: Final = {"messages": [{"role": "user", "content": "def double(x):"},
                               {"role": "assistant", "content": "return 2 * x"}]}


def _repos(root: Path) -> Path:
    """Three small repositories of Python source (a few KB each)."""
    for r, name in enumerate(("alpha", "beta", "gamma")):
        pkg = root / name / name
        pkg.mkdir(parents=True)
        for f in range(3):
            body = "".join(f"def {name}_{f}_{i}(x, y):\n    return x * {i + r} + y - {f}\n\n\n" for i in range(12))
            (pkg / f"mod{f}.py").write_text(f'"""{name} module {f}."""\n\n{body}')
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("phase-data")
    data = root / "sft.jsonl"
    data.write_text(json.dumps(SFT_ROW) + "\n")
    return _repos(root / "repos"), data


def _config(repos: Path) -> PretrainConfig:
    """Tiny, on source documents of `repos` only (no task documents to grade)."""
    config = PretrainConfig.preset("tiny", eval_n=1, max_new_tokens=4, batch_size=4, code_fraction=1.0,
                                   corpus_dirs=(str(repos),), stdlib=False)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=128))


def _phases(repos: Path, data: Path) -> list[Phase]:
    return [Phase("main", "main", 2), Phase("long", "long_context", 2, seq_len=512, data=str(repos)),
            Phase("sft", "sft", 1, data=str(data))]


class Stop(Exception):
    """Raised from the progress callback: the run stops there, as a killed one would."""


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_policy(out).module.state_dict()


def test_phases_resume_at_the_phase_boundary_and_end_as_an_unbroken_run(tmp_path: Path,
                                                                         inputs: tuple[Path, Path]) -> None:
    """Stopped during the long-context phase, then again between its save and its marker, a run started again
    trains each phase once (the main phase's steps are never reported twice) and ends with the weights, markers
    and summary of an unbroken run; the summary lists the phases and the long-context held-out losses."""
    repos, data = inputs
    phases = _phases(repos, data)
    unbroken = run_phases(_config(repos), phases, 0, tmp_path / "unbroken", 1)
    out = tmp_path / "stopped"
    seen: list[tuple[str, int]] = []

    def stop_at(what: str, step: int) -> PretrainProgress | None:
        def progress(p: PretrainProgress) -> None:
            seen.append((p.phase, p.step))
            if (p.phase, p.step) == (what, step):
                raise Stop
        return progress  # type: ignore[return-value]

    with pytest.raises(Stop):
        run_phases(_config(repos), phases, 0, out, 1, stop_at("train", 3))     # the long phase's first step
    assert (out / marker_name(0, phases[0])).is_file() and not (out / marker_name(1, phases[1])).exists()
    with pytest.raises(Stop):
        run_phases(_config(repos), phases, 0, out, 1, stop_at("checkpoint", 4))  # the long phase saved, not marked
    assert not (out / marker_name(1, phases[1])).exists()
    seen.clear()
    result = run_phases(_config(repos), phases, 0, out, 1, stop_at("never", 0))
    assert [s for p, s in seen if p == "train"] == [5]                     # only the sft phase trained
    assert result.steps == unbroken.steps == 5
    a, b = _weights(tmp_path / "unbroken"), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary, whole = (json.loads(r.summary.read_text()) for r in (result, unbroken))
    assert [p["name"] for p in summary["phases"]] == ["main", "long", "sft"] and summary["losses"] == whole["losses"]
    assert len(whole["losses"]) == 5 and min(whole["losses"]) > 0
    assert summary["phases"][1]["resumed"] == "saved before its marker"
    held = whole["phases"][1]["held_out"]
    assert held["documents"] >= 1 and held["before"] > 0 and held["after"] > 0 and held["repositories"]
    policy = load_policy(out)
    assert policy.max_seq_len == 512 and (tmp_path / "unbroken" / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_long_context_phase_writes_the_new_context_and_rope_base_into_the_hf_config(
        tmp_path: Path, inputs: tuple[Path, Path]) -> None:
    """A Hugging Face policy's long-context phase rewrites max_position_embeddings and the RoPE base in config.json
    (plain transformers loads the directory with them) and lowers the loss on held-out repositories at the new
    length."""
    from transformers import AutoConfig

    repos, _ = inputs
    start = HFPolicy.load(build_family(tmp_path, "qwen2-tied", max_seq_len=128), dtype=torch.float32)
    config = dataclasses.replace(_config(repos), lr=3e-3)
    result = run_phases(config, [Phase("long", "long_context", 3, seq_len=512, data=str(repos), warmup_steps=1,
                                               batch_size=2)],
                        0, tmp_path / "out", 1, policy=start)
    record = result.phases[0]
    hf_config = AutoConfig.from_pretrained(tmp_path / "out")
    assert hf_config.max_position_embeddings == 512 and result.policy.max_seq_len == 512
    assert hf_config.rope_parameters["rope_theta"] == pytest.approx(record["rope_theta"]) and record["rope_theta"] > 1e4
    assert record["held_out"]["after"] < record["held_out"]["before"] and record["batch_size"] == 2


def test_validate_refuses_a_long_context_phase_under_four_times_the_main_one() -> None:
    """`[[pretrain.phases]]`: a long-context seq_len under 4x the main phase's is refused naming the key; 4x passes;
    an sft phase without data and top-level steps beside phases are refused too."""
    tiny = (Path(examples_init).parent / "tiny.toml").read_text().replace("steps = 30\n", "")
    main = '\n[[pretrain.phases]]\nname = "main"\nsteps = 3\nseq_len = 128\n'

    def problems(extra: str, text: str = tiny) -> list[str]:
        _, found = validate_text(text + main + extra)
        return [f"{p.key}: {p.message}" for p in found if p.severity == "error"]

    long = '\n[[pretrain.phases]]\nname = "long"\nkind = "long_context"\nsteps = 2\nseq_len = {}\n'
    [refused] = problems(long.format(511))
    assert refused.startswith("pretrain: phases[1].seq_len: 511;") and "4 x the main phase's 128 tokens = 512" in refused
    assert problems(long.format(512)) == []
    [sft] = problems('\n[[pretrain.phases]]\nname = "chat"\nkind = "sft"\nsteps = 2\n')
    assert sft.startswith("pretrain: phases[1].data:")
    [steps] = problems("", tiny.replace('preset = "tiny"\n', 'preset = "tiny"\nsteps = 5\n'))
    assert steps.startswith("pretrain: steps: with [[pretrain.phases]]")
