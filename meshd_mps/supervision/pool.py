"""Idle workers, kept with their context (module unloaded) for the next load.

Creating an MPS client stalls every running client once (~0.44 ms on the
H200) and takes ~120 ms; a load into an existing client stalls nobody.  So
workers are started before any program runs and reused.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from meshd_mps.errors import WorkerError
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")


class Pool:
    def __init__(self, cap: int, retire: Callable[[WorkerProc], None]):
        self.cap = cap
        self._idle: list[WorkerProc] = []
        self._retire = retire

    def __len__(self) -> int:
        return len(self._idle)

    def pids(self) -> list[int]:
        return [w.pid for w in self._idle]

    def add(self, w: WorkerProc) -> None:
        """An idle worker in; over the cap only for a moment (a batch about to be taken)."""
        self._idle.append(w)

    def take(self) -> WorkerProc | None:
        """A fit idle worker, or None; unfit ones met on the way are retired."""
        while self._idle:
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
