"""The feeder on real regions (a hub and a leaf, each its own nats-server and JetStream domain): every
region's TASKS is filled to the bound and no further and topped up as generators take tasks, each task
goes to its deterministic region only, a restarted feeder neither repeats nor skips a task, a cut-off
region's tasks wait for it, and a JSONL task file is fed to the end of its epochs (each after the first shuffled,
under ids of its own); the ids the saved cursors cover are
exactly the tasks fed, and the task ledger accounts for each (rolled out, pending, dead-lettered, or lost)."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import nats
import pytest
from helpers import eventually, hosted, new_run

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import FeederLaunch, feed_weights
from rlbus.actors.common.feed import (
    POSITION_KEY,
    VERIFIER_KIND,
    FeederConfig,
    Position,
    TaskSequence,
    assign_region,
    fed_id,
    fed_task_ids,
    read_position,
    read_tasks_file,
    task_from_verifier,
    task_sequence,
    task_source,
    verifier_for,
)
from rlbus.actors.common.ledger import ORIGINAL_MSG_ID_HEADER, TaskLedger, read_task_ledger
from rlbus.actors.feeder import Feeder
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Delivery
from rlbus.messages.schemas import Rollout, TensorBlob
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import Subjects
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=2.0)


# ---- pure parts ---------------------------------------------------------------------------------------
def test_region_assignment_is_deterministic_and_follows_the_weights() -> None:
    """The same (seed, index) always gets the same region; shares follow the weights; weight 0 gets none."""
    weights = [("eu", 2.0), ("hub", 1.0)]
    first = [assign_region(7, i, weights) for i in range(3000)]
    assert first == [assign_region(7, i, weights) for i in range(3000)]
    assert abs(first.count("eu") / 3000 - 2 / 3) < 0.03
    assert first != [assign_region(8, i, weights) for i in range(3000)]
    assert {assign_region(7, i, [("eu", 1.0)]) for i in range(50)} == {"eu"}
    with pytest.raises(ValueError, match="positive share"):
        assign_region(7, 0, [("eu", 0.0)])
    config = FeederConfig(region_weights={"hub": 1.0, "eu": 0.0})
    launch = FeederLaunch(regions=["hub", "eu", "us"])
    assert feed_weights(config, launch, "hub") == [("hub", 1.0)]
    assert feed_weights(FeederConfig(), FeederLaunch(regions=["hub", "eu"]), "hub") == [("eu", 1.0), ("hub", 1.0)]
    shares = FeederLaunch(regions=["hub", "eu"], default_weights={"hub": 0.0, "eu": 2.0})
    assert feed_weights(FeederConfig(), shares, "hub") == [("eu", 2.0)]
    assert feed_weights(config, shares, "hub") == [("hub", 1.0)]     # region_weights, when given, win


def test_verifier_and_task_file_rebuild_the_same_task(tmp_path: Path) -> None:
    """A task travels in `Task.verifier` and in a JSONL file as its fields; a bad line names file and line."""
    task = eval_tasks(3, n=1)[0]
    message = TaskMessage(task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task))
    assert message.verifier["kind"] == VERIFIER_KIND
    assert task_from_verifier(message) == task
    path = tmp_path / "tasks.jsonl"
    line = json.loads(verifier_for(task)["task"])
    path.write_text(json.dumps(line) + "\n\n" + json.dumps({"task_id": "x", "prompt": "def f(x):\n"}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:3: task object needs"):
        read_tasks_file(path)
    path.write_text(json.dumps(line) + "\n")
    assert read_tasks_file(path) == [task]
    with pytest.raises(ValueError, match="verifier kind"):
        task_from_verifier(TaskMessage(task_id="t", prompt="p", verifier={"kind": "python_tests"}))


def test_a_task_with_a_test_source_travels_in_the_verifier_and_reads_from_a_file(tmp_path: Path) -> None:
    """A JSONL line with `test` (a check function) instead of `tests` is a task with that test source; it
    rebuilds the same from its verifier, and a pair-only task's verifier JSON has no `test` key."""
    path = tmp_path / "source.jsonl"
    line = {"task_id": "s1", "prompt": "def inc(x):\n", "entry_point": "inc",
            "test": "def check(candidate):\n    assert candidate(1) == 2\n", "solution": "    return x + 1\n"}
    path.write_text(json.dumps(line) + "\n")
    (task,) = read_tasks_file(path)
    assert (task.tests, task.test_source, task.solution) == ((), line["test"], line["solution"])
    message = TaskMessage(task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task))
    assert task_from_verifier(message) == task
    assert "test" not in json.loads(verifier_for(eval_tasks(3, n=1)[0])["task"])
    path.write_text(json.dumps({**line, "test": "print(1)\n"}) + "\n")
    with pytest.raises(ValueError, match=r"source.jsonl:1: task 's1': a test source needs top-level assert"):
        read_tasks_file(path)


# ---- on real regions ----------------------------------------------------------------------------------
@dataclass
class Env:
    rs: RegionSet
    run: str

    async def bus(self, region: str, role: str) -> Bus:
        cred = self.rs.credentials(role)
        return await Bus.connect(self.rs.url(region), run=self.run, domain=region,
                                 options=ConnectOptions(user=cred.user, password=cred.password))


def _start(tmp_path: Path, regions: list[str], relay: bool = False) -> tuple[RegionSet, str]:
    run = new_run()
    return RegionSet.start(tmp_path / "regions", regions, "hub", relay=relay, run=run), run


async def _provision(rs: RegionSet, run: str) -> Env:
    admin = await nats.connect(**rs.connect_options("hub", "admin"))
    env = Env(rs, run)
    try:
        subjects = Subjects(run)
        await provision_run(admin, subjects, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        for region in rs.regions:
            await wait_routable(admin, subjects.tasks(region))
    finally:
        await admin.close()
    return env


@pytest.fixture
def two_regions(tmp_path: Path) -> Iterator[tuple[RegionSet, str]]:
    rs, run = _start(tmp_path, ["hub", "eu"])
    try:
        yield rs, run
    finally:
        rs.stop()


@asynccontextmanager
async def feeding(env: Env, config: FeederConfig, launch: FeederLaunch | None = None) -> AsyncIterator[Feeder]:
    """A feeder (feeder role, at the hub) served in this process until the block ends."""
    bus = await env.bus("hub", "feeder")
    async with hosted(Feeder(ActorId(env.run, "hub", "feeder", "f1"), bus, config, FAST, launch),
                      close=[bus]) as feeder:
        yield feeder


async def stream_tasks(env: Env, region: str) -> list[TaskMessage]:
    """The tasks now queued in a region's TASKS, in stream order (read without consuming)."""
    bus = await env.bus(region, "admin")
    try:
        stream = bus.subjects.tasks_stream(region)
        info = await bus.js.stream_info(stream)
        out = []
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1 if info.state.messages else 1):
            try:
                msg = await bus.js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue                          # acked (work queue) in between
            out.append(codec.decode_as(msg.data, msg.headers, TaskMessage))
        return out
    finally:
        await bus.close()


@functools.cache
def sequence_ids(seed: int, n: int = 40) -> list[str]:
    """Ids of the first `n` tasks of the built-in sequence of `seed`."""
    sequence = TaskSequence(seed)
    return [sequence.get(i).task_id for i in range(n)]


def expected_ids(seed: int, weights: list[tuple[str, float]], region: str, n: int, end: int | None = None) -> list[str]:
    """The first `n` task ids of the built-in sequence that `assign_region` gives to `region`."""
    indices = [i for i in range(end or 40) if assign_region(seed, i, weights) == region][:n]
    assert len(indices) == n or end is not None
    return [sequence_ids(seed)[i] for i in indices]


def _cursor_after(seed: int, weights: list[tuple[str, float]], region: str, n: int) -> int:
    """The sequence index just past the n-th task of `region`."""
    i = seen = 0
    while seen < n:
        seen += assign_region(seed, i, weights) == region
        i += 1
    return i


@asynccontextmanager
async def generator_deliveries(env: Env, region: str) -> AsyncIterator[tuple[Bus, AsyncIterator[Delivery[TaskMessage]]]]:
    """A generator's bus in `region` and its deliveries from the region's TASKS, one at a time; closed after."""
    bus = await env.bus(region, "generator")
    try:
        s = bus.subjects
        async with aclosing(bus.consume(s.tasks_stream(region), s.durable("generator", region), TaskMessage,
                                        batch=1)) as deliveries:
            yield bus, deliveries
    finally:
        await bus.close()


async def polls_later(feeder: Feeder, n: int = 3) -> None:
    """Return once the feeder has done `n` whole polls that began after this call (one more is awaited: the
    poll under way may have read the backlogs before), or has published the last task of its sequence (it polls
    no more: nothing more can be fed)."""
    start = feeder.counters.get("polls", 0)
    await eventually(lambda: feeder.counters.get("polls", 0) >= start + n + 1 or feeder._exhausted(),
                     what=f"{n} more feeder polls")


async def take(env: Env, region: str, n: int, into: list[tuple[str, str]]) -> None:
    """Consume and ack `n` tasks as that region's generators do."""
    async with generator_deliveries(env, region) as (_, deliveries):
        async for delivery in deliveries:
            await delivery.ack_sync()
            into.append((region, delivery.message.task_id))
            if len([r for r, _ in into if r == region]) >= n:
                return


async def test_every_backlog_is_filled_to_the_bound_and_topped_up(two_regions: tuple[RegionSet, str]) -> None:
    """Each region gets its own tasks, in sequence order, up to 4 queued and no more; when a generator
    takes 3 from eu, eu is topped up with its next 3 and the hub is left as it was."""
    env = await _provision(*two_regions)
    config = FeederConfig(seed=5, backlog_per_region=4, poll_interval_s=0.1)
    launch = FeederLaunch(regions=["hub", "eu"], group_size=3)
    weights = feed_weights(config, launch, "hub")
    async with feeding(env, config, launch) as feeder:
        async def full() -> bool:
            return [len(await stream_tasks(env, r)) for r in ("hub", "eu")] == [4, 4]
        await eventually(full)
        await polls_later(feeder)                          # several more polls: still at the bound
        for region in ("hub", "eu"):
            queued = await stream_tasks(env, region)
            assert [t.task_id for t in queued] == expected_ids(5, weights, region, 4)
            assert all(t.region == region and t.group_size == 3 and t.verifier["kind"] == VERIFIER_KIND
                       for t in queued)
        taken: list[tuple[str, str]] = []
        await take(env, "eu", 3, taken)

        async def topped_up() -> bool:
            return len(await stream_tasks(env, "eu")) == 4
        await eventually(topped_up)
        await polls_later(feeder)
        assert [t.task_id for t in await stream_tasks(env, "eu")] == expected_ids(5, weights, "eu", 7)[3:]
        assert [t.task_id for t in await stream_tasks(env, "hub")] == expected_ids(5, weights, "hub", 4)
        assert feeder.counters["tasks"] == 11 and feeder.counters.get("duplicates", 0) == 0


@pytest.mark.parametrize("source", ["builtin", "file"])
async def test_restarted_feeder_neither_repeats_nor_skips(two_regions: tuple[RegionSet, str], tmp_path: Path,
                                                          source: str) -> None:
    """A feeder stopped after filling the backlogs, whose last saved position is even older than what it
    published (a crash between publish and save), is restarted: generators get each of the first 10 tasks
    exactly once, in its region; the republished ones are dropped by the streams' msg-id dedupe. A file of 4
    tasks fed without end is stopped in its second epoch and gets 10 distinct ids over 3 epochs."""
    env = await _provision(*two_regions)
    config = FeederConfig(seed=9, backlog_per_region=3, max_tasks=10, poll_interval_s=0.1)
    launch = FeederLaunch(regions=["hub", "eu"])
    ids = sequence_ids(9)
    if source == "file":
        path = tmp_path / "tasks.jsonl"
        path.write_text("".join(verifier_for(t)["task"] + "\n" for t in eval_tasks(4, n=4)))
        config = msgspec.structs.replace(config, tasks_file=str(path))
        ids = [fed_id(task_sequence(config, launch, read_tasks_file(path)), i) for i in range(10)]
        assert len(set(ids)) == 10 and {i.partition("~e")[2] for i in ids} == {"", "1", "2"}
    async with feeding(env, config, launch):
        async def full() -> bool:
            return [len(await stream_tasks(env, r)) for r in ("hub", "eu")] == [3, 3]
        await eventually(full)
    admin = await env.bus("hub", "admin")
    try:
        kv = await admin.js.key_value(admin.subjects.partials_bucket("hub"))
        saved = msgspec.json.decode((await kv.get(POSITION_KEY)).value or b"", type=Position)
        assert saved.cursors == {r: _cursor_after(9, feed_weights(config, launch, "hub"), r, 3) for r in ("hub", "eu")}
        await kv.put(POSITION_KEY, msgspec.json.encode(msgspec.structs.replace(saved, cursors={"hub": 0, "eu": 0})))
    finally:
        await admin.close()
    weights = feed_weights(config, launch, "hub")
    wanted = {r: [ids[i] for i in range(10) if assign_region(9, i, weights) == r] for r in ("hub", "eu")}
    taken: list[tuple[str, str]] = []
    async with feeding(env, config, launch) as feeder, anyio.create_task_group() as tg:
        for region in ("hub", "eu"):
            tg.start_soon(take, env, region, len(wanted[region]), taken)

        async def all_taken() -> bool:
            return len(taken) == 10
        await eventually(all_taken)
        await polls_later(feeder)                      # nothing more arrives
        assert [len(await stream_tasks(env, r)) for r in ("hub", "eu")] == [0, 0]
        assert feeder.counters["duplicates"] == 6 and feeder.counters["tasks"] == 4
        assert await saved_fed_ids(env, config, launch) == wanted
    assert Counter(taken) == Counter((r, t) for r, region_ids in wanted.items() for t in region_ids)
    assert sorted(t for _, t in taken) == sorted(ids[:10])


async def test_cut_off_region_waits_for_its_tasks(tmp_path: Path) -> None:
    """While eu is cut off the hub is fed as usual and eu's tasks wait (never rerouted); healed, eu gets
    exactly its own first tasks."""
    rs, run = _start(tmp_path, ["hub", "eu"], relay=True)
    try:
        env = await _provision(rs, run)
        config = FeederConfig(seed=2, backlog_per_region=3, poll_interval_s=0.2)
        launch = FeederLaunch(regions=["hub", "eu"])
        weights = feed_weights(config, launch, "hub")
        rs.cut("eu")
        async with feeding(env, config, launch) as feeder:
            async def hub_full() -> bool:
                return len(await stream_tasks(env, "hub")) == 3 and feeder.counters.get("region_unreachable", 0) > 0
            await eventually(hub_full)
            await anyio.to_thread.run_sync(rs.heal, "eu")

            async def eu_full() -> bool:
                return len(await stream_tasks(env, "eu")) == 3
            await eventually(eu_full)
            await polls_later(feeder)
            assert [t.task_id for t in await stream_tasks(env, "eu")] == expected_ids(2, weights, "eu", 3)
            assert [t.task_id for t in await stream_tasks(env, "hub")] == expected_ids(2, weights, "hub", 3)
    finally:
        rs.stop()


@pytest.mark.parametrize("epochs", [1, 2, 0])
async def test_task_file_is_fed_to_its_end(tmp_path: Path, epochs: int) -> None:
    """A JSONL file of 3 tasks reaches the only region in file order; with 2 epochs it is fed again in another
    order (seed 0's), each task under the id "ID~e1" with its prompt and verifier; then the feeder says it is done
    (the gauge `exhausted`). With endless epochs (0) it fills the backlog of 10 and is never done."""
    tasks = eval_tasks(4, n=3)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(verifier_for(t)["task"] + "\n" for t in tasks))
    rs, run = _start(tmp_path, ["hub"])
    n = 3 * epochs if epochs else 10
    try:
        env = await _provision(rs, run)
        config = FeederConfig(backlog_per_region=10, tasks_file=str(path), poll_interval_s=0.1, epochs=epochs)
        launch = FeederLaunch()
        async with feeding(env, config, launch) as feeder:
            async def fed() -> bool:
                return feeder.counters.get("tasks", 0) == n
            await eventually(fed)
            await polls_later(feeder)
            queued = await stream_tasks(env, "hub")
            assert feeder.counters["tasks"] == n and len(queued) == n
            assert feeder.gauges.get("exhausted") == (float(n) if epochs else None)
    finally:
        rs.stop()
    assert [task_from_verifier(t) for t in queued[:3]] == tasks
    assert len({t.task_id for t in queued}) == n
    by_id = {t.task_id: t for t in queued[:3]}
    order = []
    for index, message in enumerate(queued[3:], start=3):
        original, _, epoch = message.task_id.partition("~e")
        assert int(epoch) == index // 3 and message.prompt == by_id[original].prompt
        assert message.verifier == by_id[original].verifier
        order.append(original)
    if epochs != 1:
        assert sorted(order[:3]) == sorted(by_id) and order[:3] != list(by_id)      # epoch 1: shuffled


def test_sequence_skips_the_evaluators_held_out_prompts_and_the_launcher_names_them(tmp_path: Path) -> None:
    """With eval_seed the built-in sequence never yields a prompt of eval_tasks(eval_seed) (the plain sequence
    of the same seed does, for some seeds); the launcher passes the topology's evaluator seed."""
    from rlbus.model.tasks.builtin import EVAL_POOL, eval_tasks
    from rlbus.topology.backends.launch import feeder_launch
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.load import load

    held_out = {t.prompt_hash for t in eval_tasks(1, EVAL_POOL)}
    plain = TaskSequence(0)
    skipping = TaskSequence(0, eval_seed=1)
    plain_hits = sum(plain.get(i).prompt_hash in held_out for i in range(4000))
    assert plain_hits > 0                      # seed 0's stream does draw seed 1's held-out prompts
    assert not any(skipping.get(i).prompt_hash in held_out for i in range(4000))
    topology = tmp_path / "t.toml"
    topology.write_text(example_path("single").read_text().replace("[evaluator]", "[evaluator]\nseed = 7"))
    assert feeder_launch(load(topology)).eval_seed == 7


def test_a_listed_held_out_source_is_skipped_by_prompt_hash_and_named_in_the_saved_source(tmp_path: Path) -> None:
    """With the evaluator's tasks a file, a tasks file sharing two of its prompts feeds only the third task, and
    the ids the cursors account for agree; the saved source names the exclusion; the launcher passes it."""
    from rlbus.model.tasks.sources import HUMANEVAL
    from rlbus.topology.backends.launch import feeder_launch
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.load import load

    train = eval_tasks(5, n=3)
    feed_file, held_out_file = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    feed_file.write_text("".join(verifier_for(t)["task"] + "\n" for t in train))
    held_out_file.write_text("".join(verifier_for(t)["task"] + "\n" for t in (train[0], train[2])))
    config = FeederConfig(tasks_file=str(feed_file), epochs=1)
    launch = FeederLaunch(eval_tasks=str(held_out_file))
    sequence = task_sequence(config, launch, read_tasks_file(feed_file))
    assert sequence.end == 1 and sequence.get(0) == train[1]
    assert fed_task_ids(config, launch, {"hub": 5}, "hub") == {"hub": [train[1].task_id]}
    assert task_source(config, launch) == f"{feed_file}:excluding={held_out_file}"
    assert task_source(config, FeederLaunch()) == str(feed_file)
    built_in = task_sequence(FeederConfig(seed=0), FeederLaunch(eval_seed=1, eval_tasks=HUMANEVAL))
    assert [built_in.get(i) for i in range(20)] == [TaskSequence(0, eval_seed=1).get(i) for i in range(20)]
    topology = tmp_path / "t.toml"
    topology.write_text(example_path("single").read_text().replace("[evaluator]", '[evaluator]\ntasks = "humaneval"'))
    assert feeder_launch(load(topology)).eval_tasks == HUMANEVAL


def test_levels_keep_only_those_built_in_tasks_in_sequence_order() -> None:
    """levels = [1, 2]: the sequence is the plain one with level-3 tasks left out (same order, same ids),
    and the feeder's saved source names the levels, so a restart with other levels does not resume it."""
    whole = TaskSequence(0, eval_seed=1)
    plain = [whole.get(i) for i in range(60)]
    easy = TaskSequence(0, eval_seed=1, levels=[1, 2])
    expected = [t for t in plain if t.level in (1, 2)]
    assert len(expected) < len(plain)
    assert [easy.get(i) for i in range(len(expected))] == expected
    assert task_source(FeederConfig(seed=3)) == "builtin:3"
    assert task_source(FeederConfig(seed=3, levels=[2, 1])) == "builtin:3:levels=1,2"


def test_fed_task_ids_follow_each_cursor_and_the_task_file(tmp_path: Path) -> None:
    """A region is fed exactly the indices below its own cursor that are assigned to it (another region's
    higher cursor adds nothing); a tasks file is read from the config and cut at the end of its epochs."""
    config = FeederConfig(seed=3)
    launch = FeederLaunch(regions=["hub", "eu"])
    weights = feed_weights(config, launch, "hub")
    fed = fed_task_ids(config, launch, {"hub": 4, "eu": 8}, "hub")
    assert fed == {"hub": [sequence_ids(3)[i] for i in range(4) if assign_region(3, i, weights) == "hub"],
                   "eu": [sequence_ids(3)[i] for i in range(8) if assign_region(3, i, weights) == "eu"]}
    assert fed_task_ids(config, launch, {}, "hub") == {"hub": [], "eu": []}
    tasks = eval_tasks(4, n=3)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(verifier_for(t)["task"] + "\n" for t in tasks))
    from_file = FeederConfig(tasks_file=str(path), epochs=1)
    from_file_launch = FeederLaunch()
    assert fed_task_ids(from_file, from_file_launch, {"hub": 2}, "hub") == {"hub": [t.task_id for t in tasks[:2]]}
    assert fed_task_ids(from_file, from_file_launch, {"hub": 99}, "hub") == {"hub": [t.task_id for t in tasks]}
    endless = fed_task_ids(FeederConfig(tasks_file=str(path)), from_file_launch, {"hub": 5}, "hub")["hub"]
    assert endless[:3] == [t.task_id for t in tasks] and all(i.endswith("~e1") for i in endless[3:])


async def saved_fed_ids(env: Env, config: FeederConfig, launch: FeederLaunch) -> dict[str, list[str]]:
    """`fed_task_ids` of the position the feeder has saved at the hub now ({} when none is saved)."""
    admin = await env.bus("hub", "admin")
    try:
        position = await read_position(admin, "hub")
    finally:
        await admin.close()
    return {} if position is None else fed_task_ids(config, launch, position.cursors, "hub")


async def test_fed_task_ids_of_the_saved_cursors_are_the_tasks_published(two_regions: tuple[RegionSet, str]) -> None:
    """With a levels filter and a held-out seed, the ids derived from the feeder's saved cursors are, per region
    and in order, the tasks the feeder put on that region's TASKS: those a generator took, then those queued."""
    env = await _provision(*two_regions)
    config = FeederConfig(seed=5, backlog_per_region=3, poll_interval_s=0.1, levels=[1, 2])
    launch = FeederLaunch(regions=["hub", "eu"], eval_seed=1)
    taken: list[tuple[str, str]] = []
    async with feeding(env, config, launch) as feeder:
        async def full() -> bool:
            return [len(await stream_tasks(env, r)) for r in ("hub", "eu")] == [3, 3]
        await eventually(full)
        await take(env, "eu", 2, taken)

        async def saved() -> bool:
            return {r: len(ids) for r, ids in (await saved_fed_ids(env, config, launch)).items()} == {"hub": 3, "eu": 5}
        await eventually(saved)
        published = feeder.counters["tasks"]
    queued = {r: [t.task_id for t in await stream_tasks(env, r)] for r in ("hub", "eu")}
    assert published == 8
    assert await saved_fed_ids(env, config, launch) == {"hub": queued["hub"], "eu": [t for _, t in taken] + queued["eu"]}
    plain = TaskSequence(5, eval_seed=1)
    assert any(plain.get(i).level == 3 for i in range(12))    # ignoring `levels` would give other ids


def _rollout(task_id: str, region: str) -> Rollout:
    empty = TensorBlob.of([], "int32")
    return Rollout(rollout_id=f"{task_id}-0", task_id=task_id, group_index=0, group_size=1, prompt_tokens=empty,
                   completion_tokens=empty, behaviour_logprobs=TensorBlob.of([], "float32"),
                   policy_versions=empty, region=region, generator_id="test")


async def settle_one(env: Env, region: str, how: str) -> str:
    """As a generator of `region` does with its next task: publish a rollout then ack ("rollout"), or
    dead-letter it ("dead_letter"). Returns the task's id."""
    async with generator_deliveries(env, region) as (bus, deliveries):
        s = bus.subjects
        async for delivery in deliveries:
            task_id = delivery.message.task_id
            if how == "rollout":
                await bus.publish(s.rollouts(region), _rollout(task_id, region), msg_id=f"{task_id}-0")
                await delivery.ack_sync()
            else:
                assert await bus.dead_letter(delivery.raw, reason="test: unusable", source=s.tasks_stream(region))
            return task_id
    raise AssertionError("unreachable")


@pytest.mark.parametrize("source", ["builtin", "file"])
async def test_task_ledger_accounts_for_every_fed_task(two_regions: tuple[RegionSet, str], tmp_path: Path,
                                                       source: str) -> None:
    """8 tasks fed, 4 per region: one rolled out in each region, one dead-lettered in eu, one deleted from the
    hub's TASKS by hand, the rest still queued → the deleted one alone is lost; the others are accounted. From a
    file of 3 tasks fed without end, the 8 span 3 epochs."""
    env = await _provision(*two_regions)
    config = FeederConfig(seed=3, backlog_per_region=8, max_tasks=8, poll_interval_s=0.1)
    if source == "file":
        path = tmp_path / "tasks.jsonl"
        path.write_text("".join(verifier_for(t)["task"] + "\n" for t in eval_tasks(4, n=3)))
        config = msgspec.structs.replace(config, tasks_file=str(path))
    launch = FeederLaunch(regions=["hub", "eu"])
    assert [assign_region(3, i, feed_weights(config, launch, "hub")) for i in range(8)].count("eu") == 4
    async with feeding(env, config, launch):
        async def all_saved() -> bool:
            return sum(map(len, (await saved_fed_ids(env, config, launch)).values())) == 8
        await eventually(all_saved)
    rolled = [await settle_one(env, "eu", "rollout"), await settle_one(env, "hub", "rollout")]
    dead = await settle_one(env, "eu", "dead_letter")
    admin = await env.bus("hub", "admin")
    try:
        stream = admin.subjects.tasks_stream("hub")
        info = await admin.js.stream_info(stream)
        raw = await admin.js.get_msg(stream, seq=info.state.last_seq)
        deleted = codec.decode_as(raw.data or b"", raw.headers, TaskMessage).task_id
        await admin.js.delete_msg(stream, info.state.last_seq)
        book: TaskLedger | None = None

        async def rollouts_at_hub() -> bool:     # eu's rollout reaches the hub's ROLLOUTS by sourcing
            nonlocal book
            book = await read_task_ledger(admin, config, launch, feeder_region="hub")
            return book.rolled_out == 2
        await eventually(rollouts_at_hub)
        letter = await admin.js.get_msg(admin.subjects.dead_letter_stream(),
                                        subject=admin.subjects.dead_letter(admin.subjects.tasks_stream("eu")))
        assert (letter.headers or {}).get(ORIGINAL_MSG_ID_HEADER) == dead   # the id of an undecodable dead letter
    finally:
        await admin.close()
    assert book is not None
    assert book.lost == [deleted] and not book.clean
    assert (book.fed, book.rolled_out, book.dead_lettered, book.pending) == (8, 2, 1, 4)
    assert book.unfed == [] and deleted not in [*rolled, dead]
    if source == "file":
        fed = fed_task_ids(config, launch, {"hub": 8, "eu": 8}, "hub")
        assert {i.partition("~e")[2] for ids in fed.values() for i in ids} == {"", "1", "2"}


async def test_work_ahead_of_the_trainer_stays_under_the_bound(tmp_path: Path) -> None:
    """max_rollouts_ahead 10, groups of 2: 5 tasks are queued, no more; 3 settled by a generator (a rollout
    published, the task acked) leave the trainer 3 rollouts waiting, so one task more is fed (3 x 2 + 3 <= 10);
    once the trainer is handed the 3, two more are: 8 fed in all and 5 queued."""
    rs, run = _start(tmp_path, ["hub"])
    try:
        env = await _provision(rs, run)
        config = FeederConfig(seed=4, backlog_per_region=8, poll_interval_s=0.1, max_rollouts_ahead=10)
        launch = FeederLaunch(regions=["hub"], group_size=2, hub="hub")

        async def queued(n: int) -> bool:
            return len(await stream_tasks(env, "hub")) == n

        async with feeding(env, config, launch) as feeder:
            await eventually(functools.partial(queued, 5))
            await polls_later(feeder)                        # several more polls: still 5
            assert await queued(5) and feeder.counters["tasks"] == 5
            settled = [await settle_one(env, "hub", "rollout") for _ in range(3)]
            await eventually(functools.partial(queued, 3))
            await polls_later(feeder)
            assert await queued(3) and feeder.counters["tasks"] == 6
            assert feeder.gauges["rollouts_ahead"] == 9.0
            trainer = await env.bus("hub", "trainer")
            try:
                s = trainer.subjects
                handed: list[str] = []
                async with aclosing(trainer.consume(s.hub_rollouts_stream(), s.durable("trainer"), Rollout,
                                                    batch=3)) as deliveries:
                    async for delivery in deliveries:
                        handed.append(delivery.message.task_id)
                        await delivery.ack_sync()
                        if len(handed) == 3:
                            break
            finally:
                await trainer.close()
            assert handed == settled
            await eventually(functools.partial(queued, 5))
            await polls_later(feeder)
            assert await queued(5) and feeder.counters["tasks"] == 8
            assert feeder.gauges["rollouts_ahead"] == 10.0
        assert [t.task_id for t in await stream_tasks(env, "hub")] == expected_ids(4, [("hub", 1.0)], "hub", 8)[3:]
    finally:
        rs.stop()
