"""Structured logging: structlog rendered as JSON lines through the stdlib ``logging`` module.

Daemons call :func:`configure` once; code everywhere gets a logger with :func:`get` and binds the
context it knows (``task``, ``node``, ``gpu``, ``rank``, ``step``) so every line can be filtered
by it. Stdlib loggers (ours and third-party) go through the same JSON renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, cast

import structlog

from unicron.kernel.errors import ConfigError

#: fields every line of this process carries (:func:`bind_process`)
_PROCESS: dict[str, object] = {}


def _process_fields(logger: Any, method: str, event_dict: Any) -> Any:
    for key, value in _PROCESS.items():
        event_dict.setdefault(key, value)
    return event_dict


def bind_process(**fields: object) -> None:
    """Fields every line of this process carries from now on, from every thread (an agent's ``node``):
    contextvars bound on the main thread do not reach threads started later, and most of a daemon's
    lines come from its threads (27 of 30 of an agent's lines had no node)."""
    _PROCESS.update(fields)


_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    _process_fields,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure(level: str = "INFO", stream: Any = None, json: bool = True) -> None:
    """Raises ConfigError for a level the stdlib does not name (any case; WARN and FATAL included)."""
    if level.upper() not in logging.getLevelNamesMapping():
        raise ConfigError(f"log level {level!r} (--log-level / UNICRON_LOG_LEVEL): expected one of DEBUG, INFO, "
                          "WARNING, ERROR, CRITICAL")
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


def _route_to_stdlib() -> None:
    """Before any :func:`configure` (a user's training script importing our client), send lines
    through stdlib ``logging`` as JSON so they land where that process's logging goes (stderr,
    warnings and up, by default) and never on its stdout, which is structlog's own default."""
    structlog.configure(
        processors=[*_SHARED, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get(
    name: str,
    *,
    task: str | None = None,
    node: str | None = None,
    gpu: int | None = None,
    rank: int | None = None,
    step: int | None = None,
    **extra: str | int,
) -> structlog.stdlib.BoundLogger:
    """A logger named ``name`` bound to the context it knows; unknown (None) fields are left out so
    a line never carries ``rank=None``. ``extra`` is for subsystem keys (``job``, ``incarnation``)."""
    if not structlog.is_configured():
        _route_to_stdlib()
    known = {"task": task, "node": node, "gpu": gpu, "rank": rank, "step": step}
    bound = {k: v for k, v in known.items() if v is not None} | extra
    # get_logger stays lazy: binding here would freeze the default configuration into a logger
    # created at import time, before the daemon's configure() runs.
    return cast(structlog.stdlib.BoundLogger, structlog.get_logger(name, **bound))
