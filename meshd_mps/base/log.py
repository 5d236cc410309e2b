"""structlog set-up: JSON lines to stderr when it is not a TTY, a console otherwise.

Always stderr: a worker's stdout carries frames, and structlog's default
(stdout) would corrupt them.  Per-worker context (pid, program) is bound with
contextvars, so every line a task logs carries it.
"""

from __future__ import annotations

import logging
import sys

import structlog

from meshd_mps.base.defaults import log_level


def setup_logging(component: str = "meshd", level: str | None = None, json: bool | None = None) -> bool:
    """structlog configured for this process; True if it writes JSON lines."""
    level = log_level(level)
    if json is None:
        json = not sys.stderr.isatty()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.EventRenamer("msg") if json else _noop,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, _component(component), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return json


def _noop(_logger: object, _name: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    return event


def _component(name: str) -> structlog.typing.Processor:
    def add(_logger: object, _method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("component", name)
        return event

    return add
