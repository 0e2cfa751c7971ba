"""The checkpointer actor: turns the trainer's uploaded state into durable checkpoints and announces them.

Owns: its durable consumer on STATE filtered to `state.upload` (created in setup); per `StateUploaded`:
download every object and check its digest (a mismatch or a missing object is an `Event(incident)`, a dead
letter with the reason and no mark — the trainer's next upload is checked afresh), copy the objects atomically to
`<state_dir>/checkpoints/step-<N>/` (temporary directory, fsync, rename), publish
`CheckpointMark` (msg_id `ckpt-<N>`) and `Event(checkpoint)`, then keep only the newest `keep`
checkpoints (directories and CKPT objects).
Does not: decide when to checkpoint or read the state's contents (actors/trainer/actor.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.checkpoints import checkpoint_dir, durable_marks, durable_steps, write_durable
from rlbus.actors.common.config import CheckpointerConfig, CheckpointerLaunch, decode_config
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus, Delivery
from rlbus.messages.errors import BadMessage, DigestMismatch
from rlbus.messages.objects import delete_object
from rlbus.messages.schemas import CheckpointMark, StateUploaded
from rlbus.messages.streams import ensure_consumer
from rlbus.messages.subjects import Subjects

log = structlog.get_logger()



def build_checkpointer(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                       launch: CheckpointerLaunch | None = None) -> Checkpointer:
    """The checkpointer of a `[checkpoint]` section (plain values) — called by actors/kinds.py.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Checkpointer(ident, bus, decode_config("checkpoint", settings, CheckpointerConfig), limits, launch)


class Checkpointer(Actor):
    """Verifies `StateUploaded`, makes it durable, publishes `CheckpointMark`; keeps the newest `keep`."""

    kind = "checkpointer"

    def __init__(self, ident: ActorId, bus: Bus, config: CheckpointerConfig | None = None,
                 limits: ActorLimits | None = None, launch: CheckpointerLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.config = config or CheckpointerConfig()
        self.launch = launch or CheckpointerLaunch()
        self.subjects: Subjects = bus.subjects
        self.state_dir = Path(self.launch.state_dir) if self.launch.state_dir else None
        self.kept: list[tuple[int, list[str]]] = []
        """(step, objects) of the marks this checkpointer published, oldest first."""

    async def setup(self) -> None:
        s = self.subjects
        await ensure_consumer(self.bus.js, s.state_stream(), ConsumerConfig(
            durable_name=s.durable("checkpointer"), filter_subject=s.state_uploads(), ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.launch.ack_wait_s, max_deliver=-1, max_ack_pending=1))
        if self.state_dir is not None:              # a restarted checkpointer still prunes what it kept before
            state_dir = self.state_dir
            self.kept = await anyio.to_thread.run_sync(lambda: durable_marks(state_dir))

    async def run(self) -> None:
        s = self.subjects
        async for delivery in self.bus.consume(s.state_stream(), s.durable("checkpointer"), StateUploaded, batch=1):
            with self.busy():
                await self._handle(delivery)

    async def drain(self) -> None:
        """Mark the uploads that arrive while everything shuts down (the trainer's drain checkpoint)."""
        if self.launch.drain_linger_s <= 0:
            return
        s = self.subjects
        psub = await self.bus.js.pull_subscribe_bind(durable=s.durable("checkpointer"), stream=s.state_stream())
        try:
            while True:
                try:
                    msgs = await psub.fetch(1, timeout=self.launch.drain_linger_s)
                except (nats.errors.TimeoutError, TimeoutError):
                    return
                for msg in msgs:
                    try:
                        upload = codec.decode_as(msg.data, msg.headers, StateUploaded)
                        checks.check(upload)
                    except BadMessage as err:
                        await self.bus.dead_letter(msg, reason=str(err), source=s.state_stream())
                        continue
                    await self._handle(Delivery(message=upload, raw=msg))
        finally:
            with anyio.move_on_after(1.0, shield=True):
                await psub.unsubscribe()

    async def _handle(self, delivery: Delivery[StateUploaded]) -> None:
        upload = delivery.message
        bucket = self.subjects.checkpoint_bucket()
        blobs: dict[str, bytes] = {}
        try:
            if not upload.objects or len(upload.objects) != len(upload.digests):
                raise DigestMismatch(f"{len(upload.objects)} objects with {len(upload.digests)} digests")
            for name, expected in zip(upload.objects, upload.digests, strict=True):
                blobs[name] = await self.bus.get_object(bucket, name, expected_digest=expected)
        except (DigestMismatch, nats.js.errors.NotFoundError) as err:
            self.count("rejected")
            log.warning("checkpoint_rejected", step=upload.step, objects=upload.objects, error=repr(err))
            await self.emit("incident", detail=f"state upload of step {upload.step} rejected: {err}",
                            step=str(upload.step), reason="digest" if isinstance(err, DigestMismatch) else "missing")
            kept = self._kept_objects()
            for name in upload.objects:
                if name not in kept:
                    await delete_object(self.bus.js, bucket, name)
            await self.bus.dead_letter(delivery.raw, reason=f"state upload of step {upload.step} rejected: {err}",
                                       source=self.subjects.state_stream())
            return
        mark = CheckpointMark(step=upload.step, policy_version=upload.policy_version, objects=list(upload.objects),
                              digests=list(upload.digests), consumed_rollout_ids=list(upload.consumed_rollout_ids),
                              parent_step=upload.parent_step)
        if self.state_dir is not None:
            state_dir = self.state_dir
            await anyio.to_thread.run_sync(lambda: write_durable(state_dir, mark, blobs))
        await self.bus.publish_once(self.subjects.checkpoints(), mark, msg_id=f"ckpt-{mark.step}")
        await self.emit("checkpoint", detail=f"step {mark.step} (version {mark.policy_version}) is durable",
                        step=str(mark.step), version=str(mark.policy_version),
                        bytes=str(sum(len(b) for b in blobs.values())))
        await delivery.ack_sync()
        self.count("marks")
        self.gauges["step"] = float(mark.step)
        self.policy_version = mark.policy_version
        log.info("checkpoint_marked", step=mark.step, version=mark.policy_version, objects=mark.objects,
                 consumed=len(mark.consumed_rollout_ids))
        await self._prune(mark)

    def _kept_objects(self) -> set[str]:
        """Every object a kept checkpoint lists: never deleted (shard objects are named by their content, so two
        checkpoints can list the same one)."""
        return {name for _, names in self.kept for name in names}

    async def _prune(self, mark: CheckpointMark) -> None:
        """Keep the newest `keep` checkpoints: older durable directories and CKPT objects go."""
        self.kept = [(s, o) for s, o in self.kept if s != mark.step] + [(mark.step, list(mark.objects))]
        while len(self.kept) > self.config.keep:
            _, objects = self.kept.pop(0)
            still = self._kept_objects()
            for name in objects:
                if name not in still:
                    await delete_object(self.bus.js, self.subjects.checkpoint_bucket(), name)
        if self.state_dir is not None:
            state_dir, keep = self.state_dir, self.config.keep
            await anyio.to_thread.run_sync(lambda: _prune_dirs(state_dir, keep))


def _prune_dirs(state_dir: Path, keep: int) -> None:
    for step in durable_steps(state_dir)[:-keep]:
        shutil.rmtree(checkpoint_dir(state_dir, step), ignore_errors=True)
