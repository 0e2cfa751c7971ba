"""The rlbus arm of `rlbus bench peer`: the RL job of `rlbus up` (real actor processes on an embedded bus) on
the shared Hugging Face policy, for a wall-clock budget or a fixed number of optimizer steps.

- Owns: `rlbus_topology` (`topology/examples/hf.toml` with the shared policy directory, this bench's actors
  and the settings matched to TRL's) and `run_rlbus` (launch, clock, snapshots, counters from TRAINLOG and
  ROLLOUTS).
- Does not: score snapshots (ops/bench/peer.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from rlbus.ops.bench.peer_trl import ArmRun, Shared

HUB: Final = "hub"


def rlbus_topology(run: str, state: Path, base: Path, shared: Shared, *, generators: int) -> Any:
    """hf.toml's run on `base`: feeder, generators, sandbox, trainer, publisher, checkpointer (no evaluator: the
    bench scores off the clock); constant lr, every group trained on (TRL has no flat-group drop), every version
    published as a full snapshot."""
    import msgspec

    from rlbus.topology.examples import example_path
    from rlbus.topology.file.schema import ActorSpec, PolicySettings, Region, Topology

    hf = msgspec.toml.decode(example_path("hf").read_bytes(), type=Topology)
    replace = msgspec.structs.replace
    actors = [ActorSpec(kind="feeder"), ActorSpec(kind="generator", count=generators), ActorSpec(kind="sandbox"),
              ActorSpec(kind="trainer"), ActorSpec(kind="publisher"), ActorSpec(kind="checkpointer")]
    policy = PolicySettings(kind="hf", path=str(base.resolve()), device="cpu", dtype="float32")   # as TRL samples
    generator = replace(hf.generator, group_size=shared.group_size, temperature=shared.temperature,
                        max_tokens=shared.max_tokens, max_attempts=1)
    trainer = replace(hf.trainer, lr=shared.lr, lr_decay_steps=0, kl_coef=shared.kl_coef, drop_flat_groups=False,
                      scale_by_std=False, aggregation="token_mean", seed=shared.seed,
                      batch_rollouts=shared.group_size * shared.tasks_per_step)
    # One region on loopback and a model of a few MB: full snapshots cost the publisher a copy, where deltas from
    # several bases each version cost it a core's share that the generator and trainer need.
    weights = replace(hf.weights, full_every=1)
    return replace(hf, run=run, state_dir=str(state), policy=policy, generator=generator, trainer=trainer,
                   weights=weights, regions=[Region(name=HUB, role="hub", actors=actors)])


async def run_rlbus(topology: Any, state: Path, *, budget_s: float | None, marks: list[float], out: Path,
                    timeout_s: float, progress: Callable[[str], None], steps: int | None = None) -> ArmRun:
    """Run the topology for `budget_s` from its t0, saving the newest version at each of `marks` (seconds); the
    last mark waits for a version past v0 if there is none yet, and the arm's wall-clock ends at that snapshot.
    With `steps` (`budget_s` and `marks` unused): run until the trainer published version `steps` (one version an
    optimizer step), however long that takes (at most `timeout_s`), and save that version; the arm's wall-clock
    ends when it was published. Either way the arm's counters cover the steps that made the last snapshot.

    The clock starts once a generator can work (the later of the first Task and version 0's WeightManifest, as
    in `rlbus bench async`); a snapshot is the bf16 version object the trainer put in CKPT, copied by this
    process while the actors go on (a few MB: no pause of the run).
    """
    if (steps is None) == (budget_s is None):
        raise ValueError("run_rlbus: give a wall-clock budget or a number of steps, not both")
    import anyio

    from rlbus.actors.common.ledger import final_lineage
    from rlbus.messages import codec
    from rlbus.messages.errors import BadMessage
    from rlbus.messages.history import last_message, read_all
    from rlbus.messages.schemas import Rollout, Task, TrainStep, VersionReady, WeightManifest
    from rlbus.topology.backends.launch import Launch

    first_task: list[float] = []
    v0: list[float] = []
    snapshots: list[tuple[float, Path, int]] = []
    launched = time.time()
    async with Launch.open(topology, state_dir=state) as launch:
        bus = launch.admin
        s = bus.subjects
        task_sub = await bus.nc.subscribe(s.tasks(HUB))
        weights_sub = await bus.nc.subscribe(s.weights())

        async def first(sub: Any, kind: type, into: list[float], seen: anyio.Event) -> None:
            async for msg in sub.messages:
                try:
                    message = codec.decode_as(msg.data, msg.headers, kind)
                except BadMessage:
                    continue
                if kind is Task or message.version == 0:
                    into.append(time.time())
                    seen.set()
                    return

        async def snapshot(mark: float, t0: float, *, at_least: int, exact: bool = False) -> VersionReady:
            """Copy the newest version once it is `at_least` (with `exact`: version `at_least` itself), waiting at
            most `timeout_s` (a trainer that never gets there leaves the newest there is). -> its VersionReady."""
            ready = await last_message(bus.js, s.state_stream(), s.version_ready(), VersionReady)
            with anyio.move_on_after(timeout_s):
                while ready is None or ready.version < at_least:
                    await anyio.sleep(0.5)                      # polled: the STATE stream holds every version
                    ready = await last_message(bus.js, s.state_stream(), s.version_ready(), VersionReady)
            if ready is None:
                raise RuntimeError("bench peer: the rlbus arm published no version")
            if exact and ready.version > at_least:              # the trainer went on while this polled
                ready = next(r for r in await read_all(bus.js, s.state_stream(), s.version_ready(), VersionReady)
                             if r.version == at_least)
            mark = max(mark, round(ready.created_at - t0, 1))
            blob = await bus.get_object(s.checkpoint_bucket(), ready.object, expected_digest=ready.digest)
            path = out / f"rlbus-{len(snapshots) + 1:02d}.bin"
            await anyio.to_thread.run_sync(path.write_bytes, blob)
            snapshots.append((mark, path, ready.version))
            progress(f"rlbus: snapshot {len(snapshots)} at {mark:.0f}s (version {ready.version})")
            return ready

        try:
            async with anyio.create_task_group() as tg:
                fed, published = anyio.Event(), anyio.Event()
                tg.start_soon(first, task_sub, Task, first_task, fed)
                tg.start_soon(first, weights_sub, WeightManifest, v0, published)
                await tg.start(lambda task_status: launch.run_actors(heartbeat_s=1.0, task_status=task_status))
                with anyio.move_on_after(timeout_s) as guard:   # not fail_after: its error would leave the
                    await fed.wait()                            # task group as a group
                    await published.wait()
                if not guard.cancelled_caught:
                    t0 = max(first_task[0], v0[0])
                    progress(f"rlbus: actors up, clock started {t0 - launched:.0f}s after launch")
                    if steps is not None:
                        last = await snapshot(0.0, t0, at_least=steps, exact=True)
                    for i, mark in enumerate(marks if steps is None else []):
                        await anyio.sleep(max(0.0, t0 + mark - time.time()))
                        # the last mark waits for a version past v0 (a budget shorter than the first step)
                        last = await snapshot(mark, t0, at_least=1 if i == len(marks) - 1 else 0)
                    wall = snapshots[-1][0] if steps is None else last.created_at - t0
                    t_end = max(t0 + wall, last.created_at)
                tg.cancel_scope.cancel()
            if guard.cancelled_caught:
                raise TimeoutError(f"bench peer: the rlbus arm did not start within {timeout_s:.0f}s (logs in "
                                   f"{state / 'logs'})")
            if steps is not None and last.version < steps:
                raise TimeoutError(f"bench peer: the rlbus arm published version {last.version}, not {steps}, within "
                                   f"{timeout_s:.0f}s (logs in {state / 'logs'})")
        finally:
            with anyio.move_on_after(2, shield=True):
                await task_sub.unsubscribe()
                await weights_sub.unsubscribe()
        records = await read_all(bus.js, s.trainlog_stream(), s.trainlog(), TrainStep)
        rollouts = await read_all(bus.js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout)
    # the steps that made the last snapshot's version (its TrainStep is logged just before its VersionReady)
    trained = [r for r in final_lineage(records) if r.rollout_ids and r.policy_version <= last.version]
    made = [r for r in rollouts if t0 <= r.created_at <= t_end]
    return ArmRun(wall_s=wall, steps=len(trained), rollouts_trained=sum(len(r.rollout_ids) for r in trained),
                  rollouts_generated=len(made), completion_tokens=sum(r.completion_tokens.shape[0] for r in made),
                  snapshots=[(t, p) for t, p, _ in snapshots],
                  extra={"versions": [v for _, _, v in snapshots],
                         "dropped": sum(len(r.dropped) for r in final_lineage(records) if r.created_at <= t_end),
                         "train_pass_rate": sum(r.reward >= 1.0 for r in made) / max(1, len(made))})

