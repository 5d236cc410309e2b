"""The programs loaded, by name, and what every job of ``Programs`` shares: the lock that takes one
change at a time, the mailbox slots and the GPUs they are placed on, the counters the metrics read,
and the recorder of the desired state."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
import structlog

from meshd_mps.backend import payloads
from meshd_mps.base.errors import MeshError, NoFreeSlot, NotLoaded, SlotTaken
from meshd_mps.base.restart import Policy
from meshd_mps.protocol import abi

if TYPE_CHECKING:
    from meshd_mps.backend import Backend
    from meshd_mps.gpu.compiler import Manifest
    from meshd_mps.programs.datastore import DataStore
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.recorder import Recorder
    from meshd_mps.programs.report import FaultReport
    from meshd_mps.protocol.payloads import Region

log = structlog.get_logger("meshd_mps")

#: The recent fault reports a live restore carries over (status shows the last 10).
KEEP_FAULTS = 20


class Registry:
    """``restart``: the restart policy of a program loaded without one; ``stall_after``: seconds
    without a heartbeat before a running program is stalled."""

    def __init__(self, backend: Backend, restart: Policy, stall_after: float, data: DataStore):
        self.b = backend
        self.d = backend.deadlines
        self.restart = restart
        self.stall_after = stall_after
        self.by_name: dict[str, Program] = {}
        self.data = data  # the programs' data files (datastore.py)
        self.lock = anyio.Lock()  # one load/upgrade/unload/recovery at a time
        self.closing = False  # set by the close or detach: nothing starts from then on
        #: Where successful loads, upgrades and unloads are recorded (state/desired.py); None: nowhere.
        self.recorder: Recorder | None = None
        # What the metrics and status read.
        self.start_ms: list[float] = []  # the start check's share of each load: LAUNCHED -> STATE = RUNNING
        self.loads = 0
        self.load_ms: list[float] = []
        self.faults: list[FaultReport] = []
        self.failed_total = 0  # launches of loaded programs that failed (the metrics' counters)
        self.deaths_total = 0  # ... of them because the worker process died
        self.relaunched_total = 0  # programs relaunched by a recovery or their restart policy

    # ---- who is loaded ------------------------------------------------------------------------
    def get(self, name: str) -> Program:
        p = self.by_name.get(name)
        if p is None:
            raise NotLoaded(name)
        return p

    def current(self, p: Program, generation: int) -> bool:
        """``p``'s launch of ``generation`` is still the one its name runs: not replaced (an upgrade,
        a relaunch: a new generation), not unloaded (another object, or none, by its name)."""
        q = self.by_name.get(p.name)
        return q is not None and q.generation == generation

    def closed(self) -> bool:
        return self.closing or self.b.closed

    # ---- payload regions ----------------------------------------------------------------------
    def payloads(self, m: Manifest, existing: bool = False) -> Region | None:
        """The payload region for a program of manifest ``m`` (None: it needs none): made, or,
        ``existing``, the one an earlier daemon left it (live restore; MailboxError if it is gone)."""
        return payloads.region(self.b.mailbox.path if self.b.live is not None else None, m.name, m.layout, existing)

    def sweep_payloads(self) -> None:
        """Live restore, after a start's restore: the regions no program holds removed (programs
        halted at the restore, or not adopted)."""
        if self.b.live is not None:
            keep = {p.kernel.payloads.path for p in self.by_name.values() if p.kernel.payloads is not None}
            payloads.sweep(self.b.mailbox.path, keep)

    # ---- slots and GPUs -----------------------------------------------------------------------
    def free_slot(self, want: int | None = None) -> int:
        """A mailbox slot no program holds: ``want`` (a restore's), else the lowest."""
        used = {p.slot for p in self.by_name.values()}
        if want is not None:
            if not 0 <= want < abi.SLOTS or want in used:
                holder = next((p.name for p in self.by_name.values() if p.slot == want), None)
                raise SlotTaken(want, holder)
            return want
        for s in range(abi.SLOTS):
            if s not in used:
                return s
        raise NoFreeSlot(abi.SLOTS)

    def place(self, device: int | None = None) -> int:
        """The GPU for a new program: ``device`` if it is one of ours, else the one with the
        fewest programs (ties to the lowest ordinal)."""
        if device is not None:
            return self.b.device_or_first(device)
        count = {d: 0 for d in self.b.devices}
        for p in self.by_name.values():
            count[p.device] = count.get(p.device, 0) + 1
        return self.b.least_loaded(count)

    def on_device(self, device: int) -> list[Program]:
        return [p for p in self.by_name.values() if p.device == device]

    def used(self, device: int, without: Program | None = None) -> float:
        """The shares of GPU ``device``'s resident blocks its running programs hold (``without`` one)."""
        return sum(p.share() for p in self.on_device(device) if p is not without)

    # ---- counters -----------------------------------------------------------------------------
    def count_load(self, t0: float) -> None:
        self.loads += 1
        self.load_ms.append((time.perf_counter() - t0) * 1e3)
        del self.load_ms[:-1000]

    def report(self, r: FaultReport) -> None:
        self.faults.append(r)

    # ---- the desired state --------------------------------------------------------------------
    async def record(self, p: Program) -> None:
        """The change into the desired state (if one is kept) before the request is answered; a
        write that fails is logged, the program runs on (the state is then behind, and says so)."""
        if self.recorder is not None:
            try:
                await self.recorder.loaded(p)
            except MeshError as e:
                log.error(f"program {p.name}: not recorded in the desired state: {e}", program=p.name)
        await self.keep_history()

    async def forget(self, name: str) -> None:
        if self.recorder is not None:
            try:
                await self.recorder.unloaded(name)
            except MeshError as e:
                log.error(f"program {name}: its unload not recorded in the desired state: {e}", program=name)
        await self.keep_history()

    async def keep_history(self, programs: Iterable[Program] | None = None) -> None:
        """Each program's launch time and restarts, and the recent fault reports, kept for a live
        restore (``Recorder.history``); a write that fails is logged."""
        if self.recorder is not None:
            try:
                await self.recorder.history(list(self.by_name.values() if programs is None else programs),
                                            self.faults[-KEEP_FAULTS:])
            except MeshError as e:
                log.error(f"programs: their history not kept in the state directory: {e}")
