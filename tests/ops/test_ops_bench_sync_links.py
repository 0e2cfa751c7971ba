"""`rlbus bench sync --quick --sync-link RATE/LATENCY` over shaped links: the JSON carries every link key, the
full snapshots the generators fetched crossed each leaf's link, the delta mode relayed the leaves (as `rlbus up`
does behind links), and nothing is left behind. `--sync-link` is parsed as RATE/LATENCY or refused by name;
`--sync-relay` defaults to relaying behind links only. No speed is asserted (benchmarks report numbers; the suite
checks outcomes). The run over links needs root, ip, tc and nft; skipped with the reason elsewhere."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.ops import json_in

from rlbus.ops.bench.sync import LEAVES, add_arguments, relayed, run
from rlbus.ops.bench.sync_links import link_lines, link_spec, link_summary
from rlbus.topology.network.links import LinkShape, namespaces_unavailable

LINK_KEYS = ("link_seconds_per_version_delta", "link_seconds_per_version_full", "link_speedup_vs_full",
             "link_bytes_per_version_delta", "link_bytes_per_version_full", "round_trips_per_version_delta",
             "round_trips_per_version_full", "full_goodput_ratio", "link_speedup_bound", "speedup_vs_full")


def test_sync_link_is_rate_slash_latency_or_refused_by_name() -> None:
    assert link_spec("100mbit/30ms") == LinkShape(bandwidth_bps=100_000_000, latency_s=0.03)
    assert link_spec("1gbit/5ms") == LinkShape(bandwidth_bps=1_000_000_000, latency_s=0.005)
    for bad in ("100mbit", "fast/30ms", "100mbit/soon"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"--sync-link '{bad}'"):
            link_spec(bad)


def test_the_delta_mode_relays_behind_links_unless_told_not_to() -> None:
    """As `rlbus up` relays every leaf behind a link: `--sync-link` alone relays, `--no-sync-relay` keeps the
    publisher writing every leaf's objects across its link, loopback relays only when asked."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def relays(*argv: str) -> bool:
        args = parser.parse_args(list(argv))
        return relayed(args.sync_link, args.sync_relay)

    assert relays("--sync-link", "100mbit/30ms")
    assert not relays("--sync-link", "100mbit/30ms", "--no-sync-relay")
    assert not relays()
    assert relays("--sync-relay")


def test_link_summary_takes_medians_over_leaves_and_versions_and_prints_them() -> None:
    """The summary keys from per-version rows (as `link_version` makes them), for two leaves and two versions
    per mode at 8 Mbit/s (1 MB/s) and 10 ms each way, and the table lines naming the leaves and the relay."""
    def leaf(link_s: float, size: int, trips: int) -> dict[str, object]:
        return {"link_s": link_s, "bytes": size, "round_trips": trips, "round_trips_by_kind": {"object chunks": trips}}

    rows = {"delta": [{"version": v, "one_step_bytes": 1000, "eu": leaf(0.1, 1000, 1), "us": leaf(0.3, 1100, 1)}
                      for v in (1, 2)],
            "full": [{"version": v, "eu": leaf(1.0, 1_000_000, 2), "us": leaf(2.0, 1_000_000, 2)} for v in (3, 4)]}
    shape = link_spec("8mbit/10ms")
    out = link_summary(rows, shape, {"eu": 0.021, "us": 0.022}, LEAVES)
    assert out["link_seconds_per_version_delta"] == pytest.approx(0.2)
    assert out["link_seconds_per_version_full"] == pytest.approx(1.5)
    assert out["link_speedup_vs_full"] == pytest.approx(7.5)
    assert out["link_bytes_ratio"] == pytest.approx(1_000_000 / 1050)
    assert out["full_goodput_ratio"] == pytest.approx(0.75)          # 1 MB over 1 s and 2 s at 1 MB/s
    assert out["link_speedup_bound"] == pytest.approx((1.0 + 2 * 0.02) / (1050 / 1e6 + 0.02))
    assert out["link_bytes_over_one_step_delta"] == {"median": pytest.approx(1.05), "max": pytest.approx(1.1)}
    assert out["round_trips_by_kind"] == {"delta": {"object chunks": 1.0}, "full": {"object chunks": 2.0}}
    text = "\n".join(link_lines({**out, "relay": True}))
    assert text.startswith("links eu, us: 8 Mbit/s, 10 ms each way") and "carried 1.050x the one-step delta" in text


def test_without_namespaces_the_bench_says_why_and_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where shaped links cannot be made (here faked: the check itself reads uid and PATH), nothing starts."""
    import rlbus.topology.network.links as links

    monkeypatch.setattr(links, "namespaces_unavailable", lambda: "network namespaces need root (uid 1000)")
    with pytest.raises(SystemExit) as exited:
        run(argparse.Namespace(sync_link=link_spec("100mbit/5ms"), quick=True))
    assert exited.value.code == 2
    assert "--sync-link: shaped links cannot be made here: network namespaces need root" in capsys.readouterr().err


@pytest.mark.skipif(namespaces_unavailable() is not None,
                    reason=f"shaped links cannot be made here: {namespaces_unavailable()}")
def test_quick_bench_over_links_reports_every_link_key_and_leaves_nothing(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "bench", "sync", "--quick", "--sync-link", "100mbit/5ms", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)          # hang guard only
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)                # its own process group: stop by its pid
        proc.communicate()
        raise
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    result = json_in(out)
    assert set(LINK_KEYS) <= set(result), sorted(set(LINK_KEYS) - set(result))
    assert result["link"]["leaves"] == list(LEAVES) and result["link"]["bandwidth_bps"] == 100_000_000
    assert result["relay"] is True                         # the default behind links, as `rlbus up`
    assert result["link_bytes_over_one_step_delta"]["median"] is not None
    assert set(result["link"]["rtt_measured_s"]) == set(LEAVES)
    full_object = max(row["bytes_fetched"] for row in result["versions"]["full"])
    for mode in ("delta", "full"):
        assert len(result["link_versions"][mode]) == len(result["versions"][mode])
        for row in result["link_versions"][mode]:
            for leaf in LEAVES:
                assert row[leaf]["round_trips"] > 0 and row[leaf]["link_s"] > 0, (mode, leaf, row)
                if mode == "full":                        # the snapshot each leaf's generators read crossed it
                    assert row[leaf]["bytes_to_leaf"] >= full_object, (leaf, row, full_object)
    assert processes_mentioning(str(tmp_path)) == []
    assert list(tmp_path.glob("rlbus-bench-sync-*")) == []
    made = result["link"]["made"]
    assert set(made) == set(LEAVES)
    for leaf in LEAVES:                                    # its namespaces and veths are gone
        assert not Path("/run/netns", made[leaf]["netns"]).exists(), made[leaf]
        assert not set(made[leaf]["interfaces"]) & set(os.listdir("/sys/class/net")), made[leaf]
