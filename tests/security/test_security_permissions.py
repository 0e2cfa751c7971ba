"""Every role's connection, tried as an attacker would, on a hub and a leaf started for a run: it is refused
every subject outside its rights — other roles' data subjects, other roles' buckets (plainly and through
another domain's JetStream API), stream and consumer management, other roles' durable consumers — and what
it tried had no effect. The expected rights are this file's own table, not the code under test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest
from helpers import new_run
from nats.aio.client import Client as NATS

from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.messages.subjects import Subjects
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
HUB, LEAF = "hub", "eu"
ROLES = ("feeder", "generator", "trainer", "trainer_rank", "publisher", "weights_relay", "checkpointer", "sandbox",
         "evaluator", "observer")


def attacks(s: Subjects) -> dict[str, str]:
    """Name → subject of every publish an attacker might try (run `s`, hub `hub`, leaf `eu`)."""
    ckpt, latest_eu, latest_hub = s.checkpoint_bucket(), s.latest_bucket(LEAF), s.latest_bucket(HUB)
    weights_eu, partials_hub = s.weights_bucket(LEAF), s.partials_bucket(HUB)
    api, api_hub, api_eu = "$JS.API", Subjects.js_api(HUB), Subjects.js_api(LEAF)
    return {
        # data subjects
        "tasks": s.tasks(LEAF), "rollouts": s.rollouts(LEAF), "trainlog": s.trainlog(), "weights": s.weights(),
        "checkpoints": s.checkpoints(), "state.upload": s.state_uploads(), "state.version": s.version_ready(),
        "evals": s.evals(), "sandbox": s.sandbox(HUB),
        # buckets, plainly and through another domain's API (the old `$JS.*.API.>` hole)
        "kv.partials": f"$KV.{partials_hub}.k", "kv.latest": f"$KV.{latest_eu}.latest",
        "obj.weights": f"$O.{weights_eu}.C.x", "obj.ckpt": f"$O.{ckpt}.C.x",
        "obj.workspaces": f"$O.{s.workspaces_bucket(LEAF)}.C.x",
        "xd.kv.partials": Subjects.kv_key(partials_hub, "k", domain=HUB),
        "xd.kv.latest": Subjects.kv_key(latest_eu, "latest", domain=LEAF),
        "xd.kv.latest.hub": Subjects.kv_key(latest_hub, "latest", domain=HUB),
        "xd.obj.weights": f"{api_eu}.$O.{weights_eu}.C.x", "xd.obj.ckpt": f"{api_hub}.$O.{ckpt}.C.x",
        # stream management: nobody but admin
        "stream.delete": f"{api}.STREAM.DELETE.{s.trainlog_stream()}",
        "xd.stream.delete": f"{api_hub}.STREAM.DELETE.{s.hub_rollouts_stream()}",
        "xd.stream.delete.leaf": f"{api_eu}.STREAM.DELETE.{s.tasks_stream(LEAF)}",
        "stream.purge": f"{api}.STREAM.PURGE.{s.hub_rollouts_stream()}",
        "xd.stream.purge": f"{api_eu}.STREAM.PURGE.{s.rollouts_stream(LEAF)}",
        "stream.update": f"{api}.STREAM.UPDATE.{s.trainlog_stream()}",
        "stream.create": f"{api}.STREAM.CREATE.EVIL",
        "msg.delete": f"{api}.STREAM.MSG.DELETE.{s.trainlog_stream()}",
        "snapshot": f"{api}.STREAM.SNAPSHOT.{s.checkpoints_stream()}",
        "account.purge": f"{api}.ACCOUNT.PURGE.$G",
        "server.remove": f"{api}.SERVER.REMOVE",
        # bucket streams: purged by their writers only (an object store purges old chunks)
        "purge.ckpt": f"{api}.STREAM.PURGE.OBJ_{ckpt}",
        "xd.purge.weights": f"{api_eu}.STREAM.PURGE.OBJ_{weights_eu}",
        "xd.purge.latest": f"{api_eu}.STREAM.PURGE.KV_{latest_eu}",
        # durable consumers: only their owner pulls, acks or (re)creates; nobody deletes one
        "next.trainer": f"{api}.CONSUMER.MSG.NEXT.{s.hub_rollouts_stream()}.trainer",
        "xd.next.generator": f"{api_eu}.CONSUMER.MSG.NEXT.{s.tasks_stream(LEAF)}.generator_{LEAF}",
        "next.publisher": f"{api}.CONSUMER.MSG.NEXT.{s.state_stream()}.publisher",
        "create.trainer": f"{api}.CONSUMER.CREATE.{s.hub_rollouts_stream()}.trainer",
        "create.checkpointer": f"{api}.CONSUMER.CREATE.{s.state_stream()}.checkpointer.{s.state_uploads()}",
        "durable.create.publisher": f"{api}.CONSUMER.DURABLE.CREATE.{s.state_stream()}.publisher",
        "ack.trainer": f"$JS.ACK.{s.hub_rollouts_stream()}.trainer.1.1.1.1.0",
        "xd.ack.generator": f"$JS.ACK.{s.tasks_stream(LEAF)}.generator_{LEAF}.1.1.1.1.0",
        "delete.trainer": f"{api}.CONSUMER.DELETE.{s.hub_rollouts_stream()}.trainer",
        "xd.delete.generator": f"{api_eu}.CONSUMER.DELETE.{s.tasks_stream(LEAF)}.generator_{LEAF}",
        # what everyone may do: read through the API, own ephemeral consumers, heartbeats, events
        "read.info": f"{api}.STREAM.INFO.{s.trainlog_stream()}",
        "read.ephemeral": f"{api}.CONSUMER.MSG.NEXT.{s.trainlog_stream()}.reader42",
        "health": s.health(HUB, "x", "x1"), "events": s.events(HUB, "x"),
    }


EVERYONE = {"read.info", "read.ephemeral", "health", "events"}
RIGHTS: dict[str, set[str]] = {
    "feeder": {"tasks", "kv.partials", "xd.kv.partials"},
    "generator": {"rollouts", "sandbox", "kv.partials", "xd.kv.partials", "xd.next.generator", "xd.ack.generator",
                  "obj.workspaces"},
    "trainer": {"trainlog", "state.upload", "state.version", "obj.ckpt", "xd.obj.ckpt", "purge.ckpt",
                "next.trainer", "create.trainer", "ack.trainer"},
    "trainer_rank": {"obj.ckpt", "xd.obj.ckpt", "purge.ckpt"},     # its checkpoint shards, nothing else
    "publisher": {"weights", "kv.latest", "obj.weights", "xd.kv.latest", "xd.kv.latest.hub", "xd.obj.weights",
                  "xd.purge.weights", "xd.purge.latest", "next.publisher", "durable.create.publisher"},
    # a leaf's weights relay: weight objects and LATEST (its region's, reached plainly or through a domain's API),
    # no announcement and not the publisher's durable
    "weights_relay": {"kv.latest", "obj.weights", "xd.kv.latest", "xd.kv.latest.hub", "xd.obj.weights",
                      "xd.purge.weights", "xd.purge.latest"},
    "checkpointer": {"checkpoints", "obj.ckpt", "xd.obj.ckpt", "purge.ckpt", "create.checkpointer"},
    "sandbox": set(),
    "evaluator": {"evals", "sandbox"},
    "observer": set(),
}
"""What each role may publish of `attacks()`, besides EVERYONE's."""


@pytest.fixture(scope="module")
def run() -> str:
    return new_run()


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory, run: str) -> Iterator[RegionSet]:
    """A hub and a leaf, their users granted the buckets of `run`."""
    rs = RegionSet.start(tmp_path_factory.mktemp("sec") / "regions", [HUB, LEAF], HUB, run=run)
    try:
        yield rs
    finally:
        rs.stop()


async def _connect(rs: RegionSet, region: str, role: str, errors: list[str]) -> NATS:
    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    return await nats.connect(**rs.connect_options(region, role), error_cb=on_error, allow_reconnect=False)


def test_the_table_covers_the_permission_rules() -> None:
    """A generator may publish none of weights, checkpoints, tasks, TRAINLOG; weights come from the trainer
    side only (objects and LATEST also from a leaf's weights relay, announcements from the publisher alone);
    destructive stream management belongs to no role (the table under test says so)."""
    generator = RIGHTS["generator"]
    assert not generator & {"weights", "checkpoints", "tasks", "trainlog", "kv.latest", "xd.kv.latest",
                            "obj.weights", "xd.obj.weights", "state.version"}
    assert {r for r, rights in RIGHTS.items() if rights & {"weights", "obj.weights", "kv.latest"}} == {
        "publisher", "weights_relay"}
    assert {r for r, rights in RIGHTS.items() if "weights" in rights} == {"publisher"}   # announcements
    destructive = {"stream.delete", "xd.stream.delete", "xd.stream.delete.leaf", "stream.purge", "xd.stream.purge",
                   "stream.update", "stream.create", "msg.delete", "snapshot", "account.purge", "server.remove",
                   "delete.trainer", "xd.delete.generator"}
    assert not any(rights & destructive for rights in RIGHTS.values())


@pytest.mark.parametrize("region", [HUB, LEAF])
@pytest.mark.parametrize("role", ROLES)
async def test_role_is_refused_everything_outside_its_rights(regions: RegionSet, run: str, role: str,
                                                             region: str) -> None:
    """Each forbidden publish is a permissions violation (and nothing else is); the streams and buckets it
    aimed at are untouched. A last publish no role may make is refused after every earlier one (one connection,
    in order): once its refusal is in, every refusal there will be is."""
    s = Subjects(run)
    admin = await _connect(regions, HUB, "admin", [])
    try:
        await provision_run(admin, s, hub=HUB, domains=regions.domains, settings=StreamSettings.tiny())
        latest = {domain: await _messages(admin, f"KV_{s.latest_bucket(domain)}", domain) for domain in (HUB, LEAF)}
        errors: list[str] = []
        conn = await _connect(regions, region, role, errors)
        targets = attacks(s)
        forbidden = {name for name in targets if name not in RIGHTS[role] | EVERYONE}
        last = f"rlbus-no-role.{new_run()}"
        try:
            for subject in targets.values():
                await conn.publish(subject, b"{}")
            await conn.publish(last, b"{}")
            await conn.flush()
            with anyio.fail_after(20):
                while not any(last.lower() in e.lower() for e in errors):
                    await anyio.sleep(0.02)
            assert conn.is_connected
        finally:
            await conn.close()
        errors = [e for e in errors if last.lower() not in e.lower()]
        refused = {e.split('"')[1] for e in errors if "permissions violation for publish" in e}
        assert all({targets[n].lower(), _as_checked(targets[n], region).lower()} & refused for n in forbidden)
        assert len(errors) == len(forbidden)
        js = admin.jetstream()
        for stream in (s.trainlog_stream(), s.hub_rollouts_stream(), s.state_stream()):
            info = await js.stream_info(stream)              # still there
            assert info.config.name == stream
        assert (await js.consumer_info(s.hub_rollouts_stream(), "trainer")).config.durable_name == "trainer"
        eu = admin.jetstream(domain=LEAF)
        assert (await eu.consumer_info(s.tasks_stream(LEAF), f"generator_{LEAF}")).config.durable_name
        if "kv.latest" not in RIGHTS[role]:                # no new LATEST entry in any region
            assert latest == {d: await _messages(admin, f"KV_{s.latest_bucket(d)}", d) for d in (HUB, LEAF)}
    finally:
        await admin.close()


def _as_checked(subject: str, region: str) -> str:
    """The subject a server may check (and report) instead: its own domain's API prefix mapped to the local
    one, and a KV write through it to the bucket's own subject."""
    local = f"{Subjects.js_api(region)}."
    if subject.startswith(local):
        subject = "$JS.API." + subject.removeprefix(local)
        if subject.startswith("$JS.API.$KV."):
            subject = subject.removeprefix("$JS.API.")
    return subject


async def _messages(nc: NATS, stream: str, domain: str) -> int:
    return int((await nc.jetstream(domain=domain).stream_info(stream)).state.messages)


async def test_only_sandboxes_may_listen_for_sandbox_requests(regions: RegionSet, run: str) -> None:
    """A generator subscribing to sandbox requests (to answer them with forged verdicts) is refused."""
    s = Subjects(run)
    errors: list[str] = []
    conn = await _connect(regions, HUB, "generator", errors)
    try:
        await conn.subscribe(s.sandbox(HUB), queue=s.durable("sandbox", HUB))
        await conn.flush()
        with anyio.fail_after(10):
            while not errors:
                await anyio.sleep(0.02)
        assert errors == [(f'nats: permissions violation for subscription to "{s.sandbox(HUB).lower()}" '
                           f'using queue "{s.durable("sandbox", HUB)}"')]
    finally:
        await conn.close()


@pytest.mark.parametrize("who", ["wrong password", "another role's password", "no password"])
async def test_bad_credentials_are_refused(regions: RegionSet, who: str) -> None:
    """A wrong password, a role's name with another role's password, and no password are refused."""
    good = regions.credentials("generator")
    user, password = {"wrong password": (good.user, good.password[:-1] + ("y" if good.password.endswith("x") else "x")),
                      "another role's password": (good.user, regions.credentials("publisher").password),
                      "no password": (good.user, None)}[who]
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(regions.url(HUB), user=user, password=password, allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=5, error_cb=_ignore)


async def _ignore(err: Exception) -> None:
    """error_cb: the refusal is asserted through the raised error."""


def test_credentials_file_is_private(regions: RegionSet) -> None:
    """credentials.json and every server's config (which hold the passwords) are readable by the owner only."""
    files = [regions.base_dir / "credentials.json", *(server.config_path for server in regions.servers.values())]
    assert all((path.stat().st_mode & 0o777) == 0o600 for path in files), [oct(p.stat().st_mode) for p in files]
    assert isinstance(regions.base_dir, Path)
