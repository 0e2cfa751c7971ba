"""Weight publishing: every trainer version, encoded once, written into every region's weight store.

- `encoder.py`: the version encoder (deltas and snapshots from the versions kept), no bus.
- `regions.py`: the region writers (objects, then LATEST forward, then pruning; one link object per version
  into a relayed region).
- `actor.py`: `Publisher` (kind "publisher"), on the hub: CKPT version in, WeightManifest announced.
- `relay.py`: `RegionRelay` (kind "weights_relay"), in a leaf behind a link: the region's objects from what crossed.
"""

from __future__ import annotations

from rlbus.actors.publisher.actor import Publisher, build_publisher
from rlbus.actors.publisher.encoder import EncodedVersion, VersionEncoder, object_name
from rlbus.actors.publisher.regions import RegionState, RegionWriter, advance_latest
from rlbus.actors.publisher.relay import RegionRelay, build_region_relay

__all__ = ["EncodedVersion", "Publisher", "RegionRelay", "RegionState", "RegionWriter", "VersionEncoder",
           "advance_latest", "build_publisher", "build_region_relay", "object_name"]
