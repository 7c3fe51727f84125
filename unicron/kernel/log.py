"""Structured logging: structlog rendered as JSON lines through the stdlib ``logging`` module.

Daemons call :func:`configure` once; code everywhere gets a logger with :func:`get` and binds the
context it knows (``task``, ``node``, ``gpu``, ``rank``, ``step``) so every line can be filtered
by it. Stdlib loggers (ours and third-party) go through the same JSON renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure(level: str = "INFO", stream: Any = None, json: bool = True) -> None:
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def get(name: str, **bound: Any) -> Any:
    """A structlog logger named ``name`` with ``bound`` context (task=, node=, gpu=, rank=, step=)."""
    # get_logger stays lazy: binding here would freeze the default configuration into a logger
    # created at import time, before the daemon's configure() runs.
    return structlog.get_logger(name, **bound)
