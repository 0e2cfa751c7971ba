"""`rlbus bench async`: the async RL pipeline against a synchronous generate-then-train schedule.

- Owns: the async benchmark (`run`): both arms, one after the other in the same call, on the same topology,
  actor processes, threads and starting policy, for the same number of optimizer steps;
  `speedup` = sync / async.
- Does not: assert speed (nothing here fails on a slow machine).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

HUB: Final = "hub"
ARMS: Final = ("async", "sync")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-steps", type=int, default=32,
                   help="async: optimizer steps N per arm (default 32; --quick: 2, with the tiny settings, "
                        "preset and 2 tasks per step)")
    p.add_argument("--async-generators", type=int, default=1, help="async: generator processes (default 1)")
    p.add_argument("--async-settings", choices=["single", "tiny"], default="single",
                   help="async: the example topology whose [generator], [trainer] and [sandbox] settings "
                        "both arms use (default single, what `rlbus up` runs: 8 rollouts per task, 8 tasks "
                        "sampled in one batch, 128 tokens, one attempt; tiny: 2 rollouts per task, one task "
                        "at a time, 32 tokens, up to 3 attempts)")
    p.add_argument("--async-tasks-per-step", type=int, default=4,
                   help="async: tasks per optimizer step; batch = this x the group size (default 4)")
    p.add_argument("--async-preset", choices=["tiny", "small"], default="small",
                   help="async: pretrain preset (model size) of the shared starting policy (default small)")
    p.add_argument("--async-pretrain-steps", type=int, default=5,
                   help="async: pretraining steps (batch 8) of the starting policy (default 5, as --quick)")
    p.add_argument("--async-timeout", type=float, default=240.0,
                   help="async: hang guard per arm, seconds (default 240)")
    p.add_argument("--async-repeats", type=int, default=1,
                   help="async: run both arms this many times (async, sync, async, sync, ...) and report each run "
                        "and the median speedup (default 1)")
    p.add_argument("--async-dtype", choices=["bfloat16", "float32"], default="float32",
                   help="async: what the generators sample in ([policy] dtype; default float32: on a CPU without "
                        "native bf16 matrix units it samples 2-3x faster than bfloat16)")
    p.add_argument("--async-state-dir", type=Path, default=None,
                   help="async: keep the arms' state (logs, streams) in this directory (default: a temp "
                        "dir, deleted)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both arms and return their numbers.

    Both arms run one after the other in the same call, on the same topology (one region: feeder,
    `--async-generators` generators (default 1), sandbox, trainer, publisher, checkpointer; the generator,
    trainer, sandbox, checkpoint and weights settings of the default run `single` (`--async-settings`):
    8 rollouts per task, 8 tasks sampled in one batch, 128 tokens, one attempt, a checkpoint every 10 steps,
    every version a full snapshot; flat groups kept so that a lockstep batch fills; the tiny example's feeder
    (its backlog raised to every task the generators hold), restart and launch settings), the same actor
    processes and torch threads (one each: on 2 cores the generator and the trainer each get one), from the
    same starting policy (`--async-preset`, default the `small` pretrain preset's model, pretrained briefly
    once at the start and copied into each arm's state directory), generators sampling in `--async-dtype`
    ([policy] dtype, default float32), for the same number of optimizer steps N:
    - async: the normal pipeline: the feeder keeps a backlog, generators keep generating while the trainer
      trains and swap new weights in flight; stale rollouts are dropped past `trainer.staleness_versions`.
    - sync: the same actors with two knobs: `feeder.lockstep` (one batch of tasks per new policy version,
      generators start them only with that version) and `trainer.staleness_versions = 0`: generate one batch
      with the current version, train one step, wait for the new version to reach the generators, repeat.
    Wall-clock per arm runs from t0 = the later of the first Task published and version 0's WeightManifest
    (before that, no generator can work in either arm) to the N-th optimizer step's TrainStep (`created_at`);
    `speedup` = sync / async; with `--async-repeats N` the pair runs N times (async, sync, async, ...) and
    `speedup` is the median, each run's in `runs`.
    """
    import anyio

    return anyio.run(_run, args, backend="asyncio")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile
    import uuid

    import anyio
    import matplotlib.backends.backend_agg  # noqa: F401  pretrain plots with it: import it here, as torch._dynamo
    import torch._dynamo  # noqa: F401  here, not in pretrain's worker thread (actors/trainer/core.py: why)

    from rlbus.model.training.pretrain import PretrainConfig, pretrain
    from rlbus.topology.backends.launch import PRETRAINED_DIR

    started = time.perf_counter()
    quick = bool(getattr(args, "quick", False))
    steps = 2 if quick else args.async_steps
    settings = "tiny" if quick else args.async_settings
    tasks = 2 if quick else args.async_tasks_per_step
    keep = getattr(args, "async_state_dir", None)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-async-") as tmp:
        root = Path(tmp) if keep is None else keep.resolve()
        root.mkdir(parents=True, exist_ok=keep is None)
        base = root / "pretrained"
        preset = "tiny" if quick else args.async_preset
        config = PretrainConfig.preset(preset, eval_n=2, batch_size=8)   # a starting point, not a good policy
        pretrained = await anyio.to_thread.run_sync(
            lambda: pretrain(config, args.async_pretrain_steps, 0, base, 2))
        repeats = max(1, getattr(args, "async_repeats", 1))
        dtype = getattr(args, "async_dtype", "float32")
        runs: list[dict[str, dict[str, Any]]] = []
        for r in range(repeats):
            arms: dict[str, dict[str, Any]] = {}
            for arm in ARMS:
                state = root / (arm if repeats == 1 else f"{arm}-{r + 1}")
                state.mkdir()
                shutil.copytree(base, state / PRETRAINED_DIR)
                topology = _topology(arm, f"b{uuid.uuid4().hex[:8]}", state, settings=settings, tasks=tasks,
                                     generators=args.async_generators, dtype=dtype)
                arms[arm] = await _run_arm(topology, state, steps, args.async_timeout)
            runs.append(arms)
            if repeats > 1:
                print(f"bench async: run {r + 1}/{repeats}: speedup {_speedup(arms):.2f} (async "
                      f"{arms['async']['wall_s']:.1f}s, sync {arms['sync']['wall_s']:.1f}s)", file=sys.stderr,
                      flush=True)
    speedups = [_speedup(arms) for arms in runs]
    arms = runs[sorted(range(len(runs)), key=speedups.__getitem__)[(len(runs) - 1) // 2]]   # the median run
    a, s = arms["async"], arms["sync"]
    return {
        "speedup": statistics.median(speedups),
        "speedups": speedups,
        "runs": [{"speedup": sp, "async_wall_s": r["async"]["wall_s"], "sync_wall_s": r["sync"]["wall_s"],
                  "async_step_interval_s": r["async"]["step_interval_s"],
                  "sync_step_interval_s": r["sync"]["step_interval_s"]} for sp, r in zip(speedups, runs, strict=True)],
        "dtype": dtype,
        "speedup_from_first_task": s["wall_from_first_task_s"] / a["wall_from_first_task_s"],
        "staleness": a["staleness"],
        "steps": steps,
        "arms": arms,
        "generators": args.async_generators,
        "batch_rollouts": arms["async"]["batch_rollouts"],
        "settings": settings,
        "staleness_bound": a["staleness_bound"],
        "preset": preset,
        "parameters": _parameters(config.model),
        "pretrain_s": round(pretrained.wall_s, 1),
        "load_avg_1m": os.getloadavg()[0],
        "total_s": round(time.perf_counter() - started, 1),
    }


def _speedup(arms: dict[str, dict[str, Any]]) -> float:
    return float(arms["sync"]["wall_s"] / arms["async"]["wall_s"])


def _parameters(config: Any) -> int:
    from rlbus.model.policies.transformer import Transformer

    return sum(p.numel() for p in Transformer(config).parameters())


def _topology(arm: str, run: str, state: Path, *, settings: str, tasks: int, generators: int,
              dtype: str = "float32") -> Any:
    """The tiny example's feeder, restart and launch settings with this bench's actors, the `settings` example's
    generator, trainer, sandbox, checkpoint and weights settings, batches of `tasks` tasks and generators sampling
    in `dtype`; flat groups are kept (a lockstep batch must fill). The sync arm adds lockstep and staleness 0."""
    import msgspec

    from rlbus.topology.examples import example_path
    from rlbus.topology.file.schema import ActorSpec, Region, Topology

    base = msgspec.toml.decode(example_path("tiny").read_bytes(), type=Topology)   # settings; actors: ours
    work = msgspec.toml.decode(example_path(settings).read_bytes(), type=Topology)
    actors = [ActorSpec(kind="feeder"), ActorSpec(kind="generator", count=generators),
              ActorSpec(kind="sandbox"), ActorSpec(kind="trainer"), ActorSpec(kind="publisher"),
              ActorSpec(kind="checkpointer")]
    replace = msgspec.structs.replace
    trainer = replace(work.trainer, batch_rollouts=tasks * work.generator.group_size, drop_flat_groups=False)
    # every task the generators hold queued (tiny's backlog of 8 is one wave of 8 concurrent tasks: each wave
    # then waited up to the feeder's poll interval for the next)
    held = generators * work.generator.tasks_held
    feeder = replace(base.feeder, backlog_per_region=max(base.feeder.backlog_per_region, held))
    if arm == "sync":
        trainer = replace(trainer, staleness_versions=0)
        feeder = replace(feeder, lockstep=True, backlog_per_region=tasks)
    return replace(base, run=run, state_dir=str(state), regions=[Region(name=HUB, role="hub", actors=actors)],
                   trainer=trainer, generator=work.generator, feeder=feeder, sandbox=work.sandbox,
                   checkpoint=work.checkpoint, weights=work.weights,
                   policy=replace(base.policy, dtype=dtype))


async def _run_arm(topology: Any, state: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    """Launch the topology, stop once TRAINLOG holds step `steps`, then read the streams and the ledger."""
    import anyio

    from rlbus.actors.common.ledger import read_all, read_ledger
    from rlbus.messages import codec
    from rlbus.messages.errors import BadMessage
    from rlbus.messages.schemas import Rollout, Task, TrainStep, WeightManifest
    from rlbus.topology.backends.launch import Launch

    first_task: list[float] = []
    launched = time.time()
    async with Launch.open(topology, state_dir=state) as launch:
        bus = launch.admin
        s = bus.subjects
        task_sub = await bus.nc.subscribe(s.tasks(HUB))
        step_sub = await bus.nc.subscribe(s.trainlog())

        async def first_task_time() -> None:
            async for msg in task_sub.messages:
                try:
                    first_task.append(codec.decode_as(msg.data, msg.headers, Task).created_at)
                except BadMessage:
                    continue
                return

        async def reached() -> None:
            async for msg in step_sub.messages:
                try:
                    record = codec.decode_as(msg.data, msg.headers, TrainStep)
                    if record.rollout_ids and record.policy_version >= steps:    # fresh run: version = steps
                        return
                except BadMessage:
                    continue

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(first_task_time)
                await tg.start(lambda task_status: launch.run_actors(heartbeat_s=1.0,
                                                                     task_status=task_status))
                with anyio.move_on_after(timeout_s) as guard:     # not fail_after: its error would come
                    await reached()                                # out of the task group as a group
                tg.cancel_scope.cancel()
            if guard.cancelled_caught:
                raise TimeoutError(f"bench async: the {_arm_name(topology)} arm did not reach step {steps} "
                                   f"within {timeout_s:.0f}s (logs in {state / 'logs'}; raise --async-timeout)")
        finally:
            with anyio.move_on_after(2, shield=True):
                await task_sub.unsubscribe()
                await step_sub.unsubscribe()
        stopped = time.time()
        records = await read_all(bus.js, s.trainlog_stream(), s.trainlog(), TrainStep)
        manifests = await read_all(bus.js, s.weights_stream(), s.weights(), WeightManifest)
        rollouts = await read_all(bus.js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout)
        book = await read_ledger(bus)
    return _summary(topology, steps, records, manifests, rollouts, book, first_task,
                    launched=launched, stopped=stopped)


def _arm_name(topology: Any) -> str:
    return "sync" if topology.feeder.lockstep else "async"


def _summary(topology: Any, steps: int, records: list[Any], manifests: list[Any], rollouts: list[Any],
             book: Any, first_task: list[float], *, launched: float, stopped: float) -> dict[str, Any]:
    """One arm's numbers over its first `steps` optimizer steps (the trainer may take more before it stops).

    Optimizer steps are the TrainSteps with rollouts; records of drops alone (no step) count for drops."""
    from rlbus.actors.common.ledger import final_lineage, reason_category

    optimizer = [r for r in final_lineage(records) if r.rollout_ids]
    if len(optimizer) < steps:
        raise RuntimeError(f"bench async: the {_arm_name(topology)} arm's TRAINLOG holds {len(optimizer)} of "
                           f"{steps} optimizer steps")
    last = optimizer[steps - 1].step
    lineage = [r for r in final_lineage(records) if r.step <= last]
    v0 = min((m.created_at for m in manifests if m.version == 0), default=None)
    task0 = first_task[0] if first_task else min(r.created_at for r in rollouts)
    t0 = max(task0, v0) if v0 is not None else task0
    t_end = optimizer[steps - 1].created_at
    wall = t_end - t0
    staleness: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for record in lineage:
        staleness.update(record.staleness)
        dropped.update(reason_category(d.reason) for d in record.dropped)
    made = [r for r in rollouts if t0 <= r.created_at <= t_end]
    done = optimizer[:steps]
    gaps = [b.created_at - a.created_at for a, b in itertools.pairwise(done)]
    return {
        "wall_s": wall,
        "wall_from_first_task_s": t_end - task0,
        "steps_per_s": steps / wall,
        "rollouts_per_s": len(made) / wall,
        "rollouts_generated": len(made),
        "rollouts_trained": sum(len(r.rollout_ids) for r in lineage),
        "dropped": dict(dropped),
        "dropped_total": sum(dropped.values()),
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "staleness_bound": topology.trainer.staleness_versions,
        "batch_rollouts": topology.trainer.batch_rollouts,
        "step_interval_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "first_step_s": done[0].created_at - t0,
        "step_intervals_s": [round(g, 3) for g in gaps],
        "startup_s": t0 - launched,
        "steps_taken": len([r for r in final_lineage(records) if r.rollout_ids]),
        "ledger": {"clean": book.clean, "produced": book.produced, "trained": book.trained,
                   "dropped": book.dropped, "lost": len(book.lost), "trained_twice": len(book.trained_twice),
                   "pending": len(book.pending)},
        "arm_s": round(stopped - launched, 1),
    }


def table(result: dict[str, Any]) -> str:
    """The human table: one column per arm, then the speedup and the async staleness histogram."""
    arms = result["arms"]
    rows = [
        ("wall-clock to step N (s)", "wall_s", "{:.1f}"),
        ("  from the first task (s)", "wall_from_first_task_s", "{:.1f}"),
        ("optimizer steps/s", "steps_per_s", "{:.3f}"),
        ("rollouts generated/s", "rollouts_per_s", "{:.2f}"),
        ("rollouts generated", "rollouts_generated", "{}"),
        ("rollouts trained", "rollouts_trained", "{}"),
        ("rollouts dropped", "dropped_total", "{}"),
        ("median step interval (s)", "step_interval_s", "{:.2f}"),
        ("staleness bound", "staleness_bound", "{}"),
        ("startup before t0 (s)", "startup_s", "{:.1f}"),
    ]
    width = max(len(label) for label, _, _ in rows)
    head = (f"rlbus bench async: {result['steps']} optimizer steps per arm, {result['generators']} "
            f"generator(s), {result['settings']} settings, batch {result['batch_rollouts']} rollouts, "
            f"{result['preset']} model sampled in {result['dtype']} "
            f"(load {result['load_avg_1m']:.1f}, {result['total_s']:.0f}s in all)")
    lines = [head, f"{'':{width}}  {'async':>10}  {'sync':>10}"]
    for label, key, fmt in rows:
        cells = [fmt.format(arms[a][key]) if arms[a][key] is not None else "-" for a in ARMS]
        lines.append(f"{label:{width}}  {cells[0]:>10}  {cells[1]:>10}")
    for a in ARMS:
        book = arms[a]["ledger"]
        lines.append(f"ledger {a}: {'clean' if book['clean'] else 'NOT CLEAN'} (produced {book['produced']}, "
                     f"trained {book['trained']}, dropped {book['dropped']}, lost {book['lost']}, "
                     f"trained twice {book['trained_twice']}, pending {book['pending']})")
    histogram = ", ".join(f"{k} behind: {n}" for k, n in result["staleness"].items()) or "-"
    lines.append(f"async staleness (rollouts by versions behind): {histogram}")
    lines.append(f"speedup (sync / async wall-clock): {result['speedup']:.2f}x (target >= 1.6); "
                 f"from the first task: {result['speedup_from_first_task']:.2f}x")
    if len(result["speedups"]) > 1:
        lines.append(f"median of {len(result['speedups'])} runs (columns above: the median run); each: "
                     + ", ".join(f"{sp:.2f}" for sp in result["speedups"]))
    return "\n".join(lines)
