"""Weight sync over shaped links, measured for `rlbus bench sync --sync-link RATE/LATENCY`.

Owns: `link_spec` (the flag's RATE/LATENCY parsed into a `LinkShape`), `LinkSampler` (a thread sampling every
leaf link's veth byte counters every `SAMPLE_S`), `RoundTrips` (the publisher connection's request/response round
trips and object puts to each leaf, counted on that connection), `measure_rtt`, and per version and link
(`link_version`) and over a run (`link_summary`, `link_lines`) the link seconds, bytes and round trips.
Per version and link, the link seconds run from the first sample that moved to the last one that did, the link
bytes are all that crossed during the version. Does not: make links (topology/network/links.py), run the bench
(ops/bench/sync.py) or judge the numbers (the suite checks outcomes, never speeds).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

SAMPLE_S: Final = 0.005
"""How often the link counters are sampled."""
MOVED_BYTES: Final = 0
"""A sample interval counts as the link moving when its counters grew by more than this many bytes (while the
publisher has something open to that leaf)."""


def link_spec(text: str) -> Any:
    """`RATE/LATENCY` (one-way latency), e.g. `100mbit/30ms`, as a `LinkShape`; argparse's error otherwise."""
    from rlbus.topology.network.links import LinkShape

    rate, sep, latency = text.partition("/")
    try:
        if not sep:
            raise ValueError("expected RATE/LATENCY")
        return LinkShape.parse(bandwidth=rate, latency=latency)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--sync-link {text!r}: {err} (e.g. 100mbit/30ms: the rate, then the "
                                         f"one-way latency)") from None


class LinkSampler:
    """Each leaf link's veth byte counters (`Link.counters`, both directions) every `SAMPLE_S`, on a thread."""

    def __init__(self, rs: Any, leaves: Iterable[str]) -> None:
        if rs.links is None:
            raise RuntimeError(f"the leaves run on loopback: {rs.links_skipped}")
        self.links = {region: rs.links.link(region) for region in leaves}
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sync-link-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = {}
            for region, link in self.links.items():
                c = link.counters()
                row[region] = (c["tx_bytes"], c["rx_bytes"])
            self.samples.append((time.perf_counter(), row))
            self._stop.wait(SAMPLE_S)

    def window(self, region: str, t0: float, t1: float) -> list[tuple[float, int, int]]:
        """(time, bytes towards the leaf, bytes from it) of the samples between t0 and t1."""
        return [(t, row[region][0], row[region][1]) for t, row in self.samples if t0 <= t <= t1]


class RoundTrips:
    """The publisher connection's request/response round trips to each leaf: every `nc.request` whose subject is
    the leaf's JetStream API (`$JS.<leaf>.API.…`) or one of its buckets (acked publishes of object metadata,
    KV updates), by kind; and each object put to the leaf: one round trip for its chunks (and, for an object
    put as `new`, its metadata), which stream in a sliding window of `PUT_WINDOW` (wider than the
    bandwidth-delay product of the links benched here, so the stream waits for the last ack only)."""

    def __init__(self, bus: Any, regions: Iterable[str]) -> None:
        self.requests: list[tuple[float, float, str, str]] = []
        """(start, end, leaf, kind) of every request to a leaf."""
        self.puts: list[tuple[float, float, str, int]] = []
        """(start, end, leaf, bytes) of every object put to a leaf."""
        self._regions = tuple(regions)
        self._buckets = {bucket: r for r in self._regions
                         for bucket in (bus.subjects.weights_bucket(r), bus.subjects.latest_bucket(r))}
        request: Callable[..., Any] = bus.nc.request
        put: Callable[..., Any] = bus.put_object

        async def counted_request(subject: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await request(subject, *args, **kwargs)
            finally:
                if (found := self._classify(subject)) is not None:
                    self.requests.append((t0, time.perf_counter(), *found))

        async def counted_put(bucket: str, name: str, data: bytes | memoryview, *,
                              domain: str | None = None, **kwargs: Any) -> str:
            t0 = time.perf_counter()
            try:
                return await put(bucket, name, data, domain=domain, **kwargs)
            finally:
                if domain in self._regions:
                    self.puts.append((t0, time.perf_counter(), domain, len(data)))

        bus.nc.request = counted_request
        bus.put_object = counted_put

    def _classify(self, subject: str) -> tuple[str, str] | None:
        """(leaf, kind) of a request subject, None when it stays in the hub."""
        parts = subject.split(".")
        if len(parts) > 3 and parts[0] == "$JS" and parts[1] in self._regions and parts[2] == "API":
            if parts[3] == "$KV":                       # a KV update through the leaf's domain
                return parts[1], "kv update"
            return parts[1], ".".join(parts[3:5]) if parts[3] in ("STREAM", "CONSUMER", "DIRECT") else parts[3]
        if len(parts) > 2 and parts[0] in ("$O", "$KV") and parts[1] in self._buckets:
            kind = "kv update" if parts[0] == "$KV" else "object chunk" if parts[2] == "C" else "object meta"
            return self._buckets[parts[1]], kind
        return None

    def between(self, region: str, t0: float, t1: float) -> tuple[dict[str, int], tuple[float, float] | None]:
        """Round trips to `region` started between t0 and t1, by kind ("object chunks": one per object), and
        when the first of them started and the last ended (None: there were none)."""
        kinds: dict[str, int] = {}
        spans = []
        for start, end, r, kind in self.requests:
            if r == region and t0 <= start <= t1:
                kinds[kind] = kinds.get(kind, 0) + 1
                spans.append((start, end))
        windows = 0
        for start, end, r, _size in self.puts:
            if r == region and t0 <= start <= t1:
                windows += 1
                spans.append((start, end))
        if windows:
            kinds["object chunks"] = windows
        span = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None
        return kinds, span


async def measure_rtt(admin: Any, leaves: Iterable[str], n: int = 5) -> dict[str, float]:
    """Leaf -> median seconds of a JetStream API request (account info) from the hub across its link."""
    from rlbus.messages.subjects import Subjects

    out = {}
    for leaf in leaves:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await admin.nc.request(f"{Subjects.js_api(leaf)}.INFO", b"", timeout=10.0)
            times.append(time.perf_counter() - t0)
        out[leaf] = statistics.median(times)
    return out


def link_version(version: int, sampler: LinkSampler, round_trips: RoundTrips, t0: float, t1: float
                 ) -> dict[str, Any]:
    """One version on each leaf link: seconds from the first sample interval its counters moved in to the last
    (`link_s`), bytes both ways and towards the leaf, and its round trips by kind. Only movements while the
    publisher had a request or an upload to that leaf open count (the link's own keepalives between versions
    do not), one sample either side."""
    row: dict[str, Any] = {"version": version}
    for region in sampler.links:
        points = sampler.window(region, t0, t1)
        totals = [tx + rx for _, tx, rx in points]
        kinds, span = round_trips.between(region, t0, t1)
        lo, hi = (span[0] - SAMPLE_S, span[1] + 2 * SAMPLE_S) if span is not None else (t1, t0)
        moved = [i for i in range(1, len(points))
                 if totals[i] - totals[i - 1] > MOVED_BYTES and points[i][0] >= lo and points[i - 1][0] <= hi]
        row[region] = {
            "link_s": points[moved[-1]][0] - points[moved[0] - 1][0] if moved else 0.0,
            "bytes": totals[-1] - totals[0] if points else 0,
            "bytes_to_leaf": points[-1][1] - points[0][1] if points else 0,
            "round_trips": sum(kinds.values()), "round_trips_by_kind": kinds, "samples": len(points),
            "publisher_s": span[1] - span[0] if span is not None else 0.0,
        }
    return row


def link_summary(rows: dict[str, list[dict[str, Any]]], shape: Any, rtt_measured: dict[str, float],
                 leaves: tuple[str, ...]) -> dict[str, Any]:
    """The link keys: medians over every (leaf, version) of each mode, their ratios, the goodput and the bound."""

    def values(mode: str, key: str) -> list[float]:
        return [float(r[leaf][key]) for r in rows[mode] for leaf in leaves]

    med = {(mode, key): statistics.median(values(mode, key))
           for mode in ("delta", "full") for key in ("link_s", "bytes", "round_trips")}
    rate = shape.bandwidth_bps / 8                       # bytes per second
    rtt = 2 * shape.latency_s
    goodput = [r[leaf]["bytes"] / r[leaf]["link_s"] / rate for r in rows["full"] for leaf in leaves
               if r[leaf]["link_s"] > 0]

    def bound_s(mode: str) -> float:
        return med[mode, "bytes"] / rate + med[mode, "round_trips"] * rtt

    ratios = [r[leaf]["bytes"] / r["one_step_bytes"] for r in rows["delta"] for leaf in leaves
              if r.get("one_step_bytes")]
    kinds: dict[str, dict[str, float]] = {}
    for mode in ("delta", "full"):
        total: dict[str, int] = {}
        for r in rows[mode]:
            for leaf in leaves:
                for kind, n in r[leaf]["round_trips_by_kind"].items():
                    total[kind] = total.get(kind, 0) + n
        kinds[mode] = {k: round(n / max(1, len(rows[mode]) * len(leaves)), 2) for k, n in sorted(total.items())}
    return {
        "link": {"bandwidth_bps": shape.bandwidth_bps, "latency_s": shape.latency_s, "rtt_s": rtt,
                 "rtt_measured_s": rtt_measured, "sample_s": SAMPLE_S, "leaves": list(leaves)},
        "link_seconds_per_version_delta": med["delta", "link_s"],
        "link_seconds_per_version_full": med["full", "link_s"],
        "link_speedup_vs_full": med["full", "link_s"] / max(med["delta", "link_s"], 1e-9),
        "link_bytes_per_version_delta": med["delta", "bytes"],
        "link_bytes_per_version_full": med["full", "bytes"],
        "link_bytes_ratio": med["full", "bytes"] / max(med["delta", "bytes"], 1.0),
        "round_trips_per_version_delta": med["delta", "round_trips"],
        "round_trips_per_version_full": med["full", "round_trips"],
        "round_trips_by_kind": kinds,
        "full_goodput_ratio": statistics.median(goodput) if goodput else 0.0,
        "link_speedup_bound": bound_s("full") / max(bound_s("delta"), 1e-9),
        "link_bytes_over_one_step_delta": {
            "median": statistics.median(ratios) if ratios else None, "max": max(ratios) if ratios else None},
        "link_versions": rows,
    }


def link_lines(result: dict[str, Any]) -> list[str]:
    """The link part of `rlbus bench sync`'s table, from the keys `link_summary` made."""
    link = result["link"]
    rtt_ms = ", ".join(f"{r} {s * 1e3:.1f}" for r, s in link["rtt_measured_s"].items())
    return [
        (f"links {', '.join(link['leaves'])}: {link['bandwidth_bps'] / 1e6:g} Mbit/s, {link['latency_s'] * 1e3:g} ms each way "
         f"(RTT {link['rtt_s'] * 1e3:g} ms asked; measured by a JetStream API request: {rtt_ms} ms)."),
        (f"link_speedup_vs_full = {result['link_speedup_vs_full']:.1f}x: "
         f"{result['link_seconds_per_version_full']:.3f} / {result['link_seconds_per_version_delta']:.3f} s "
         f"per version per link (first to last byte); physical bound {result['link_speedup_bound']:.1f}x."),
        (f"link bytes per version: delta {result['link_bytes_per_version_delta'] / 1e6:.2f} MB, full "
         f"{result['link_bytes_per_version_full'] / 1e6:.2f} MB ({result['link_bytes_ratio']:.0f}x); round "
         f"trips delta {result['round_trips_per_version_delta']:g}, full "
         f"{result['round_trips_per_version_full']:g}."),
        f"full_goodput_ratio = {result['full_goodput_ratio']:.2f} of the shaped rate.",
        *([(f"relayed leaves: per version a link carried {over['median']:.3f}x the one-step delta "
            f"(max {over['max']:.3f}).")]
          if result.get("relay") and (over := result["link_bytes_over_one_step_delta"])["median"] else []),
        "round trips per version per link by kind: " + "; ".join(
            f"{mode}: " + ", ".join(f"{k} {n:g}" for k, n in kinds.items())
            for mode, kinds in result["round_trips_by_kind"].items()),
    ]
