"""``Programs``: named resident programs on mailbox slots, the layer ``meshd-mps serve`` exposes.

A facade over small objects that share one :class:`Registry` (the programs by name, the lock, the
slots): ``Launching`` (a kernel onto its slot and off it), ``Lifecycle`` (load, upgrade, unload,
close, detach), ``Adoption`` (live restore), ``Calls`` (the ring), ``Recovery`` (a program's end: its
own failure, a fault of its GPU, its restart policy) and ``Heartbeats`` (stalls).

Several GPUs: a program goes to the GPU named, else to the one with the fewest programs (ties to
the lowest ordinal), and stays there through upgrades and fault relaunches.  MPS contains a fatal
fault to the clients of the faulting GPU, so a fault's recovery is scoped to that GPU: only its
workers and pool are retired and only its programs relaunched.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from meshd_mps.base.errors import ConfigError, MeshError
from meshd_mps.base.restart import DEFAULT as DEFAULT_RESTART, Policy
from meshd_mps.base.restore import Restore
from meshd_mps.programs.adoption import Adoption
from meshd_mps.programs.calls import Calls
from meshd_mps.programs.data import DataSource, Recorded, Written
from meshd_mps.programs.datastore import DataStore
from meshd_mps.programs.heartbeats import Heartbeats
from meshd_mps.programs.launching import Launching
from meshd_mps.programs.lifecycle import Lifecycle
from meshd_mps.programs.recovery import Recovery
from meshd_mps.programs.registry import Registry
from meshd_mps.protocol import abi

if TYPE_CHECKING:
    from meshd_mps.backend import Backend
    from meshd_mps.base.deadlines import Deadlines
    from meshd_mps.gpu.compiler import Manifest
    from meshd_mps.isolation.base import Found
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.recorder import Recorder
    from meshd_mps.programs.report import FaultReport


class Programs:
    """``restart``: the restart policy of a program loaded without one (restart.py);
    ``stall_after``: seconds without a heartbeat before a running program is stalled (None: the
    deadlines' ``stall``); ``data``: where the programs' data files are kept (datastore.py; None: a
    temporary directory, removed at close)."""

    def __init__(self, backend: Backend, restart: Policy | str | None = None, stall_after: float | None = None, *,
                 data: DataStore | None = None):
        d = backend.deadlines
        stall_after = d.stall if stall_after is None else stall_after
        if not stall_after > 0:
            raise ConfigError(f"stall_after {stall_after!r}: seconds, more than 0")
        self.reg = Registry(backend, Policy.parse(DEFAULT_RESTART if restart is None else restart), stall_after,
                            data if data is not None else DataStore.temp())
        self.launching = Launching(self.reg)
        self.recovery = Recovery(self.reg, self.launching)
        self.lifecycle = Lifecycle(self.reg, self.launching, self.recovery)
        self.adoption = Adoption(self.reg, self.recovery)
        self.calls = Calls(self.reg)
        self.heartbeats = Heartbeats(self.reg)
        backend.start_soon(self.heartbeats.watch, name="heartbeats")

    # ---- what the daemon, its API and metrics read --------------------------------------------
    @property
    def b(self) -> Backend:
        return self.reg.b

    @property
    def d(self) -> Deadlines:
        return self.reg.d

    @property
    def restart(self) -> Policy:
        return self.reg.restart

    @property
    def stall_after(self) -> float:
        return self.reg.stall_after

    @property
    def by_name(self) -> dict[str, Program]:
        return self.reg.by_name

    @property
    def faults(self) -> list[FaultReport]:
        return self.reg.faults

    @property
    def recorder(self) -> Recorder | None:
        return self.reg.recorder

    @recorder.setter
    def recorder(self, r: Recorder | None) -> None:
        self.reg.recorder = r

    @property
    def loads(self) -> int:
        return self.reg.loads

    @property
    def load_ms(self) -> list[float]:
        return self.reg.load_ms

    @property
    def start_ms(self) -> list[float]:
        return self.reg.start_ms

    @property
    def failed_total(self) -> int:
        return self.reg.failed_total

    @property
    def deaths_total(self) -> int:
        return self.reg.deaths_total

    @property
    def relaunched_total(self) -> int:
        return self.reg.relaunched_total

    def get(self, name: str) -> Program:
        return self.reg.get(name)

    def place(self, device: int | None = None) -> int:
        return self.reg.place(device)

    def on_device(self, device: int) -> list[Program]:
        return self.reg.on_device(device)

    async def ahead(self, devices: Iterable[int | None]) -> None:
        """Before a start loads programs, one a GPU of ``devices`` (None: ``place``'s choice, as the
        loads will make it): what they need made at once, before any of them is launched
        (Backend.ahead), and not once programs run."""
        count = {d: len(self.reg.on_device(d)) for d in self.reg.b.devices}
        loads: dict[int, int] = {}
        for want in devices:
            try:
                d = self.reg.place(want)
            except MeshError:  # a GPU not served here: its load is refused by itself
                continue
            if want is None:
                d = self.reg.b.least_loaded(count)
            count[d] = count.get(d, 0) + 1
            loads[d] = loads.get(d, 0) + 1
        await self.reg.b.ahead(loads)

    def settled(self) -> None:
        """The start's loads are done: what ``ahead`` made and they did not take goes to the pools,
        and (live restore) the payload regions no program holds are removed."""
        self.reg.b.settled()
        self.reg.sweep_payloads()

    def _free_slot(self, want: int | None = None) -> int:
        return self.reg.free_slot(want)

    # ---- changes ------------------------------------------------------------------------------
    async def load(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, hash: int | None = None,
                   nodes: int = 1, device: int | None = None, restart: Policy | str | None = None,
                   slot: int | None = None, *, restore: Restore | str = Restore.RELOAD,
                   data: DataSource | None = None) -> Program:
        """Compile, preload and launch on a free slot (``slot``: that one, a restore's), on GPU
        ``device`` (None: ``place``'s choice); ``hash``: the image hash it must have; ``restart``:
        its restart policy (None: the default of these Programs); ``restore``: what the daemon's
        next start does with it (restore.py: reload, or adopt only while it runs); ``data``: its
        data (a path, bytes, a binary file, ``DataRef``: docs/program-abi.md, "Data")."""
        return await self.lifecycle.load(manifest, ptx, hash, nodes, device, restart, slot, restore, data)

    async def upgrade(self, name: str, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes,
                      hash: int | None = None, restart: Policy | str | None = None, *,
                      data: DataSource | None = None) -> Program:
        """A new image on the program's slot (Lifecycle.upgrade); ``data``: other data (None: its
        data kept, with their writes)."""
        return await self.lifecycle.upgrade(name, manifest, ptx, hash, restart, data)

    async def write(self, name: str, offset: int, data: bytes) -> Written:
        """``data`` into the program's data at ``offset`` while its kernel runs, on its worker's own
        stream: nothing is halted; the slot's DATA_SEQ counts it once the copy is complete
        (programs/data.py).  WriteOutOfRange past its end, NoData for a program without data."""
        return await self.launching.data.write(name, offset, bytes(data))

    async def unload(self, name: str) -> None:
        await self.lifecycle.unload(name)

    async def close(self) -> None:
        """Every program halted (briefly) and unloaded, before the backend closes."""
        try:
            await self.lifecycle.close()
        finally:
            self.reg.data.remove()  # a temporary store only

    async def detach(self) -> None:
        """Live restore's stop: the programs left running for the next meshd-mps."""
        try:
            await self.lifecycle.detach()
        finally:
            self.reg.data.remove()

    # ---- live restore -------------------------------------------------------------------------
    async def adopt(self, f: Found, manifest: Manifest, ptx: bytes, hash: int, nodes: int,
                    restart: Policy | str | None = None, *, started_wall: float | None = None, restarts: int = 0,
                    restore: Restore | str = Restore.RELOAD, data: Recorded | None = None) -> Program:
        return await self.adoption.adopt(f, manifest, ptx, hash, nodes, restart,
                                         started_wall=started_wall, restarts=restarts, restore=restore, data=data)

    async def discard(self, f: Found, why: str) -> None:
        await self.adoption.discard(f, why)

    def carry_over(self, reports: Iterable[FaultReport]) -> None:
        """The fault reports an earlier meshd-mps kept (live restore), before this one's own."""
        self.reg.faults[:0] = list(reports)

    # ---- calls --------------------------------------------------------------------------------
    async def call(self, name: str, payload: bytes, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        """A request through the program's ring, and its response (Calls.call)."""
        return await self.calls.call(name, payload, timeout)

    def check_request(self, name: str, size: int) -> None:
        """PayloadTooLarge if a request of ``size`` bytes is over the most program ``name`` takes,
        before anything of it is read (Calls.check)."""
        self.calls.check(name, size)

    async def call_many(self, name: str, payloads: Sequence[bytes], timeout: float | None = None,  # noqa: ASYNC109
                        window: int = abi.RING) -> list[bytes]:
        """Requests through the program's ring, pipelined (Calls.call_many)."""
        return await self.calls.call_many(name, payloads, timeout, window)

    # ---- reads --------------------------------------------------------------------------------
    def sample(self) -> None:
        """The heartbeats read now (the heartbeat watcher's step, taken at once)."""
        self.heartbeats.sample()

    def describe(self, p: Program) -> dict[str, Any]:
        """``p`` as the API shows it; a read, which changes nothing."""
        state, error = p.state()
        hb = self.reg.b.mailbox.heartbeat(p.slot)  # one read for the count and its age
        age = p.beat_age(hb=hb)
        return {
            "name": p.name,
            "slot": p.slot,
            "state": state,
            "error": error,
            "pid": p.kernel.pid,
            "device": p.device,
            "heartbeat": hb,
            "beat_age_s": None if age is None else round(age, 3),
            "uptime_s": round(time.monotonic() - p.started, 3),
            "hash": f"{p.hash:016x}",
            "upgrades": p.upgrades,
            "restarts": p.restarts,
            "restart": p.restart.value,
            "restore": p.restore.value,
            "regs": p.kernel.regs,
            "nodes": p.nodes,
            # Its data (docs/program-abi.md, "Data"): the device memory it owns, the file it was
            # loaded with (its SHA-256), the writes since.
            "data_bytes": p.data_bytes,
            "data": p.data.spec.key if p.data else None,
            "data_writes": p.data.writes if p.data else 0,
            "faults": p.faults,
            "calls": p.calls.as_dict(),
            # The most bytes a request and a response may have (its manifest's; a ring entry's 188
            # where it declares none): larger ones travel through its payload region.
            "max_request": p.manifest.layout.request_limit if p.manifest else None,
            "max_response": p.manifest.layout.response_limit if p.manifest else None,
        }

    def sm_share(self, device: int) -> float:
        """The part of GPU ``device``'s resident blocks that its running programs hold (0..1): its
        SMs' use by resident kernels, which is what an operator can still place there (NVML's
        utilization reads 100 % while any resident kernel polls)."""
        return min(1.0, sum(p.share() for p in self.reg.on_device(device)))

    def list(self) -> list[dict[str, Any]]:
        """Every program, by slot, as ``describe`` shows it."""
        return [self.describe(p) for p in sorted(self.reg.by_name.values(), key=lambda p: p.slot)]
