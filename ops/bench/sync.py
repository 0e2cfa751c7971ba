"""`rlbus bench sync`: delta vs full-snapshot weight sync from the trainer to generators in three regions.

Owns: the sync benchmark. On the embedded 3-region bus (hub, eu, us; `RegionSet`) it runs the real path:
a trainer stand-in (`ModelConfig.m30()` fp32 master weights, AdamW on the task corpus; `--quick`: `tiny()`)
uploads each version to CKPT and publishes VersionReady; the publisher actor writes it into every
region's WEIGHTS store and LATEST key; two `WeightSync` generators per region (each its own bus
connection to its region) fetch, verify, stage it and bring their bf16 model to it in place (sparse deltas
patched, anything else copied). The same run first times
`--sync-versions` versions with deltas (the topology defaults `full_every` 4, `delta_depth` 3), then as
many with only full snapshots (a publisher with `full_every` 1), each from VersionReady published to
every generator holding it. `speedup_vs_full` = median full / median delta of that end-to-end time.

`--sync-link RATE/LATENCY` (e.g. `100mbit/30ms`) puts both leaf regions (eu, us) behind shaped links
(topology/network/links.py: each leaf's nats-server in its own network namespace, `tbf` for the rate, the delaying
relay for the one-way latency). What crosses a link is what the hub sends a region: the publisher's writes into
its WEIGHTS store and LATEST key (object-store chunks, their metadata, KV reads and updates, JetStream API
requests) and their acks. The generators stay in-process tasks, each connected to its own region's server at
the address that region's clients use (`RegionSet.url`): their fetches are region-local, as in a deployment
and as for `rlbus up`'s actors inside the namespace, and never cross the link. A thread samples every link's
veth byte counters every `SAMPLE_S`; per version and link, the link seconds run from the first sample that
moved to the last one that did, the link bytes are all that crossed during the version. The publisher's
request/response round trips to each leaf are counted on its connection (`_RoundTrips`), plus one per object
for its chunks (pipelined, `messages/objects.py` `PUT_WINDOW`). `--sync-relay` runs the delta mode with the
leaves relayed: the hub's publisher sends each one object per version and a `RegionRelay` per leaf (an
in-process task on the leaf's server, like its generators) makes the region's objects there;
`link_bytes_over_one_step_delta` is then what a link carried per version over that version's one-step delta.
The full mode never relays (it is the baseline).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

GENERATORS_PER_REGION = 2
REGIONS = ("hub", "eu", "us")
LEAVES: Final = ("eu", "us")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sync-versions", type=int, default=4, help="sync: versions timed per mode (default 4)")
    p.add_argument("--sync-lr", type=float, default=1e-6,
                   help="sync: lr of the timed AdamW steps (default 1e-6)")
    p.add_argument("--sync-warmup", type=int, default=10,
                   help="sync: AdamW warm-up steps before the timed ones (default 10)")
    p.add_argument("--sync-warmup-lr", type=float, default=3e-4, help="sync: warm-up lr (default 3e-4)")
    p.add_argument("--sync-full-every", type=int, default=4,
                   help="sync: publisher full_every in the delta mode (default 4, the topology default)")
    p.add_argument("--sync-delta-depth", type=int, default=3,
                   help="sync: publisher delta_depth in the delta mode (default 3, the topology default)")
    p.add_argument("--sync-threads", type=int, default=2, help="sync: torch and codec threads (default 2)")
    p.add_argument("--sync-relay", action="store_true",
                   help="sync: the delta mode sends each leaf one object per version and a RegionRelay in the leaf "
                        "(in-process, on the leaf's server) makes the rest there")
    p.add_argument("--sync-link", type=link_spec, default=None, metavar="RATE/LATENCY",
                   help="sync: put eu and us behind shaped links of this rate and one-way latency, e.g. "
                        "100mbit/30ms (needs root, ip, tc, nft; default: every region on loopback)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    if getattr(args, "sync_link", None) is not None:
        from rlbus.topology.network.links import namespaces_unavailable

        if (why := namespaces_unavailable()) is not None:
            print(f"rlbus bench sync --sync-link: shaped links cannot be made here: {why}", file=sys.stderr)
            raise SystemExit(2)

    return anyio.run(_run, args, backend="asyncio")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile
    import uuid
    from pathlib import Path

    import anyio
    import torch

    from rlbus.actors.base import ActorId, ActorLimits
    from rlbus.actors.common.config import PublisherConfig, PublisherLaunch
    from rlbus.actors.common.weight_sync import WeightSync
    from rlbus.actors.publisher import Publisher, RegionRelay
    from rlbus.messages.bus import Bus, ConnectOptions, Identity
    from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
    from rlbus.model.policies.transformer import ModelConfig, Transformer
    from rlbus.ops.bench.version_source import VersionSource
    from rlbus.topology.network.regions import RegionSet

    shape = getattr(args, "sync_link", None)
    links = {leaf: shape for leaf in LEAVES} if shape is not None else None

    t_start = time.perf_counter()
    threads = args.sync_threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    quick = bool(getattr(args, "quick", False))
    config = ModelConfig.tiny() if quick else ModelConfig.m30()
    n_versions = 2 if quick else args.sync_versions
    warmup = 3 if quick else args.sync_warmup
    run_id = f"b{uuid.uuid4().hex[:8]}"
    buses: list[Bus] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-sync-") as tmp:
        rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(Path(tmp), REGIONS, "hub", run=run_id,
                                                                    links=links))
        sampler = _LinkSampler(rs) if shape is not None else None
        made = ({leaf: link.manifest() for leaf, link in sampler.links.items()} if sampler is not None
                else {})                                  # namespaces and interfaces, for leftover checks
        round_trips: list[_RoundTrips] = []
        link_rows: dict[str, list[dict[str, Any]]] = {"delta": [], "full": []}
        try:
            async def connect(region: str, role: str, actor: str) -> Bus:
                cred = rs.credentials(role)
                bus = await Bus.connect(rs.url(region), run=run_id, domain=region,
                                        identity=Identity(actor_id=actor, kind=role, region=region),
                                        options=ConnectOptions(user=cred.user, password=cred.password))
                buses.append(bus)
                return bus

            admin = await connect("hub", "admin", "bench")
            await provision_run(admin.nc, admin.subjects, hub="hub", domains=rs.domains,
                                settings=StreamSettings())
            for region in REGIONS:
                await wait_routable(admin.nc, admin.subjects.tasks(region))
            rtt_measured = await _measure_rtt(admin, LEAVES) if shape is not None else {}
            if sampler is not None:
                sampler.start()
            trainer = await connect("hub", "trainer", "hub-trainer-0")
            source = VersionSource(Transformer(config), lr=args.sync_warmup_lr, batch=4, seq_len=64,
                                   keep_history=False)
            losses = [await anyio.to_thread.run_sync(source.step) for _ in range(warmup)]
            source.set_lr(args.sync_lr)
            source.version = 0                          # the warmed-up weights are the run's version 0
            syncs = [WeightSync(await connect(region, "generator", f"{region}-generator-{i}"), region,
                                threads=1)
                     for region in REGIONS for i in range(GENERATORS_PER_REGION)]
            limits = ActorLimits(heartbeat_interval_s=2.0, drain_timeout_s=5.0)

            async def start_publisher(tg: Any, full_every: int, depth: int, *, relay: bool = False) -> Publisher:
                config = PublisherConfig(full_every=full_every, delta_depth=depth)
                launch = PublisherLaunch(regions=list(REGIONS), hub="hub", threads=threads)
                bus = await connect("hub", "publisher", f"hub-publisher-{full_every}")
                if shape is not None:
                    round_trips.append(_RoundTrips(bus, LEAVES))
                ident = ActorId(run_id, "hub", "publisher", "hub-publisher-0")
                publisher = Publisher(ident, bus, config, limits, launch, relayed=LEAVES if relay else ())
                await tg.start(publisher.serve)
                for leaf in LEAVES if relay else ():      # in-region, on the leaf's own server
                    relay_bus = await connect(leaf, "publisher", f"{leaf}-relay-{full_every}")
                    region_relay = RegionRelay(ActorId(run_id, leaf, "publisher", f"{leaf}-relay-0"), relay_bus,
                                               config, limits, hub="hub", threads=1)
                    await tg.start(region_relay.serve)
                return publisher

            async def one_version(publisher: Publisher, *, step: bool, mode: str | None = None) -> dict[str, Any]:
                if step:
                    await anyio.to_thread.run_sync(source.step)
                t_before = time.perf_counter()
                ready = await source.publish(trainer, threads=threads)
                t_pub = time.perf_counter()
                applied: dict[str, float] = {}

                async def wait(sync: WeightSync) -> None:
                    await sync.wait_for_version(ready.version)
                    applied[sync.bus.identity.actor_id] = time.perf_counter()

                with anyio.fail_after(600):              # hang guard
                    async with anyio.create_task_group() as waits:
                        for sync in syncs:
                            waits.start_soon(wait, sync)
                    await publisher.wait_announced(ready.version)
                if sampler is not None and mode is not None:
                    await anyio.sleep(0.05)                  # the last segments' acks
                    row = _link_version(ready.version, sampler, round_trips[-1], t_before, time.perf_counter())
                    if publisher.last is not None:       # the one-step delta's size, the floor of a version
                        m = publisher.last.manifest
                        sizes = dict(zip(m.objects, m.sizes, strict=True))
                        row["one_step_bytes"] = sizes.get(f"v{ready.version}.from{ready.version - 1}")
                    link_rows[mode].append(row)
                return _breakdown(ready.version, t_pub, applied, publisher, syncs)

            async with anyio.create_task_group() as tg:
                for sync in syncs:
                    await tg.start(sync.run)
                results: dict[str, list[dict[str, Any]]] = {}
                async with anyio.create_task_group() as phase:
                    publisher = await start_publisher(phase, args.sync_full_every, args.sync_delta_depth,
                                                      relay=bool(getattr(args, "sync_relay", False)))
                    seed = await one_version(publisher, step=False)      # v0: every generator joins
                    results["delta"] = [await one_version(publisher, step=True, mode="delta")
                                        for _ in range(n_versions)]
                    delta_manifest = publisher.last.manifest if publisher.last else None
                    phase.cancel_scope.cancel()
                async with anyio.create_task_group() as phase:
                    publisher = await start_publisher(phase, 1, 1)
                    results["full"] = [await one_version(publisher, step=True, mode="full")
                                       for _ in range(n_versions)]
                    phase.cancel_scope.cancel()
                tg.cancel_scope.cancel()
        finally:
            if sampler is not None:
                sampler.stop()
            for bus in buses:
                await bus.close()
            await anyio.to_thread.run_sync(rs.stop)
    n_params = sum(p.numel() for p in source.policy.module.parameters())
    median = {mode: statistics.median(r["total_s"] for r in rows) for mode, rows in results.items()}
    after = {mode: statistics.median(r["total_s"] - r["queue_s"] - r["download_s"] for r in rows)
             for mode, rows in results.items()}
    out: dict[str, Any] = {
        "speedup_vs_full": median["full"] / median["delta"],
        "speedup_after_download": after["full"] / after["delta"],
        "delta_s": median["delta"], "full_s": median["full"],
        "bytes_ratio": statistics.median(r["bytes_fetched"] for r in results["full"])
        / max(1.0, statistics.median(r["bytes_fetched"] for r in results["delta"])),
        "verify_every": syncs[0].verify_every,
        "breakdown": {mode: {k: statistics.median(r[k] for r in rows) for k in _PHASES}
                      for mode, rows in results.items()},
        "versions": results, "seed_s": seed["total_s"],
        "model": "tiny" if quick else "m30", "parameters": n_params, "raw_bf16_bytes": 2 * n_params,
        "regions": list(REGIONS), "generators": len(REGIONS) * GENERATORS_PER_REGION,
        "lr": args.sync_lr, "warmup_steps": warmup, "warmup_lr": args.sync_warmup_lr,
        "warmup_loss_first_last": [round(losses[0], 3), round(losses[-1], 3)] if losses else [],
        "delta_mode": {"full_every": args.sync_full_every, "delta_depth": args.sync_delta_depth,
                       "last_objects": delta_manifest.objects if delta_manifest else []},
        "threads": threads, "load_avg_1m": os.getloadavg()[0],
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    if shape is not None:
        out |= _link_summary(link_rows, shape, rtt_measured)
        out["link"]["made"] = made
        out["relay"] = bool(getattr(args, "sync_relay", False))
    return out


class _LinkSampler:
    """Each leaf link's veth byte counters (`Link.counters`, both directions) every `SAMPLE_S`, on a thread."""

    def __init__(self, rs: Any) -> None:
        if rs.links is None:
            raise RuntimeError(f"the leaves run on loopback: {rs.links_skipped}")
        self.links = {region: rs.links.link(region) for region in LEAVES}
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


class _RoundTrips:
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


async def _measure_rtt(admin: Any, leaves: Iterable[str], n: int = 5) -> dict[str, float]:
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


def _link_version(version: int, sampler: _LinkSampler, round_trips: _RoundTrips, t0: float, t1: float
                  ) -> dict[str, Any]:
    """One version on each leaf link: seconds from the first sample interval its counters moved in to the last
    (`link_s`), bytes both ways and towards the leaf, and its round trips by kind. Only movements while the
    publisher had a request or an upload to that leaf open count (the link's own keepalives between versions
    do not), one sample either side."""
    row: dict[str, Any] = {"version": version}
    for region in LEAVES:
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


def _link_summary(rows: dict[str, list[dict[str, Any]]], shape: Any, rtt_measured: dict[str, float]
                  ) -> dict[str, Any]:
    """The link keys: medians over every (leaf, version) of each mode, their ratios, the goodput and the bound."""

    def values(mode: str, key: str) -> list[float]:
        return [float(r[leaf][key]) for r in rows[mode] for leaf in LEAVES]

    med = {(mode, key): statistics.median(values(mode, key))
           for mode in ("delta", "full") for key in ("link_s", "bytes", "round_trips")}
    rate = shape.bandwidth_bps / 8                       # bytes per second
    rtt = 2 * shape.latency_s
    goodput = [r[leaf]["bytes"] / r[leaf]["link_s"] / rate for r in rows["full"] for leaf in LEAVES
               if r[leaf]["link_s"] > 0]

    def bound_s(mode: str) -> float:
        return med[mode, "bytes"] / rate + med[mode, "round_trips"] * rtt

    ratios = [r[leaf]["bytes"] / r["one_step_bytes"] for r in rows["delta"] for leaf in LEAVES
              if r.get("one_step_bytes")]
    kinds: dict[str, dict[str, float]] = {}
    for mode in ("delta", "full"):
        total: dict[str, int] = {}
        for r in rows[mode]:
            for leaf in LEAVES:
                for kind, n in r[leaf]["round_trips_by_kind"].items():
                    total[kind] = total.get(kind, 0) + n
        kinds[mode] = {k: round(n / max(1, len(rows[mode]) * len(LEAVES)), 2) for k, n in sorted(total.items())}
    return {
        "link": {"bandwidth_bps": shape.bandwidth_bps, "latency_s": shape.latency_s, "rtt_s": rtt,
                 "rtt_measured_s": rtt_measured, "sample_s": SAMPLE_S, "leaves": list(LEAVES)},
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


_PHASES = ("total_s", "queue_s", "download_s", "decode_s", "encode_s", "upload_s", "watch_s", "fetch_s",
           "apply_s", "swap_s", "bytes_fetched")


def _breakdown(version: int, t_pub: float, applied: dict[str, float], publisher: Any, syncs: list[Any]
               ) -> dict[str, Any]:
    """Seconds of one version from VersionReady published to the last generator holding it, by phase.

    queue: VersionReady to the publisher; download: its CKPT blob; decode: to tensors (delta mode);
    encode: the delta from v-1 (delta mode; full mode writes the trainer's blob as is); upload: objects
    and LATEST in every region (first stage); watch: LATEST to the generators starting to fetch (the
    rest of the slowest generator's time); fetch / apply (decode into the staging buffers) / swap (patch or
    copy into the live model): medians over the generators.
    """
    trace = publisher.trace[version]
    landed = max(region.written_at[version] for region in publisher.regions.values())
    last = max(applied.values())
    per_gen = [s.timings for s in syncs]
    med = {k: statistics.median(t.get(k, 0.0) for t in per_gen) for k in ("fetch", "apply", "swap")}
    slowest = max(syncs, key=lambda s: applied[s.bus.identity.actor_id])
    path = slowest.latest
    fetched = 0
    if path is not None:
        sizes = dict(zip(path.objects, path.sizes, strict=True))
        fetched = sum(sizes.get(name, 0) for name in slowest.last_path)
    slow_t = slowest.timings
    return {
        "version": version, "total_s": last - t_pub, "queue_s": trace["received"] - t_pub,
        "download_s": trace["downloaded"] - trace["received"],
        "decode_s": trace["decoded"] - trace["downloaded"],
        "encode_s": trace["staged"] - trace["decoded"], "upload_s": landed - trace["staged"],
        "watch_s": max(0.0, last - landed - slow_t.get("fetch", 0.0) - slow_t.get("apply", 0.0)
                       - slow_t.get("swap", 0.0)),
        "fetch_s": med["fetch"], "apply_s": med["apply"], "swap_s": med["swap"], "bytes_fetched": fetched,
        "objects": slowest.last_path,
    }


def table(result: dict[str, Any]) -> str:
    head = ("mode", "total", "queue", "download", "decode", "encode", "upload", "watch", "fetch", "apply",
            "swap", "MB fetched")
    rows = [head]
    for mode in ("delta", "full"):
        b = result["breakdown"][mode]
        rows.append((mode, *(f"{b[k]:.3f}" for k in _PHASES[:-1]), f"{b['bytes_fetched'] / 1e6:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    dm = result["delta_mode"]
    n = len(result["versions"]["delta"])
    lines += [
        "",
        (f"speedup_vs_full = {result['speedup_vs_full']:.1f}x (target >= 20): median seconds from "
         f"VersionReady published to all {result['generators']} generators holding the version, "
         f"{n} versions per mode;"),
        (f"{result['speedup_after_download']:.1f}x without the common queue + CKPT download; "
         f"{result['bytes_ratio']:.0f}x fewer bytes fetched per generator."),
        (f"{result['model']}: {result['parameters'] / 1e6:.1f}M parameters "
         f"({result['raw_bf16_bytes'] / 1e6:.0f} MB bf16), AdamW at lr {result['lr']:g} after "
         f"{result['warmup_steps']} warm-up steps at {result['warmup_lr']:g}; "
         f"regions {', '.join(result['regions'])}."),
        (f"delta mode: full_every {dm['full_every']}, delta_depth {dm['delta_depth']}; "
         f"full mode: full_every 1. Phases are medians; fetch/apply/swap per generator."),
        (f"apply = decode into the staging buffers; every tensor is re-hashed on full snapshots and every "
         f"{result['verify_every']}th delta."),
        (f"{result['threads']} threads, load avg {result['load_avg_1m']:.1f} when done, "
         f"{result['total_s']:.0f} s."),
    ]
    if "link" in result:
        link = result["link"]
        rtt_ms = ", ".join(f"{r} {s * 1e3:.1f}" for r, s in link["rtt_measured_s"].items())
        lines += [
            "",
            (f"links eu, us: {link['bandwidth_bps'] / 1e6:g} Mbit/s, {link['latency_s'] * 1e3:g} ms each way "
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
    return "\n".join(lines)
