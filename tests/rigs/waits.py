"""The tests' one polling loop: wait for a condition under a deadline (never a bare sleep).

``poll`` (blocking) and ``until`` (async) take the same arguments in the same order:
``cond, within, what, every``.  ``what`` names what was waited for in the failure; a callable is
asked only then (so that it can say what it saw).  ``poll``'s conditions mostly ask another process
(a daemon's status over HTTP, /proc): it asks every 20 ms, not every 10, so that a suite of waits
does not keep the daemons busy answering; ``until``'s are read in-process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

What = str | Callable[[], str]


def _said(what: What) -> str:
    return what() if callable(what) else what


def poll(cond: Callable[[], Any], within: float = 20.0, what: What = "the condition", every: float = 0.02) -> Any:
    """cond() until it returns something truthy; its value, or a test failure naming ``what``."""
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within:g} s: {_said(what)}")
        time.sleep(every)  # the polling interval, not synchronisation


async def until(cond: Callable[[], Any], within: float = 20.0, what: What = "the condition", every: float = 0.01) -> Any:
    """``poll`` for async tests: cond() until it returns something truthy, the loop's other tasks
    running meanwhile; its value, or a test failure naming ``what``."""
    with anyio.move_on_after(within):
        while not (got := cond()):
            await anyio.sleep(every)  # the polling interval, not synchronisation
        return got
    pytest.fail(f"not within {within:g} s: {_said(what)}")
