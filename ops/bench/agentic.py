"""`rlbus bench agentic`: the turn engine (model/sampling/engine.py) on agentic-shaped episodes, against the
re-prefill of the whole history at every turn and against transformers' own `generate`.

- Owns: the agentic sampling benchmark (`run`, `table`): episodes of a prompt, then turns of sampled ids each
  followed by a fixed scripted observation (no tool runs, so only generation is timed); policy tokens per second
  with the cache kept vs re-prefilled, on the built-in `small` policy and a small Qwen2 built on the spot; the
  batch occupancy of continuous vs static batching while tools run (simulated delays); the generator's two
  sampling paths (engine driver, batcher) serving concurrent tasks whose tools take seeded delays.
- Does not: assert anything about the figures, or run sandboxes, environments or the bus.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rlbus.ops.bench.hf_model import CACHE_ROOT

_SEED: Final = 0


@dataclass(frozen=True)
class Shape:
    """One benchmark's episodes: `episodes` rows sampled together, each `prompt` ids, then `turns` turns of
    `turn` sampled ids, an `observation` of fixed ids after every turn but the last."""

    episodes: int
    prompt: int
    turns: int
    turn: int
    observation: int

    @property
    def final(self) -> int:
        """Ids of a finished episode."""
        return self.prompt + self.turns * self.turn + (self.turns - 1) * self.observation


FULL: Final = Shape(episodes=2, prompt=1000, turns=8, turn=128, observation=256)
QUICK: Final = Shape(episodes=2, prompt=24, turns=3, turn=6, observation=8)


@dataclass(frozen=True)
class Occupancy:
    """The batching simulation: `episodes` rows of `turns` turns, turn lengths drawn in `turn_range`, a tool delay
    after each turn drawn in `delay_range` decoding steps; `max_batch` rows may decode at once."""

    episodes: int
    turns: int
    prompt: int
    observation: int
    turn_range: tuple[int, int]
    delay_range: tuple[int, int]

    @property
    def max_batch(self) -> int:
        return self.episodes


OCC_FULL: Final = Occupancy(episodes=8, turns=4, prompt=64, observation=32, turn_range=(16, 64), delay_range=(0, 48))
OCC_QUICK: Final = Occupancy(episodes=3, turns=3, prompt=8, observation=4, turn_range=(2, 8), delay_range=(0, 6))


@dataclass(frozen=True)
class Tasks:
    """The generator-level measurement: `tasks` concurrent tasks of `group` episodes each, `turns` turns whose
    lengths are drawn in `turn_range` (one length per task and turn: a task's rows sample together), a tool
    delay drawn in `delay_s` seconds after each turn."""

    tasks: int
    group: int
    turns: int
    prompt: int
    observation: int
    turn_range: tuple[int, int]
    delay_s: tuple[float, float]


TASKS_FULL: Final = Tasks(tasks=4, group=4, turns=4, prompt=64, observation=32, turn_range=(16, 64),
                          delay_s=(0.0, 0.5))
TASKS_QUICK: Final = Tasks(tasks=3, group=2, turns=3, prompt=8, observation=4, turn_range=(4, 12), delay_s=(0.0, 0.02))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agentic-rounds", type=int, default=3,
                   help="agentic: timed rounds, the modes alternating within each; medians reported (default 3)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every figure and return them.

    - `turn_cache_speedup` {"hf", "builtin"}: policy tokens per second of the turn engine (the cache kept across
      turns, only each observation prefilled) over `generate` on the whole history at every turn (what the
      generator does today), the episodes batched in both; same prompts, observations and seeds, temperature 1,
      no stop id (every turn runs its full length).
    - `vs_transformers_ratio`: the Qwen2's engine tokens per second over transformers' `model.generate` called once
      per turn on the growing (left-padded) history, sampling at temperature 1 with top-k and top-p off and
      `min_new_tokens` = the turn, so both sample the same number of ids.
    - `batch_occupancy` {"continuous", "static"}: mean fraction of the batch's rows sampling at each decoding step
      while tools run (a seeded delay, counted in decoding steps, after each turn; seeded turn lengths): static
      batching starts every row's next turn together once all tools have returned; continuous batching lets a row
      rejoin as soon as its own has. `occupancy_steps` gives both runs' lengths in steps.
    - `generator_batch_rows` {"continuous", "batcher"}: the mean decoding batch (rows per decoding step) of the
      generator's two sampling paths serving `Tasks` concurrent tasks whose tools take seeded delays (real
      sleeps) between turns: the engine driver (actors/generator/stepper.py: a task's request joins the running
      batch at the next step) and the batcher (actors/generator/batcher.py: requests that arrive during a call go
      into the next call, which runs until all its rows ended), on the built-in policy's turn engine (a batcher
      call decodes every row to its longest request's n, the rest cut off: those rows count too);
      `generator_tokens_per_s` the policy tokens kept per second of each (wall time of the run, delays included).
    - `episode_tokens`: the episodes' shape and final length.
    - `spec_speedup` and `mtp_acceptance` {"builtin", "hf"}: MTP speculative sampling over plain greedy decoding at
      equal outputs, and the share of drafts accepted, on two policies trained on strided counting (the Qwen2's
      heads distilled from it); `speculative` has the detail (ops/bench/speculative.py).
    Wall-clock, torch at 1 thread, float32 weights on the CPU; `--agentic-rounds` rounds, the modes alternating
    in order within each round, medians. The Qwen2 (`hf_recipe.build_hf_dir`, random weights) is built once
    into `.rlbus/bench/agentic-qwen2-<size>/`; the built-in policy is randomly initialised (speed needs no
    training).
    """
    import torch

    quick = bool(getattr(args, "quick", False))
    rounds = 1 if quick else max(1, int(args.agentic_rounds))
    shape, occ = (QUICK, OCC_QUICK) if quick else (FULL, OCC_FULL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.monotonic()
    try:
        builtin = _builtin(quick, shape)
        hf = _qwen2(quick, shape)
        times: dict[str, dict[str, list[float]]] = {"builtin": {}, "hf": {}}
        tokens: dict[str, dict[str, int]] = {"builtin": {}, "hf": {}}
        modes: dict[str, dict[str, Callable[[], int]]] = {
            "builtin": {"cached": lambda: _engine_episodes(builtin, shape),
                        "reprefill": lambda: _reprefill_episodes(builtin, shape)},
            "hf": {"cached": lambda: _engine_episodes(hf, shape),
                   "reprefill": lambda: _reprefill_episodes(hf, shape),
                   "transformers": lambda: _transformers_episodes(hf, shape)},
        }
        for r in range(rounds):
            for policy, arms in modes.items():
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for mode in order:
                    t0 = time.perf_counter()
                    n = arms[mode]()
                    times[policy].setdefault(mode, []).append(time.perf_counter() - t0)
                    tokens[policy][mode] = n
        rate = {p: {m: tokens[p][m] / statistics.median(ts) for m, ts in arms.items()} for p, arms in times.items()}
        occupancy = {mode: _occupancy(builtin, occ, continuous=mode == "continuous")
                     for mode in ("continuous", "static")}
        load = TASKS_QUICK if quick else TASKS_FULL
        served = {mode: _generator_paths(builtin, load, continuous=mode == "continuous")
                  for mode in ("continuous", "batcher")}
        from rlbus.ops.bench import speculative

        spec = speculative.measure(quick, rounds)
    finally:
        torch.set_num_threads(threads)
    return {
        "turn_cache_speedup": {p: rate[p]["cached"] / rate[p]["reprefill"] for p in ("hf", "builtin")},
        "vs_transformers_ratio": rate["hf"]["cached"] / rate["hf"]["transformers"],
        "batch_occupancy": {m: o["occupancy"] for m, o in occupancy.items()},
        "occupancy_steps": {m: o["steps"] for m, o in occupancy.items()},
        "generator_batch_rows": {m: o["batch_rows"] for m, o in served.items()},
        "generator_tokens_per_s": {m: o["tokens_per_s"] for m, o in served.items()},
        "episode_tokens": {"episodes": shape.episodes, "prompt": shape.prompt, "turns": shape.turns,
                           "turn": shape.turn, "observation": shape.observation, "final": shape.final},
        "tokens_per_s": rate,
        **spec,
        "policies": {"builtin": builtin.describe(), "hf": hf.describe()},
        "rounds": rounds,
        "threads": 1,
        "quick": quick,
        "wall_s": time.monotonic() - started,
        "loadavg": list(os.getloadavg()),
    }


# ---- the policies -------------------------------------------------------------------------------------------
def _builtin(quick: bool, shape: Shape) -> Any:
    import torch

    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.policies.transformer import ModelConfig, Transformer

    torch.manual_seed(_SEED)
    preset = ModelConfig.tiny if quick else ModelConfig.small
    config = preset(max_seq_len=max(256, _room(shape)), tie_embeddings=False)
    return BuiltinPolicy(Transformer(config)).to_(dtype=torch.float32).eval()


def _room(shape: Shape) -> int:
    """max_seq_len the episodes need, rounded up to a multiple of 256."""
    return -(-shape.final // 256) * 256


def _qwen2(quick: bool, shape: Shape) -> Any:
    """A Qwen2 of the recipe's tiny (quick) or small size with random weights, built once under CACHE_ROOT."""
    import torch

    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.policies.hf_checks import inspect_dir
    from rlbus.model.policies.hf_recipe import build_hf_dir
    from rlbus.model.policies.interface import PolicyError
    from rlbus.model.tasks.builtin import eval_tasks

    size = "tiny" if quick else "small"
    out = CACHE_ROOT / f"agentic-qwen2-{size}-{_room(shape)}"
    try:
        inspect_dir(out)
    except PolicyError:  # missing or unfinished: build it again
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        texts = [t.prompt + "\n" + t.solution for t in eval_tasks(1, 20 if quick else 200)]
        build_hf_dir(out, architecture="qwen2", texts=texts, vocab_size=512, size=size, tie_embeddings=False,
                     max_seq_len=max(256, _room(shape)), seed=_SEED)
    return HFPolicy.load(out, dtype=torch.float32)


# ---- the episodes -------------------------------------------------------------------------------------------
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, min(vocab, 256)) for _ in range(n)]


def _script(policy: Any, shape: Shape) -> tuple[list[list[int]], list[list[int]]]:
    """The episodes' prompts and their fixed observations (the same for every mode)."""
    rng = random.Random(_SEED)
    prompts = [_ids(rng, shape.prompt, policy.vocab_size) for _ in range(shape.episodes)]
    observations = [_ids(rng, shape.observation, policy.vocab_size) for _ in range(shape.episodes)]
    return prompts, observations


def _engine_episodes(policy: Any, shape: Shape) -> int:
    """Every episode through one TurnEngine; returns the policy tokens sampled."""
    from rlbus.model.sampling.engine import TurnEngine

    prompts, observations = _script(policy, shape)
    engine = TurnEngine(policy, temperature=1.0, max_batch=shape.episodes)
    contexts = {e: list(p) for e, p in enumerate(prompts)}
    for e, ctx in contexts.items():
        engine.turn(e, ctx, shape.turn, seed=_SEED + e)
    done = dict.fromkeys(contexts, 0)
    sampled = 0
    while engine.busy:
        for turn in engine.step():
            e = int(turn.row)  # type: ignore[call-overload]
            sampled += len(turn.tokens)
            done[e] += 1
            if done[e] < shape.turns:
                contexts[e] += turn.tokens + observations[e]
                engine.turn(e, contexts[e], shape.turn)
            else:
                engine.close(e)
    return sampled


def _reprefill_episodes(policy: Any, shape: Shape) -> int:
    """Every turn one batched `generate` call on the episodes' whole histories (what the generator does today)."""
    import torch

    from rlbus.model.sampling.generate import generate, sampling_kv_dtype

    prompts, observations = _script(policy, shape)
    contexts = [list(p) for p in prompts]
    g = torch.Generator().manual_seed(_SEED)
    sampled = 0
    for t in range(shape.turns):
        outs = generate(policy, contexts, max_new_tokens=shape.turn, temperature=1.0, generator=g,
                        kv_dtype=sampling_kv_dtype(policy.device))
        for e, out in enumerate(outs):
            sampled += len(out.tokens)
            if t + 1 < shape.turns:
                contexts[e] += out.tokens.tolist() + observations[e]
    return sampled


def _transformers_episodes(policy: Any, shape: Shape) -> int:
    """Every turn one transformers `generate` call on the episodes' whole histories, left-padded."""
    import torch

    prompts, observations = _script(policy, shape)
    contexts = [list(p) for p in prompts]
    model = policy.module
    pad = policy.tokenizer.pad_id
    torch.manual_seed(_SEED)
    sampled = 0
    for t in range(shape.turns):
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.long)
        for e, c in enumerate(contexts):
            ids[e, width - len(c):] = torch.tensor(c)
            mask[e, width - len(c):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=shape.turn,
                                 min_new_tokens=shape.turn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=pad)
        new = out[:, width:]
        for e in range(len(contexts)):
            sampled += int(new.shape[1])
            if t + 1 < shape.turns:
                contexts[e] += new[e].tolist() + observations[e]
    return sampled


def _occupancy(policy: Any, occ: Occupancy, *, continuous: bool) -> dict[str, float]:
    """Episodes whose tools take a seeded number of decoding steps; the mean fraction of `max_batch` rows that
    sample at each step (idle steps, with every row waiting on a tool, count as 0)."""
    from rlbus.model.sampling.engine import TurnEngine

    rng = random.Random(_SEED + 1)
    lengths = [[rng.randint(*occ.turn_range) for _ in range(occ.turns)] for _ in range(occ.episodes)]
    delays = [[rng.randint(*occ.delay_range) for _ in range(occ.turns)] for _ in range(occ.episodes)]
    obs = _ids(rng, occ.observation, policy.vocab_size)
    contexts = {e: _ids(rng, occ.prompt, policy.vocab_size) for e in range(occ.episodes)}
    engine = TurnEngine(policy, temperature=1.0, max_batch=occ.max_batch)
    done = dict.fromkeys(contexts, 0)
    ready_at: dict[int, int] = dict.fromkeys(contexts, 0)  # step at which a row's next turn may start
    clock = busy = 0
    while ready_at or engine.busy:
        start = [e for e, at in ready_at.items() if at <= clock]
        if not continuous and (len(start) < len(ready_at) or engine.busy):
            start = []  # static: the next turns start together, once every tool has returned and every turn ended
        for e in start:
            del ready_at[e]
            engine.turn(e, contexts[e], lengths[e][done[e]], seed=_SEED + e)
        before = engine.stats.sampled_tokens
        for turn in engine.step() if engine.busy else []:
            e = int(turn.row)  # type: ignore[call-overload]
            contexts[e] += turn.tokens + obs
            done[e] += 1
            if done[e] < occ.turns:
                ready_at[e] = clock + 1 + delays[e][done[e] - 1]
            else:
                engine.close(e)
        busy += engine.stats.sampled_tokens - before
        clock += 1
    return {"occupancy": busy / (occ.max_batch * clock), "steps": clock}


def _generator_paths(policy: Any, load: Tasks, *, continuous: bool) -> dict[str, float]:
    """`load`'s tasks served by the engine driver (continuous) or the batcher over one turn engine, as the generator
    serves its tasks; the mean decoding batch and the policy tokens per second over the run's wall time."""
    import threading

    import anyio

    from rlbus.actors.generator.batcher import SampleBatcher
    from rlbus.actors.generator.stepper import EngineDriver
    from rlbus.model.sampling.engine import TurnEngine
    from rlbus.model.sampling.generate import SampledSequence

    rng = random.Random(_SEED + 2)
    lengths = [[rng.randint(*load.turn_range) for _ in range(load.turns)] for _ in range(load.tasks)]
    delays = [[rng.uniform(*load.delay_s) for _ in range(load.turns)] for _ in range(load.tasks)]
    obs = _ids(rng, load.observation, policy.vocab_size)
    prompts = [_ids(rng, load.prompt, policy.vocab_size) for _ in range(load.tasks)]
    engine = TurnEngine(policy, temperature=1.0, kv_cache_tokens=load.tasks * load.group * policy.max_seq_len,
                        max_batch=256)
    lock = threading.Lock()
    sampled = 0

    async def serve() -> None:
        def call(contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
            with lock:
                return engine.generate(contexts, max_new_tokens=n, seed=seed)

        driver = EngineDriver(lambda: engine, lock, before_step=lambda e, step: None)
        batcher = SampleBatcher(call, max_len=policy.max_seq_len)
        sample = driver.sample if continuous else batcher.sample

        async def task(t: int) -> None:
            nonlocal sampled
            contexts = [prompts[t] + [3 + g] for g in range(load.group)]   # a group: one prompt, rows apart
            for turn in range(load.turns):
                outs = await sample(contexts, lengths[t][turn], _SEED + 100 * t + turn)
                sampled += sum(len(o.tokens) for o in outs)
                await anyio.sleep(delays[t][turn])
                contexts = [c + o.tokens.tolist() + obs for c, o in zip(contexts, outs, strict=True)]

        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.run)
            async with anyio.create_task_group() as tasks:
                for t in range(load.tasks):
                    tasks.start_soon(task, t)
            tg.cancel_scope.cancel()

    t0 = time.perf_counter()
    anyio.run(serve)
    wall = time.perf_counter() - t0
    stats = engine.stats
    return {"batch_rows": stats.decode_rows / max(stats.decode_steps, 1), "tokens_per_s": sampled / wall}


# ---- the table ----------------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    r = result
    s = r["episode_tokens"]
    rate = r["tokens_per_s"]
    lines = [f"{s['episodes']} episodes: {s['prompt']}-token prompt, {s['turns']} turns of {s['turn']} tokens, "
             f"{s['observation']}-token observations ({s['final']} tokens at the end); torch 1 thread, median of "
             f"{r['rounds']}",
             f"{'policy':<9} {'cache kept':>12} {'re-prefill':>12} {'speedup':>8}"]
    for p in ("builtin", "hf"):
        lines.append(f"{p:<9} {rate[p]['cached']:>10.1f}/s {rate[p]['reprefill']:>10.1f}/s "
                     f"{r['turn_cache_speedup'][p]:>7.2f}x")
    lines.append(f"hf vs transformers generate per turn ({rate['hf']['transformers']:.1f}/s): "
                 f"{r['vs_transformers_ratio']:.2f}x")
    occ, steps = r["batch_occupancy"], r["occupancy_steps"]
    lines.append(f"batch occupancy while tools run: continuous {occ['continuous']:.3f} ({steps['continuous']} steps), "
                 f"static {occ['static']:.3f} ({steps['static']} steps)")
    rows, served = r["generator_batch_rows"], r["generator_tokens_per_s"]
    lines.append(f"generator paths, concurrent tasks with tool delays: engine driver {rows['continuous']:.2f} rows/step "
                 f"({served['continuous']:.1f} tok/s), batcher {rows['batcher']:.2f} rows/step "
                 f"({served['batcher']:.1f} tok/s)")
    from rlbus.ops.bench import speculative

    lines.extend(speculative.lines(r))
    lines.append(f"policies: builtin {r['policies']['builtin']}; hf {r['policies']['hf']}")
    load = ", ".join(f"{x:.2f}" for x in r["loadavg"])
    lines.append(f"wall {r['wall_s']:.0f} s; load average {load}; cpu count {os.cpu_count()}")
    return "\n".join(lines)

