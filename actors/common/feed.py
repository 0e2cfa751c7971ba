"""The task feed: the sequence of tasks a feeder puts on the bus, its regions, its saved position, and the
task codec every consumer of tasks shares.

- Owns: the task sequence of each source (`task_sequence`, `listed_tasks`, `read_tasks_file`; a listed source's
  epochs and the id each task is fed under, `fed_id`; under a `[feeder.curriculum]`, a `CurriculumSequence` of
  per-level streams), `assign_region`
  (the deterministic weighted region of each task), the verifier spec a generator rebuilds a task from
  (`verifier_for` / `task_from_verifier`), the feeder's saved `Position` in the hub's PARTIALS KV under
  `POSITION_KEY` (`read_position`), and which ids its cursors have fed (`fed_task_ids`).
- Does not: publish tasks (actors/feeder.py), account for fed tasks (actors/common/ledger.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from rlbus.actors.common.config import (
    REPO_LEVELS,
    FeederConfig,
    FeederLaunch,
    feed_weights,
    feeder_file_problem,
    feeder_tasks_problem,
    names_task_file,
)
from rlbus.actors.common.curriculum import CurriculumSequence, level_source, takes_curriculum
from rlbus.actors.common.errors import TaskError
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.subjects import POSITION_KEY
from rlbus.model.tasks import sources as task_sources
from rlbus.model.tasks.builtin import Task as CodingTask
from rlbus.model.tasks.builtin import train_tasks
from rlbus.model.tasks.repo import RepoTask

FedTask = CodingTask | RepoTask
"""What a feeder puts on the bus: a function to write, or a repository task (an agentic episode)."""

log = structlog.get_logger()

VERIFIER_KIND: Final = "rlbus-task-v1"
"""`Task.verifier["kind"]` of tasks whose `Task.verifier["task"]` is a `model.tasks.Task` as JSON."""


# ---- the task sequence --------------------------------------------------------------------------
def assign_region(seed: int, index: int, weights: Sequence[tuple[str, float]]) -> str:
    """The region of task `index`: u = sha256("seed:index") as a fraction in [0, 1), then the first region
    whose cumulative share exceeds u (regions in the given order). Pure and stable across processes."""
    total = sum(w for _, w in weights)
    if not weights or total <= 0:
        raise ValueError(f"region weights {list(weights)} give no region a positive share")
    u = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "big") / 2.0**64
    acc = 0.0
    for region, weight in weights:
        acc += weight / total
        if u < acc:
            return region
    return weights[-1][0]


def task_seed(seed: int, index: int) -> int:
    """`Task.seed` of task `index`: 31 bits of sha256("task:seed:index"); generators seed sampling with it."""
    return int.from_bytes(hashlib.sha256(f"task:{seed}:{index}".encode()).digest()[:4], "big") >> 1


def verifier_for(task: FedTask, *, with_reference: bool = False) -> dict[str, str]:
    """`Task.verifier` of a coding task: {"kind": VERIFIER_KIND, "task": <the task's fields as JSON>}; of a
    repository task its own `verifier_spec()` (kind model/tasks/repo.py `VERIFIER_KIND`), which leaves out the
    reference edit a built-in task's id rebuilds; `with_reference` keeps it (a repository task file's task, whose
    reference nothing else carries, for `[generator] script = "reference"`; the policy never sees the verifier)."""
    if isinstance(task, RepoTask):
        if with_reference:
            shown = msgspec.structs.replace(task, solution={})
            return {"kind": task.verifier_spec()["kind"], "task": msgspec.json.encode(shown).decode()}
        return task.verifier_spec()
    doc = {"task_id": task.task_id, "family": task.family, "level": task.level, "prompt": task.prompt,
           "entry_point": task.entry_point, "solution": task.solution,
           "tests": [{"args": t.args, "expected": t.expected} for t in task.tests]}
    if task.test_source:             # absent when empty: the same JSON as before for pair-only tasks
        doc["test"] = task.test_source
    return {"kind": VERIFIER_KIND, "task": json.dumps(doc)}


def task_from_json(doc: Mapping[str, Any]) -> CodingTask:
    """A `model.tasks.Task` from its JSON object (a verifier's or a task file line's, rlbus or test-source
    layout: model/tasks/sources.py `task_from_json`).

    :raises TaskError: a required field is missing or has the wrong type, or there are no tests.
    """
    try:
        return task_sources.task_from_json(doc)
    except task_sources.TaskSourceError as err:
        raise TaskError(str(err)) from None


def task_from_verifier(message: TaskMessage) -> CodingTask:
    """Rebuild the coding task a Task message carries (generator side).

    :raises TaskError: the verifier is not of kind VERIFIER_KIND or its task does not parse.
    """
    if message.verifier.get("kind") != VERIFIER_KIND or "task" not in message.verifier:
        raise TaskError(f"task {message.task_id}: verifier kind {message.verifier.get('kind')!r} is not "
                        f"{VERIFIER_KIND!r}")
    try:
        doc = json.loads(message.verifier["task"])
    except (ValueError, RecursionError) as err:    # RecursionError: nested past the parser's depth
        raise TaskError(f"task {message.task_id}: verifier task is not usable JSON: {err!r}"[:500]) from None
    if not isinstance(doc, dict):   # TaskError, as for every unusable verifier: the generator dead-letters those
        raise TaskError(f"task {message.task_id}: verifier task is a JSON {type(doc).__name__}, "
                        f"not an object")
    return task_from_json(doc)


def read_tasks_file(path: Path) -> list[CodingTask]:
    """Every task of a JSONL file, in file order, each line in the rlbus, test-source or MBPP layout
    (model/tasks/sources.py `read_tasks_file`).

    One JSON object per line with the `model.tasks.Task` fields, e.g.
    `{"task_id": "t1", "prompt": "def f(x):\\n    ...", "entry_point": "f",
      "tests": [{"args": "(3,)", "expected": "8"}], "family": "int", "level": 1, "solution": ""}`
    (`args` is the repr of the argument tuple, `expected` the repr of the result; family, level and solution
    are optional), or with `"test": "def check(candidate): ..."` (Python source tests) instead of `tests`, or
    an MBPP row.

    :raises TaskError: naming the file and line of the first bad line.
    """
    try:
        return task_sources.read_tasks_file(path)
    except task_sources.TaskSourceError as err:
        raise TaskError(str(err)) from None


def listed_tasks(config: FeederConfig) -> list[FedTask] | None:
    """The tasks of a listed source the feeder walks in order: `tasks_file`'s, the repository task file's of
    `tasks = "PATH"`, or HumanEval's for `tasks = "humaneval"`; None for a generated sequence (the built-in
    family, the built-in repository tasks).

    :raises TaskError: the file or the package cannot be read; a bad repository task file names its line and key.
    """
    if config.tasks_file is not None:
        return list(read_tasks_file(Path(config.tasks_file)))
    if names_task_file(config.tasks):
        if (problem := feeder_file_problem(config.tasks)) is not None:
            raise TaskError(f"feeder.tasks: {problem}")
        try:
            return list(task_sources.load_repo_tasks(config.tasks, n=1 << 62))
        except task_sources.TaskSourceError as err:
            raise TaskError(f"feeder.tasks: {err}") from None
    if config.tasks == task_sources.HUMANEVAL:
        try:
            return task_sources.humaneval_tasks()
        except task_sources.TaskSourceError as err:
            raise TaskError(f"feeder.tasks = 'humaneval': {err}") from None
    return None


def task_source(config: FeederConfig, launch: FeederLaunch | None = None) -> str:
    """What the feeder's saved position is a position in: the tasks file, or the built-in sequence of a seed
    (and levels), and ":excluding=<source>" when the evaluator's held-out set is a listed source whose
    prompts the sequence skips, and ":curriculum=<by>,<start>,<review>" under a `[feeder.curriculum]` (what
    decides its draws; when a stage begins the position saves itself). A restart that finds another source
    saved restarts every region at the furthest saved index rather than at its own cursor
    (`feeder_assignment_changed`)."""
    excluding = (f":excluding={launch.eval_tasks}" if launch is not None and launch.eval_tasks != task_sources.BUILTIN
                 else "")
    if config.tasks_file is not None:
        return f"{config.tasks_file}{excluding}"
    c = config.curriculum
    curriculum = f":curriculum={c.by},{c.start},{c.review}" if c is not None else ""
    if config.tasks != task_sources.BUILTIN:
        return f"{config.tasks}:{config.seed}{curriculum}{excluding}"
    levels = f":levels={','.join(map(str, sorted(set(config.levels))))}" if config.levels else ""
    return f"builtin:{config.seed}{levels}{curriculum}{excluding}"


def epoch_task_id(task_id: str, epoch: int) -> str:
    """The id a listed source's task is fed under in `epoch`: its own in epoch 0, "ID~eE" in epoch E > 0 (the
    streams deduplicate publishes by this id, and rollouts and the ledgers key on it)."""
    return task_id if epoch == 0 else f"{task_id}~e{epoch}"


class TaskSequence:
    """Random access to the task sequence (built-in or file), caching the window still needed; tasks whose
    prompt hash is in `exclude` (the evaluator's held-out set of a listed source), and repository tasks of a
    function in `skip_functions` (the evaluator's `:heldout` split), are skipped.

    A listed source of n tasks is walked `epochs` times (0: without end): index i is task i mod n of epoch
    i // n, epoch 0 in the source's order, epoch e > 0 in a permutation seeded by (`seed`, e); it is fed under
    `epoch_task_id` (`task_id`). The built-in streams are endless and have no epochs."""

    def __init__(self, seed: int, tasks: list[FedTask] | None = None, max_tasks: int | None = None,
                 *, eval_seed: int | None = None, levels: Sequence[int] = (),
                 exclude: frozenset[str] = frozenset(), repo: str | None = None,
                 skip_functions: frozenset[str] = frozenset(), epochs: int = 1) -> None:
        self._exclude = exclude
        self._repo = repo
        self._skip = skip_functions
        if tasks is not None and (exclude or skip_functions):
            tasks = [t for t in tasks if t.prompt_hash not in exclude
                     and getattr(t, "function", "") not in skip_functions]
        self._listed = tasks
        self._levels = frozenset(levels)
        self._stream: Iterator[FedTask] | None = None
        self._seed = seed
        self._eval_seed = eval_seed
        self._cache: list[FedTask] = []
        self._base = 0
        self._orders: dict[int, list[int]] = {}
        """Listed source: the order of each epoch in use (the latest few)."""
        listed = None if tasks is None else 0 if not tasks else len(tasks) * epochs if epochs else None
        ends = [n for n in (max_tasks, listed) if n is not None]
        self.end: int | None = min(ends) if ends else None
        """First index past the sequence (None: endless)."""

    def get(self, index: int) -> FedTask:
        if self._listed is not None:
            epoch, k = divmod(index, len(self._listed))
            return self._listed[self._order(epoch)[k] if epoch else k]
        if index < self._base:
            raise IndexError(f"task {index} was dropped from the cache (window starts at {self._base})")
        if self._stream is None and self._repo is not None:
            repos = task_sources.repo_stream(self._repo, self._seed, skip_functions=self._skip)
            self._stream = (t for t in repos if t.prompt_hash not in self._exclude) if self._exclude else repos
        if self._stream is None:
            stream = train_tasks(self._seed, eval_seed=self._eval_seed)
            if self._exclude:
                stream = (t for t in stream if t.prompt_hash not in self._exclude)
            self._stream = (t for t in stream if t.level in self._levels) if self._levels else stream
        missing = index - self._base - len(self._cache) + 1
        if missing > 0:
            self._cache.extend(itertools.islice(self._stream, missing))
        return self._cache[index - self._base]

    def task_id(self, index: int) -> str:
        """The id task `index` is fed under: a listed source's `epoch_task_id`, else the task's own."""
        task = self.get(index)
        if self._listed is None:
            return task.task_id
        return epoch_task_id(task.task_id, index // len(self._listed))

    def _order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s permutation of the listed tasks' positions, seeded by (seed, epoch)."""
        if (order := self._orders.get(epoch)) is None:
            order = list(range(len(self._listed or ())))
            random.Random(f"epoch:{self._seed}:{epoch}").shuffle(order)
            if len(self._orders) >= 4:              # regions' cursors straddle an epoch's end at most
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    def forget_below(self, index: int) -> None:
        """Drop cached tasks before `index` (every region's cursor is past them)."""
        if self._listed is None and index > self._base:
            del self._cache[: index - self._base]
            self._base = index


class Position(msgspec.Struct, kw_only=True):
    """The feeder's saved state: per region, the next sequence index it has not been given."""

    seed: int
    source: str
    weights: dict[str, float]
    cursors: dict[str, int]
    versions: dict[str, int] = {}
    """Lockstep: per region, the last policy version it was given its batch for."""
    stages: list[tuple[int, int]] = []
    """`[feeder.curriculum]`: (first sequence index, highest open level) of each stage (`CurriculumSequence`)."""


def task_sequence(config: FeederConfig, launch: FeederLaunch, listed: list[FedTask] | None = None,
                  stages: Sequence[tuple[int, int]] = ()) -> TaskSequence | CurriculumSequence[FedTask]:
    """The sequence the feeder walks: `listed` (a listed source's tasks: `listed_tasks`), the built-in repository
    tasks of `[feeder] tasks`,
    or the built-in family of the config, without the prompts of the evaluator's held-out source
    (`launch.eval_tasks`, by prompt hash) and, when that source is a `:heldout` split of repository tasks, without
    any repository task of its functions (`held_out_functions`). Under a `[feeder.curriculum]`, the built-in family's or repository
    tasks' `CurriculumSequence` of the saved `stages` (none: the first stage only).

    :raises TaskError: the evaluator's source cannot be read, `[feeder] tasks` names no source, or a curriculum
        is asked of a listed source or one level.
    """
    try:
        exclude = task_sources.held_out_hashes(launch.eval_tasks, seed=launch.eval_seed, n=launch.eval_n)
        skip = task_sources.held_out_functions(launch.eval_tasks)
    except task_sources.TaskSourceError as err:
        raise TaskError(f"evaluator.tasks = {launch.eval_tasks!r}: {err}") from None
    if config.curriculum is not None:
        return curriculum_sequence(config, launch, exclude, stages, skip_functions=skip)
    repo = None
    if listed is None and config.tasks != task_sources.BUILTIN:
        if (problem := feeder_tasks_problem(config.tasks)) is not None:
            raise TaskError(f"feeder.tasks: {problem}")
        if config.tasks == task_sources.HUMANEVAL or names_task_file(config.tasks):
            listed = listed_tasks(config)
        else:
            repo = config.tasks
    return TaskSequence(config.seed, listed, config.max_tasks, eval_seed=launch.eval_seed, levels=config.levels,
                        exclude=exclude, repo=repo, skip_functions=skip, epochs=config.epochs)


def fed_id(tasks: TaskSequence | CurriculumSequence[FedTask], index: int) -> str:
    """The id task `index` of `tasks` is fed under (`TaskSequence.task_id`; a curriculum's task's own)."""
    return tasks.task_id(index) if isinstance(tasks, TaskSequence) else tasks.get(index).task_id


def curriculum_sequence(config: FeederConfig, launch: FeederLaunch, exclude: frozenset[str],
                        stages: Sequence[tuple[int, int]] = (), *,
                        skip_functions: frozenset[str] = frozenset()) -> CurriculumSequence[FedTask]:
    """The `CurriculumSequence` of `[feeder.curriculum]` over the levels `REPO_LEVELS`: per level, the built-in
    family's tasks of that level (without the held-out prompts `exclude`) or the built-in repository tasks',
    each walked as the source walks it without a curriculum (`TaskSequence`).

    :raises TaskError: the source is not "builtin" or "repo" (or a split of it: `takes_curriculum`; not a listed
        source or one repository level), or `[feeder] levels` is set too.
    """
    assert config.curriculum is not None
    if not takes_curriculum(config.tasks) or config.tasks_file is not None or config.levels:
        raise TaskError(f"feeder.curriculum needs feeder.tasks 'builtin' or 'repo' (or a split of it) without "
                        f"tasks_file or levels, got tasks {config.tasks!r}, tasks_file {config.tasks_file!r}, "
                        f"levels {config.levels}")

    def streams(level: int) -> Iterator[FedTask]:
        """The source's own sequence of one level: "repo:LEVEL" (with the split), or the built-in family with
        `levels = [level]`."""
        if config.tasks != task_sources.BUILTIN:
            one = TaskSequence(config.seed, repo=level_source(config.tasks, level), exclude=exclude,
                               skip_functions=skip_functions)
        else:
            one = TaskSequence(config.seed, eval_seed=launch.eval_seed, levels=(level,), exclude=exclude)
        for index in itertools.count():
            yield one.get(index)
            one.forget_below(index + 1)

    return CurriculumSequence(config.seed, config.curriculum, REPO_LEVELS, streams, stages, end=config.max_tasks)


def position_matches(saved: Position, config: FeederConfig, launch: FeederLaunch, own_region: str) -> bool:
    """Whether `saved` is a position in this config's sequence and assignment (seed, task source, weights);
    a feeder that finds another one saved does not resume its cursors (`feeder_assignment_changed`)."""
    return (saved.seed, saved.source, saved.weights) == (config.seed, task_source(config, launch),
                                                         dict(feed_weights(config, launch, own_region)))


def fed_task_ids(config: FeederConfig, launch: FeederLaunch, cursors: Mapping[str, int], own_region: str,
                 listed: list[FedTask] | None = None, stages: Sequence[tuple[int, int]] = ()) -> dict[str, list[str]]:
    """Per region of `feed_weights(config, launch, own_region)`, the ids of the tasks a feeder with these cursors has given
    it, in sequence order: every index below the region's cursor that `assign_region` gives the region
    (the feeder walks each region's indices in order and advances the cursor past each one published).

    `listed`: the listed source's tasks (None: read them, `listed_tasks`); `stages`: the saved position's
    curriculum stages (`Position.stages`). Cursors of a position saved under another seed, source or weights
    (`position_matches`) do not mean this."""
    weights = feed_weights(config, launch, own_region)
    if listed is None:
        listed = listed_tasks(config)
    tasks = task_sequence(config, launch, listed, stages)
    out: dict[str, list[str]] = {region: [] for region, _ in weights}
    stop = max((cursors.get(region, 0) for region in out), default=0)
    if tasks.end is not None:
        stop = min(stop, tasks.end)
    for index in range(stop):
        region = assign_region(config.seed, index, weights)
        task_id = fed_id(tasks, index)
        tasks.forget_below(index)
        if index < cursors.get(region, 0):
            out[region].append(task_id)
    return out


async def read_position(bus: Bus, region: str, *, domain: str | None = None) -> Position | None:
    """The feeder's saved position in `region`'s PARTIALS KV (the feeder's own region), or None if none is saved.

    `domain`: that region's JetStream domain when `bus` is connected elsewhere.
    :raises BadMessage: the saved value is not a `Position`.
    """
    js = bus.jetstream(domain) if domain is not None else bus.js
    bucket = bus.subjects.partials_bucket(region)
    position, _ = await load_position(await js.key_value(bucket), bucket)
    return position


async def load_position(kv: KeyValue, bucket: str) -> tuple[Position | None, int | None]:
    """The position saved under `POSITION_KEY` in `kv` (the PARTIALS bucket `bucket`) and its KV revision;
    (None, None) when none is saved. The one decoding of a saved position: the feeder resuming and the
    ledger accounting alike refuse an unreadable one rather than guess (a feeder that started over would
    feed every task again).

    :raises BadMessage: the saved value is not a `Position`; the text says how to start over.
    """
    try:
        entry = await kv.get(POSITION_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None, None
    try:
        return msgspec.json.decode(entry.value or b"", type=Position), entry.revision
    except msgspec.DecodeError as err:
        raise BadMessage(f"feeder position {POSITION_KEY!r} in bucket {bucket} (revision {entry.revision}) is "
                         f"unreadable: {err}; restore it, or delete the key to feed from the first task "
                         f"again") from None
