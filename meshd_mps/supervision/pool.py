"""Idle workers, kept with their context (module unloaded) for the next load, and the pool's
reserve: its last worker, which no load takes, kept for an upgrade.

Creating an MPS client stalls every running client once (~0.44 ms on the
H200; 0.5 ms at 8 clients, 1.6 ms at 44 on an H100) and takes ~120 ms; a load
into an existing one stalls nobody.  So workers are started before any
program runs and reused.  A load that finds only the reserve left creates its
own client, at the load and said in its answer; an upgrade (or a relaunch)
takes the reserve, and gets it back from the old version's worker, so that an
upgrade in steady state creates none (docs/operations.md, "The pool").
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from meshd_mps.base.errors import FrameError, WorkerError
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")

#: Workers of a pool that no load takes (its last one), kept for an upgrade or a relaunch.
RESERVE = 1


class Pool:
    def __init__(self, cap: int, retire: Callable[[WorkerProc], None]):
        self.cap = cap
        #: The pool's last workers, which a load leaves for an upgrade (none where the pool is empty).
        self.reserve = min(cap, RESERVE)
        self._idle: list[WorkerProc] = []
        self._retire = retire

    def __len__(self) -> int:
        return len(self._idle)

    def pids(self) -> list[int]:
        return [w.pid for w in self._idle]

    def reserve_idle(self) -> int:
        """The reserve's workers idle now (fewer than ``reserve``: one was used and not yet back)."""
        return min(len(self._idle), self.reserve)

    def for_loads(self) -> int:
        """Idle workers a load may take: those above the reserve."""
        return max(0, len(self._idle) - self.reserve)

    def add(self, w: WorkerProc) -> None:
        """An idle worker in; over the cap only for a moment (a batch about to be taken)."""
        self._idle.append(w)

    def remove(self, w: WorkerProc) -> bool:
        """``w`` out of the pool (it died while idle); True if it was in it."""
        if w in self._idle:
            self._idle.remove(w)
            return True
        return False

    def take(self, load: bool = False) -> WorkerProc | None:
        """A fit idle worker, or None; unfit ones met on the way are retired.  ``load`` (a new
        program): never the reserve."""
        while len(self._idle) > (self.reserve if load else 0):
            w = self._idle.pop()
            if w.idle():
                return w
            log.info("mps: pooled worker unfit; retiring it", pid=w.pid, why=w.unfit or w.err or "exited")
            self._retire(w)
        return None

    async def give_back(self, w: WorkerProc, module: int = 0) -> bool:
        """Back to the pool with its module unloaded (UNLOAD), unless it is unfit or the
        pool is full: then it is retired.  True if kept."""
        keep = w.idle() and len(self._idle) < self.cap
        if keep:
            try:
                await w.send(Op.UNLOAD, frames.unload_body(module))
            except WorkerError:
                keep = False
        if keep:
            w.program = None
            self._idle.append(w)
        else:
            self._retire(w)
        return keep

    def drain(self) -> list[WorkerProc]:
        idle, self._idle = self._idle, []
        return idle


async def ready(p: WorkerProc) -> None:
    """READY asked of an idle worker (its context made, if it was held) and its answer checked: its own pid."""
    try:
        payload = await p.ask(Op.READY)
    except WorkerError as e:
        raise e.prefixed("mps: pool") from e
    try:
        pid = frames.ready_pid(payload)
    except FrameError as e:
        p.mark_unfit(f"worker {p.pid}: bad READY: {e}")
        raise WorkerError(f"mps: pool: worker {p.pid}: bad READY: {e}", pid=p.pid) from e
    if pid != p.pid:
        p.mark_unfit(f"worker {p.pid}: READY says pid {pid}")
        raise WorkerError(f"mps: pool: worker {p.pid}: READY says pid {pid}", pid=p.pid)
