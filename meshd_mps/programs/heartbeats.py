"""Each program's heartbeat, watched: a running program whose heartbeat has not advanced for
``stall_after`` is stalled, and running again once it beats."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import structlog

from meshd_mps.programs.program import ProgramState

if TYPE_CHECKING:
    from meshd_mps.programs.registry import Registry

log = structlog.get_logger("meshd_mps")


class Heartbeats:
    def __init__(self, reg: Registry):
        self.reg = reg

    async def watch(self) -> None:
        """Every program's heartbeat, read often enough to see a stall within a fraction of
        ``stall_after`` (a read of one word per program)."""
        every = min(1.0, self.reg.stall_after / 4)
        while True:
            self.sample()
            await anyio.sleep(every)

    def sample(self) -> None:
        """Note each program's heartbeat; a running one whose heartbeat has not advanced for
        ``stall_after`` is stalled.  The start and the end of a stall are logged once each."""
        now = time.monotonic()
        mb = self.reg.b.mailbox
        stall_after = self.reg.stall_after
        for p in list(self.reg.by_name.values()):
            hb = mb.heartbeat(p.slot)
            p.saw_beat(hb, now)
            ended = p.launch.finished()
            if p.stalled_at and (ended or p.beat_at > p.stalled_at):
                since = p.stalled_at
                p.to(None if ended else ProgramState.RUNNING, stalled_at=0.0)
                how = f"it ended ({p.state()[0]})" if ended else "it beats again"
                log.info(f"program {p.name} no longer stalled after {now - since + stall_after:.1f}s: {how}",
                         program=p.name, slot=p.slot)
            elif p.beaten and not p.stalled_at and not ended and now - p.beat_at >= stall_after:
                p.to(ProgramState.STALLED, stalled_at=now)
                log.warning(f"program {p.name} stalled: its heartbeat has not advanced for {now - p.beat_at:.1f}s",
                            program=p.name, slot=p.slot, heartbeat=hb)
