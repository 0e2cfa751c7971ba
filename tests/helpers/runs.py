"""Run ids: every test gets its own, so subjects, streams and buckets of tests never collide."""

from __future__ import annotations

import uuid


def new_run() -> str:
    """A fresh run id (`t` and 8 hex digits)."""
    return f"t{uuid.uuid4().hex[:8]}"
