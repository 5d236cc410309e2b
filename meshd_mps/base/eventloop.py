"""Which event loop runs the daemon and the bench: uvloop where it is installed.

Every frame to or from a worker costs the one event loop a few wake-ups, and
on the H200 host the loop, not the pipe, is most of an ask's round trip
(docs/benchmarks.md, row b); uvloop (libuv) cuts the loop's share.  It is
optional: the plain asyncio loop runs the same code, and ``--loop asyncio``
asks for it.  No child is ever started through the loop's own subprocess
support (child.py connects the pipes itself): uvloop's leaks copies of the
child's stdio into the child, so a daemonized child never gave EOF.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from meshd_mps.base.errors import ConfigError

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


class LoopError(ConfigError):
    """The loop asked for is not installed."""


def factory(choice: str = "auto") -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(the loop's name, its factory); None for asyncio's default loop."""
    if choice not in CHOICES:
        raise LoopError(f"loop {choice}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError as e:
        if choice == "uvloop":
            raise LoopError("loop uvloop: uvloop is not installed (pip install 'meshd-mps[uvloop]')") from e
        return "asyncio", None
    return f"uvloop {uvloop.__version__}", uvloop.new_event_loop


def run(main: Callable[[], Coroutine[Any, Any, T]], choice: str = "auto") -> T:
    """``asyncio.run(main())`` on the chosen loop."""
    _name, make = factory(choice)
    with asyncio.Runner(loop_factory=make) as runner:
        return runner.run(main())
