"""`rlbus bench bus`: typed Rollouts through rlbus vs raw nats-py moving the same wire bytes.

Owns: the bus benchmark. Both arms run in the same process against one embedded JetStream server, on
fresh streams with identical settings: publish N messages pipelined with `Nats-Msg-Id` and wait for
every ack, then pull them with `fetch` and ack each. The rlbus arm encodes typed Rollouts (msgspec +
zstd above the threshold) and decodes/validates each one on consumption; the raw arm moves the exact
bytes the rlbus arm produced. Rounds alternate arms; the median round is reported.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=int, default=2000, help="bus: messages per arm and round (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="bus/…: alternating rounds; the median is reported")
    p.add_argument("--tokens", type=int, default=4000, help="bus: completion tokens per Rollout (~12 B each)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    n = 200 if args.quick else args.messages
    rounds = 1 if args.quick else args.rounds
    return anyio.run(_run, n, rounds, args.tokens, backend="asyncio")


async def _run(n: int, rounds: int, tokens: int) -> dict[str, Any]:
    import random
    import tempfile
    import time
    import uuid

    import msgspec
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

    from rlbus.actors.demo import synthetic_rollout
    from rlbus.messages import codec
    from rlbus.messages.bus import MSG_ID_HEADER, Bus, ConnectOptions
    from rlbus.messages.schemas import Rollout
    from rlbus.topology.network.server_config import ServerOptions
    from rlbus.topology.network.servers import EmbeddedServer

    rng = random.Random(0)
    rollouts = [synthetic_rollout(f"r{i}", "hub", "bench", tokens, rng) for i in range(n)]
    batch = 64
    variants = {"default": codec.COMPRESS_ABOVE, "zstd": 0}

    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        server = EmbeddedServer.start(tmp, ServerOptions(name="bench"))
        try:
            cred = server.credential("admin")
            bus = await Bus.connect(server.url, run=f"b{uuid.uuid4().hex[:8]}",
                                    options=ConnectOptions(user=cred.user, password=cred.password))
            js = bus.js

            async def fresh_stream(tag: str) -> tuple[str, str]:
                name = f"BENCH_{tag}_{uuid.uuid4().hex[:6]}"
                subject = bus.subjects.rollouts(name)
                await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.FILE,
                                                 duplicate_window=120))
                await js.add_consumer(name, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT,
                                                           ack_wait=30, max_ack_pending=10_000))
                return name, subject

            async def rlbus_arm(threshold: int) -> tuple[float, float]:
                stream, subject = await fresh_stream("rlbus")
                t0 = time.perf_counter()
                await bus.publish_batch([(subject, r, r.rollout_id) for r in rollouts], compress_above=threshold)
                t1 = time.perf_counter()
                seen = 0
                async for delivery in bus.consume(stream, "c", Rollout, batch=batch, fetch_timeout_s=5.0):
                    await delivery.ack()
                    seen += 1
                    if seen == n:
                        break
                t2 = time.perf_counter()
                await js.delete_stream(stream)
                return t1 - t0, t2 - t1

            async def raw_arm(threshold: int) -> tuple[float, float]:
                wire = [codec.encode(r, compress_above=threshold) for r in rollouts]   # the same bytes, untimed
                stream, subject = await fresh_stream("raw")
                t0 = time.perf_counter()
                futures = []
                for i, (data, headers) in enumerate(wire):
                    futures.append(await js.publish_async(subject, data, headers={**headers, MSG_ID_HEADER: f"r{i}"}))
                    if len(futures) >= 256:
                        for f in futures:
                            await f
                        futures = []
                for f in futures:
                    await f
                t1 = time.perf_counter()
                psub = await js.pull_subscribe_bind(durable="c", stream=stream)
                seen = 0
                while seen < n:
                    for msg in await psub.fetch(batch, timeout=5.0):
                        await msg.ack()
                        seen += 1
                await psub.unsubscribe()
                t2 = time.perf_counter()
                await js.delete_stream(stream)
                return t1 - t0, t2 - t1

            results: dict[str, list[tuple[float, float]]] = {}
            wire_bytes = {}
            for variant, threshold in variants.items():
                wire_bytes[variant] = len(codec.encode(rollouts[0], compress_above=threshold)[0])
                for r in range(rounds):
                    order = (raw_arm, rlbus_arm) if r % 2 == 0 else (rlbus_arm, raw_arm)
                    for arm in order:
                        key = f"{'rlbus' if arm is rlbus_arm else 'raw'}_{variant}"
                        results.setdefault(key, []).append(await arm(threshold))
            await bus.close()
        finally:
            server.stop()

    def rate(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
        pub = statistics.median(n / p for p, _ in samples)
        con = statistics.median(n / c for _, c in samples)
        total = statistics.median(n / (p + c) for p, c in samples)
        return pub, con, total

    out: dict[str, Any] = {}
    for variant in variants:
        suffix = "" if variant == "default" else f"_{variant}"
        rp, rc, rt = rate(results[f"rlbus_{variant}"])
        wp, wc, wt = rate(results[f"raw_{variant}"])
        out |= {
            f"rlbus_msgs_per_s{suffix}": round(rt, 1),
            f"raw_msgs_per_s{suffix}": round(wt, 1),
            f"ratio{suffix}": round(rt / wt, 3),
            f"rlbus_publish_msgs_per_s{suffix}": round(rp, 1),
            f"raw_publish_msgs_per_s{suffix}": round(wp, 1),
            f"rlbus_consume_msgs_per_s{suffix}": round(rc, 1),
            f"raw_consume_msgs_per_s{suffix}": round(wc, 1),
            f"wire_bytes{suffix}": wire_bytes[variant],
        }
    return out | {"message_bytes": len(msgspec.msgpack.encode(rollouts[0])), "messages": n, "rounds": rounds,
                  "compress_above": codec.COMPRESS_ABOVE}


def table(result: dict[str, Any]) -> str:
    rows = [("arm", "wire bytes", "publish msg/s", "consume msg/s", "end-to-end msg/s", "ratio")]
    for suffix, label in (("", "default codec"), ("_zstd", "zstd forced")):
        for arm, name in (("rlbus", "rlbus typed"), ("raw", "raw nats-py")):
            rows.append((f"{name} ({label})", str(result[f"wire_bytes{suffix}"]),
                         f"{result[f'{arm}_publish_msgs_per_s{suffix}']:.0f}",
                         f"{result[f'{arm}_consume_msgs_per_s{suffix}']:.0f}",
                         f"{result[f'{arm}_msgs_per_s{suffix}']:.0f}",
                         f"{result[f'ratio{suffix}']:.3f}" if arm == "rlbus" else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"\nratio rlbus/raw = {result['ratio']:.3f} (default codec: zstd above {result['compress_above']} B)"
                 f"; Rollout {result['message_bytes']} B; {result['messages']} msgs x {result['rounds']} rounds")
    return "\n".join(lines)
