"""structlog setup: JSON lines by default, readable key=value lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO", *, json: bool | None = None, stream=None) -> None:
    """Route structlog (and stdlib logging) to `stream` (stderr).

    `json=None` picks JSON unless the stream is a TTY. Every event carries a timestamp, the level
    and whatever was bound (request_id, worker).
    """
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level.upper(), stream=stream, format="%(levelname)s %(name)s: %(message)s")


def get_logger(name: str = "pagedq", **bound):
    return structlog.get_logger(name).bind(**bound)
