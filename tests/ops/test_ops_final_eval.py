"""The closing evaluation of `rlbus up` (ops/final_eval.py) scores the weights a version is published as,
and the summary compares where the run ended with the pretrained base (ops/runview.py)."""

from __future__ import annotations

import copy

import torch

from rlbus.actors.trainer.core import TrainerCore
from rlbus.messages.schemas import EvalReport
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.evaluate import EvalResult, evaluate_pass_at_1
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.ops.final_eval import FinalEval, _evaluate_state, policy_from_state
from rlbus.ops.runview import RunView, summary


def test_final_evaluation_scores_the_published_bf16_weights_of_the_state() -> None:
    """The policy rebuilt from a trainer state blob holds exactly the tensors a published version of it
    holds (bf16-rounded fp32 master weights), so the closing evaluation scores what the evaluator would."""
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = Transformer(ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=512))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)       # bits below bf16's precision: rounding matters
    core = TrainerCore(BuiltinPolicy(model), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3)
    blob = core.state_blob({"step": 7})

    policy = policy_from_state(blob)
    published = core.bf16_state()
    state = policy.named_tensors()
    assert state.keys() == published.keys()
    for name, tensor in published.items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], tensor), name
    assert any(not torch.equal(state[n].float(), t) for n, t in model.state_dict().items())   # not the fp32 master
    assert not policy.module.training and policy.device == torch.device("cpu")

    got = _evaluate_state(blob, eval_tasks(1, 6), max_tokens=24, threads=1)
    want = evaluate_pass_at_1(policy, policy.tokenizer, eval_tasks(1, 6), max_new_tokens=24, batch_size=32)
    assert got.completions == want.completions and got.n == 6
    assert sum(n for _, n in got.by_family.values()) == 6


def _result(passed: int, n: int) -> EvalResult:
    from rlbus.model.sampling.evaluate import wilson_interval

    low, high = wilson_interval(passed, n)
    return EvalResult(n, passed, passed / n, low, high, {}, [], [])


def _report(version: int, passed: int, n: int) -> EvalReport:
    r = _result(passed, n)
    return EvalReport(policy_version=version, task_seed=1, n=n, pass_at_1=r.pass_at_1, ci_low=r.ci_low,
                      ci_high=r.ci_high)


def test_summary_compares_the_final_weights_with_the_base() -> None:
    view = RunView(evals={0: _report(0, 115, 1000), 300: _report(300, 200, 1000)})
    view.final = FinalEval(step=347, policy_version=347, result=_result(230, 1000))
    text = summary(view, None)
    assert "evaluator pass@1: v0 0.115" in text and "→ v300 0.200" in text
    assert "final weights v347 (checkpoint step 347, evaluated after the run, n=1000): pass@1 0.230" in text
    assert "versus v0 (the pretrained base, same tasks): 2.00x; the held-out pass rate rose clearly" in text


def test_summary_without_a_final_evaluation_uses_the_last_report_and_says_when_intervals_overlap() -> None:
    view = RunView(evals={0: _report(0, 115, 1000), 50: _report(50, 125, 1000)})
    text = summary(view, None)
    assert "last evaluation v50 (n=1000): pass@1 0.125" in text
    assert "1.09x; the 95% intervals overlap" in text
    assert "rose clearly" not in text
