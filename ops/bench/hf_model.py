"""`rlbus bench model --model-policy hf`: a Hugging Face policy's sampling, training and weight-swap costs.

Owns the HF model benchmark, each number beside a baseline measured in the same run: rlbus `generate` sampling
groups vs transformers' own `generate(num_return_sequences=G)` (useful tokens per second, alternating rounds);
the trainer's tokens per second vs a plain supervised step on the same tokens; the rise of the memory
high-water mark of a full-snapshot swap through `WeightSync` (a fresh process) over the model's bf16 bytes.
The model (Qwen2, m30) is built and pretrained on the task corpus once, into `.rlbus/bench/hf-<size>-<steps>/`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

CACHE_ROOT: Final = Path(".rlbus/bench")
"""Where built models are kept (relative to the working directory), one folder per size and step count."""
_PRETRAIN_SEED: Final = 0


def model_dir(size: str, steps: int, *, quick: bool, threads: int) -> Path:
    """The cached pretrained Qwen2 directory of `size` after `steps` steps, built (with progress on stderr)
    when missing or unfinished. Pretrained on task documents only (code fraction 0): prompts, canonical
    solutions closed by the stop id."""
    from rlbus.model.policies.interface import is_hf_dir
    from rlbus.model.training.pretrain import PretrainConfig, new_hf_policy, pretrain
    from rlbus.ops.pretrain import PretrainPrinter

    out = CACHE_ROOT / f"hf-{size}-{steps}"
    summary = out / "pretrain.json"
    if is_hf_dir(out) and summary.is_file() and json.loads(summary.read_text()).get("final"):
        return out
    preset = "m30" if size == "m30" else "tiny"
    quick_only = {"retry_fraction": 0.0, "warmup_steps": 1, "max_new_tokens": 16} if quick else {}
    config = PretrainConfig.preset(preset, eval_n=1 if quick else 16, checkpoint_every=10**9 if quick else 20,
                                   stdlib=not quick, code_fraction=0.0, **quick_only)
    printer = PretrainPrinter(sys.stderr, prefix="bench model: ", every=10)
    print(f"bench model: building {out} (hf qwen2 {size}, {steps} pretraining steps on the task corpus, "
          f"{threads} threads); later runs reuse it", file=sys.stderr, flush=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    policy = new_hf_policy(config, "qwen2", size, _PRETRAIN_SEED, max_seq_len=config.model.max_seq_len)
    result = pretrain(config, steps, _PRETRAIN_SEED, out, threads, printer, policy=policy)
    print(f"bench model: pretrained, loss {result.first_loss:.3f} -> {result.final_loss:.3f}, held-out greedy "
          f"pass@1 {result.eval.pass_at_1:.2f} ({result.eval.n} tasks)", file=sys.stderr, flush=True)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-policy", choices=("builtin", "hf"), default="builtin",
                   help="model: the built-in transformer's bench (default) or a Hugging Face policy's")
    p.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="model, hf: the Hugging Face directory to use (default: build and pretrain a Qwen2 m30 "
                        "into .rlbus/bench/ once)")
    p.add_argument("--model-hf-steps", type=int, default=60,
                   help="model, hf: pretraining steps of the built model (default 60)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.tasks.builtin import eval_tasks

    quick = bool(getattr(args, "quick", False))
    steps = 4 if quick else args.model_hf_steps
    size = "tiny" if quick else "m30"
    directory = args.model_dir or model_dir(size, steps, quick=quick, threads=2)
    torch.set_num_threads(args.model_threads)
    device = torch.device(args.model_device)
    policy = HFPolicy.load(directory, device=device, dtype=torch.float32)
    prompts = [policy.tokenizer.prompt_ids(t.prompt) for t in eval_tasks(0, 2 if quick else 8)]
    new_tokens = 32 if quick else 256
    group = 4 if quick else 8
    result: dict[str, Any] = {
        "policy": "hf", "model_dir": str(directory), "architecture": policy.architecture,
        "params": sum(p.numel() for p in policy.module.parameters()), "device": str(device),
        "threads": args.model_threads, "clock": "wall", "pretrain_steps": _pretrain_steps(directory),
        "prompts": len(prompts), "group": group, "max_new_tokens": new_tokens, "temperature": TEMPERATURE,
    }
    samples, sampling = _sampling(policy, prompts, group, new_tokens)
    result |= sampling | _greedy_stops(policy, prompts, new_tokens)
    result |= _training(policy, prompts, samples, group)
    result |= _swap(directory)
    return result


TEMPERATURE: Final = 0.7
ROUNDS: Final = 3


def _pretrain_steps(directory: Path) -> int | None:
    try:
        return int(json.loads((directory / "pretrain.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wall(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _useful(completion: list[int], stop: int) -> int:
    """Tokens of a completion up to and including its first stop (all of them when it never stops)."""
    return completion.index(stop) + 1 if stop in completion else len(completion)


def _sampling(policy: Any, prompts: list[list[int]], group: int, new_tokens: int
              ) -> tuple[list[Any], dict[str, Any]]:
    """rlbus `generate` on each prompt `group` times vs transformers' `generate(num_return_sequences=group)` on
    the same left-padded prompts, alternating rounds, seed r in round r on both sides; median of `ROUNDS`.
    -> (the first rlbus round's samples, the numbers)."""
    import torch

    from rlbus.model.sampling.generate import generate, left_pad

    tok = policy.tokenizer
    stop, pad = tok.stop_id, tok.pad_id
    rows = [p for p in prompts for _ in range(group)]
    tokens, mask = left_pad(prompts, pad, policy.device)
    rate: dict[str, list[float]] = {"rlbus": [], "hf": []}
    lengths: dict[str, list[int]] = {"rlbus": [], "hf": []}
    stops: dict[str, list[bool]] = {"rlbus": [], "hf": []}
    first: list[Any] = []
    generate(policy, rows[:2], max_new_tokens=4, temperature=TEMPERATURE, eos_id=stop, pad_id=pad)  # warm-up
    for r in range(ROUNDS):
        g = torch.Generator(device=policy.device).manual_seed(r)
        t0 = _wall(policy.device)
        out = generate(policy, rows, max_new_tokens=new_tokens, temperature=TEMPERATURE, eos_id=stop, pad_id=pad,
                       generator=g)
        t1 = _wall(policy.device)
        first = first or out
        counts = [_useful(s.tokens.tolist(), stop) for s in out]
        rate["rlbus"].append(sum(counts) / (t1 - t0))
        lengths["rlbus"] += counts
        stops["rlbus"] += [s.finish_reason == "eos" for s in out]
        torch.manual_seed(r)
        t0 = _wall(policy.device)
        with torch.no_grad():
            seqs = policy.module.generate(
                input_ids=tokens, attention_mask=mask.long(), do_sample=True, temperature=TEMPERATURE, top_k=0,
                top_p=1.0, num_return_sequences=group, max_new_tokens=new_tokens, eos_token_id=stop,
                pad_token_id=pad)
        t1 = _wall(policy.device)
        completions = seqs[:, tokens.shape[1]:].tolist()
        counts = [_useful(c, stop) for c in completions]
        rate["hf"].append(sum(counts) / (t1 - t0))
        lengths["hf"] += counts
        stops["hf"] += [stop in c for c in completions]
    result: dict[str, Any] = {}
    for side in ("rlbus", "hf"):
        result[f"{side}_tokens_per_s"] = statistics.median(rate[side])
        result[f"{side}_len_mean"] = statistics.fmean(lengths[side])
        result[f"{side}_len_std"] = statistics.pstdev(lengths[side])
        result[f"{side}_stop_fraction"] = sum(stops[side]) / len(stops[side])
    result["hf_generate_ratio"] = result["rlbus_tokens_per_s"] / result["hf_tokens_per_s"]
    return first, result


def _greedy_stops(policy: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The share of greedy completions of the prompts that end with the stop id."""
    from rlbus.model.sampling.generate import generate

    tok = policy.tokenizer
    out = generate(policy, prompts, max_new_tokens=new_tokens, temperature=0, eos_id=tok.stop_id, pad_id=tok.pad_id)
    return {"greedy_stop_fraction": sum(s.finish_reason == "eos" for s in out) / len(out),
            "greedy_len_mean": statistics.fmean(len(s.tokens) for s in out)}


def _rollouts(samples: list[Any], prompts: list[list[int]], group: int) -> list[Any]:
    """The sampled groups as Rollouts (the generator's layout and id scheme); rewards are made up (the share of
    even ids), since only their spread within a group matters to the step's cost."""
    from rlbus.messages.schemas import Rollout, TensorBlob

    out = []
    for i, s in enumerate(samples):
        task, g = divmod(i, group)
        ids, n = s.tokens.tolist(), len(s.tokens)
        out.append(Rollout(
            rollout_id=f"bench-{task}-{g}", task_id=f"bench-{task}", group_index=g, group_size=group,
            prompt_tokens=TensorBlob.of(prompts[task], "int32"), completion_tokens=TensorBlob.of(ids, "int32"),
            behaviour_logprobs=TensorBlob.of(s.logprobs.tolist(), "float32"),
            policy_versions=TensorBlob.of([0] * n, "int32"), loss_mask=TensorBlob.of([1] * n, "uint8"),
            reward=sum(t % 2 == 0 for t in ids) / max(1, n), region="hub", generator_id="bench"))
    return out


def _training(policy: Any, prompts: list[list[int]], samples: list[Any], group: int) -> dict[str, Any]:
    """`TrainerCore.train_step` on the sampled groups vs a plain supervised step (transformers' own loss on the
    same prompt + completion rows, completions as labels, AdamW), median of `ROUNDS` steps each, alternating."""
    import torch

    from rlbus.actors.trainer.core import Objective, TrainerCore

    rollouts = _rollouts(samples, prompts, group)
    core = TrainerCore(policy.clone(), policy.clone(), lr=1e-6)
    objective = Objective(temperature=TEMPERATURE)
    sft = policy.clone().to_(dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(sft.module.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
    width = max(len(p) + len(s.tokens) for p, s in zip((prompts[i // group] for i in range(len(samples))),
                                                       samples, strict=True))
    ids = torch.full((len(samples), width), policy.tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    real = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        row = [*prompts[i // group], *s.tokens.tolist()]
        ids[i, :len(row)] = torch.tensor(row)
        real[i, :len(row)] = 1
        labels[i, len(prompts[i // group]):len(row)] = s.tokens
    ids, labels, real = (t.to(policy.device) for t in (ids, labels, real))
    sft_tokens = int((labels[:, 1:] != -100).sum())
    rates: dict[str, list[float]] = {"trainer": [], "sft": []}
    tokens = 0
    for _ in range(ROUNDS):
        t0 = _wall(policy.device)
        stats = core.train_step(rollouts, objective)
        t1 = _wall(policy.device)
        tokens = stats.tokens
        rates["trainer"].append(tokens / (t1 - t0))
        t0 = _wall(policy.device)
        loss = sft.module(input_ids=ids, attention_mask=real, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        t1 = _wall(policy.device)
        rates["sft"].append(sft_tokens / (t1 - t0))
    trainer, baseline = statistics.median(rates["trainer"]), statistics.median(rates["sft"])
    return {"trainer_tokens_per_s": trainer, "sft_tokens_per_s": baseline, "trainer_sft_ratio": trainer / baseline,
            "trainer_tokens": tokens, "trainer_rollouts": len(rollouts)}


# ---- the swap's memory, measured in fresh processes ----------------------------------------------------
_HUB: Final = "hub"
_OBJECT: Final = "v1.full"


def _swap(directory: Path) -> dict[str, Any]:
    import anyio

    return anyio.run(_swap_async, directory.resolve(), backend="asyncio")


async def _swap_async(directory: Path) -> dict[str, Any]:
    """A one-region embedded bus; version 1 of the policy, a full snapshot, uploaded to its WEIGHTS store and
    announced on LATEST as the publisher does; then a fresh generator process holding version 0 takes it
    through `WeightSync` while decoding, and another fresh process only fetches the blob."""
    import tempfile
    import uuid

    import anyio
    import torch

    from rlbus.actors.publisher import advance_latest
    from rlbus.kernels.delta.state import encode_state
    from rlbus.messages.bus import Bus, ConnectOptions, Identity
    from rlbus.messages.schemas import WeightManifest
    from rlbus.messages.streams import StreamSettings, provision_run
    from rlbus.model.policies.hf import HFPolicy
    from rlbus.topology.network.regions import RegionSet

    policy = HFPolicy.load(directory, dtype=torch.bfloat16)
    state = {name: (t.float() + 1e-3).to(torch.bfloat16) for name, t in policy.published_state().items()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    index, blob = encode_state(state, None)
    del state
    run_id = f"b{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-swap-") as tmp:
        rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(Path(tmp), (_HUB,), _HUB, run=run_id))
        buses: list[Bus] = []
        try:
            for role in ("admin", "publisher"):
                cred = rs.credentials(role)
                buses.append(await Bus.connect(rs.url(_HUB), run=run_id, domain=_HUB,
                                               identity=Identity(actor_id=f"bench-{role}", kind=role, region=_HUB),
                                               options=ConnectOptions(user=cred.user, password=cred.password)))
            admin, publisher = buses
            await provision_run(admin.nc, admin.subjects, hub=_HUB, domains=rs.domains, settings=StreamSettings())
            digest = await publisher.put_object(publisher.subjects.weights_bucket(_HUB), _OBJECT, blob)
            manifest = WeightManifest(version=1, encoding="full", objects=[_OBJECT], digests=[digest],
                                      sizes=[len(blob)], version_digest=index.version_digest.hex(),
                                      raw_bytes=model_bytes, model_config=policy.spec(), bases=[None], yields=[1])
            await advance_latest(publisher.js, publisher.subjects.latest_bucket(_HUB), manifest)
            cred = rs.credentials("generator")
            job = {"url": rs.url(_HUB), "run": run_id, "user": cred.user, "password": cred.password,
                   "model_dir": str(directory), "digest": digest}
            whole = await anyio.to_thread.run_sync(_child, {**job, "mode": "sync"})
            fetch = await anyio.to_thread.run_sync(_child, {**job, "mode": "fetch"})
        finally:
            for bus in buses:
                await bus.close()
            await anyio.to_thread.run_sync(rs.stop)
    return {
        "swap_peak_ratio": whole["rise"] / model_bytes,
        "swap_fetch_peak_ratio": fetch["rise"] / model_bytes,
        "swap_model_bytes": model_bytes, "swap_blob_bytes": len(blob), "swap_rise_bytes": whole["rise"],
        "swap_fetch_rise_bytes": fetch["rise"], "swap_at_step": whole["swapped_at"],
        "swap_fetch_s": whole["timings"].get("fetch"), "swap_apply_s": whole["timings"].get("apply"),
        "swap_copy_s": whole["timings"].get("swap"),
    }


def _child(job: dict[str, Any]) -> dict[str, Any]:
    """Run `swap_child` in a fresh interpreter; its last stdout line is its JSON result."""
    code = "from rlbus.ops.bench.hf_model import swap_child; swap_child()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"swap measurement ({job['mode']}) failed with exit {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water() -> int:
    """Reset this process's VmHWM to its current RSS (write 5 to clear_refs); -> that baseline in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmHWM")


def swap_child() -> None:
    """The fresh process of `_swap`: reads its job (JSON) from stdin, prints its result as one JSON line."""
    import anyio

    job = json.loads(sys.stdin.read())
    print(json.dumps(anyio.run(_child_async, job, backend="asyncio")))


async def _child_async(job: dict[str, Any]) -> dict[str, Any]:
    """mode "sync": a generator holding version 0 (the directory's weights, bf16) decodes greedily, one prompt at
    a time, with `WeightSync.maybe_swap` between steps until it holds version 1; mode "fetch": only
    `fetch_object` of the blob. -> the rise of VmHWM from just before the sync (or fetch) starts."""
    import anyio
    import torch

    from rlbus.actors.common.weight_sync import WeightSync
    from rlbus.messages.bus import Bus, ConnectOptions, Identity
    from rlbus.messages.objects import fetch_object
    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.sampling.generate import generate

    torch.set_num_threads(1)
    bus = await Bus.connect(job["url"], run=job["run"], domain=_HUB,
                            identity=Identity(actor_id="bench-generator", kind="generator", region=_HUB),
                            options=ConnectOptions(user=job["user"], password=job["password"]))
    try:
        if job["mode"] == "fetch":
            base = _reset_high_water()
            blob = await fetch_object(bus.js, bus.subjects.weights_bucket(_HUB), _OBJECT,
                                      expected_digest=job["digest"])
            return {"rise": _status_kb("VmHWM") - base, "bytes": len(blob)}
        policy = HFPolicy.load(Path(job["model_dir"]), dtype=torch.bfloat16)
        prompt = policy.tokenizer.prompt_ids("def f(x):")
        generate(policy, [prompt], max_new_tokens=4, temperature=0)        # warm-up: decoding's own buffers
        sync = WeightSync(bus, _HUB, model=policy, threads=1)
        swapped: list[int] = []

        def hook(step: int) -> int | None:
            version = sync.maybe_swap(step)
            if version is not None:
                swapped.append(step)
            return version

        def decode() -> None:
            deadline = time.monotonic() + 300
            while sync.held_version != 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("version 1 was not swapped in within 300 s")
                generate(policy, [prompt], max_new_tokens=16, temperature=0, on_step=hook)

        base = _reset_high_water()
        async with anyio.create_task_group() as tg:
            await tg.start(sync.run)
            await anyio.to_thread.run_sync(decode)
            tg.cancel_scope.cancel()
        return {"rise": _status_kb("VmHWM") - base, "swapped_at": swapped[0] if swapped else None,
                "timings": sync.timings}
    finally:
        await bus.close()


def table(result: dict[str, Any]) -> str:
    r = result
    rows = [
        ("hf_generate_ratio", f"{r['hf_generate_ratio']:.2f}x",
         f"transformers generate {r['hf_tokens_per_s']:.0f} tok/s",
         (f"rlbus generate {r['rlbus_tokens_per_s']:.0f} tok/s; {r['prompts']} prompts x {r['group']}, "
          f"<= {r['max_new_tokens']} new tokens, T {r['temperature']}; length rlbus {r['rlbus_len_mean']:.1f} "
          f"+- {r['rlbus_len_std']:.1f}, hf {r['hf_len_mean']:.1f} +- {r['hf_len_std']:.1f}; stopped rlbus "
          f"{r['rlbus_stop_fraction']:.2f}, hf {r['hf_stop_fraction']:.2f}, greedy {r['greedy_stop_fraction']:.2f}")),
        ("trainer_tokens_per_s", f"{r['trainer_tokens_per_s']:.0f}",
         f"supervised step {r['sft_tokens_per_s']:.0f} tok/s",
         (f"TrainerCore.train_step on {r['trainer_rollouts']} rollouts ({r['trainer_tokens']} completion "
          f"tokens): {r['trainer_sft_ratio']:.2f}x the plain step")),
        ("swap_peak_ratio", f"{r['swap_peak_ratio']:.2f}",
         f"bf16 model {r['swap_model_bytes'] / 2**20:.1f} MiB, target <= 1.25",
         (f"VmHWM rise {r['swap_rise_bytes'] / 2**20:.1f} MiB for a {r['swap_blob_bytes'] / 2**20:.1f} MiB "
          f"full snapshot through WeightSync (swapped before step {r['swap_at_step']}); fetch_object alone "
          f"{r['swap_fetch_peak_ratio']:.2f}")),
    ]
    w0, w1, w2 = (max(len(row[i]) for row in rows) for i in range(3))
    lines = [f"{'metric':<{w0}}  {'value':>{w1}}  {'baseline':<{w2}}  detail"]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:<{w2}}  {d}" for a, b, c, d in rows]
    steps = f", pretrained {r['pretrain_steps']} steps" if r.get("pretrain_steps") is not None else ""
    lines.append(f"{r['architecture']} {r['params'] / 1e6:.1f}M parameters{steps} ({r['model_dir']}); device "
                 f"{r['device']}, {r['threads']} thread(s), clock: {r['clock']}")
    return "\n".join(lines)
