from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """nats-py is asyncio-only."""
    return "asyncio"
