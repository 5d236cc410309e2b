"""One GPU's pool refilled in the background, paced: each new MPS client stalls every running
program of the GPU once (0.5 ms at 8 clients, 1.6 ms at 44 on an H100), so the refill creates one
at a time, the first ``Deadlines.pool_pace`` after it was asked for and at most one per
``pool_pace`` after that.  What it fills the pool to is the caller's: the pool's cap after pooled
workers died or a fault's recovery, its reserve once an upgrade or a relaunch took that (an
upgrade's old worker, given back within the pace, usually makes it up with no client at all)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import structlog

from meshd_mps.base.errors import MeshError
from meshd_mps.supervision.pool import Pool
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")


class Refill:
    """The paced refill of ``pool``; ``make_one`` adds one worker to it (a held one: a stop
    meanwhile leaves no client half made for the next daemon)."""

    def __init__(self, sup: Supervisor, pool: Pool, device: int, make_one: Callable[[], Awaitable[None]]):
        self.sup, self.pool, self.device, self._make_one = sup, pool, device, make_one
        self.running = False  # a task refills the pool
        self.to = 0  # what it fills the pool to
        self.asked = 0.0  # monotonic time it was last asked for: the next client waits pool_pace from it
        self.last_client = 0.0  # monotonic time the last client of the GPU was made (a refill's, a recovery's)
        self.closing = False

    def ask(self, to: int) -> None:
        """The pool refilled to ``to`` workers (a refill under way fills to the larger of the two)."""
        if self.closing:
            return
        self.to = max(to, self.to if self.running else 0)
        self.asked = time.monotonic()
        if not self.running:
            self.running = True
            self.sup.start_soon(self._run, name=f"pool refill GPU {self.device}")

    async def _run(self) -> None:
        try:
            while not self.closing:
                wait = max(self.last_client, self.asked) + self.sup.deadlines.pool_pace - time.monotonic()
                if wait > 0:
                    await anyio.sleep(wait)
                    continue
                if len(self.pool) >= self.to:
                    break
                self.last_client = time.monotonic()
                try:
                    await self._make_one()
                except MeshError as e:
                    log.error(f"mps: GPU {self.device}: a pooled worker was not replaced: {e}", device=self.device)
                    return
        finally:
            self.running = False
