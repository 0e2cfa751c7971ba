"""Feeding the health model from a live run: HEALTH history, the live health subject, events, bus probes.

Owns: `HealthWatch` — with one hub connection (observer role) it loads the HEALTH stream's history (the
last heartbeat of every actor ever seen within the stream's retention, plus every heartbeat of the
recent look-back so intervals and progress are known), restart/failure events of the restart window,
then follows the live health and events subjects; `probe()` asks every region's server (ping to its URL,
JetStream through its domain) for its backlogs; `snapshot()` combines both into a `Snapshot`.
Does not: judge (ops/health/model.py) or render (ops/health/view.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import anyio
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.history import Start, read_stream, stored_at, stream_count
from rlbus.messages.schemas import Event, Heartbeat, WeightManifest
from rlbus.ops.health.model import BusHealth, HealthModel, HealthRules, RegionHealth, Snapshot
from rlbus.ops.target import Target
from rlbus.topology.network.tls import client_context

log = structlog.get_logger()

_JS_ERRORS: Final = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)


class HealthWatch:
    """A run's health, kept up to date from the bus. Use `load()`, then `follow()` in a task, `snapshot()`."""

    def __init__(self, target: Target, bus: Bus, rules: HealthRules | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.target = target
        self.bus = bus
        self.model = HealthModel(rules)
        self.clock = clock
        self._region_nc: dict[str, NATS] = {}
        self._last_bus = BusHealth(regions=[])

    # ---- heartbeats and events ------------------------------------------------------------------
    def _take(self, msg: Msg, seen_at: float) -> None:
        try:
            message = codec.decode(msg.data, msg.headers)
        except BadMessage as err:
            log.debug("health_message_skipped", subject=msg.subject, reason=str(err))
            return
        if isinstance(message, Heartbeat):
            self.model.observe(message, seen_at)
        elif isinstance(message, Event):
            self.model.observe_event(message, seen_at)

    async def load(self) -> None:
        """Read the stored history: every actor's last heartbeat, the recent look-back, recent events."""
        subjects, js = self.bus.subjects, self.bus.js
        rules = self.model.rules
        now = self.clock()
        lookback = max(rules.stall_s, 20 * rules.default_interval_s, 60.0) + 5.0
        history: list[tuple[float, Msg]] = []
        for start in (Start("last_per_subject"), Start.since(now - lookback)):
            try:
                async for msg in read_stream(js, subjects.health_stream(), subject=subjects.all_health(), start=start):
                    history.append((stored_at(msg), msg))
            except nats.js.errors.NotFoundError:
                log.warning("health_stream_missing", stream=subjects.health_stream())
                break
        for seen_at, msg in sorted(history, key=lambda x: x[0]):
            self._take(msg, seen_at)
        try:
            async for msg in read_stream(js, subjects.events_stream(), subject=subjects.all_events(),
                                         start=Start.since(now - rules.restart_window_s)):
                self._take(msg, stored_at(msg))
        except nats.js.errors.NotFoundError:
            log.warning("events_stream_missing", stream=subjects.events_stream())

    async def follow(self) -> None:
        """Take live heartbeats and events as they arrive (until cancelled)."""
        subjects = self.bus.subjects
        sub_h = await self.bus.nc.subscribe(subjects.all_health())
        sub_e = await self.bus.nc.subscribe(subjects.all_events())
        try:
            async with anyio.create_task_group() as tg:
                for sub in (sub_h, sub_e):
                    tg.start_soon(self._drain, sub)
        finally:
            with anyio.move_on_after(1.0, shield=True):
                await sub_h.unsubscribe()
                await sub_e.unsubscribe()

    async def _drain(self, sub: nats.aio.subscription.Subscription) -> None:
        async for msg in sub.messages:
            self._take(msg, self.clock())

    # ---- the bus itself -------------------------------------------------------------------------
    def _regions(self) -> list[str]:
        seen = {t.last.region for t in self.model.tracks.values()}
        return sorted(set(self.target.urls) | seen, key=lambda r: (r != self.target.hub, r))

    def _domain(self, region: str) -> str | None:
        if region in self.target.domains:
            return self.target.domains[region]
        return region          # by convention a region's JetStream domain is its name

    async def _ping(self, region: str) -> tuple[bool | None, float | None, str]:
        urls = self.target.urls.get(region)
        if not urls:
            return None, None, ""
        nc = self._region_nc.get(region)
        try:
            if nc is None or nc.is_closed:
                user, password = self.target.auth(region)
                async def quiet(err: Exception) -> None:       # the table reports it; no traceback on stderr
                    log.debug("region_ping_error", region=region, error=repr(err))

                with anyio.fail_after(3.0):   # max_reconnect_attempts=-1 would retry a first connect forever
                    tls = client_context(Path(self.target.tls_ca)) if self.target.tls_ca else None
                    nc = await nats.connect(list(urls), user=user, password=password, connect_timeout=1.5, tls=tls,
                                            allow_reconnect=True, max_reconnect_attempts=2, reconnect_time_wait=0.5,
                                            ping_interval=5, max_outstanding_pings=2, name="rlbus-health",
                                            error_cb=quiet)
                self._region_nc[region] = nc
            if not nc.is_connected:
                return False, None, "disconnected"
            return True, await nc.rtt(timeout=2) * 1000.0, ""
        except _JS_ERRORS as err:
            return False, None, repr(err)[:200]

    async def _region(self, region: str) -> RegionHealth:
        reachable, rtt, error = await self._ping(region)
        subjects = self.bus.subjects
        js = self.bus.jetstream(self._domain(region) if region != self.target.hub else self.bus.domain)
        tasks = rollouts = None
        jetstream = False
        if reachable is not False:
            try:
                with anyio.fail_after(3.0):
                    tasks = await stream_count(js, subjects.tasks_stream(region), subjects.durable("generator", region))
                    rollouts = await stream_count(js, subjects.rollouts_stream(region))
                jetstream = True
            except _JS_ERRORS as err:
                error = error or f"jetstream: {err!r}"[:200]
        return RegionHealth(region=region, url=(self.target.urls.get(region) or (None,))[0], reachable=reachable,
                            rtt_ms=None if rtt is None else round(rtt, 3), jetstream=jetstream,
                            tasks_pending=None if tasks is None else tasks.messages,
                            tasks_unacked=None if tasks is None else tasks.ack_pending,
                            rollouts_stored=None if rollouts is None else rollouts.messages, error=error)

    async def probe(self) -> BusHealth:
        """Ask every region's server and the hub's streams for their numbers (bounded; errors recorded)."""
        names = self._regions()
        found: dict[str, RegionHealth] = {}

        async def one(region: str) -> None:
            found[region] = await self._region(region)

        async with anyio.create_task_group() as tg:       # a region that is down costs its timeout once
            for region in names:
                tg.start_soon(one, region)
        regions = [found[r] for r in names]
        subjects, js = self.bus.subjects, self.bus.js
        hub = dlq = None
        newest: int | None = None
        try:
            with anyio.fail_after(3.0):
                hub = await stream_count(js, subjects.hub_rollouts_stream(), subjects.durable("trainer"))
                dlq = await stream_count(js, subjects.dead_letter_stream())
                newest = await self._newest_manifest()
        except _JS_ERRORS as err:
            log.debug("hub_probe_failed", error=repr(err))
        self.model.observe_version(newest)
        self._last_bus = BusHealth(
            regions=regions, rollouts_stored=None if hub is None else hub.messages,
            rollouts_pending=None if hub is None else hub.pending,
            rollouts_unacked=None if hub is None else hub.ack_pending,
            dead_letters=None if dlq is None else dlq.messages, newest_manifest=newest)
        return self._last_bus

    async def _newest_manifest(self) -> int | None:
        subjects = self.bus.subjects
        try:
            raw = await self.bus.js.get_last_msg(subjects.weights_stream(), subjects.weights())
        except nats.js.errors.NotFoundError:
            return None
        try:
            return codec.decode_as(raw.data or b"", raw.headers, WeightManifest).version
        except BadMessage:
            return None

    def snapshot(self, bus: BusHealth | None = None) -> Snapshot:
        """The verdicts now, with the latest probe (or `bus`)."""
        now = self.clock()
        return Snapshot(run=self.target.run, hub=self.target.hub, at=now, actors=self.model.verdicts(now),
                        bus=bus or self._last_bus, newest_policy_version=self.model.newest_version)

    async def aclose(self) -> None:
        """Close the per-region ping connections."""
        for nc in self._region_nc.values():
            with anyio.move_on_after(1.0, shield=True):
                if not nc.is_closed:
                    await nc.close()
        self._region_nc.clear()
