"""The rollout generator: tasks in, groups of G graded multi-turn rollouts out, resumable at every chunk.

- Owns: `Generator` (kind "generator", settings in actors/generator/config.py): per task of the region's TASKS,
  a group of G episodes sampled, graded in the region's sandbox and published as Rollouts.
- Guarantee: the group's partial is saved (compare-and-set) after every chunk and graded round, so a
  replacement resumes it; the task is acked only after its Rollouts are stored.
- Does not: define the partial layout (actors/generator/group.py), drive agentic groups
  (actors/generator/agentic.py), fetch weights (actors/common/weight_source.py) or run code (actors/sandbox/).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any, Final, Literal

import anyio
import nats.errors
import nats.js.errors
import structlog
import torch

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import decode_config
from rlbus.actors.common.errors import PartialGroupError, TaskError
from rlbus.actors.common.feed import task_from_verifier
from rlbus.actors.common.sandbox_client import grade_result, request_for_case, run_in_sandbox
from rlbus.actors.common.weight_source import WeightSource, open_weights
from rlbus.actors.generator.agentic import AgenticGroups, environment_of, fits
from rlbus.actors.generator.batcher import SampleBatcher
from rlbus.actors.generator.config import GeneratorConfig, GeneratorLaunch
from rlbus.actors.generator.group import (
    Attempt,
    EpisodeState,
    PartialGroup,
    PartialLimits,
    SampledSummary,
    add_chunk,
    any_passed,
    apply_step,
    base_context,
    build_rollout,
    check_partial,
    decode_partial,
    encode_partial,
    function_state,
    grow_group,
    new_group,
    prompt_length,
    published_episodes,
    record_summary,
)
from rlbus.messages.bus import Bus, Delivery
from rlbus.messages.errors import RlbusError
from rlbus.messages.kv import RETRIED, put_at, read_key
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Event, SandboxLimits, SandboxVerdict
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import FunctionEnvironment
from rlbus.model.policies.interface import ChatTokenizer, Policy
from rlbus.model.sampling.generate import SampledSequence, generate, sampling_kv_dtype
from rlbus.model.sampling.summarize import summarize_if_over_budget
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeCase, GradeResult
from rlbus.model.tasks.repo import VERIFIER_KIND as REPO_KIND
from rlbus.model.tasks.repo import RepoTask

log = structlog.get_logger()

_KV_KEY: Final = re.compile(r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")


def partial_key(task_id: str) -> str:
    """The PARTIALS key of a task: its id when that is a valid KV key, else "task-" + sha256 prefix."""
    if _KV_KEY.match(task_id):
        return task_id
    return "task-" + hashlib.sha256(task_id.encode()).hexdigest()[:32]


class _Place:
    """A task's hold on one of the generator's `concurrent_tasks` sampling places (`tasks_ahead`)."""

    def __init__(self, places: anyio.Semaphore | None) -> None:
        self._places = places
        self.held = False

    async def take(self) -> None:
        if not self.held and self._places is not None:
            await self._places.acquire()
            self.held = True

    def give_up(self) -> None:
        if self.held:
            self._places.release()
            self.held = False


class _TakenOver(Exception):
    """Another generator saved this task's partial since we read it: it owns the task now."""


class Generator(Actor):
    """Samples, grades and publishes groups of rollouts.

    Per task delivery (durable `generator_<region>` on the region's TASKS): rebuild the coding task from
    `Task.verifier`; wait until the live weights are at `Task.min_version` (the lockstep feeder's; 0 for every
    other task); load its partial from the region's PARTIALS KV (key = task id) and resume it — unless it is
    garbage or hostile (`check_partial`): then it is discarded with an Event(incident) — or start G episodes.
    Then step the group until every episode is done: self-summarise an episode whose context is over budget,
    sample the open drafts together `partial_every_tokens` at a time (`model.generate` in a worker thread,
    weights swapped in flight through `WeightSource.maybe_swap`), and once every draft is complete take each as
    a turn of the function-writing environment (model/env/function.py: the environment extracts the program,
    the generator's port grades it in the region's sandbox — request/reply, each distinct program of the round
    once; a timeout or error is a failed attempt, never a crash — and the environment adds the feedback).

    With `max_group_size`, a finished group in which no episode passed grows by G fresh episodes until one
    passes or the cap is reached: a task the policy solves once in 30 tries has no pass in most groups of 8, so
    its groups are all-fail and teach nothing, while a grown group carries that rare pass (every Rollout of it
    carries the grown `group_size`). Finally the group's Rollouts go out with `publish_batch` (msg id = rollout
    id f"{task_id}-{g}"), the partial is deleted, and only then is the task acked; `in_progress()` holds it
    meanwhile. Another generator that wins the partial's compare-and-set owns the task; the loser lets go.
    A task of the repository kind (model/tasks/repo.py) is an agentic group instead (actors/generator/agentic.py);
    the delivery, holding, acking and dead-lettering around it are the same.

    Heartbeat counters: tasks, rollouts, resumed, sandbox_errors, tokens, graded_repeats (drafts that reused the
    verdict of a draft of the same round with the same program), groups_grown, grown_unpublished (episodes of
    grown groups left out by `grown_subsample`), summaries, publish_failures, taken_over, rejected; gauges:
    tokens_per_s, held_version, sessions_held (sandbox sessions of agentic episodes open now).
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
        self.agentic = AgenticGroups(self)
        self.counters.update(dict.fromkeys(("tasks", "rollouts", "resumed", "partials_discarded", "sandbox_errors",
                                            "tokens", "graded_repeats", "groups_grown", "grown_unpublished",
                                            "restores_checked", "restores_equal"), 0))

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
        log.info("generator_weights_ready", version=weights.held_version, policy=weights.model.describe())
        self._places = anyio.Semaphore(self.config.concurrent_tasks)
        async with anyio.create_task_group() as tg:
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
        task: Task | RepoTask
        try:
            if message.verifier.get("kind") == REPO_KIND:     # an agentic group (actors/generator/agentic.py)
                task = RepoTask.from_spec(message.verifier)
                if not fits(task, env := environment_of(self)):
                    raise TaskError(f"the first context of repository task {message.task_id} leaves no room for a "
                                    f"turn in the episode's {env.budgets.max_tokens} tokens ([generator.agentic] "
                                    f"max_tokens, capped by max_seq_len {self.model.max_seq_len})")
            else:
                task = task_from_verifier(message)
                if prompt_length(task, self.tokenizer) + 2 > self.model.max_seq_len:
                    raise TaskError(f"prompt of task {message.task_id} does not fit max_seq_len "
                                    f"{self.model.max_seq_len}")
        except ValueError as err:      # a TaskError, or a prompt the tokenizer cannot encode (UnicodeError)
            self.count("rejected")
            await self.bus.dead_letter(delivery.raw, reason=str(err), source=self.stream)
            return
        with self.busy():
            outcome = "cancelled"
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._hold, delivery)
                    await self._await_version(message.min_version)
                    if isinstance(task, RepoTask):
                        outcome = await self.agentic.run(message, task, partial_key(message.task_id))
                    else:
                        outcome = await self._run_group(message, task)
                    tg.cancel_scope.cancel()
            except anyio.get_cancelled_exc_class():
                with anyio.move_on_after(1.0, shield=True):
                    await delivery.nak()          # the partial is saved: the next generator resumes it
                raise
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

    async def _run_group(self, message: TaskMessage, task: Task) -> Literal["published", "taken_over"]:
        """Finish the group (resuming its partial), publish it and delete the partial; "taken_over": see
        _TakenOver."""
        key = partial_key(message.task_id)
        group_size = message.group_size if message.group_size >= 1 else self.config.group_size
        state, revision = await self._load(key, message.task_id, group_size, task)
        if state is None:
            state = new_group(task, message.task_id, group_size, self.tokenizer, now=time.time())
        else:
            state.resumes += 1
            self.count("resumed")
            log.info("partial_resumed", task_id=message.task_id, rounds=state.rounds, chunks=state.chunks,
                     tokens=state.sampled_tokens, writer=state.writer)
        place = _Place(self._places)
        try:
            while True:
                while not state.finished(self.config.max_attempts):
                    await self._advance(state, task, place)
                    state.writer = self.ident.actor_id
                    revision = await self._save(key, state, revision)
                if any_passed(state) or state.group_size + group_size > self.config.max_group_size:
                    break
                grow_group(state, task, self.tokenizer, group_size)   # saved, so a resume samples the rest
                self.count("groups_grown")
                revision = await self._save(key, state, revision)
        except _TakenOver:
            return "taken_over"
        finally:
            place.give_up()
        await self._publish(state, task, message, key, group_size)
        return "published"

    async def _advance(self, state: PartialGroup, task: Task, place: _Place) -> None:
        """One step: summaries due, else one sampled chunk of the open drafts (holding a sampling place from the
        first chunk to the last), else a graded round (the place given up)."""
        starting = [ep for ep in state.episodes
                    if not ep.done(self.config.max_attempts) and not ep.draft_ids and not ep.draft_done]
        for ep in starting:
            if not await self._prepare_attempt(state, ep, task):
                return
        sampling = [ep for ep in state.episodes if not ep.done(self.config.max_attempts) and not ep.draft_done]
        if sampling:
            await place.take()
            await self._sample(state, sampling, task)
            return
        place.give_up()
        grading = [(g, ep) for g, ep in enumerate(state.episodes)
                   if not ep.done(self.config.max_attempts) and ep.draft_done]
        started = time.monotonic()
        env = FunctionEnvironment(self.tokenizer, max_attempts=self.config.max_attempts)
        port = _RoundGrades(self, task, state.task_id)

        async def step(ep: EpisodeState) -> None:
            episode_port = port.episode(len(ep.attempts))
            outcome = await env.step(function_state(ep, task, self.config.max_attempts), ep.draft_ids, episode_port)
            assert episode_port.attempt is not None   # the step graded through it
            apply_step(ep, outcome.state, episode_port.attempt)

        async with anyio.create_task_group() as tg:       # each distinct program of the round runs once
            for _, ep in grading:
                tg.start_soon(step, ep)
        self.count("graded_repeats", port.repeats)
        state.grade_s += time.monotonic() - started
        state.rounds += 1

    async def _prepare_attempt(self, state: PartialGroup, ep: EpisodeState, task: Task) -> bool:
        """Before an attempt: end the episode when no context is left, summarise when over budget.
        Returns False when it summarised (a step of its own, saved before sampling)."""
        max_len = self.model.max_seq_len
        budget = min(self.config.context_budget or max_len - self.config.max_tokens, max_len - 1)
        context = base_context(ep, task, self.tokenizer, self.config.max_attempts)
        if len(context) <= budget or not ep.attempts:     # the first attempt fits (checked per task)
            return True
        keep = prompt_length(task, self.tokenizer)
        # the new context, prompt + summary header + summary + closing + assistant header, must fit the budget
        tok = self.tokenizer
        framing = len(tok.header("summary")) + len(tok.closing()) + len(tok.header("assistant"))
        summary_tokens = min(self.config.max_tokens, budget - keep - framing)
        if summary_tokens < 1:
            ep.ended = "no_room"
            return True
        seed = _seed(state)

        def summarise() -> SampledSummary:
            return self.write_summary(context, budget=budget, keep=keep, prompt=tok.header("summary"),
                                      tokens=summary_tokens, seed=seed)

        started = time.monotonic()
        written = await anyio.to_thread.run_sync(summarise)
        state.generate_s += time.monotonic() - started
        state.chunks += 1
        record_summary(ep, task, written, self.tokenizer)
        self.count("summaries")
        log.info("episode_summarised", task_id=state.task_id, context=len(context), summary=len(written.ids))
        return False

    async def _sample(self, state: PartialGroup, rows: list[EpisodeState], task: Task) -> None:
        """Sample up to `partial_every_tokens` more ids for every open draft, in one batch."""
        max_len = self.model.max_seq_len
        bases = [base_context(ep, task, self.tokenizer, self.config.max_attempts) for ep in rows]
        limits = [min(self.config.max_tokens, max_len - len(b)) for b in bases]
        contexts = [b + ep.draft_ids for b, ep in zip(bases, rows, strict=True)]
        n = min(self.config.partial_every_tokens,
                *(lim - len(ep.draft_ids) for lim, ep in zip(limits, rows, strict=True)))
        started = time.monotonic()
        samples = await self._batcher.sample(contexts, n, _seed(state))
        elapsed = time.monotonic() - started
        kept = 0
        for ep, out, context, limit in zip(rows, samples, contexts, limits, strict=True):
            routing = out.routing.numpy() if out.routing is not None else None
            kept += add_chunk(ep, out.tokens.tolist(), out.logprobs.tolist(), out.versions.tolist(), routing,
                              len(context), stop_ids=self.tokenizer.stop_ids, limit=limit)
        state.chunks += 1
        state.sampled_tokens += kept
        state.generate_s += elapsed
        self._sampling_s += elapsed
        self.count("tokens", kept)
        self.gauges["tokens_per_s"] = self.counters["tokens"] / max(self._sampling_s, 1e-9)
        self._note_version()

    def _sample_rows(self, contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
        """One `generate` call over the open drafts of every task in the batch (SampleBatcher's worker
        thread); weights are swapped in flight between decoding steps. The KV cache's dtype is
        `sampling_kv_dtype`'s (float32 on CPU); the rollouts' behaviour logprobs are those of that computation."""
        weights = self._weights()
        with self._model_lock:
            return generate(weights.model, contexts, max_new_tokens=n, temperature=self.config.temperature,
                            eos_id=self.tokenizer.stop_id, pad_id=self.tokenizer.pad_id,
                            version=weights.held_version or 0, on_step=weights.maybe_swap,
                            generator=torch.Generator().manual_seed(seed),
                            kv_dtype=sampling_kv_dtype(weights.model.device))

    async def grade_case(self, task: Task, task_id: str, case: GradeCase, *, attempt: int) -> Attempt:
        """Grade `case` (an attempt's program on the task's hidden tests) in the region's sandbox; no verdict is a
        failed attempt, counted. The attempts of a round with the same program share this verdict
        (`_RoundGrades`)."""
        digest = hashlib.sha256(case.code.encode()).hexdigest()[:12]
        request = request_for_case(case, request_id=f"{task_id}-a{attempt}-{digest}", limits=SandboxLimits())
        try:
            result = await run_in_sandbox(self.bus, self.ident.region, request,
                                          timeout_s=self.config.sandbox_timeout_s)
        except (RlbusError, nats.errors.Error, TimeoutError) as err:
            self.count("sandbox_errors")
            log.warning("sandbox_unavailable", task_id=task_id, attempt=attempt, error=repr(err))
            return Attempt(status="error", n_passed=0, n_tests=len(task.tests),
                           feedback=f"the sandbox gave no verdict ({type(err).__name__})",
                           verdict=SandboxVerdict(total=len(task.tests), status="error"), sandbox_error=True)
        grade = grade_result(result)
        failed_infra = result.verdict.status in ("crashed", "error")
        if failed_infra:
            self.count("sandbox_errors")
        return Attempt(status=grade.status, n_passed=grade.n_passed, n_tests=grade.n_tests,
                       feedback=grade.feedback, verdict=result.verdict, sandbox_error=failed_infra)

    async def _publish(self, state: PartialGroup, task: Task, message: TaskMessage, key: str,
                       group_size: int) -> None:
        """Publish the group (msg id = rollout id, retried until stored), then delete the partial. A grown
        group with `grown_subsample` goes out as `group_size` of its episodes (`published_episodes`)."""
        now = time.time()
        timings = {"generate_s": state.generate_s, "grade_s": state.grade_s, "wall_s": now - state.started_at,
                   "queue_s": max(0.0, state.started_at - message.created_at)}
        subject = self.bus.subjects.rollouts(self.ident.region)
        episodes = state.episodes
        if self.config.grown_subsample and state.group_size > group_size:
            episodes = published_episodes(state, group_size)
            self.count("grown_unpublished", state.group_size - len(episodes))
        rollouts = [build_rollout(ep, task=task, task_id=state.task_id, group_index=g, group_size=len(episodes),
                                  tokenizer=self.tokenizer, region=self.ident.region,
                                  generator_id=self.ident.actor_id,
                                  timings={**timings, "attempts": float(len(ep.attempts)),
                                           "resumes": float(state.resumes)},
                                  partial_credit=self.config.partial_credit)
                    for g, ep in enumerate(episodes)]
        retry = retry_policy("rollouts_not_published", on=(nats.errors.Error, TimeoutError), initial_s=0.5, max_s=5.0,
                             forever="the group is in hand and its task held: ride out the region's outage rather "
                                     "than give the work back", task_id=state.task_id)
        async for attempt in retry:
            with attempt:
                try:
                    await self.bus.publish_batch([(subject, r, r.rollout_id) for r in rollouts])
                except (nats.errors.Error, TimeoutError):
                    self.count("publish_failures")
                    raise
        self.count("rollouts", len(rollouts))
        try:
            await self.kv.delete(key)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("partial_not_deleted", task_id=state.task_id, error=repr(err))
        log.info("group_published", task_id=state.task_id, rollouts=len(rollouts),
                 rewards=[r.reward for r in rollouts], rounds=state.rounds, tokens=state.sampled_tokens,
                 resumes=state.resumes)

    # ---- partials -------------------------------------------------------------------------------
    async def _load(self, key: str, task_id: str, group_size: int,
                    task: Task) -> tuple[PartialGroup | None, int | None]:
        """The saved partial of the task and its revision; (None, revision) when absent or unusable. An
        unusable one (undecodable, another task's, or failing `check_partial`) is discarded with a warning and
        an `Event(incident)`: the group starts over and overwrites it (compare-and-set on its revision)."""
        entry = await read_key(self.bus.js, self.bus.subjects.partials_bucket(self.ident.region), key,
                               give_up_after_s=GIVE_UP_S)
        if entry.value is None:
            return None, None
        try:
            state = decode_partial(entry.value)
            check_partial(state, task, task_id, self.tokenizer, self._partial_limits(group_size))
        except PartialGroupError as err:
            self.count("partials_discarded")
            log.warning("partial_discarded", task_id=task_id, revision=entry.revision, error=str(err)[:300])
            await self.bus.event(Event(event="incident", actor_id=self.ident.actor_id, actor_kind=self.kind,
                                       region=self.ident.region, detail=f"partial discarded: {str(err)[:300]}",
                                       data={"what": "partial_discarded", "task_id": task_id[:200]}))
            return None, entry.revision
        return state, entry.revision

    def _partial_limits(self, group_size: int) -> PartialLimits:
        policy = self.model
        held = self._weights().held_version
        moe, experts = policy.moe, policy.n_experts
        routing = (*moe, experts) if moe is not None and experts is not None else None
        return PartialLimits(group_size=group_size, max_group_size=self.config.max_group_size,
                             max_attempts=self.config.max_attempts,
                             max_tokens=self.config.max_tokens, max_seq_len=policy.max_seq_len,
                             vocab_size=policy.vocab_size,
                             held_version=held if held is not None else 0, routing=routing)

    async def _save(self, key: str, state: PartialGroup, revision: int | None) -> int:
        """Compare-and-set the partial; raises _TakenOver when another generator wrote it meanwhile."""
        bucket = self.bus.subjects.partials_bucket(self.ident.region)
        try:
            return await put_at(self.bus.js, bucket, key, encode_partial(state), revision=revision,
                                give_up_after_s=GIVE_UP_S)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _TakenOver(state.task_id) from None

    # ---- what agentic groups use ------------------------------------------------------------------
    async def sample_rows(self, contexts: list[list[int]], n: int, seed: int) -> list[SampledSequence]:
        """Sample through the generator's batcher (merged with every other task's rows, weights swapped in
        flight)."""
        started = time.monotonic()
        samples = await self._batcher.sample(contexts, n, seed)
        self._sampling_s += time.monotonic() - started
        self.gauges["tokens_per_s"] = self.counters["tokens"] / max(self._sampling_s, 1e-9)
        return samples

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


class _RoundGrades:
    """The `GradePort` of one graded round of a function group: each distinct case (program and tests) runs in the
    sandbox once, the round's other attempts with that case reuse its verdict (counted in `repeats`)."""

    def __init__(self, gen: Generator, task: Task, task_id: str) -> None:
        self.gen, self.task, self.task_id = gen, task, task_id
        self.repeats = 0
        self._done: dict[GradeCase, Attempt] = {}
        self._running: dict[GradeCase, anyio.Event] = {}

    def episode(self, attempt: int) -> _EpisodeGrade:
        """The port of one episode's attempt (number `attempt`, from 0)."""
        return _EpisodeGrade(self, attempt)

    async def attempt(self, case: GradeCase, attempt: int) -> Attempt:
        running = self._running.get(case)
        if running is not None:
            await running.wait()
            self.repeats += 1
            return self._done[case]
        self._running[case] = done = anyio.Event()
        try:
            self._done[case] = await self.gen.grade_case(self.task, self.task_id, case, attempt=attempt)
        finally:
            done.set()
        return self._done[case]


class _EpisodeGrade:
    """One episode's `GradePort` in a round; keeps the `Attempt` (the grade with the sandbox's verdict)."""

    def __init__(self, round_: _RoundGrades, attempt: int) -> None:
        self.round, self.number = round_, attempt
        self.attempt: Attempt | None = None

    async def grade(self, case: GradeCase) -> GradeResult:
        self.attempt = await self.round.attempt(case, self.number)
        return self.attempt.grade()


def _seed(state: PartialGroup) -> int:
    """Sampler seed of the group's next call: stable across a resume (task id and calls done so far)."""
    return int.from_bytes(hashlib.sha256(f"{state.task_id}:{state.chunks}".encode()).digest()[:7], "big")


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
