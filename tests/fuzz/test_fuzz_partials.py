"""Hostile values in the PARTIALS bucket, which a generator reads back when a task is redelivered.

Pure: 3,000 values drawn by hypothesis (fixed seed) from a valid partial — random bytes, truncations, byte
flips, lying zstd frames, and valid-looking partials with one absurd field — either are refused with a
PartialGroupError by `decode_partial` + `check_partial`, or (when the mutation left a consistent partial) can
be resumed and flattened without error. Live: a real generator finds a different hostile partial for each of
its tasks: each is discarded with an Event(incident), and every group is sampled afresh — rollouts start with
the task's own prompt, carry only the held version, and their logprobs are the model's — never a crash.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import nats.js.errors
import pytest
import torch
import zstandard
from helpers import hosted, new_run
from helpers.function_partials import base_context, new_group, record_attempt
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.errors import PartialGroupError
from rlbus.actors.common.feed import verifier_for
from rlbus.actors.common.ledger import read_all
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.group import (
    ZSTD_MAGIC,
    Attempt,
    PartialGroup,
    PartialLimits,
    check_partial,
    decode_partial,
    encode_partial,
)
from rlbus.actors.sandbox.supervisor import SandboxConfig, SandboxSupervisor
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Event, Rollout, SandboxVerdict, TensorBlob
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.streams import StreamSettings, provision_hub, provision_region
from rlbus.messages.subjects import BucketScope
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.builtin import Task, eval_tasks
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

torch.set_num_threads(1)
TOK = ByteTokenizer()
TASKS = eval_tasks(11, n=12)
HELD = 7
LIMITS = PartialLimits(group_size=2, max_attempts=2, max_tokens=8, max_seq_len=256, vocab_size=512,
                       held_version=HELD)


def _valid(task: Task) -> PartialGroup:
    """A group of 2 with one graded attempt each and a half-sampled second draft (versions 5 and 6)."""
    state = new_group(task, task.task_id, 2, TOK, now=0.0)
    first = [*TOK.encode("return 1"), TOK.end_turn_id]
    for ep in state.episodes:
        ep.draft_ids, ep.draft_logprobs, ep.draft_versions = list(first), [-0.5] * len(first), [5] * len(first)
        record_attempt(ep, task, Attempt(status="failed", n_passed=0, n_tests=len(task.tests), feedback="no",
                                         verdict=SandboxVerdict(passed=0, total=len(task.tests), status="failed")),
                       TOK, 2)
        ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [1, 2, 3], [-1.0, -2.0, -0.1], [6, 6, 6]
    state.rounds, state.chunks = 1, 3
    return state


def _absurd(task: Task) -> list[tuple[str, Callable[[PartialGroup], None]]]:
    """One bad field each: (what, mutate in place). Every one of them must be refused."""
    other = TOK.encode(TASKS[-1].prompt)

    def ep0(f: Callable[..., None]) -> Callable[[PartialGroup], None]:
        return lambda s: f(s.episodes[0])

    return [
        ("other task", lambda s: setattr(s, "task_id", "someone-else")),
        ("format", lambda s: setattr(s, "format", 99)),
        ("group size", lambda s: setattr(s, "group_size", 3)),
        ("missing episode", lambda s: s.episodes.pop()),
        ("extra episode", lambda s: s.episodes.append(s.episodes[0])),
        ("negative counter", lambda s: setattr(s, "chunks", -1)),
        ("nan timing", lambda s: setattr(s, "generate_s", math.nan)),
        ("swapped prompt", ep0(lambda e: setattr(e.turns[0], "ids", other))),
        ("no turns", ep0(lambda e: setattr(e, "turns", []))),
        ("second user turn", ep0(lambda e: setattr(e.turns[2], "role", "user"))),
        ("token past vocab", ep0(lambda e: e.turns[1].ids.__setitem__(0, 10**6))),
        ("negative token", ep0(lambda e: e.draft_ids.__setitem__(0, -5))),
        ("short logprobs", ep0(lambda e: e.turns[1].logprobs.pop())),
        ("nan logprob", ep0(lambda e: e.draft_logprobs.__setitem__(1, math.nan))),
        ("positive logprob", ep0(lambda e: e.turns[1].logprobs.__setitem__(0, 3.0))),
        ("future version", ep0(lambda e: e.draft_versions.__setitem__(0, HELD + 1))),
        ("negative version", ep0(lambda e: e.turns[1].versions.__setitem__(0, -1))),
        ("logprobs on feedback", ep0(lambda e: setattr(e.turns[2], "logprobs", [-1.0] * len(e.turns[2].ids)))),
        ("overlong draft", ep0(lambda e: (setattr(e, "draft_ids", [5] * 9), setattr(e, "draft_logprobs", [-1.0] * 9),
                                          setattr(e, "draft_versions", [6] * 9)))),
        ("past max_seq_len", ep0(lambda e: (setattr(e.turns[2], "ids", [7] * 300)))),
        ("too many attempts", ep0(lambda e: e.attempts.extend([e.attempts[0]] * 2))),
        ("attempt without answer", ep0(lambda e: e.attempts.append(e.attempts[0]))),
        ("fake pass", ep0(lambda e: setattr(e.attempts[0], "status", "passed"))),
        ("unknown status", ep0(lambda e: setattr(e.attempts[0], "status", "owned"))),
        ("tests miscounted", ep0(lambda e: setattr(e.attempts[0], "n_tests", 1000))),
        ("end reason", ep0(lambda e: setattr(e, "ended", "because"))),
        ("routing on dense", ep0(lambda e: setattr(e, "routing", TensorBlob.of([[[0, 1]]], "int64")))),
        ("routing garbage", ep0(lambda e: setattr(e, "routing", TensorBlob(dtype="int64", shape=(5, 1, 2),
                                                                              data=b"\x01" * 3)))),
        ("routing dtype", ep0(lambda e: setattr(e, "routing", TensorBlob(dtype="nope", shape=(1,), data=b"")))),
    ]


def _bad_bytes(task: Task, category: int, rng: random.Random) -> bytes:
    """Raw hostile bytes of one category (the structural ones are `_absurd`)."""
    good = encode_partial(_valid(task))
    match category:
        case 0:
            return rng.randbytes(rng.randrange(0, 400))
        case 1:
            return good[: rng.randrange(0, len(good))]
        case 2:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return bytes(data)
        case 3:
            return ZSTD_MAGIC + rng.randbytes(rng.randrange(0, 64))
        case 4:      # a frame that claims (and inflates to) 80 MiB of zeros: a bomb, refused at the cap
            return ZSTD_MAGIC + zstandard.ZstdCompressor(level=1).compress(b"\0" * (80 << 20))
        case _:
            return ZSTD_MAGIC + zstandard.ZstdCompressor().compress(rng.randbytes(200))


def _check(data: bytes, task: Task) -> PartialGroup:
    state = decode_partial(data)
    check_partial(state, task, task.task_id, TOK, LIMITS)
    return state


def test_every_absurd_partial_is_refused() -> None:
    """Each single absurd field (other task, swapped prompt, out-of-vocab ids, NaN or positive logprobs, future
    versions, fake passes, overlong episodes, bad routing, ...) is refused with a PartialGroupError (what the
    generator catches to discard a partial); the valid one passes."""
    task = TASKS[0]
    assert _check(encode_partial(_valid(task)), task).rounds == 1
    for what, mutate in _absurd(task):
        state = _valid(task)
        mutate(state)
        try:
            _check(encode_partial(state), task)
        except PartialGroupError:
            continue
        pytest.fail(f"a partial with {what} was accepted")
    with pytest.raises(PartialGroupError, match="inflates past"):
        _check(_bad_bytes(task, 4, random.Random(0)), task)


@settings(max_examples=3000, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, 5), st.integers(0, 2**32 - 1))
def test_hostile_bytes_are_refused_or_resumable(category: int, seed: int) -> None:
    """3,000 hostile byte strings: only PartialGroupError, and whatever passes the check is a consistent partial
    that a generator can continue (its contexts build, within max_seq_len)."""
    task = TASKS[seed % 4]
    if category == 4 and seed % 50:
        category = 0      # the bomb is slow to build: a few of them are enough
    try:
        state = _check(_bad_bytes(task, category, random.Random(seed)), task)
    except PartialGroupError:
        return
    for ep in state.episodes:
        assert len(base_context(ep, task, TOK, LIMITS.max_attempts)) + len(ep.draft_ids) <= LIMITS.max_seq_len


# ---- live: a real generator over a real server ----------------------------------------------------------
RUN = new_run()
CONFIG = GeneratorConfig(group_size=2, temperature=1.0, max_tokens=8, partial_every_tokens=8, max_attempts=1,
                         sandbox_timeout_s=10.0)
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256,
                        max_processes=8, max_file_mb=1, max_open_files=32, max_output_kb=16)
FAST = ActorLimits(heartbeat_interval_s=0.5, drain_timeout_s=3.0)


@dataclass
class Env:
    server: EmbeddedServer
    admin: Bus

    async def bus(self, role: str) -> Bus:
        cred = self.server.credential(role)
        return await Bus.connect(self.server.url, run=RUN, options=ConnectOptions(user=cred.user,
                                                                                  password=cred.password))


@asynccontextmanager
async def _env(tmp_path: Path) -> AsyncIterator[Env]:
    server = EmbeddedServer.start(tmp_path / "js", ServerOptions(name="partials",
                                                               scope=BucketScope(runs=(RUN,), regions=("hub",))))
    try:
        cred = server.credential("admin")
        admin = await Bus.connect(server.url, run=RUN, options=ConnectOptions(user=cred.user, password=cred.password))
        try:
            await provision_region(admin.nc, admin.subjects, "hub", domain=None, settings=StreamSettings.tiny())
            await provision_hub(admin.nc, admin.subjects, "hub", {"hub": None}, StreamSettings.tiny())
            yield Env(server, admin)
        finally:
            await admin.close()
    finally:
        server.stop()


@asynccontextmanager
async def _serving(env: Env, role: str, make: Callable[[Bus], Actor]) -> AsyncIterator[Actor]:
    bus = await env.bus(role)
    async with hosted(make(bus), close=[bus]) as actor:
        yield actor


def _teacher_forced(model: Transformer, rollout: Rollout) -> torch.Tensor:
    ids = torch.tensor([*rollout.prompt_tokens.tolist(), *rollout.completion_tokens.tolist()])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, with_mtp=False).logits[0].float(), dim=-1)
    P = len(rollout.prompt_tokens)
    return logp[P - 1:-1].gather(-1, ids[0, P:, None])[:, 0]


@pytest.mark.anyio
async def test_generator_discards_hostile_partials_and_starts_over(tmp_path: Path) -> None:
    """12 tasks, each with a different hostile partial saved: 12 discards (counter and Event), 24 rollouts
    sampled afresh (own prompt, held version only, the model's logprobs), partials deleted, generator alive."""
    rng = random.Random(8)
    absurd = _absurd(TASKS[0])
    hostile: dict[str, bytes] = {}
    for i, task in enumerate(TASKS):
        if i < 6:    # the byte categories that are bad by construction (a flipped bit may leave a valid one)
            hostile[task.task_id] = (_bad_bytes(task, {2: 5, 4: 3}.get(i, i), rng) if i != 5
                                     else msgspec.msgpack.encode({"task_id": task.task_id, "episodes": [[1]]}))
        else:
            state = _valid(task)
            absurd[(i * 5) % len(absurd)][1](state)
            hostile[task.task_id] = encode_partial(state)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(max_seq_len=1024)).eval()
    async with _env(tmp_path) as env:
        s = env.admin.subjects
        kv = await env.admin.js.key_value(s.partials_bucket("hub"))
        for task in TASKS:
            await kv.put(partial_key(task.task_id), hostile[task.task_id])
            await env.admin.publish(s.tasks("hub"), TaskMessage(
                task_id=task.task_id, prompt=task.prompt, verifier=verifier_for(task), group_size=2, region="hub",
                seed=1), msg_id=task.task_id)
        make_gen = lambda bus: Generator(ActorId(RUN, "hub", "generator", "g1"), bus, CONFIG, FAST,  # noqa: E731
                                         weights=LocalWeights(model, version=HELD))
        make_sandbox = lambda bus: SandboxSupervisor(ActorId(RUN, "hub", "sandbox", "sb"), bus,  # noqa: E731
                                                     SANDBOX, FAST)
        async with _serving(env, "sandbox", make_sandbox), _serving(env, "generator", make_gen) as actor:
            with anyio.fail_after(240):                 # hang guard only
                while actor.counters.get("tasks", 0) < len(TASKS):  # type: ignore[attr-defined]
                    await anyio.sleep(0.1)
            counters = dict(actor.counters)  # type: ignore[attr-defined]
            assert actor.state.value in ("ready", "busy")  # type: ignore[attr-defined]
        assert counters["partials_discarded"] == len(TASKS) and counters["resumed"] == 0
        rollouts = await read_all(env.admin.js, s.rollouts_stream("hub"), s.rollouts("hub"), Rollout)
        events = await read_all(env.admin.js, s.events_stream(), s.all_events(), Event)
        for task in TASKS:
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await kv.get(partial_key(task.task_id))
    discards = [e for e in events if e.event == "incident" and e.data.get("what") == "partial_discarded"]
    assert sorted(e.data["task_id"] for e in discards) == sorted(t.task_id for t in TASKS)
    by_task = {t.task_id: t for t in TASKS}
    assert sorted(r.rollout_id for r in rollouts) == sorted(f"{t.task_id}-{g}" for t in TASKS for g in range(2))
    for r in rollouts:
        assert r.prompt_tokens.tolist() == TOK.prompt_ids(by_task[r.task_id].prompt)
        assert set(r.policy_versions.tolist()) == {HELD}
        mask = torch.tensor(r.loss_mask.tolist(), dtype=torch.bool)
        torch.testing.assert_close(_teacher_forced(model, r)[mask],  # atol: float32 rounding of a batched, cached forward
                                   torch.tensor(r.behaviour_logprobs.tolist())[mask], atol=1e-4, rtol=0)
    assert msgspec.json.encode(counters)      # the counters are plain numbers (heartbeat-able)
