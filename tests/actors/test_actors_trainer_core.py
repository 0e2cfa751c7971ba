"""The trainer's math apart from the bus: step planning (groups, staleness, packing), batch alignment,
one RL step against hand-computed values, router replay, state round trip and the bf16 version blob."""

from __future__ import annotations

import copy
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.rollouts import sample_rollouts

from rlbus.actors.trainer.core import (
    Objective,
    TrainerCore,
    plan_step,
    rollout_batch,
    shared_prompt_logprobs,
    versions_behind,
)
from rlbus.kernels.delta.state import apply_state_, encode_state
from rlbus.kernels.logprob import token_logprob_entropy
from rlbus.messages.schemas import Rollout, Segment, TensorBlob
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.transformer import ModelConfig, Transformer


def _r(task: str, g: int, versions: list[int], *, size: int = 2, prompt: list[int] | None = None,
       completion: list[int] | None = None, logprobs: list[float] | None = None, mask: list[int] | None = None,
       reward: float = 0.0) -> Rollout:
    completion = completion if completion is not None else [1] * len(versions)
    return Rollout(rollout_id=f"{task}-{g}", task_id=task, group_index=g, group_size=size,
                   prompt_tokens=TensorBlob.of(prompt or [3], "int32"),
                   completion_tokens=TensorBlob.of(completion, "int32"),
                   behaviour_logprobs=TensorBlob.of(logprobs or [-1.0] * len(completion), "float32"),
                   policy_versions=TensorBlob.of(versions, "int32"),
                   loss_mask=TensorBlob.of(mask if mask is not None else [], "uint8"), reward=reward)


def _core(config: ModelConfig, seed: int = 0) -> TrainerCore:
    torch.manual_seed(seed)
    model = Transformer(config)
    return TrainerCore(BuiltinPolicy(model), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3, seed=seed)


def test_plan_drops_stale_groups_waits_for_incomplete_ones_and_fills_the_batch() -> None:
    """version 3, bound 2: a group with a token at version 0 is 3 behind → dropped; two whole groups train."""
    groups = {"a": [_r("a", 0, [3, 3]), _r("a", 1, [2])], "b": [_r("b", 0, [3])],
              "c": [_r("c", 0, [1, 1]), _r("c", 1, [0, 2])], "d": [_r("d", 0, [2]), _r("d", 1, [1])]}
    plan = plan_step(groups, version=3, staleness_versions=2, batch_rollouts=4)
    assert plan.train == ("a", "d")
    assert plan.drop == (("c", "stale: 3 versions behind (bound 2)"),)
    assert versions_behind(groups["d"][1], 3) == 2


def test_plan_waits_below_the_batch_and_packs_whole_groups() -> None:
    """3 ready rollouts < batch 4 → no step (drops still reported); groups of 3 with batch 4 → one group."""
    small = plan_step({"a": [_r("a", 0, [0]), _r("a", 1, [0])], "b": [_r("b", 0, [0])]}, version=0,
                      staleness_versions=0, batch_rollouts=4,
                      check=lambda r: "invalid: x" if r.task_id == "b" else None)
    assert small.train == () and small.drop == (("b", "invalid: x"),)
    threes = {t: [_r(t, g, [0], size=3) for g in range(3)] for t in ("a", "b")}
    assert plan_step(threes, version=0, staleness_versions=0, batch_rollouts=4).train == ("a",)
    assert plan_step(threes, version=0, staleness_versions=0, batch_rollouts=6).train == ("a", "b")


def test_plan_drops_complete_flat_groups_only_when_asked() -> None:
    """drop_flat: a complete group of equal rewards is dropped ("flat"), an incomplete one waits, a mixed one
    trains; without drop_flat the flat group trains like any other."""
    groups = {"flat": [_r("flat", g, [0], reward=0.0) for g in range(2)],
              "half": [_r("half", 0, [0], reward=1.0)],
              "mixed": [_r("mixed", 0, [0], reward=1.0), _r("mixed", 1, [0], reward=0.0)]}
    plan = plan_step(groups, version=0, staleness_versions=0, batch_rollouts=2, drop_flat=True)
    assert plan.train == ("mixed",)
    assert plan.drop == (("flat", "flat: all 2 rewards 0 (no learning signal)"),)
    assert plan_step(groups, version=0, staleness_versions=0, batch_rollouts=2).train == ("flat",)


def test_sequence_mean_weighs_each_completion_alike() -> None:
    """sequence_mean: the loss is the mean over completions of each one's token mean (2 and 7 trained
    tokens here), unlike token_mean, which pools the 9 tokens."""
    core = _core(ModelConfig.tiny(vocab_size=264))
    first, second = sample_rollouts(core.model, tasks=1, group_size=2, max_new_tokens=7, seed=5)
    first = msgspec.structs.replace(first, loss_mask=TensorBlob.of([1, 1, 0, 0, 0, 0, 0], "uint8"), reward=1.0)
    second = msgspec.structs.replace(second, reward=0.0)
    rollouts = [first, second]
    lp = [torch.from_numpy(r.behaviour_logprobs.numpy().copy()) for r in rollouts]
    adv = [0.5, -0.5]
    per_sequence = -(adv[0] * float(lp[0][:2].mean()) + adv[1] * float(lp[1].mean())) / 2
    pooled = -(adv[0] * float(lp[0][:2].sum()) + adv[1] * float(lp[1].sum())) / 9
    assert abs(per_sequence - pooled) > 1e-3
    stats = core.train_step(rollouts, Objective(kl_coef=0.0, grad_clip=0.0, aggregation="sequence_mean"))
    assert stats.loss == pytest.approx(per_sequence, abs=1e-4)


def test_batch_aligns_completion_tokens_with_next_token_positions() -> None:
    """Completion token t of row b sits at position P_b - 1 + t; loss_mask 0 and padding are off the mask."""
    r1 = _r("x", 0, [0, 0, 0], prompt=[5, 6], completion=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], mask=[1, 0, 1],
            reward=1.0)
    r2 = _r("y", 0, [0], prompt=[4], completion=[3], logprobs=[-0.5], reward=0.5)
    b = rollout_batch([r1, r2])
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert b.mask.tolist() == [[False, True, False, True], [True, False, False, False]]
    torch.testing.assert_close(b.behaviour, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.5, 0, 0, 0]]))
    assert b.lengths.tolist() == [3, 1] and b.group_ids.tolist() == [0, 1] and b.rewards.tolist() == [1.0, 0.5]
    assert b.routing is None


def test_on_policy_step_matches_the_hand_computed_loss_and_moves_the_weights() -> None:
    """At version 0 the policy is the behaviour and the reference: IS weights 1, KL 0, and
    loss = -sum_bt A_b logp_bt / tokens with A_b = r_b - mean of its group."""
    core = _core(ModelConfig.tiny(vocab_size=264))
    rollouts = sample_rollouts(core.model, tasks=2, group_size=2, max_new_tokens=5)
    before = [p.detach().clone() for p in core.model.parameters()]
    stats = core.train_step(rollouts, Objective(kl_coef=0.1, grad_clip=0.0))
    rewards = torch.tensor([r.reward for r in rollouts])
    adv = rewards - rewards.view(2, 2).mean(1).repeat_interleave(2)
    logp = [torch.from_numpy(r.behaviour_logprobs.numpy().copy()) for r in rollouts]
    expected = -sum(float(a * lp.sum()) for a, lp in zip(adv, logp, strict=True)) / sum(len(lp) for lp in logp)
    assert stats.loss == pytest.approx(expected, abs=1e-4)
    assert stats.kl == 0.0 and stats.truncated_fraction == 0.0
    assert stats.mean_weight == pytest.approx(1.0, abs=1e-4)
    assert stats.applied and stats.tokens == sum(len(lp) for lp in logp)
    assert any(not torch.equal(a, b) for a, b in zip(before, core.model.parameters(), strict=True))


def test_scale_by_std_divides_each_groups_advantages_by_its_reward_std() -> None:
    """scale_by_std (GRPO): A_b = (r_b - group mean) / (group std, ddof 1); a group with one pass in four
    then weighs 1/std = 2x what mean-centring gives it. The trainer's settings carry the switch."""
    from rlbus.actors.trainer.actor import TrainerConfig, objective

    core = _core(ModelConfig.tiny(vocab_size=264))
    rollouts = [msgspec.structs.replace(r, reward=float(i == 0))
                for i, r in enumerate(sample_rollouts(core.model, tasks=1, group_size=4, max_new_tokens=5))]
    rewards = torch.tensor([r.reward for r in rollouts])
    adv = (rewards - rewards.mean()) / rewards.std()
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    logp = [torch.from_numpy(r.behaviour_logprobs.numpy().copy()) for r in rollouts]
    expected = -sum(float(a * lp.sum()) for a, lp in zip(adv, logp, strict=True)) / sum(len(lp) for lp in logp)
    stats = core.train_step(rollouts, Objective(kl_coef=0.0, grad_clip=0.0, scale_by_std=True))
    assert stats.loss == pytest.approx(expected, abs=1e-4)
    assert objective(TrainerConfig(scale_by_std=True)).scale_by_std and not objective(TrainerConfig()).scale_by_std


def test_lr_decays_linearly_to_its_final_ratio_then_holds() -> None:
    """lr_decay_steps: step 1 at lr, step decay+1 at lr * lr_final_ratio, held after; 0: constant."""
    from rlbus.actors.trainer.actor import TrainerConfig

    config = TrainerConfig(lr=1e-4, lr_decay_steps=100, lr_final_ratio=0.1)
    assert config.lr_at(1) == pytest.approx(1e-4)
    assert config.lr_at(51) == pytest.approx(0.55e-4)
    assert config.lr_at(101) == pytest.approx(1e-5) and config.lr_at(500) == pytest.approx(1e-5)
    assert [TrainerConfig(lr=1e-4).lr_at(s) for s in (1, 1000)] == [1e-4, 1e-4]


def test_a_step_at_a_given_lr_is_the_step_of_an_optimizer_built_with_it() -> None:
    """train_step(lr=x) on a core built with another lr gives exactly the weights of a core built with x,
    also after a resume (the optimizer state's saved lr does not win)."""
    config = ModelConfig.tiny(vocab_size=264)
    ref, other = _core(config, seed=3), _core(config, seed=3)
    other.optimizer = torch.optim.AdamW(other.model.parameters(), lr=5e-2, betas=(0.9, 0.95), weight_decay=0.0)
    rollouts = [msgspec.structs.replace(r, reward=float(i % 2))
                for i, r in enumerate(sample_rollouts(ref.model, tasks=2, group_size=2, max_new_tokens=5))]
    objective = Objective(kl_coef=0.0)
    for _ in range(2):
        ref.train_step(rollouts, objective)
        other.train_step(rollouts, objective, lr=1e-3)
    for a, b in zip(ref.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    resumed = _core(config, seed=3)
    resumed.load_state_blob(other.state_blob({}))
    resumed.train_step(rollouts, objective, lr=2e-4)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [2e-4]


def test_logprobs_are_taken_at_the_sampling_temperature() -> None:
    """Rollouts sampled at temperature 0.7: at Objective(temperature=0.7) the step is on-policy (every IS
    weight 1, none truncated); read at temperature 1 the same tokens look off-policy."""
    core = _core(ModelConfig.tiny(vocab_size=264), seed=2)
    rollouts = sample_rollouts(core.model, tasks=2, group_size=2, max_new_tokens=6, seed=4, temperature=0.7)
    batch = rollout_batch(rollouts)
    with torch.no_grad():
        scaled = core.logprobs(core.policy, batch, 0.7)
        plain = core.logprobs(core.policy, batch)
    torch.testing.assert_close(scaled[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)
    assert (plain[batch.mask] - batch.behaviour[batch.mask]).abs().max() > 1e-2
    stats = core.train_step(rollouts, Objective(temperature=0.7, kl_coef=0.0))
    assert stats.mean_weight == pytest.approx(1.0, abs=1e-4) and stats.truncated_fraction == 0.0


def test_shared_prompts_run_once_and_give_the_full_forward_logprobs_and_gradients() -> None:
    """Groups sharing prompts of unequal length (one rollout with an empty completion, one multi-turn
    with a loss mask, one group of one): the shared-prompt logprobs equal the full forward's on every
    completion position, are 0 elsewhere, and give the same gradients; all-distinct prompts fall back."""
    core = _core(ModelConfig.tiny(vocab_size=264), seed=5)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 264, (n,), generator=g).tolist()

    long_prompt, short_prompt, lone = ids(11), ids(4), ids(7)
    rollouts = [_r("a", k, [0] * n, size=3, prompt=long_prompt, completion=ids(n))
                for k, n in enumerate((5, 9, 0))]
    rollouts += [_r("b", 0, [0] * 6, prompt=short_prompt, completion=ids(6), mask=[1, 1, 0, 0, 1, 1]),
                 _r("b", 1, [0] * 12, prompt=short_prompt, completion=ids(12)),
                 _r("c", 0, [0] * 3, size=1, prompt=lone, completion=ids(3))]
    batch = rollout_batch(rollouts)
    span = torch.zeros_like(batch.mask)  # every completion position, loss-masked or not
    for b, (P, T) in enumerate(zip(batch.prompt_lengths.tolist(), batch.lengths.tolist(), strict=True)):
        span[b, P - 1:P - 1 + T] = True
    logits = core.model(batch.tokens, with_mtp=False).logits[:, :-1]
    full, _ = token_logprob_entropy(logits / 0.7, batch.tokens[:, 1:])
    shared = shared_prompt_logprobs(core.policy, batch, 0.7)
    assert shared is not None and shared.shape == full.shape
    torch.testing.assert_close(shared[span], full[span], atol=1e-5, rtol=0)
    assert torch.equal(shared[~span], torch.zeros_like(shared[~span]))
    assert torch.equal(core.logprobs(core.policy, batch, 0.7), shared)
    weights = torch.randn(full.shape, generator=g) * batch.mask
    params = list(core.model.parameters())
    for want, got in zip(torch.autograd.grad((full * weights).sum(), params, allow_unused=True),
                         torch.autograd.grad((shared * weights).sum(), params, allow_unused=True), strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    distinct = rollout_batch([_r("x", 0, [0, 0], prompt=[5, 6]), _r("y", 0, [0], prompt=[7])])
    assert shared_prompt_logprobs(core.policy, distinct) is None


def test_router_replay_reproduces_the_behaviour_logprobs_of_an_moe_policy() -> None:
    """With the recorded experts replayed the trainer's logprobs equal the sampler's; other experts differ."""
    core = _core(ModelConfig.tiny(vocab_size=264, moe_layers=(0, 1), n_experts=4, top_k=2), seed=3)
    rollouts = sample_rollouts(core.model, tasks=2, group_size=2, max_new_tokens=6, seed=1)
    assert all(core.check(r) is None for r in rollouts)
    batch = rollout_batch(rollouts, moe=core.moe)
    assert batch.routing is not None and batch.routing.shape[2:] == (2, 2)
    with torch.no_grad():
        replayed = core.logprobs(core.policy, batch)
        other = core.logprobs(core.policy, type(batch)(**{**batch.__dict__, "routing": (batch.routing + 1) % 4}))
    torch.testing.assert_close(replayed[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)
    assert (other[batch.mask] - batch.behaviour[batch.mask]).abs().max() > 1e-3
    assert core.train_step(rollouts, Objective()).replayed


def test_state_blob_round_trip_resumes_bit_identically() -> None:
    """Weights, AdamW moments and RNG restored from the blob (the reference is rebuilt from the same
    source): the next step gives bit-identical weights."""
    config = ModelConfig.tiny(vocab_size=264)
    a = _core(config, seed=0)
    first = sample_rollouts(a.model, tasks=2, group_size=2, seed=5)
    a.train_step(first, Objective())
    blob = a.state_blob({"step": 1, "consumed": [r.rollout_id for r in first]})
    b = _core(config, seed=0)
    assert not torch.equal(a.model.embed.weight, b.model.embed.weight)
    assert b.load_state_blob(blob) == {"step": 1, "consumed": [r.rollout_id for r in first]}
    second = sample_rollouts(a.model, tasks=2, group_size=2, seed=6)
    a.train_step(second, Objective())
    b.train_step(second, Objective())
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    with pytest.raises(ValueError, match="architecture"):
        _core(ModelConfig.tiny(vocab_size=300)).load_state_blob(blob)


def test_version_blob_decodes_to_the_bf16_cast_of_the_master() -> None:
    """encode_state(bf16_state) applied to any buffer gives the bf16 cast of the fp32 weights, bit for bit."""
    core = _core(ModelConfig.tiny(vocab_size=264))
    core.train_step(sample_rollouts(core.model, tasks=1, group_size=2), Objective())
    _, blob = encode_state(core.bf16_state(), None)
    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in core.model.state_dict().items()}
    apply_state_(target, blob)
    for name, master in core.model.state_dict().items():
        assert torch.equal(target[name].view(torch.int16), master.to(torch.bfloat16).view(torch.int16)), name


def test_check_names_what_the_model_cannot_train_on() -> None:
    """Too long, out-of-vocabulary tokens and ragged per-token arrays each get a reason."""
    core = _core(ModelConfig.tiny(vocab_size=264, max_seq_len=8))
    assert core.check(_r("a", 0, [0] * 8)).startswith("too_long")
    assert core.check(_r("a", 0, [0], completion=[300])).startswith("invalid: token id")
    ragged = _r("a", 0, [0, 0], completion=[1, 2], logprobs=[-1.0])
    assert core.check(ragged).startswith("invalid: per-token")
    assert core.check(_r("a", 0, [0, 0])) is None


def test_launcher_settings_decode_into_the_trainer_and_checkpointer_configs(tmp_path: Path) -> None:
    """What topology/backends/launch.py hands the trainer and checkpointer (tiny example: its section as settings, the
    state directory, pretrained folder and checkpoint interval as launch values) is what they accept."""
    import msgspec

    from rlbus.actors.common.config import CheckpointerConfig, CheckpointerLaunch, decode_config
    from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
    from rlbus.topology.backends.launch import kind_launch, kind_settings
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.load import load

    topology = load(example_path("tiny"))
    trainer = decode_config("trainer", kind_settings(topology, "trainer"), TrainerConfig)
    launch = msgspec.convert(msgspec.to_builtins(kind_launch(topology, "trainer", tmp_path)), TrainerLaunch)
    assert trainer.batch_rollouts == 4 and launch.checkpoint_interval == 2 and launch.keep_version_objects == 16
    assert launch.pretrained == str(tmp_path.resolve() / "pretrained") and launch.state_dir == str(tmp_path.resolve())
    checkpointer = decode_config("checkpoint", kind_settings(topology, "checkpointer"), CheckpointerConfig)
    at = msgspec.convert(msgspec.to_builtins(kind_launch(topology, "checkpointer", tmp_path)), CheckpointerLaunch)
    assert checkpointer.keep == 2 and at.state_dir == str(tmp_path.resolve())


def test_build_core_starts_from_a_pretrained_checkpoint_folder_and_freezes_it_as_reference(tmp_path: Path) -> None:
    """A `pretrain.pt` folder gives the starting weights and an equal, frozen reference; a missing one fails."""
    import dataclasses

    from rlbus.actors.trainer.core import build_core
    from rlbus.model.policies.tokenizer import ByteTokenizer
    from rlbus.model.training.pretrain import CHECKPOINT_NAME

    torch.manual_seed(7)
    model = Transformer(ModelConfig.tiny(vocab_size=264, moe_layers=(1,)))
    (tmp_path / "pretrained").mkdir()
    torch.save({"state_dict": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "tokenizer": ByteTokenizer().info(), "meta": {"step": 1}}, tmp_path / "pretrained" / CHECKPOINT_NAME)
    core = build_core(str(tmp_path / "pretrained"), lr=1e-3, seed=0)
    assert core.policy.spec() == BuiltinPolicy(model).spec() and core.moe == (1, 2)
    for name, value in model.state_dict().items():
        assert torch.equal(core.model.state_dict()[name], value)
        assert torch.equal(core.reference.module.state_dict()[name], value)
    assert not any(p.requires_grad for p in core.reference.module.parameters())
    with pytest.raises(FileNotFoundError, match="rlbus pretrain"):
        build_core(str(tmp_path / "nowhere"), lr=1e-3, seed=0)


def _segment(prompt: list[int], completion: list[int], logprobs: list[float], versions: list[int]) -> Segment:
    return Segment(prompt_tokens=TensorBlob.of(prompt, "int32"), completion_tokens=TensorBlob.of(completion, "int32"),
                   behaviour_logprobs=TensorBlob.of(logprobs, "float32"), policy_versions=TensorBlob.of(versions, "int32"),
                   loss_mask=TensorBlob.of([1] * len(completion), "uint8"))


def test_segments_are_rows_of_their_own_rollout_and_weigh_it_once() -> None:
    """A rollout's segments enter the batch as rows before it, each under its own prompt; the group advantage
    is the rollout's (a segment does not count as a member); under sequence_mean the rollout is one
    sequence across its rows; staleness reads the oldest token of any segment."""
    core = _core(ModelConfig.tiny(vocab_size=264))
    first, second = sample_rollouts(core.model, tasks=1, group_size=2, max_new_tokens=5, seed=3)
    extra = _segment([3, 4, 5], [6, 7], [-0.5, -0.25], [0, 1])
    first = msgspec.structs.replace(first, reward=1.0, segments=[extra])
    second = msgspec.structs.replace(second, reward=0.0)
    batch = rollout_batch([first, second])
    assert batch.owner.tolist() == [0, 0, 1] and batch.segmented
    assert batch.tokens[0, :5].tolist() == [3, 4, 5, 6, 7] and batch.mask[0, 2:4].tolist() == [True, True]
    assert versions_behind(first, 4) == 4 and versions_behind(second, 4) == 4 - int(second.policy_versions.numpy().min())
    assert core.check(msgspec.structs.replace(first, segments=[_segment([3], [999], [-1.0], [0])])) == (
        "invalid: token id outside the vocabulary of 264 (segment 0)")
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    adv = [0.5, 0.5, -0.5]                          # rewards 1 and 0 of two rollouts, not of three rows
    weight = torch.exp(logp - batch.behaviour).clamp(max=2.0)        # the segment's behaviour is not the policy's
    per_row = [(-adv[b] * weight[b] * logp[b])[batch.mask[b]].sum() for b in range(3)]
    counts = [int(batch.mask[b].sum()) for b in range(3)]
    want = float(((per_row[0] + per_row[1]) / (counts[0] + counts[1]) + per_row[2] / counts[2]) / 2)
    stats = core.train_step([first, second], Objective(kl_coef=0.0, grad_clip=0.0, aggregation="sequence_mean"))
    assert stats.loss == pytest.approx(want, abs=1e-4) and stats.reward_mean == 0.5


def test_a_long_segment_context_beside_a_long_completion_is_scored_by_the_full_forward() -> None:
    """Rows fit max_seq_len one by one, but the longest prompt (a segment's) and the longest completion (another
    row's) together do not fit one shared cache: the logprobs come from the full forward, equal row by row."""
    core = _core(ModelConfig.tiny(vocab_size=264, max_seq_len=64))
    long_context = _segment(list(range(3, 53)), [6, 7, 8], [-1.0] * 3, [0] * 3)
    first = _r("a", 0, [0] * 40, prompt=[3, 4], completion=[9] * 40, reward=1.0)
    first = msgspec.structs.replace(first, segments=[long_context])
    second = _r("a", 1, [0] * 40, prompt=[3, 4], completion=[10] * 40)
    batch = rollout_batch([first, second])
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
        for b in range(3):
            n = int(batch.prompt_lengths[b] + batch.lengths[b])
            alone = torch.log_softmax(core.policy(batch.tokens[b:b + 1, :n]).logits[0, :-1], -1)
            want = alone.gather(-1, batch.tokens[b, 1:n, None])[:, 0]
            torch.testing.assert_close(logp[b, :n - 1][batch.mask[b, :n - 1]], want[batch.mask[b, :n - 1]],
                                       atol=1e-5, rtol=0)


def test_reference_dtype_names_resolve_by_device_and_unknown_ones_are_refused() -> None:
    """'auto' is bfloat16 exactly where the device multiplies bf16 natively; the explicit names are themselves."""
    from rlbus.model.policies.interface import PolicyError, native_bf16, reference_dtype

    cpu = torch.device("cpu")
    assert reference_dtype("bfloat16", cpu) is torch.bfloat16 and reference_dtype("float32", cpu) is torch.float32
    assert reference_dtype("auto", cpu) is (torch.bfloat16 if native_bf16(cpu) else torch.float32)
    assert not native_bf16(torch.device("meta"))
    with pytest.raises(PolicyError, match="'auto', 'bfloat16' or 'float32'"):
        reference_dtype("float16", cpu)


def test_a_bfloat16_reference_scores_like_the_float32_one_and_the_step_trains() -> None:
    """The same batch against the same frozen weights held in bfloat16 and in float32: the reference's logprobs
    agree to bf16 rounding, and a step with the bf16 reference moves the float32 master with a KL near 0 at
    version 0 (the policy is the reference, up to that rounding)."""
    config = ModelConfig.tiny(vocab_size=264)
    torch.manual_seed(3)
    model = Transformer(config)
    cores = {dtype: TrainerCore(BuiltinPolicy(copy.deepcopy(model)), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3,
                                reference_dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    low = cores[torch.bfloat16]
    assert all(p.dtype is torch.bfloat16 for p in low.reference.module.parameters())
    assert all(p.dtype is torch.float32 for p in low.model.parameters())
    rollouts = sample_rollouts(model, tasks=2, group_size=4, max_new_tokens=8)
    batch = rollout_batch(rollouts)
    with torch.no_grad():
        want = cores[torch.float32].logprobs(cores[torch.float32].reference, batch, 0.7)
        got = low.logprobs(low.reference, batch, 0.7)
    assert got.dtype is torch.float32
    on = batch.mask.bool()
    assert (got[on] - want[on]).abs().max() < 0.1 and (got[on] - want[on]).abs().mean() < 0.02
    assert not torch.equal(got[on], want[on])              # it did run in bfloat16
    before = [p.detach().clone() for p in low.model.parameters()]
    stats = low.train_step(rollouts, Objective(kl_coef=0.1, temperature=0.7))
    assert stats.applied and abs(stats.kl) < 0.02
    assert any(not torch.equal(a, b) for a, b in zip(before, low.model.parameters(), strict=True))
