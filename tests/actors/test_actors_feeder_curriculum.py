"""The feeder's curriculum by level: draw weights move to higher levels as the recent pass rate rises, the
sequence is a pure function of seed and saved stages (so the ledger rebuilds it), and a feeder on a real
server opens level 2 once level 1's rollouts pass, saving the stage before it feeds from it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import eventually, hosted
from test_actors_feeder import FAST, Env, _provision, _start, polls_later, stream_tasks, take

from rlbus.actors.base import ActorId
from rlbus.actors.common.config import CurriculumConfig, FeederConfig, FeederLaunch, decode_config
from rlbus.actors.common.curriculum import CurriculumSequence, LevelCurriculum, level_weights, pick_level
from rlbus.actors.common.feed import (
    fed_task_ids,
    read_position,
    task_from_verifier,
    task_sequence,
    task_source,
)
from rlbus.actors.feeder import Feeder
from rlbus.messages.errors import TopologyError
from rlbus.messages.schemas import Rollout, TensorBlob
from rlbus.topology.file.load import validate

pytestmark = pytest.mark.anyio
LEVELS = (1, 2, 3)
BASE = (Path(__file__).resolve().parents[1] / "topology" / "bad" / "levels_with_tasks_file.toml").read_text().split(
    "[feeder]")[0]


def _mean_level(weights: dict[int, float]) -> float:
    return sum(level * w for level, w in weights.items()) / sum(weights.values())


def test_weights_move_to_higher_levels_as_the_pass_rate_rises() -> None:
    """Level 1 alone at first; failing rollouts open nothing; a full window passing at raise_at opens level 2,
    then level 3; the mean drawn level rises at each opening and levels never close."""
    cur = LevelCurriculum(CurriculumConfig(window=4, raise_at=0.75, review=0.5), LEVELS)
    assert cur.weights() == {1: 1.0}
    assert not any(cur.observe(1, 0.0) for _ in range(8))
    assert cur.pass_rate(1) == 0.0 and cur.top == 1
    assert [cur.observe(1, r) for r in (1.0, 1.0, 0.5)] == [False, False, False]   # partial credit fails
    assert cur.pass_rate(1) == 0.5
    opened = [cur.observe(1, r) for r in (0.0, 1.0, 1.0, 1.0)]                      # 3 of the last 4 pass
    assert opened == [False, False, False, True] and cur.top == 2 and cur.weights() == {1: 0.5, 2: 1.0}
    means = [_mean_level({1: 1.0}), _mean_level(cur.weights())]
    assert not cur.observe(3, 1.0) and not cur.observe(1, 1.0)          # only the top level's window opens one
    assert [cur.observe(2, 1.0) for _ in range(4)] == [False, False, False, True] and cur.top == 3
    means.append(_mean_level(cur.weights()))
    assert means == sorted(means) and len(set(means)) == 3
    assert not any(cur.observe(3, 0.0) for _ in range(8)) and cur.top == 3
    assert level_weights(LEVELS, 3, 0.0) == {3: 1.0}


def test_level_draws_are_deterministic_and_follow_the_weights() -> None:
    """pick_level is a pure function of (seed, index, weights); shares follow the weights; another seed differs."""
    weights = {1: 0.25, 2: 1.0}
    draws = [pick_level(3, i, weights) for i in range(4000)]
    assert draws == [pick_level(3, i, weights) for i in range(4000)]
    assert draws != [pick_level(4, i, weights) for i in range(4000)]
    assert abs(draws.count(1) / 4000 - 0.2) < 0.03 and set(draws) == {1, 2}
    with pytest.raises(ValueError, match="positive share"):
        pick_level(3, 0, {1: 0.0})


def test_the_sequence_is_rebuilt_from_seed_and_stages() -> None:
    """Tasks drawn before a raise keep their level 1; after it levels 1 and 2 mix; the saved stages rebuild the
    very same ids for the ledger (`fed_task_ids`), with no id twice."""
    config = FeederConfig(seed=11, curriculum=CurriculumConfig(review=0.25))
    seq = task_sequence(config, FeederLaunch())
    assert isinstance(seq, CurriculumSequence)
    first = [seq.get(i) for i in range(10)]
    assert {t.level for t in first} == {1}
    seq.forget_below(6)
    assert seq.raise_to(2) == 10 and seq.stages == [(0, 1), (10, 2)]
    after = [seq.get(i) for i in range(10, 60)]
    assert Counter(t.level for t in after).keys() == {1, 2}
    ids = [t.task_id for t in [*first, *after]]
    assert len(set(ids)) == 60
    launch = FeederLaunch(regions=["hub"])
    assert fed_task_ids(config, launch, {"hub": 60}, "hub", stages=seq.stages) == {"hub": ids}
    without = fed_task_ids(config, launch, {"hub": 60}, "hub")["hub"]
    assert without[:10] == ids[:10] and without != ids
    assert task_source(config) == "builtin:11:curriculum=level,1,0.25"
    for source in ("repo", "repo:train"):
        repo = task_sequence(FeederConfig(tasks=source, seed=3, curriculum=CurriculumConfig(start=2)), FeederLaunch())
        assert {repo.get(i).level for i in range(8)} == {1, 2}


def test_bad_curriculum_settings_are_refused_naming_the_key() -> None:
    """Out-of-bounds keys name `feeder.curriculum.<key>`; a listed source or fixed levels cannot take one."""
    for settings, key in [({"start": 4}, "start"), ({"raise_at": 0.0}, "raise_at"), ({"window": 0}, "window"),
                          ({"review": 1.5}, "review"), ({"by": "family"}, "by")]:
        with pytest.raises(TopologyError, match=rf"feeder\.curriculum\.{key}"):
            decode_config("feeder", {"curriculum": settings}, FeederConfig)
    with pytest.raises(ValueError, match=r"feeder\.curriculum needs"):
        task_sequence(FeederConfig(tasks="humaneval", curriculum=CurriculumConfig()), FeederLaunch())
    with pytest.raises(ValueError, match=r"feeder\.curriculum needs"):
        task_sequence(FeederConfig(levels=[1], curriculum=CurriculumConfig()), FeederLaunch())


@pytest.mark.parametrize(("feeder", "fragment"), [
    ('tasks = "humaneval"\ncurriculum = {window = 8}', "not of feeder.tasks 'humaneval'"),
    ('tasks = "repo:2:train"\ncurriculum = {}', "not of feeder.tasks 'repo:2:train'"),
    ('levels = [1, 2]\ncurriculum = {}', "fixes the levels"),
    ('curriculum = {raise_at = 1.5}', "<= 1, found the float 1.5"),
])
def test_validate_refuses_a_curriculum_it_cannot_apply(tmp_path: Path, feeder: str, fragment: str) -> None:
    """`rlbus validate` names feeder.curriculum for a listed source, one repository level, fixed levels or a bound."""
    path = tmp_path / "t.toml"
    path.write_text(f"{BASE}[feeder]\n{feeder}\n")
    topology, problems = validate(path, local_cores=64)
    errors = [p for p in problems if p.severity == "error"]
    assert topology is None and len(errors) == 1, problems
    assert errors[0].key.startswith("feeder.curriculum") and fragment in errors[0].message, problems
    path.write_text(f'{BASE}[feeder]\ncurriculum = {{start = 2, window = 32}}\n')
    assert validate(path, local_cores=64)[1] == []


def _passing(task_id: str) -> Rollout:
    empty = TensorBlob.of([], "int32")
    return Rollout(rollout_id=f"{task_id}-0", task_id=task_id, group_index=0, group_size=1,
                   prompt_tokens=TensorBlob.of([1], "int32"), completion_tokens=empty,
                   behaviour_logprobs=TensorBlob.of([], "float32"), policy_versions=empty, reward=1.0)


async def test_feeder_opens_the_next_level_when_rollouts_pass(tmp_path: Path) -> None:
    """Window 4: the first tasks are all level 1; 4 passing rollouts of them on the hub's ROLLOUTS open level 2,
    whose stage is saved, and the tasks fed next include level 2; the saved cursors and stages give exactly
    the ids published."""
    rs, run = _start(tmp_path, ["hub"])
    try:
        env: Env = await _provision(rs, run)
        config = FeederConfig(seed=2, backlog_per_region=6, poll_interval_s=0.05,
                              curriculum=CurriculumConfig(window=4, raise_at=1.0, review=0.25))
        launch = FeederLaunch(regions=["hub"], group_size=1, hub="hub")
        published: list[str] = []
        bus = await env.bus("hub", "feeder")
        async with hosted(Feeder(ActorId(env.run, "hub", "feeder", "f1"), bus, config, FAST, launch), close=[bus]) as f:
            async def queued(n: int) -> bool:
                return len(await stream_tasks(env, "hub")) == n
            await eventually(lambda: queued(6), what="6 tasks queued")
            first = [task_from_verifier(t) for t in await stream_tasks(env, "hub")]
            assert {t.level for t in first} == {1}
            generator = await env.bus("hub", "generator")
            try:
                for task in first[:4]:
                    await generator.publish(generator.subjects.rollouts("hub"), _passing(task.task_id),
                                            msg_id=f"{task.task_id}-0")
                await eventually(lambda: f.counters.get("rewards_observed", 0) == 4, what="4 rewards observed")
                assert f.curriculum is not None and f.curriculum.top == 2
            finally:
                await generator.close()
            taken: list[tuple[str, str]] = []
            await take(env, "hub", 6, taken)                 # frees room: the next tasks are fed
            published = [task_id for _, task_id in taken]
            assert published == [t.task_id for t in first]
            await eventually(lambda: queued(6), what="6 more tasks queued")
            await polls_later(f)                                # their position saved
            second = [task_from_verifier(t) for t in await stream_tasks(env, "hub")]
            assert {t.level for t in second} == {1, 2}
            published += [t.task_id for t in second]
        admin = await env.bus("hub", "admin")
        try:
            position = await read_position(admin, "hub")
        finally:
            await admin.close()
        assert position is not None and position.stages[0] == (0, 1) and position.stages[1][1] == 2
        assert position.stages[1][0] >= 6
        assert fed_task_ids(config, launch, position.cursors, "hub", stages=position.stages)["hub"] == published
    finally:
        rs.stop()
