"""The rollout generator: tasks in, groups of G multi-turn rollouts out, resumable at every chunk.

- Owns: `Generator` (kind "generator", settings in actors/generator/config.py): per task of the region's TASKS,
  the environment's plug (by verifier kind) driven by `GroupLoop`, the task held meanwhile and acked after.
- Guarantee: the task is acked only after its Rollouts are stored; a delivery cut short is nak'ed (its partial
  is saved: the next generator resumes it).
- Does not: drive a group (actors/generator/loop.py), know an environment (function.py, agentic.py plug them
  in), fetch weights (actors/common/weight_source.py) or run code (actors/sandbox/).
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import threading
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any, Final

import anyio
import nats.errors
import structlog
import torch

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.actors.common.errors import TaskError
from rlbus.actors.common.feed import VERIFIER_KIND as FUNCTION_KIND
from rlbus.actors.common.weight_source import WeightSource, open_weights
from rlbus.actors.generator.agentic import agentic_plug
from rlbus.actors.generator.batcher import SampleBatcher
from rlbus.actors.generator.config import GeneratorConfig, GeneratorLaunch
from rlbus.actors.generator.function import function_plug
from rlbus.actors.generator.group import SampledSummary
from rlbus.actors.generator.loop import GroupLoop, plug_factory, register_environment, score_turns
from rlbus.actors.generator.stepper import EngineDriver
from rlbus.messages.bus import Bus, Delivery
from rlbus.messages.kv import RETRIED
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Heartbeat
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.policies.interface import ChatTokenizer, Policy
from rlbus.model.sampling.engine import TurnEngine, common_prefix
from rlbus.model.sampling.generate import SampledSequence, SpeculativeStats, generate, sampling_kv_dtype
from rlbus.model.sampling.speculative import drafter_for, speculative_sample
from rlbus.model.sampling.summarize import summarize_if_over_budget
from rlbus.model.tasks.repo import VERIFIER_KIND as REPO_KIND

log = structlog.get_logger()

register_environment(FUNCTION_KIND, function_plug)   # the built-in environments; a test or extension adds its own
register_environment(REPO_KIND, agentic_plug)

_KV_KEY: Final = re.compile(r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")
MIN_RELEASE_IDS: Final = 16
"""A finished task's engine rows are closed by the ids all its contexts begin with, when there are at least this
many (fewer could be a chat template's opening, shared with other tasks: those rows are left to the LRU)."""


class _TaskIds:
    """The ids every context a task sampled so far begins with (its rows in the turn engine begin with them)."""

    def __init__(self) -> None:
        self.prefix: list[int] | None = None

    def add(self, context: list[int]) -> None:
        if self.prefix is None:
            self.prefix = list(context)
        elif (n := common_prefix(self.prefix, context)) < len(self.prefix):
            del self.prefix[n:]


_TASK_IDS: contextvars.ContextVar[_TaskIds | None] = contextvars.ContextVar("rlbus_generator_task_ids", default=None)


def partial_key(task_id: str) -> str:
    """The PARTIALS key of a task: its id when that is a valid KV key, else "task-" + sha256 prefix."""
    if _KV_KEY.match(task_id):
        return task_id
    return "task-" + hashlib.sha256(task_id.encode()).hexdigest()[:32]


class Generator(Actor):
    """Samples, grades and publishes groups of rollouts.

    Per task delivery (durable `generator_<region>` on the region's TASKS): the plug of the task's verifier kind
    (`register_environment`; the function-writing one, actors/generator/function.py, by default) rebuilds the task
    (an unusable one is dead-lettered); wait until the live weights are at `Task.min_version` (the lockstep
    feeder's; 0 for every other task); then `GroupLoop` (actors/generator/loop.py) samples, steps, checkpoints
    and publishes the group, sampling through the engine driver or the batcher (below; weights swapped in flight
    through `WeightSource.maybe_swap`). Only then is
    the task acked; `in_progress()` holds it meanwhile. Another generator that wins the partial's
    compare-and-set owns the task; the loser lets go.

    With `max_group_size`, a finished group in which no episode passed grows by G fresh episodes until one
    passes or the cap is reached: a task the policy solves once in 30 tries has no pass in most groups of 8, so
    its groups are all-fail and teach nothing, while a grown group carries that rare pass (every Rollout of it
    carries the grown `group_size`).

    Sampling (`_sample_rows`): a dense policy goes through a `TurnEngine` (`[generator] turn_cache`, on by
    default; model/sampling/engine.py): each episode's KV cache is kept from one call to its next, so a turn
    prefills only what is new in its context (a context after a summary keeps only the task's ids it shares). The
    engine is made once the weights are known, and again if the policy object changes (or after a step raised).
    With `continuous_batching` (the default) an `EngineDriver` (actors/generator/stepper.py) runs it: each task's
    request joins the running decoding batch at the next step and is answered as soon as its own rows ended, so
    the batch stays full while other tasks' tools run; else `SampleBatcher` merges the requests that arrive during
    a call into the next call (`_sample_rows`). An episode's row is closed as soon as the episode ends
    (`release_episode`), and a task's remaining rows when its group is published, taken over or abandoned
    (`kv_cache_tokens` evicts the rest, least recently used first). A routed (MoE) policy samples with `generate`
    and `[generator] speculative` with `speculative_sample` (MTP heads drafting, no cache across calls), both
    through the batcher.

    Heartbeat counters: tasks, rollouts, resumed, sandbox_errors, tokens, graded_repeats (drafts that reused the
    verdict of a draft of the same round with the same program), groups_grown, grown_unpublished (episodes of
    grown groups left out by `grown_subsample`), summaries, publish_failures, taken_over, rejected, prefill_tokens
    and reused_tokens (context tokens the turn engine fed, and those it found cached), mtp_drafted and
    mtp_accepted (speculative drafts checked and accepted); gauges: tokens_per_s, held_version, sessions_held
    (sandbox sessions of agentic episodes open now), engine_rows (episodes the engine holds), batch_rows (the turn
    engine's mean decoding batch, rows per decoding step, since the last heartbeat; 0 without steps),
    mtp_acceptance (the held version's acceptance rate).
    """

    kind = "generator"

    def __init__(self, ident: ActorId, bus: Bus, config: GeneratorConfig, limits: ActorLimits | None = None,
                 *, weights: WeightSource | None = None, tokenizer: ChatTokenizer | None = None,
                 launch: GeneratorLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config
        self.launch = launch or GeneratorLaunch()
        self._given_weights = weights
        self.weights: WeightSource | None = weights
        self._tokenizer = tokenizer
        self._model_lock = threading.Lock()
        self._sampling_s = 0.0
        self._places: anyio.Semaphore | None = None
        """`concurrent_tasks` sampling places (set once serving: a semaphore needs the event loop)."""
        self.counters.update(dict.fromkeys(("tasks", "rollouts", "resumed", "partials_discarded", "sandbox_errors",
                                            "tokens", "graded_repeats", "groups_grown", "grown_unpublished",
                                            "restores_checked", "restores_equal", "prefill_tokens", "reused_tokens",
                                            "mtp_drafted", "mtp_accepted"), 0))
        self._engine: TurnEngine | None = None
        """The turn engine of the live policy (None before the first call, with turn_cache off, or for MoE)."""
        self._engine_counted = (0, 0, 0, 0)
        """(prefill_tokens, reused_tokens, decode_steps, decode_rows) of `_engine` already counted."""
        self._to_close: list[list[int]] = []
        """Prefixes of finished tasks whose engine rows are closed at the next call (the lock was busy)."""
        self._ended: list[list[int]] = []
        """Ids of ended episodes whose engine rows are closed at the next step (the lock was busy)."""
        self._driver: EngineDriver | None = None
        """Continuous batching over the turn engine (`continuous_batching`), else None: the batcher's calls."""
        self._decoded = (0, 0)
        """(decode_steps, decode_rows) of the engines so far; `_beat_decoded` what the last heartbeat saw."""
        self._beat_decoded = (0, 0)
        self._spec_plain = False
        """The policy has no MTP heads (or is routed): `speculative` samples plainly."""
        self._spec_by_version: dict[int, SpeculativeStats] = {}
        """Speculative drafts checked and accepted, by the version a call started with."""

    async def setup(self) -> None:
        if self.launch.torch_threads:
            torch.set_num_threads(self.launch.torch_threads)
        s, region = self.bus.subjects, self.ident.region
        self.stream, self.durable = s.tasks_stream(region), s.durable("generator", region)
        # a (re)started generator rides out its region's server outage here too, as its reads and writes do later
        retry = retry_policy("generator_setup_retry", on=RETRIED, initial_s=0.5, max_s=5.0, give_up_after_s=GIVE_UP_S,
                             region=region)
        async for attempt in retry:
            with attempt:
                info = await self.bus.js.consumer_info(self.stream, self.durable)
                self.kv = await self.bus.js.key_value(s.partials_bucket(region))
        self.progress_every_s = max(0.2, float(info.config.ack_wait or 30.0) / 3)

    async def run(self) -> None:
        if self._given_weights is not None:
            await self._serve(self._given_weights)
            return
        async with open_weights(self.config.weights, self.bus, self.ident.region,
                                local_version=self.config.local_version, device=self.launch.device,
                                dtype=self.launch.dtype) as weights:
            await self._serve(weights)

    async def _serve(self, weights: WeightSource) -> None:
        self.weights = weights
        await weights.wait_for_version(0)
        self._note_version()
        self._batcher = SampleBatcher(self._sample_rows, max_len=weights.model.max_seq_len)
        config, model = self.config, weights.model
        if config.turn_cache and config.continuous_batching and not config.speculative and model.moe is None:
            self._driver = EngineDriver(lambda: self._engine_of(weights), self._model_lock,
                                        before_step=lambda engine, step: self._before_step(weights, engine, step),
                                        after_burst=self._note_engine, on_error=self._drop_engine)
        log.info("generator_weights_ready", version=weights.held_version, policy=weights.model.describe(),
                 continuous=self._driver is not None)
        self._places = anyio.Semaphore(self.config.concurrent_tasks)
        async with anyio.create_task_group() as tg:
            if self._driver is not None:
                tg.start_soon(self._driver.run)
            for _ in range(self.config.tasks_held):
                tg.start_soon(self._worker)

    async def _worker(self) -> None:
        consume = self.bus.consume(self.stream, self.durable, TaskMessage, batch=1)
        async with aclosing(consume) as deliveries:  # type: ignore[type-var]  # an async generator at runtime
            async for delivery in deliveries:
                await self._handle(delivery)

    # ---- one task -------------------------------------------------------------------------------
    async def _handle(self, delivery: Delivery[TaskMessage]) -> None:
        message = delivery.message
        kind = message.verifier.get("kind")
        try:
            factory = plug_factory(kind) if isinstance(kind, str) else None
            plug = (factory or function_plug)(self, message)    # an unknown kind: refused by the function plug
            if why := plug.fits():
                raise TaskError(f"task {message.task_id}: {why}")
        except ValueError as err:      # a TaskError, or a prompt the tokenizer cannot encode (UnicodeError)
            self.count("rejected")
            await self.bus.dead_letter(delivery.raw, reason=str(err), source=self.stream)
            return
        ids = _TaskIds()
        reset = _TASK_IDS.set(ids)
        with self.busy():
            outcome = "cancelled"
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._hold, delivery)
                    await self._await_version(message.min_version)
                    outcome = await GroupLoop(self, plug, message, partial_key(message.task_id)).run()
                    tg.cancel_scope.cancel()
            except anyio.get_cancelled_exc_class():
                with anyio.move_on_after(1.0, shield=True):
                    await delivery.nak()          # the partial is saved: the next generator resumes it
                raise
            finally:
                _TASK_IDS.reset(reset)
                self._release(ids)
            if outcome == "published":
                try:
                    await delivery.ack_sync()
                except (nats.errors.Error, TimeoutError) as err:   # redelivered: republished, deduped
                    log.warning("task_ack_failed", task_id=message.task_id, error=repr(err))
                self.count("tasks")
            else:
                self.count("taken_over")
                log.warning("task_taken_over", task_id=message.task_id)

    async def _hold(self, delivery: Delivery[TaskMessage]) -> None:
        """Keep the task from being redelivered while it is worked on."""
        while True:
            await anyio.sleep(self.progress_every_s)
            try:
                await delivery.in_progress()
            except nats.errors.Error as err:
                log.warning("in_progress_failed", error=repr(err))

    async def _await_version(self, version: int) -> None:
        """Hold the task until the live model is at `version` or newer (`Task.min_version`, set only by the
        lockstep feeder, which hands out a version's tasks once no task of an older version is left, so the
        swap here cannot overlap a decode of another task)."""
        weights = self._weights()
        if weights.held_version is None or weights.held_version < version:
            await weights.wait_for_version(version)
            self._note_version()

    # ---- what the loop uses ------------------------------------------------------------------------
    @property
    def places(self) -> anyio.Semaphore | None:
        """`concurrent_tasks` sampling places (None before serving)."""
        return self._places

    def score(self, contexts: Mapping[int, list[int]], turns: Mapping[int, list[int]]
              ) -> dict[int, tuple[list[int], list[float], list[int]]]:
        """Behaviour logprobs of turns the policy did not sample (loop.py `score_turns`) under the live policy, at
        the sampling temperature. Blocking (a worker thread): the model lock is held, a pending swap taken first."""
        weights = self._weights()
        with self._model_lock:
            weights.maybe_swap(0)
            return score_turns(weights.model, contexts, turns, temperature=self.config.temperature,
                               version=weights.held_version or 0)

    async def sample_rows(self, contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
        """Sample through the engine driver (rows joining the running batch between decoding steps) or else the
        batcher (merged with every other task's rows into the next call); weights swapped in flight."""
        started = time.monotonic()
        if (ids := _TASK_IDS.get()) is not None:
            for context in contexts:
                ids.add(context)
        if self._driver is not None:
            samples = await self._driver.sample(contexts, n, seed)
        else:
            samples = await self._batcher.sample(contexts, n, seed)
        self._sampling_s += time.monotonic() - started
        self.gauges["tokens_per_s"] = self.counters["tokens"] / max(self._sampling_s, 1e-9)
        return samples

    def _sample_rows(self, contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
        """One sampling call over the open drafts of every task in the batch (SampleBatcher's worker thread);
        weights are swapped in flight between decoding steps. `speculative_sample` with `speculative` (and MTP
        heads), else the turn engine's `generate` (a dense policy with `turn_cache`), else `generate`. The KV
        cache's dtype is `sampling_kv_dtype`'s (float32 on CPU); the rollouts' behaviour logprobs are those of that
        computation."""
        weights = self._weights()
        with self._model_lock:
            version = weights.held_version or 0
            kv_dtype = sampling_kv_dtype(weights.model.device)
            if self.config.speculative and not self._spec_plain:
                try:
                    drafter_for(weights.model)
                except ValueError as err:
                    self._spec_plain = True
                    log.warning("speculative_unavailable", reason=str(err))
                else:
                    samples, stats = speculative_sample(
                        weights.model, contexts, max_new_tokens=n, temperature=self.config.temperature,
                        eos_id=self.tokenizer.stop_id, pad_id=self.tokenizer.pad_id, version=version,
                        on_step=weights.maybe_swap, generator=torch.Generator().manual_seed(seed), kv_dtype=kv_dtype)
                    self._note_speculation(version, stats)
                    return samples
            engine = self._turn_engine(weights)
            if engine is not None:
                samples = engine.generate(contexts, max_new_tokens=n, seed=seed, on_step=weights.maybe_swap,
                                          version=version)
                self._note_engine(engine)
                return samples
            return generate(weights.model, contexts, max_new_tokens=n, temperature=self.config.temperature,
                            eos_id=self.tokenizer.stop_id, pad_id=self.tokenizer.pad_id,
                            version=version, on_step=weights.maybe_swap,
                            generator=torch.Generator().manual_seed(seed), kv_dtype=kv_dtype)

    def _turn_engine(self, weights: WeightSource) -> TurnEngine | None:
        """The engine of the live policy (made, or made again for a new policy object); None with turn_cache off or
        for a routed policy. Called with the model lock held; closes the rows of tasks finished meanwhile."""
        model = weights.model
        if not self.config.turn_cache or model.moe is not None:
            return None
        if self._engine is None or self._engine.policy is not model:
            config = self.config
            group = max(config.group_size, config.max_group_size)
            auto = config.concurrent_tasks * group * model.max_seq_len
            cap = config.kv_cache_tokens or auto
            if cap < model.max_seq_len:      # `rlbus validate` refuses it where it knows the context
                log.warning("kv_cache_tokens_raised", kv_cache_tokens=cap, max_seq_len=model.max_seq_len)
                cap = model.max_seq_len
            self._engine = TurnEngine(model, temperature=config.temperature, eos_id=self.tokenizer.stop_id,
                                      kv_cache_tokens=cap, max_batch=256, kv_dtype=sampling_kv_dtype(model.device))
            self._engine_counted = (0, 0, 0, 0)
            self._to_close.clear()
            self._ended.clear()
        self._close_finished(self._engine)
        return self._engine

    def _engine_of(self, weights: WeightSource) -> TurnEngine:
        """The driver's engine (model lock held)."""
        engine = self._turn_engine(weights)
        assert engine is not None, "the driver runs only for a dense policy with turn_cache"
        return engine

    def _before_step(self, weights: WeightSource, engine: TurnEngine, step: int) -> None:
        """Before each of the driver's steps (model lock held): what is staged swapped in, tokens sampled from here
        carrying the live version (also after a swap by scoring or a summary), ended episodes' rows closed."""
        weights.maybe_swap(step)
        engine.swap(weights.held_version or 0)
        self._close_finished(engine)

    def _drop_engine(self) -> None:
        """A driver step raised: the engine's state is unknown, the next burst makes a fresh one."""
        self._engine = None

    def _note_engine(self, engine: TurnEngine) -> None:
        stats = engine.stats
        prefill, reused, steps, rows = stats.prefill_tokens, stats.reused_tokens, stats.decode_steps, stats.decode_rows
        counted = self._engine_counted
        self.count("prefill_tokens", prefill - counted[0])
        self.count("reused_tokens", reused - counted[1])
        self._decoded = (self._decoded[0] + steps - counted[2], self._decoded[1] + rows - counted[3])
        self._engine_counted = (prefill, reused, steps, rows)
        self.gauges["engine_rows"] = float(len(engine.rows("resting")))

    def heartbeat(self) -> Heartbeat:
        """The actor's heartbeat with `batch_rows`: the engine's mean decoding batch since the last heartbeat."""
        (steps, rows), (seen_steps, seen_rows) = self._decoded, self._beat_decoded
        self.gauges["batch_rows"] = (rows - seen_rows) / (steps - seen_steps) if steps > seen_steps else 0.0
        self._beat_decoded = (steps, rows)
        return super().heartbeat()

    def _note_speculation(self, version: int, stats: SpeculativeStats) -> None:
        self.count("mtp_drafted", stats.drafted)
        self.count("mtp_accepted", stats.accepted)
        held = self._spec_by_version[version] = self._spec_by_version.get(version, SpeculativeStats()).add(stats)
        for old in [v for v in self._spec_by_version if v < version]:
            del self._spec_by_version[old]
        self.gauges["mtp_acceptance"] = held.acceptance_rate

    def _release(self, ids: _TaskIds) -> None:
        """Close the engine rows of a task that is done (published, taken over or abandoned): at once when the
        model is free, else at the start of the next sampling call."""
        if self._engine is None or ids.prefix is None or len(ids.prefix) < MIN_RELEASE_IDS:
            return
        self._to_close.append(ids.prefix)
        self._close_if_free()

    def release_episode(self, ids: list[int]) -> None:
        """Close the engine row of an episode that ended (`ids`: its whole token sequence; loop.py calls it as soon
        as the episode is done, before its group publishes): at once when the model is free, else before the next
        decoding step."""
        if self._engine is None:
            return
        self._ended.append(ids)
        self._close_if_free()

    def _close_if_free(self) -> None:
        """Close the rows queued for closing now if the model lock is free (else the next holder does)."""
        if self._engine is not None and self._model_lock.acquire(blocking=False):
            try:
                self._close_finished(self._engine)
            finally:
                self._model_lock.release()

    def _close_finished(self, engine: TurnEngine) -> None:
        """Called with the model lock held."""
        if not self._to_close and not self._ended:
            return
        while self._to_close:
            engine.close_prefixed(self._to_close.pop())
        while self._ended:
            engine.close_ended(self._ended.pop())
        self.gauges["engine_rows"] = float(len(engine.rows("resting")))

    def write_summary(self, context: list[int], *, budget: int, keep: int, prompt: list[int], tokens: int,
                      seed: int) -> SampledSummary:
        """The policy's summary of `context` (model/sampling/summarize.py `summarize_if_over_budget`: it reads the context,
        its oldest tokens after the first `keep` dropped past what it can read, then `prompt`, and writes at most
        `tokens`), with what it read and each id's logprob, version and routing. Blocking (a worker thread): the
        model lock is held, weights swapped in flight.

        :raises ValueError: the context fits `budget` (nothing to summarise) or the summary cannot fit it.
        """
        weights = self._weights()
        tok = self.tokenizer
        with self._model_lock:
            summary = summarize_if_over_budget(
                weights.model, context, budget=budget, keep_prefix=keep, summary_prompt=prompt,
                max_summary_tokens=tokens, eos_id=tok.stop_id, temperature=self.config.temperature,
                version=weights.held_version or 0, on_step=weights.maybe_swap,
                generator=torch.Generator().manual_seed(seed))
        if summary is None:
            raise ValueError(f"a context of {len(context)} tokens fits the budget {budget}: nothing to summarise")
        sample = summary.sample
        return SampledSummary(source=list(summary.source), ids=sample.tokens.tolist(),
                              logprobs=sample.logprobs.tolist(), versions=sample.versions.tolist(),
                              routing=None if sample.routing is None else sample.routing.numpy())

    def weights_source(self) -> WeightSource:
        return self._weights()

    @property
    def model_lock(self) -> threading.Lock:
        """Held by whoever runs the policy (sampling, scoring, swapping)."""
        return self._model_lock

    def held_version(self) -> int:
        held = self._weights().held_version
        return held if held is not None else 0

    def note_version(self) -> None:
        self._note_version()

    # ---- helpers --------------------------------------------------------------------------------
    def _weights(self) -> WeightSource:
        if self.weights is None:
            raise RuntimeError("generator weights are not open yet")
        return self.weights

    @property
    def model(self) -> Policy:
        return self._weights().model

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The policy's tokenizer (or the one handed in)."""
        return self._tokenizer if self._tokenizer is not None else self.model.tokenizer

    def _note_version(self) -> None:
        version = self._weights().held_version
        self.policy_version = version
        if version is not None:
            self.gauges["held_version"] = float(version)


def build_generator(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                    launch: GeneratorLaunch | None = None) -> Generator:
    """`actors/kinds.py` entry: the topology's `[generator]` section as plain values. Without a launch thread
    count, `RLBUS_TORCH_THREADS` (the local and Ray backends set the instance's `torch_threads`) gives it.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    config = decode_config("generator", settings, GeneratorConfig)
    launch = launch or GeneratorLaunch()
    if not launch.torch_threads and os.environ.get("RLBUS_TORCH_THREADS"):
        launch = GeneratorLaunch(torch_threads=int(os.environ["RLBUS_TORCH_THREADS"]))
    return Generator(ident, bus, config, limits, launch=launch)
