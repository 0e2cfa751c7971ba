"""`rlbus bench trainer`: the trainer at world size 1 and 2 (FSDP2 ranks on loopback), on the built-in m30
policy and a Qwen2 of similar size (built offline, randomly initialised).

- Owns: the trainer-ranks benchmark (`run`, `rank_jobs`): per world size and policy, in fresh rank processes,
  step time, RSS rise, the time to publish a version and the tensor bytes of the fullest rank;
  `memory_per_rank_ratio` (m30) and `memory_per_rank_ratio_hf` are that peak at N = 2 over N = 1.
- Does not: use real rollouts (`_rollouts` makes seeded synthetic groups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from rlbus.ops.bench.hf_model import _reset_high_water, _status_kb  # the same /proc readings

WORLD_SIZES: Final = (1, 2)
_TEXTS: Final = tuple(f"def f_{i}(x, y):\n    return x * {i} + y  # trainer rank bench\n" for i in range(200))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer-steps", type=int, default=3,
                   help="trainer: timed optimizer steps per world size, after one warm-up (default 3)")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="trainer: torch threads per rank (default 1: N ranks use N cores)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure each world size and policy and return the numbers.

    Per world size and policy, every rank is a fresh process (`LocalGroup`): step time (median of
    `--trainer-steps` steps after one warm-up), the rise of each rank's RSS high-water mark above its
    post-import baseline (and, apart, during the steps only, from just after building and sharding), the
    time to gather and publish a version, and the tensor bytes the fullest rank holds at its peak, counted
    (not RSS, whose interpreter and gloo share would hide a small model's sharding): at AdamW's step (a
    pre-step hook) the local bytes of the policy's and reference's parameters, the gradients and the
    optimizer state, plus, with N > 1, a bound on FSDP2's transient buffers (root unit + 4 x the largest
    unit in fp32: the units being all-gathered and prefetched, and one unit's unsharded gradients with their
    reduce-scatter input); at publication the parameters, optimizer state, bf16 tensors and encoded blob.
    """
    quick = bool(getattr(args, "quick", False))
    steps = 1 if quick else max(1, args.trainer_steps)
    size = "tiny" if quick else "m30"
    shape = {"tasks": 2, "group": 2, "prompt": 8, "completion": 8} if quick else \
        {"tasks": 2, "group": 4, "prompt": 32, "completion": 32}
    result: dict[str, Any] = {"size": size, "steps": steps, "threads": args.trainer_threads, "batch": shape,
                              "world_sizes": list(WORLD_SIZES), "clock": "wall"}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-trainer-") as tmp:
        from rlbus.model.policies.hf_recipe import build_hf_dir

        hf_dir = build_hf_dir(Path(tmp) / f"qwen2-{size}", architecture="qwen2", texts=_TEXTS, vocab_size=512,
                              size=size, max_seq_len=256)
        policies = {"builtin": size, "hf": str(hf_dir)}
        together = {n: _groups(n, {"policies": list(policies.values()), "steps": steps, **shape},
                               args.trainer_threads) for n in WORLD_SIZES} if quick else {}
        for key, policy in policies.items():
            runs = {n: together[n][policy] if quick else
                    _group(n, {"policy": policy, "steps": steps, **shape}, args.trainer_threads) for n in WORLD_SIZES}
            result[key] = {str(n): r for n, r in runs.items()}
            one, two = runs[1], runs[2]
            suffix = "" if key == "builtin" else "_hf"
            result[f"memory_per_rank_ratio{suffix}"] = two["peak_bytes"] / one["peak_bytes"]
            result[f"step_speedup{suffix}"] = one["step_s"] / two["step_s"]
            result[f"publish_gather_s{suffix}"] = two["publish_s"]
            result[f"rss_rise_ratio{suffix}"] = two["rss_rise_bytes"] / one["rss_rise_bytes"]
            result[f"rss_step_rise_ratio{suffix}"] = two["rss_step_rise_bytes"] / one["rss_step_rise_bytes"]
    return result


def _group(world_size: int, job: dict[str, Any], threads: int) -> dict[str, Any]:
    """One world size in fresh rank processes -> the leader's timings and the fullest rank's bytes."""
    return _groups(world_size, {**job, "policies": [job["policy"]]}, threads)[job["policy"]]


def _groups(world_size: int, job: dict[str, Any], threads: int) -> dict[str, dict[str, Any]]:
    """`_group` of each of `job["policies"]`, one after the other in the same rank processes (`rank_jobs`)."""
    from rlbus.ops.local_ranks import LocalGroup

    with LocalGroup(world_size, "rlbus.ops.bench.trainer:rank_jobs", job, timeout_s=300, threads=threads,
                    env={"TOKENIZERS_PARALLELISM": "false"}) as group:
        results = group.wait(1800)
    for r in results:
        if r.returncode != 0 or r.result is None:
            raise RuntimeError(f"bench trainer: rank {r.rank} of {world_size} exited {r.returncode}:\n{r.error}")
    return {policy: _summary([r.result[policy] for r in results]) for policy in job["policies"]}


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    leader = ranks[0]
    fullest = max(ranks, key=lambda r: r["peak_bytes"])
    return {"step_s": leader["step_s"], "publish_s": leader["publish_s"], "params": leader["params"],
            "tokens": leader["tokens"], "peak_bytes": fullest["peak_bytes"], "fullest_rank": fullest["rank"],
            "rss_rise_bytes": max(r["rss_rise_bytes"] for r in ranks),
            "rss_step_rise_bytes": max(r["rss_step_rise_bytes"] for r in ranks), "ranks": ranks}


# ---- inside one rank -----------------------------------------------------------------------------------------
def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())


def _held(policy: Any, reference: Any, optimizer: Any, grads: bool) -> dict[str, int]:
    """Local tensor bytes of parameters (policy and reference), gradients and optimizer state."""
    params = sum(_local_bytes(p) for net in (policy, reference) for p in net.module.parameters())
    grad = sum(_local_bytes(p.grad) for p in policy.module.parameters() if p.grad is not None) if grads else 0
    state = sum(_local_bytes(v) for values in optimizer.state.values() for v in values.values()
                if hasattr(v, "numel") and v.dim())
    return {"params": params, "grads": grad, "optimizer": state}


def _rollouts(tasks: int, group: int, prompt: int, completion: int, vocab: int) -> list[Any]:
    """Synthetic groups (seeded): random prompt and completion ids below `vocab`, behaviour logprob -3 per token,
    rewards spread within each group."""
    import torch

    from rlbus.messages.schemas import Rollout, TensorBlob

    g = torch.Generator().manual_seed(0)
    out = []
    for t in range(tasks):
        ids = torch.randint(4, vocab, (prompt,), generator=g).tolist()
        for k in range(group):
            comp = torch.randint(4, vocab, (completion,), generator=g).tolist()
            out.append(Rollout(
                rollout_id=f"bench-{t}-{k}", task_id=f"bench-{t}", group_index=k, group_size=group,
                prompt_tokens=TensorBlob.of(ids, "int32"), completion_tokens=TensorBlob.of(comp, "int32"),
                behaviour_logprobs=TensorBlob.of([-3.0] * completion, "float32"),
                policy_versions=TensorBlob.of([0] * completion, "int32"), loss_mask=TensorBlob.of([], "uint8"),
                reward=k / max(1, group - 1), region="hub", generator_id="bench"))
    return out


def _core(policy: str) -> Any:
    import torch

    from rlbus.actors.trainer.core import TrainerCore
    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.policies.interface import load_policy
    from rlbus.model.policies.tokenizer import ByteTokenizer
    from rlbus.model.policies.transformer import ModelConfig, Transformer

    torch.manual_seed(0)
    if policy in ("tiny", "m30"):
        config = getattr(ModelConfig, policy)(vocab_size=ByteTokenizer().vocab_size, max_seq_len=256)
        net: Any = BuiltinPolicy(Transformer(config))
    else:
        net = load_policy(Path(policy), dtype=torch.float32)
    return TrainerCore(net, net.clone(), lr=1e-5, seed=0)


def rank_jobs(spec: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One rank of `_groups`, for each of `job["policies"]` in turn: build, shard (N > 1), step, publish; measure
    (`_measure`; followers `follow` the leader). The quick mode runs both policies in one process (half
    the process starts; the RSS figures of a later policy then include what the allocator kept of an earlier
    one, the tensor bytes do not)."""
    import torch

    import rlbus.actors.trainer.ranks as ranks

    if any(p not in ("tiny", "m30") for p in job["policies"]):
        import transformers  # noqa: F401  (its import is part of the baseline, not of the trainer)
    sharded = spec.world_size > 1
    if sharded:
        ranks.join(spec, torch.device("cpu"))
    try:
        return {policy: _measure(spec, {**job, "policy": policy}) for policy in job["policies"]}
    finally:
        if sharded:
            ranks.leave()


def _measure(spec: Any, job: dict[str, Any]) -> dict[str, Any]:
    import rlbus.actors.trainer.ranks as ranks
    from rlbus.actors.trainer.core import Objective
    from rlbus.kernels.delta.state import encode_state

    sharded = spec.world_size > 1
    baseline = _reset_high_water()
    core = _core(job["policy"])
    units = [sum(p.numel() * 4 for p in u.parameters()) for u in core.policy.shard_units()]
    total = sum(p.numel() * 4 for p in core.policy.module.parameters())
    transient = (total - sum(units) + 4 * max(units, default=0)) if sharded else 0
    trainer: Any = ranks.ShardedCore(core, spec) if sharded else core
    built = _reset_high_water()    # the steps' own rise, apart from building (full tensors, then shards)
    at_step: list[dict[str, int]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: at_step.append(_held(trainer.policy, trainer.reference, opt, grads=True)))
    out: dict[str, Any] = {"rank": spec.rank, "world_size": spec.world_size, "transient_bound_bytes": transient,
                           "params": total // 4}
    if spec.rank != 0:
        ranks.follow(trainer, lambda name, data: (name, ""))
        publish = {"buffers": 0, **_held(trainer.policy, trainer.reference, trainer.optimizer, grads=False)}
    else:
        rollouts = _rollouts(job["tasks"], job["group"], job["prompt"], job["completion"],
                             min(core.policy.vocab_size, 512))
        times = []
        for i in range(job["steps"] + 1):
            t0 = time.perf_counter()
            stats = trainer.train_step(rollouts, Objective())
            if i:
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = trainer.bf16_state()
        index, blob = encode_state(state, None)
        out["publish_s"] = time.perf_counter() - t0
        publish = {"buffers": sum(t.numel() * t.element_size() for t in state.values()) + len(blob),
                   **_held(trainer.policy, trainer.reference, trainer.optimizer, grads=False)}
        del state, blob, index
        if sharded:
            trainer.stop()
        out |= {"step_s": statistics.median(times), "tokens": stats.tokens}
    step = max(at_step, key=lambda h: sum(h.values()))   # steps 2+: AdamW's state exists
    out |= {"at_step": step, "at_publish": publish,
            "peak_bytes": max(sum(step.values()) + transient, sum(publish.values())),
            "rss_rise_bytes": _status_kb("VmHWM") - baseline, "rss_built_bytes": built - baseline,
            "rss_step_rise_bytes": _status_kb("VmHWM") - built}
    return out


def table(result: dict[str, Any]) -> str:
    r = result
    lines = [f"{'policy':<8} {'N':>2} {'step s':>8} {'publish s':>9} {'peak tensor MiB':>15} {'RSS rise MiB':>12} "
             f"{'in steps':>8}  "
             f"fullest rank: params + grads + AdamW (+ FSDP transient) | at publish"]
    for key in ("builtin", "hf"):
        for n in map(str, r["world_sizes"]):
            g = r[key][n]
            fullest = g["ranks"][g["fullest_rank"]]
            s, p = fullest["at_step"], fullest["at_publish"]
            mib = 2 ** 20
            lines.append(
                f"{key:<8} {n:>2} {g['step_s']:>8.2f} {g['publish_s']:>9.3f} {g['peak_bytes'] / mib:>15.1f} "
                f"{g['rss_rise_bytes'] / mib:>12.1f} {g['rss_step_rise_bytes'] / mib:>8.1f}  "
                f"{s['params'] / mib:.1f} + {s['grads'] / mib:.1f} + "
                f"{s['optimizer'] / mib:.1f} (+ {fullest['transient_bound_bytes'] / mib:.1f}) | "
                f"{(p['params'] + p['optimizer']) / mib:.1f} + bf16/blob {p['buffers'] / mib:.1f}")
    lines.append(f"memory_per_rank_ratio {r['memory_per_rank_ratio']:.3f} (built-in {r['size']}), memory_per_rank_ratio_hf "
                 f"{r['memory_per_rank_ratio_hf']:.3f} (target <= 0.6); step_speedup {r['step_speedup']:.2f}x, "
                 f"_hf {r['step_speedup_hf']:.2f}x; RSS rise N=2/N=1 {r['rss_rise_ratio']:.2f} (in steps "
                 f"{r['rss_step_rise_ratio']:.2f}), _hf {r['rss_rise_ratio_hf']:.2f} ({r['rss_step_rise_ratio_hf']:.2f})")
    lines.append(f"{r['size']} policies, {r['batch']['tasks']} x {r['batch']['group']} rollouts of "
                 f"{r['batch']['prompt']} + {r['batch']['completion']} tokens, median of {r['steps']} steps, "
                 f"{r['threads']} torch thread(s) per rank, clock: {r['clock']}; cpu count {os.cpu_count()}")
    return "\n".join(lines)
