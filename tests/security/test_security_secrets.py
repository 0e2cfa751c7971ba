"""Secrets never leak: a real two-region `rlbus up` run (2 optimizer steps) is searched for every password
of its credentials.json — its output, every file of its state directory (actor logs, server logs, the
JetStream stores that hold EVENTS and HEALTH, checkpoints, plots), the decoded EVENTS and HEALTH streams
read during the run, and `rlbus health --once --json`. Only credentials.json and the servers' own configs
(both mode 0600) may hold them. Also: `rlbus validate` refuses a password inline in a URL without echoing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import anyio
import msgspec
import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from rlbus.actors.common.ledger import read_all
from rlbus.messages.schemas import Event, Heartbeat, TrainStep
from rlbus.messages.subjects import Subjects, connection_inbox
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import validate
from rlbus.topology.network.regions import CREDENTIALS_NAME
from rlbus.topology.network.servers import CONFIG_NAME

pytestmark = pytest.mark.anyio
LEAF = '''
[[regions]]
name = "eu"
role = "leaf"

  [[regions.actors]]
  kind = "generator"

  [[regions.actors]]
  kind = "sandbox"

[feeder]'''


def _topology(tmp_path: Path) -> Path:
    """tiny.toml with its generator and sandbox moved to a leaf region `eu`, a one-step pretraining, short
    completions and batches of one group (2 steps take seconds)."""
    text = example_path("tiny").read_text()
    moved = '  [[regions.actors]]\n  kind = "generator"\n\n  [[regions.actors]]\n  kind = "sandbox"\n\n'
    assert moved in text
    text = text.replace(moved, "", 1).replace("[feeder]", LEAF.lstrip("\n"), 1)
    text = text.replace("steps = 30", "steps = 1").replace("eval_n = 8", "eval_n = 1")
    text = text.replace("max_tokens = 32", "max_tokens = 8").replace("batch_rollouts = 4", "batch_rollouts = 2")
    path = tmp_path / "tiny_two_regions.toml"
    path.write_text(text)
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlbus.ops.cli", *args]


def _start(cmd: list[str], out: IO[str], err: IO[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "RLBUS_TORCH_THREADS": "1"})


def _leaks(data: bytes, secrets: dict[str, str]) -> list[str]:
    return [role for role, secret in secrets.items() if secret.encode() in data]


async def _streams_during_run(state: Path, secrets: dict[str, str]) -> tuple[int, int, dict[str, list[str]]]:
    """Wait for the first TrainStep, then decode EVENTS and HEALTH as an observer and search them.
    -> (events, heartbeats, {stream: roles whose password appears})."""
    doc = json.loads((state / "run.json").read_text())
    cred = json.loads((state / "nats" / CREDENTIALS_NAME).read_text())["observer"]
    nc = await nats.connect(doc["urls"][doc["hub"]], user=cred["user"], password=cred["password"],
                            inbox_prefix=connection_inbox("observer"))
    try:
        js = nc.jetstream(domain=doc["domains"][doc["hub"]])
        s = Subjects(doc["run"])
        with anyio.fail_after(300):
            while not await _trained(js, s):
                await anyio.sleep(0.5)
        events = await read_all(js, s.events_stream(), s.all_events(), Event)
        beats = await read_all(js, s.health_stream(), s.all_health(), Heartbeat)
    finally:
        await nc.close()
    found = {"EVENTS": _leaks(msgspec.json.encode(events), secrets),
             "HEALTH": _leaks(msgspec.json.encode(beats), secrets)}
    return len(events), len(beats), found


async def _trained(js: JetStreamContext, s: Subjects) -> bool:
    try:
        return bool(await read_all(js, s.trainlog_stream(), s.trainlog(), TrainStep))
    except nats.js.errors.NotFoundError:               # run.json is written before the streams exist
        return False


async def test_no_password_in_logs_events_health_or_state(tmp_path: Path) -> None:
    """No role's password in up's output, any state file but the two credential files, EVENTS, HEALTH, or
    `rlbus health --once --json`; the files that must hold them are 0600."""
    state = tmp_path / "state"
    out, err = (tmp_path / "up.out").open("w"), (tmp_path / "up.err").open("w")
    proc = _start(_cli("up", str(_topology(tmp_path)), "--state-dir", str(state), "--steps", "2"), out, err)
    try:
        with anyio.fail_after(300):                      # hang guard only
            while not (state / "run.json").exists():
                assert proc.poll() is None, (tmp_path / "up.err").read_text()[-3000:]
                await anyio.sleep(0.2)
        secrets = {role: c["password"] for role, c in
                   json.loads((state / "nats" / CREDENTIALS_NAME).read_text()).items()}
        n_events, n_beats, in_streams = await _streams_during_run(state, secrets)
        health = await anyio.to_thread.run_sync(lambda: subprocess.run(
            _cli("health", "--state-dir", str(state), "--once", "--json"), capture_output=True, timeout=120, check=False))
        code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=600))
        # The two steps may be done by the time health asks: a run that is stopping answers neither as a live
        # run nor as a stopped one (its exit status and message then say so). Ask the stopped run again.
        stopped = await anyio.to_thread.run_sync(lambda: subprocess.run(
            _cli("health", "--state-dir", str(state), "--once", "--json"), capture_output=True, timeout=120, check=False))
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        out.close()
        err.close()
    assert code == 0, (tmp_path / "up.err").read_text()[-3000:]
    assert n_events > 0 and n_beats > 0 and in_streams == {"EVENTS": [], "HEALTH": []}
    answered = [h for h in (health, stopped) if h.stdout.strip()]
    assert answered and all(json.loads(h.stdout)["actors"] for h in answered), (health.stderr, stopped.stderr)
    assert not _leaks(health.stdout + health.stderr + stopped.stdout + stopped.stderr, secrets)
    allowed = {state / "nats" / CREDENTIALS_NAME, *(state / "nats" / r / CONFIG_NAME for r in ("hub", "eu"))}
    assert all(path.exists() and (path.stat().st_mode & 0o777) == 0o600 for path in allowed)
    searched, leaked = 0, {}
    for path in [p for p in state.rglob("*") if p.is_file()] + [tmp_path / "up.out", tmp_path / "up.err"]:
        if path in allowed:
            continue
        searched += 1
        if roles := _leaks(path.read_bytes(), secrets):
            leaked[str(path)] = roles
    assert leaked == {}
    assert searched > 10 and list((state / "logs").glob("*.log")) and list((state / "nats").rglob("*.blk"))


@pytest.mark.parametrize("url", ["nats://admin:s3cr3t-pw@10.0.0.1:4222", "tls://s3cr3t-pw@10.0.0.1:4222",
                                 "nats://generator:s3cr3t-pw@hub.example:4222"])
def test_validate_refuses_an_inline_password_without_echoing_it(tmp_path: Path, url: str) -> None:
    """A `nats_urls` entry with credentials in it is an error naming the key, and the text holds no secret;
    credentials by reference (credentials_file) validate."""
    text = ('run = "r"\n[[regions]]\nname = "hub"\nrole = "hub"\nnats_urls = ["nats://10.0.0.1:4222", "URL"]\n'
            + "".join(f'  [[regions.actors]]\n  kind = "{k}"\n'
                      for k in ("feeder", "generator", "sandbox", "trainer", "publisher", "checkpointer")))
    path = tmp_path / "inline.toml"
    path.write_text(text.replace("URL", url))
    _, problems = validate(path, local_cores=64)
    errors = [p for p in problems if p.severity == "error"]
    assert [p.key for p in errors] == ["regions[0].nats_urls[1]"]
    assert "credentials inline" in errors[0].message and "s3cr3t" not in str(errors[0])
    shown = subprocess.run(_cli("validate", str(path)), capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode != 0 and "s3cr3t" not in shown.stdout + shown.stderr
    (tmp_path / "creds.json").write_text("{}")
    by_reference = text.replace(', "URL"', "").replace('role = "hub"\n', 'role = "hub"\ncredentials_file = "creds.json"\n')
    path.write_text(by_reference)
    _, problems = validate(path, local_cores=64)
    assert [p for p in problems if p.severity == "error"] == []
