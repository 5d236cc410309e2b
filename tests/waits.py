"""The tests' one polling loop: wait for a condition under a deadline (never a bare sleep)."""

from __future__ import annotations

import time

import anyio
import pytest


def poll(cond, within: float, what: str, every: float = 0.01):
    """cond() until it returns something truthy; its value, or a test failure naming ``what``."""
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within:g} s: {what}")
        time.sleep(every)  # the polling interval, not synchronisation


async def until(cond, within: float = 20.0, what: str = "the condition", every: float = 0.01):
    """``poll`` for async tests: cond() until it returns something truthy, the loop's other tasks
    running meanwhile; its value, or a test failure naming ``what``."""
    with anyio.move_on_after(within):
        while not (got := cond()):
            await anyio.sleep(every)  # the polling interval, not synchronisation
        return got
    pytest.fail(f"not within {within:g} s: {what}")
