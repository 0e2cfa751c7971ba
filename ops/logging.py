"""Logging setup for every rlbus process: structlog, pretty on a terminal, JSON otherwise.

Owns: `configure_logging()`, called once by each process entry (the CLI, an actor process). Library
modules only call `structlog.get_logger()`.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, json: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog once. `json=None`: JSON unless stderr is a terminal."""
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if as_json else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
    )


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    """A logger on whatever `sys.stderr` is now (not the one at configure time: tests swap it)."""
    return structlog.PrintLogger(sys.stderr)
