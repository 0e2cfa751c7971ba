"""rlbus.ops.recording.format."""
