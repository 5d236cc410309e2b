"""The worker's log: the daemon's line format (meshd_mps/base/log.py), written without structlog.

Why not structlog here: importing it costs a worker 78 ms of its ~180 ms start (it imports
asyncio, which no worker uses), paid by every pooled worker and every relaunch, and by each of
the ~500 workers the CPU suite starts.  A worker logs a few lines in its life, each one level,
a message and fields, so this module writes exactly what ``setup_logging`` would: a JSON line
(``level``, ``timestamp``, ``msg``, ``component``, the bound and the given fields) when stderr
is not a terminal, else the console renderer's ``time [level   ] msg key=value`` line.
Always stderr: a worker's stdout carries frames.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from typing import Any

from meshd_mps.base.defaults import LOG_FORMAT_ENV, log_level

#: logging's numbers (the levels setup_logging filters by), without importing logging.
_LEVELS = {"CRITICAL": 50, "ERROR": 40, "WARNING": 30, "INFO": 20, "DEBUG": 10, "NOTSET": 0}
_state: dict[str, Any] = {"level": _LEVELS["INFO"], "json": True, "component": "worker"}
_bound: dict[str, Any] = {}


def setup(component: str = "worker", level: str | None = None, as_json: bool | None = None) -> None:
    """As ``meshd_mps.base.log.setup_logging``: the level from ``MESHD_MPS_LOG_LEVEL`` (default info);
    the daemon's format (``MESHD_MPS_LOG_FORMAT``, its stderr is ours), else JSON unless stderr is a
    terminal."""
    name = log_level(level)
    if as_json is None:
        told = os.environ.get(LOG_FORMAT_ENV)
        as_json = told == "json" if told in ("json", "console") else not sys.stderr.isatty()
    _state.update(level=_LEVELS[name], json=as_json, component=component)


def bind(**fields: Any) -> None:
    """Fields every later line carries (the worker's pid and GPU)."""
    _bound.update(fields)


def _line(level: str, msg: str, fields: dict[str, Any]) -> str:
    stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")  # structlog's TimeStamper("iso", utc=True)
    if _state["json"]:
        event = {**fields, **_bound, "level": level, "timestamp": stamp, "msg": msg, "component": _state["component"]}
        return json.dumps(event, default=repr)
    kv = " ".join(f"{k}={v if isinstance(v, str) else repr(v)}"
                  for k, v in sorted({**fields, **_bound, "component": _state["component"]}.items()))
    return f"{stamp} [{level:<9}] {msg:<30} {kv}".rstrip()


class Logger:
    """``log.info("what", key=value)``, as structlog's bound logger is called."""

    def _log(self, level: str, msg: str, fields: dict[str, Any]) -> None:
        if _LEVELS[level.upper()] < _state["level"]:
            return
        print(_line(level, msg, fields), file=sys.stderr, flush=True)

    def debug(self, msg: str, **fields: Any) -> None:
        self._log("debug", msg, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._log("info", msg, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._log("warning", msg, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._log("error", msg, fields)


log = Logger()
