"""Live restore's side of the programs: a module an earlier meshd-mps left running adopted as it
runs (its launch time and restarts carried over when they were kept), or discarded."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from meshd_mps.base.errors import AlreadyLoaded
from meshd_mps.base.restart import Policy
from meshd_mps.base.restore import Restore
from meshd_mps.programs.data import Recorded
from meshd_mps.programs.datastore import ProgramData
from meshd_mps.programs.program import Program
from meshd_mps.protocol import frames

if TYPE_CHECKING:
    from meshd_mps.gpu.compiler import Manifest
    from meshd_mps.isolation.base import Found
    from meshd_mps.programs.recovery import Recovery
    from meshd_mps.programs.registry import Registry

log = structlog.get_logger("meshd_mps")


class Adoption:
    def __init__(self, reg: Registry, recovery: Recovery):
        self.reg = reg
        self.recovery = recovery

    async def adopt(self, f: Found, manifest: Manifest, ptx: bytes, hash: int, nodes: int,
                    restart: Policy | str | None = None, *, started_wall: float | None = None,
                    restarts: int = 0, restore: Restore | str = Restore.RELOAD, data: Recorded | None = None) -> Program:
        """A program an earlier meshd-mps left running (live restore, ``Backend.found``), taken
        over as it runs: its worker, kernel and launch unchanged, nothing halted, its heartbeat
        counted on from the mailbox.  The caller (state/desired.py) matched it to its record.
        ``started_wall`` and ``restarts``: its launch's wall time and its relaunches, as the
        earlier daemon kept them (its uptime counts from that launch, as docker's does); ``restore``:
        its record's restore mode, kept; ``data``: its record's data, which its worker holds still."""
        reg = self.reg
        pol = reg.restart if restart is None else Policy.parse(restart)
        mode = Restore.parse(restore)
        assert f.launch is not None, "adopt: a module with no launch runs nothing"
        pd = None
        if data is not None:
            pd = ProgramData(data.spec, written=data.written)
        async with reg.lock:
            if f.name in reg.by_name:
                raise AlreadyLoaded(f.name)
            slot = reg.free_slot(f.launch.slot)
            # The region its worker maps still, opened again (MailboxError where it is gone: then the
            # module is discarded and the program loaded again from its record), before it is taken.
            region = reg.payloads(manifest, existing=True)
            k = reg.b.take(f, manifest)
            k.payloads = region
            assert k.launch is not None
            now, wall = time.monotonic(), time.time()
            since = wall if started_wall is None or started_wall > wall else started_wall
            p = Program(f.name, slot, k, k.launch, hash, nodes, cached=True, manifest=manifest, ptx=ptx, restart=pol,
                        restore=mode, started=now - (wall - since), started_wall=since, restarts=restarts, data=pd)
            if pd is not None:
                reg.b.held(k.proc, slot, pd.token, pd.spec.alloc)  # the worker kept it, as it kept the kernel
            p.saw_beat(reg.b.mailbox.heartbeat(slot), now)  # it beat before we came: a stall from here on is one
            self.recovery.install(p)
            log.info(f"program {f.name} adopted on slot {slot}, GPU {k.device}, worker {k.pid}: it runs on",
                     program=f.name, pid=k.pid, slot=slot, device=k.device, heartbeat=p.beat)
            return p

    async def discard(self, f: Found, why: str) -> None:
        """An adopted module that the desired state does not want (no record names it, another
        version, a half-done load or upgrade): its kernel halted through its slot if it runs, and
        the module unloaded (MPS: its worker back to the pool; blink: in one blink)."""
        async with self.reg.lock:
            k = self.reg.b.take(f, None)
            log.warning(f"program {f.name} on worker {k.pid}: halted and unloaded at adoption: {why}", program=f.name,
                        pid=k.pid, slot=f.launch.slot if f.launch else None)
            if k.launch is not None:
                if k.proc.hello is not None and k.proc.hello.version >= frames.DATA_SINCE:
                    self.reg.b.held(k.proc, k.launch.slot, (0, 0), 0)  # whatever the slot's data there, it goes
                    await self.reg.b.free(k.proc, k.launch.slot)
                await self.reg.b.abandon(k, k.launch.slot)
            else:
                await self.reg.b.unload(k)
