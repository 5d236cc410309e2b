"""A program's residency on a slot, as the caller awaits it.

In blink mode a resident kernel is halted and relaunched around every module
load; its caller should not see those as endings.  A :class:`Launch` follows
the generation that runs now and resolves only when the program really ends
(or its worker dies).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from meshd_mps.protocol.frames import Done


class Launch:
    def __init__(self, name: str, slot: int, nodes: int, inner: asyncio.Future[Done]):
        self.name = name
        self.slot = slot
        self.nodes = nodes
        self._inner = inner
        self._steady = asyncio.Event()  # cleared while a blink halts and relaunches it
        self._steady.set()
        inner.add_done_callback(_quiet)

    @property
    def inner(self) -> asyncio.Future[Done]:
        return self._inner

    def blinking(self) -> None:
        self._steady.clear()

    def relaunched(self, inner: asyncio.Future[Done]) -> None:
        inner.add_done_callback(_quiet)
        self._inner = inner
        self._steady.set()

    def relaunch_failed(self, error: BaseException) -> None:
        fut: asyncio.Future[Done] = asyncio.get_running_loop().create_future()
        fut.set_exception(error)
        self.relaunched(fut)

    def finished(self) -> bool:
        return self._inner.done() and self._steady.is_set()

    async def wait(self) -> Done:
        """The program's last DONE; WorkerError if its worker died or broke."""
        while True:
            fut = self._inner
            try:
                d = await asyncio.shield(fut)
            except Exception:
                await self._steady.wait()
                if self._inner is fut:
                    raise
                continue
            await self._steady.wait()
            if self._inner is fut:
                return d

    def __await__(self) -> Generator[Any, None, Done]:
        return self.wait().__await__()


def _quiet(fut: asyncio.Future[Done]) -> None:
    """Mark an exception as retrieved: a launch nobody awaits must not warn at exit."""
    if not fut.cancelled():
        fut.exception()
