"""A program's kernel onto its slot and off it: loaded, launched and seen started (or rolled
back), and halted through its slot within a deadline."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import anyio
import structlog

from meshd_mps.base.errors import HaltTimeout, NotStarted, WorkerError
from meshd_mps.isolation import limits
from meshd_mps.programs.data import Data
from meshd_mps.protocol import abi, frames

if TYPE_CHECKING:
    from meshd_mps.backend import Image, Kernel
    from meshd_mps.isolation.launch import Launch
    from meshd_mps.programs.datastore import ProgramData
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.registry import Registry

log = structlog.get_logger("meshd_mps")


class Launching:
    def __init__(self, reg: Registry):
        self.reg = reg
        self.data = Data(reg)

    async def start(self, img: Image, slot: int, nodes: int, used: float,
                    data: ProgramData | None = None) -> tuple[Kernel, Launch]:
        """Loaded, launched, and seen started; anything less is rolled back.  ``used``: the shares
        of its GPU's blocks that the other programs hold (the module's real occupancy is checked
        against what they leave before it is launched)."""
        name = img.name

        def admit(info: frames.Loaded) -> None:
            limits.check_resident(name, nodes, info.per_sm, info.sms, used)

        k = await self.reg.b.load(img, admit)
        return k, await self.launch(k, slot, nodes, data=data)

    async def launch(self, k: Kernel, slot: int, nodes: int, *, data: ProgramData | None) -> Launch:
        """A loaded kernel launched on ``slot`` and seen started, its program's ``data`` placed in
        its worker first; anything less is rolled back."""
        b = self.reg.b
        try:
            await self.data.place(k.proc, k.name, slot, data)
            b.mailbox.reset_slot(slot)
            run = await b.launch(k, slot, nodes)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await b.unload(k)
            raise
        try:
            await self.until_started(k, run, slot)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await b.abandon(k, slot)
            raise
        b.keep_reserve(k.device)  # an upgrade's old worker is back by now; a relaunch may have taken it
        return run

    async def until_started(self, k: Kernel, run: Launch, slot: int) -> None:
        """The start check: a launched kernel counts only once it has set STATE = RUNNING (or
        already ended), within the start deadline; NotStarted otherwise.  A kernel on a hardware
        queue held by a resident one, or whose blocks wait for SMs, is launched but never runs."""
        timeout = self.reg.d.start
        mb = self.reg.b.mailbox
        t0 = time.perf_counter()
        with anyio.move_on_after(timeout):
            while mb.u32(slot, abi.STATE) == abi.IDLE and not run.inner.done():
                # The kernel writes STATE within microseconds of LAUNCHED: yield first, then back off.
                await anyio.sleep(0 if time.perf_counter() - t0 < 200e-6 else 1e-3)
            self.reg.start_ms.append((time.perf_counter() - t0) * 1e3)
            del self.reg.start_ms[:-1000]
            return
        why = self.reg.b.not_started_why(k.device)
        # Not logged here: the caller says it once (the API's refusal, a relaunch's or a restore's failure).
        raise NotStarted(f"{k.name}: the kernel was launched but did not start within {timeout:g}s (STATE is not RUNNING):"
                         f" likely {why}; the load was rolled back", program=k.name, within=timeout, likely=why)

    async def halt(self, p: Program, within: float | None = None) -> None:
        """HALT through the slot and wait for the program's DONE; an MPS worker that
        does not stop is killed, since it would never be fit again."""
        if p.launch.finished():
            return
        within = self.reg.d.halt if within is None else within
        self.reg.b.mailbox.halt(p.slot)
        with anyio.move_on_after(within):
            with contextlib.suppress(WorkerError):
                await p.launch.wait()
            return
        if self.reg.b.retire_stuck(p.kernel):
            log.error(f"program {p.name} did not halt in {within:g}s; retiring its worker", pid=p.kernel.pid)
            return
        raise HaltTimeout(f"program {p.name} did not halt within {within:g}s", programs=(p.name,), within=within)
