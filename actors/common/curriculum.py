"""The feeder's curriculum by level: which levels are open, how often each is drawn, and the task sequence it makes.

- Owns: which sources take a curriculum (`takes_curriculum`), `LevelCurriculum` (per level, the pass/fail outcomes of its recent rollouts; the highest open level, which
  rises when that level's recent pass rate reaches `raise_at`), `level_weights` (the draw weights of the open
  levels), `pick_level` (the level of one sequence index: a pure function of seed, index and weights), and
  `CurriculumSequence` (the task sequence of per-level task streams, its stages saved as (first index, highest
  open level) so that a restarted feeder and the ledger rebuild the same sequence).
- Guarantee: pure and deterministic: the same seed and stages give the same sequence in any process. No bus, no
  torch, no task source (actors/common/feed.py hands in the per-level streams).
- Does not: read rewards off the bus or save the stages (actors/feeder.py), or define levels (model/tasks/).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, Generic, Protocol, TypeVar

from rlbus.actors.common.config import CurriculumConfig, without_split

PASS_REWARD: Final = 1.0
"""A rollout passes when its reward reaches this: every hidden test passed (partial credit stays below it)."""


def takes_curriculum(tasks: str) -> bool:
    """Whether a curriculum can draw the levels of `[feeder] tasks`: the built-in family ("builtin") or the built-in
    repository tasks of every level ("repo", or one split of them: "repo:train", "repo:heldout")."""
    return tasks == "builtin" or without_split(tasks) == "repo"


def level_source(tasks: str, level: int) -> str:
    """The repository source of one level of `tasks` ("repo" -> "repo:2", "repo:train" -> "repo:2:train")."""
    return f"repo:{level}{tasks.removeprefix('repo')}"


class Leveled(Protocol):
    @property
    def level(self) -> int: ...


T = TypeVar("T", bound=Leveled)


def level_weights(levels: Sequence[int], top: int, review: float) -> dict[int, float]:
    """Draw weights of the open levels (those of `levels` up to `top`): 1 for `top`, `review` for each below it.
    Levels with weight 0 are left out."""
    out = {level: (1.0 if level == top else review) for level in sorted(levels) if level <= top}
    return {level: w for level, w in out.items() if w > 0}


def pick_level(seed: int, index: int, weights: Mapping[int, float]) -> int:
    """The level of sequence index `index`: u = sha256("curriculum:seed:index") as a fraction in [0, 1), then the
    first level (ascending) whose cumulative share exceeds u. Pure and stable across processes.

    :raises ValueError: no level has a positive weight.
    """
    items = sorted((level, w) for level, w in weights.items() if w > 0)
    if not items:
        raise ValueError(f"curriculum weights {dict(weights)} give no level a positive share")
    total = sum(w for _, w in items)
    u = int.from_bytes(hashlib.sha256(f"curriculum:{seed}:{index}".encode()).digest()[:8], "big") / 2.0**64
    acc = 0.0
    for level, w in items:
        acc += w / total
        if u < acc:
            return level
    return items[-1][0]


class LevelCurriculum:
    """The recent outcomes of each level and the highest open level (`top`).

    Each level keeps the pass/fail of its last `window` rollouts. Once the window of `top` is full and its pass
    rate is at least `raise_at`, the next level opens and becomes `top` (its own window starts empty). Levels never
    close: a falling pass rate keeps `top` where it is. Not thread-safe: one caller at a time.
    """

    def __init__(self, config: CurriculumConfig, levels: Sequence[int], top: int | None = None) -> None:
        self.config = config
        self.levels = tuple(sorted(levels))
        start = top if top is not None else config.start
        self.top = max((lv for lv in self.levels if lv <= start), default=self.levels[0])
        self._recent: dict[int, deque[bool]] = {lv: deque(maxlen=config.window) for lv in self.levels}

    def pass_rate(self, level: int) -> float | None:
        """The pass rate of the level's last `window` rollouts; None until it has that many."""
        recent = self._recent[level]
        return sum(recent) / len(recent) if len(recent) == self.config.window else None

    def observe(self, level: int, reward: float) -> bool:
        """Record one rollout of `level` (passed when `reward` >= `PASS_REWARD`); True when this opened a level.
        A level not in `levels` is ignored."""
        if level not in self._recent:
            return False
        self._recent[level].append(reward >= PASS_REWARD)
        rate = self.pass_rate(self.top)
        above = [lv for lv in self.levels if lv > self.top]
        if level == self.top and rate is not None and rate >= self.config.raise_at and above:
            self.top = above[0]
            return True
        return False

    def weights(self) -> dict[int, float]:
        """The draw weights now (`level_weights` of `top`)."""
        return level_weights(self.levels, self.top, self.config.review)


class CurriculumSequence(Generic[T]):
    """Random access to the curriculum's task sequence, caching the window still needed (as `feed.TaskSequence`).

    Index i takes the level `pick_level(seed, i, level_weights(top at i))`, where `top at i` is that of the last
    stage whose first index is <= i, and then the next task of that level's stream (`streams(level)`, an endless
    iterator of tasks of that level). `raise_to` starts a new stage at the first index not yet drawn, so what was
    drawn never changes: the stages and the seed rebuild the sequence.
    """

    end: int | None = None
    """Endless: the feeder's `max_tasks` bounds it (`end`)."""

    def __init__(self, seed: int, config: CurriculumConfig, levels: Sequence[int],
                 streams: Callable[[int], Iterator[T]], stages: Sequence[tuple[int, int]] = (),
                 end: int | None = None) -> None:
        self._seed = seed
        self._config = config
        self._levels = tuple(sorted(levels))
        self._factory = streams
        self._streams: dict[int, Iterator[T]] = {}
        self.stages: list[tuple[int, int]] = [(int(i), int(t)) for i, t in stages] or [(0, config.start)]
        """(first index, highest open level) of each stage, in index order."""
        self._cache: list[T] = []
        self._base = 0
        self.end = end

    @property
    def drawn(self) -> int:
        """The first index whose task has not been drawn yet."""
        return self._base + len(self._cache)

    def top_at(self, index: int) -> int:
        """The highest open level at sequence index `index`."""
        return [top for first, top in self.stages if first <= index][-1]

    def level_at(self, index: int) -> int:
        """The level of sequence index `index`."""
        return pick_level(self._seed, index, level_weights(self._levels, self.top_at(index), self._config.review))

    def raise_to(self, top: int) -> int:
        """Open levels up to `top` from the first index not drawn yet on; returns that index."""
        first = self.drawn
        if top == self.stages[-1][1]:
            return first
        if self.stages[-1][0] == first:
            self.stages[-1] = (first, top)
        else:
            self.stages.append((first, top))
        return first

    def get(self, index: int) -> T:
        if index < self._base:
            raise IndexError(f"task {index} was dropped from the cache (window starts at {self._base})")
        while self.drawn <= index:
            level = self.level_at(self.drawn)
            if level not in self._streams:
                self._streams[level] = self._factory(level)
            self._cache.append(next(self._streams[level]))
        return self._cache[index - self._base]

    def forget_below(self, index: int) -> None:
        """Drop cached tasks before `index` (every region's cursor is past them)."""
        if index > self._base:
            drop = min(index, self.drawn) - self._base
            del self._cache[:drop]
            self._base += drop


__all__ = ["PASS_REWARD", "CurriculumSequence", "LevelCurriculum", "level_source", "level_weights", "pick_level",
           "takes_curriculum"]
