"""`[tls] enabled = true` end to end: a real two-region launch (local backend) whose embedded servers require
TLS on client ports and the leaf link, whose actor processes all connect over TLS trusting the generated CA,
whose rollouts cross the leaf link into the hub's stream and are consumed there; ops commands find the CA in
run.json; a plaintext client is refused.
Also the `[tls]` validation rules."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import pytest
from helpers import new_run

from rlbus.ops.target import add_target_options, resolve
from rlbus.topology.backends.launch import Launch, actor_specs
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load, validate_text
from rlbus.topology.file.schema import RestartSettings, TlsSettings, Topology

HUB, LEAF = "hub", "eu"


def _two_regions(tmp_path: Path) -> Topology:
    """The bus demo cut to two regions: a rollout producer in `eu`, the hub's consumer, TLS on."""
    demo = load(example_path("demo"))
    return msgspec.structs.replace(
        demo, run=new_run(), state_dir=str(tmp_path / "state"),
        regions=[r for r in demo.regions if r.name in (HUB, LEAF)], tls=TlsSettings(enabled=True),
        restart=RestartSettings(max_restarts=0))


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("openssl") is None, reason="TLS certificates need the openssl CLI")
async def test_tls_launch_two_regions(tmp_path: Path,
                                      plaintext_refused: Callable[[int, str, str], Awaitable[bool]]) -> None:
    """Every actor connection is TLS, eu's rollouts reach and are consumed at the hub, plaintext is refused."""
    topology = _two_regions(tmp_path)
    async with Launch.open(topology) as launch, anyio.create_task_group() as tg:
        regions = launch.regions
        assert regions is not None and regions.tls is not None
        assert launch.endpoints.tls_ca == regions.tls.ca
        assert all(url.startswith("tls://") for urls in launch.endpoints.urls.values() for url in urls)
        for spec in actor_specs(topology, launch.endpoints):
            assert spec.args[spec.args.index("--tls-ca") + 1] == str(regions.tls.ca)
        await tg.start(lambda task_status: launch.run_actors(heartbeat_s=0.5, task_status=task_status))
        s = launch.admin.subjects
        with anyio.fail_after(40):                       # sourced across the TLS leaf link, then consumed
            while True:
                info = await launch.admin.js.stream_info(s.hub_rollouts_stream(),
                                                         subjects_filter=s.rollouts(LEAF))
                consumer = await launch.admin.js.consumer_info(s.hub_rollouts_stream(), s.durable("trainer"))
                if (info.state.subjects or {}).get(s.rollouts(LEAF), 0) >= 3 and consumer.ack_floor.stream_seq:
                    break
                await anyio.sleep(0.3)
        assert regions.linked() == {LEAF}
        for region, kind in ((LEAF, "demo_producer"), (HUB, "demo_consumer")):
            clients = regions.servers[region].monitor("connz?auth=1")["connections"]
            actors = [c for c in clients if str(c.get("name", "")).startswith(f"{kind}:")]
            assert actors, f"no {kind} connection at {region}: {clients}"
            assert all(c.get("tls_version") for c in clients), clients     # launcher and actors alike
        parser = argparse.ArgumentParser()
        add_target_options(parser)
        target = resolve(parser.parse_args(["--state-dir", str(launch.state_dir)]))   # as `rlbus health` does
        assert target.tls_ca == str(regions.tls.ca)
        async with await target.connect() as observer:
            assert (await observer.js.stream_info(s.events_stream())).state.messages > 0
        for region in (HUB, LEAF):
            cred = regions.credentials("observer")
            assert await plaintext_refused(regions.servers[region].port, cred.user, cred.password)
        tg.cancel_scope.cancel()


def _tls_problems(tls_toml: str, *, urls: bool = False) -> list[tuple[str, str, str]]:
    region = ('nats_urls = ["tls://nats.example:4222"]\ncredentials_file = "c.json"\n' if urls else "")
    text = (f'run = "r"\n[[regions]]\nname = "hub"\nrole = "hub"\n{region}'
            '  [[regions.actors]]\n  kind = "demo_consumer"\n' + tls_toml)
    _, problems = validate_text(text, local_cores=64)
    return [(p.key, p.severity, p.message) for p in problems]


def test_tls_validation_rules() -> None:
    """A certificate without its key, or without its CA, is an error; unused TLS files are warnings."""
    assert _tls_problems("[tls]\nenabled = true\n") == []
    own = '[tls]\nenabled = true\nca_file = "ca.pem"\ncert_file = "s.pem"\nkey_file = "k.pem"\n'
    assert _tls_problems(own) == []
    [(key, severity, message)] = _tls_problems('[tls]\nenabled = true\ncert_file = "s.pem"\n')
    assert (key, severity) == ("tls.key_file", "error") and "goes with its private key" in message
    [(key, severity, message)] = _tls_problems('[tls]\nenabled = true\nkey_file = "k.pem"\nca_file = "ca.pem"\n')
    assert (key, severity) == ("tls.cert_file", "error")
    [(key, severity, message)] = _tls_problems('[tls]\nenabled = true\ncert_file = "s.pem"\nkey_file = "k.pem"\n')
    assert (key, severity) == ("tls.ca_file", "error") and "signed it" in message
    [(key, severity, message)] = _tls_problems('[tls]\nenabled = true\nca_file = "ca.pem"\n')
    assert (key, severity) == ("tls.ca_file", "error") and "cert_file and key_file" in message
    [(key, severity, message)] = _tls_problems('[tls]\nca_file = "ca.pem"\n')
    assert (key, severity) == ("tls.ca_file", "warning") and "enabled is false" in message
    assert _tls_problems('[tls]\nenabled = true\nca_file = "ca.pem"\n', urls=True) == []
    [(key, severity, _)] = _tls_problems('[tls]\nenabled = true\ncert_file = "s.pem"\nkey_file = "k.pem"\n',
                                         urls=True)[:1]
    assert (key, severity) == ("tls.cert_file", "warning")
    [(key, _, message)] = _tls_problems('[tls]\nenabled = "yes"\n')
    assert key == "tls.enabled"

