"""`rlbus bench sync`: delta vs full-snapshot weight sync from the trainer to generators in three regions.

- Owns: the sync benchmark (`run`): on the embedded 3-region bus, the real path from a trainer stand-in
  through the publisher to two `WeightSync` generators per region, timed with deltas then with full
  snapshots only (`speedup_vs_full`), optionally behind shaped links (`--sync-link`) with relays (`relayed`).
- Does not: measure the links themselves (ops/bench/sync_links.py) or assert speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Final

from rlbus.ops.bench.sync_links import (
    LinkSampler,
    RoundTrips,
    link_lines,
    link_spec,
    link_summary,
    link_version,
    measure_rtt,
)

GENERATORS_PER_REGION = 2
REGIONS = ("hub", "eu", "us")
LEAVES: Final = ("eu", "us")


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
    p.add_argument("--sync-relay", action=argparse.BooleanOptionalAction, default=None,
                   help="sync: the delta mode sends each leaf one object per version and a RegionRelay in the leaf "
                        "(in-process, on the leaf's server) makes the rest there (default: with --sync-link, as "
                        "`rlbus up` relays every leaf behind a link; --no-sync-relay: the publisher writes every "
                        "leaf's objects across its link)")
    p.add_argument("--sync-link", type=link_spec, default=None, metavar="RATE/LATENCY",
                   help="sync: put eu and us behind shaped links of this rate and one-way latency, e.g. "
                        "100mbit/30ms (needs root, ip, tc, nft; default: every region on loopback)")


def relayed(shape: Any, sync_relay: bool | None) -> bool:
    """Whether the delta mode relays the leaves: as asked (`--sync-relay` / `--no-sync-relay`), else when they
    are behind shaped links (`rlbus up` starts a relay in every leaf behind a `[regions.link]`)."""
    return shape is not None if sync_relay is None else sync_relay


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time weight sync with deltas, then with full snapshots only, and return the numbers.

    On the embedded 3-region bus (hub, eu, us; `RegionSet`) it runs the real path: a trainer stand-in
    (`ModelConfig.m30()` fp32 master weights, AdamW on the task corpus; `--quick`: `tiny()`) uploads each
    version to CKPT and publishes VersionReady; the publisher actor writes it into every region's WEIGHTS
    store and LATEST key; two `WeightSync` generators per region (each its own bus connection to its region)
    fetch, verify, stage it and bring their bf16 model to it in place (sparse deltas patched, anything else
    copied). The same run first times `--sync-versions` versions with deltas (the topology defaults
    `full_every` 4, `delta_depth` 3), then as many with only full snapshots (a publisher with `full_every`
    1), each from VersionReady published to every generator holding it. `speedup_vs_full` = median full /
    median delta of that end-to-end time.

    `--sync-link RATE/LATENCY` (e.g. `100mbit/30ms`) puts both leaf regions (eu, us) behind shaped links
    (topology/network/links.py: each leaf's nats-server in its own network namespace, `tbf` for the rate, the
    delaying relay for the one-way latency). What crosses a link is what the hub sends a region: the
    publisher's writes into its WEIGHTS store and LATEST key (object-store chunks, their metadata, KV reads
    and updates, JetStream API requests) and their acks. The generators stay in-process tasks, each
    connected to its own region's server at the address that region's clients use (`RegionSet.url`): their
    fetches are region-local, as in a deployment and as for `rlbus up`'s actors inside the namespace, and
    never cross the link. What is measured on the links (bytes, link seconds, round trips) and how:
    ops/bench/sync_links.py.

    Behind links the delta mode relays the leaves, as `rlbus up` does: the hub's publisher sends each one
    object per version and a `RegionRelay` per leaf (an in-process task on the leaf's server, like its
    generators) makes the region's objects there; `link_bytes_over_one_step_delta` is then what a link
    carried per version over that version's one-step delta. `--no-sync-relay` measures the path without
    relays (the publisher writes every leaf's objects across its link); `--sync-relay` relays on loopback
    too. The full mode never relays (it is the baseline).
    """
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
    relay = relayed(shape, getattr(args, "sync_relay", None))

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
        sampler = LinkSampler(rs, LEAVES) if shape is not None else None
        made = ({leaf: link.manifest() for leaf, link in sampler.links.items()} if sampler is not None
                else {})                                  # namespaces and interfaces, for leftover checks
        round_trips: list[RoundTrips] = []
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
            rtt_measured = await measure_rtt(admin, LEAVES) if shape is not None else {}
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
                    round_trips.append(RoundTrips(bus, LEAVES))
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
                    row = link_version(ready.version, sampler, round_trips[-1], t_before, time.perf_counter())
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
                                                      relay=relay)
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
        out |= link_summary(link_rows, shape, rtt_measured, LEAVES)
        out["link"]["made"] = made
    out["relay"] = relay
    return out


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
        lines += ["", *link_lines(result)]
    return "\n".join(lines)
