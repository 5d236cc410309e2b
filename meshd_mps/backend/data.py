"""The programs' data in their workers (docs/program-abi.md, "Data"): the backend's part, a mixin
of :class:`Backend`.

A program's data is a region of device memory per mailbox slot, in the worker that runs the
program (MPS: its own; blink: the GPU's context), placed from a file (DATA), written at an offset
(WRITE) and freed (DATA of 0 bytes).  Which worker holds which slot's region, and of which content
(a ``Token``: the program's data and how many writes it has had), is kept here, so that a program
relaunched or upgraded in the worker that holds its data is not copied in again, and a worker
that goes back to MPS mode's pool gives its regions back first.  Free memory, checked before a
load: NVML's on the GPU (a whole-device figure: every process, every context), on the simulated
GPU its memory (``$MESHD_MPS_SIM_GPU_MEMORY``) less the regions our workers of it hold.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import anyio
import structlog

from meshd_mps.base.errors import MeshError, WorkerError
from meshd_mps.gpu.device import simulated_memory
from meshd_mps.gpu.nvml import Nvml
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import DataReq, Op, WriteReq

if TYPE_CHECKING:
    from meshd_mps.base.deadlines import Deadlines
    from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")

#: Which content a worker's region holds: (the program's data's epoch, the writes it has had).
Token = tuple[int, int]
#: A write goes to the worker in frames of at most this much (a frame is at most 64 MiB).
WRITE_CHUNK = 32 << 20


class DataRegions:
    """``place``, ``write``, ``free``, ``holds`` and ``free_memory`` (the Backend's ``gpu`` and
    ``isolation``; ``nvml_free``: a GPU's free memory by NVML, None where it cannot say)."""

    gpu: str
    isolation: str

    @property
    def deadlines(self) -> Deadlines:
        """The backend's (which overrides this)."""
        raise NotImplementedError

    @property
    def _regions(self) -> weakref.WeakKeyDictionary[WorkerProc, dict[int, tuple[Token, int]]]:
        r = self.__dict__.get("_data_regions")
        if r is None:
            r = self.__dict__["_data_regions"] = weakref.WeakKeyDictionary()
        return r

    @staticmethod
    def _speaks_data(p: WorkerProc) -> bool:
        """A worker we started, or one adopted of a protocol that has DATA and WRITE."""
        return p.hello is None or p.hello.version >= frames.DATA_SINCE

    def holds(self, p: WorkerProc, slot: int, token: Token) -> bool:
        """``p`` holds slot ``slot``'s region with this content already."""
        have = self._regions.get(p, {}).get(slot)
        return have is not None and have[0] == token

    def held(self, p: WorkerProc, slot: int, token: Token, alloc: int) -> None:
        """``p`` holds slot ``slot``'s region of ``alloc`` bytes, ``token``'s content (an adopted
        worker's, as its program's record says)."""
        self._regions.setdefault(p, {})[slot] = (token, alloc)

    async def place(self, p: WorkerProc, slot: int, token: Token, alloc: int, length: int, path: str) -> None:
        """Slot ``slot``'s region in the worker ``p``: ``alloc`` bytes, the first ``length`` of the
        file ``path``, unless the worker holds that content already."""
        if self.holds(p, slot, token):
            return
        if not self._speaks_data(p):
            raise WorkerError(f"worker {p.pid} predates program data (protocol {p.hello.version if p.hello else '?'}):"
                              " upgrade the program to place it in a new worker", pid=p.pid)
        try:
            payload = await p.ask(Op.DATA, DataReq(slot, alloc, length, path).encode())
            frames.data_placed(payload)
        except (WorkerError, frames.FrameError) as e:
            raise e.prefixed(f"program data (slot {slot})") from e
        self._regions.setdefault(p, {})[slot] = (token, alloc)

    async def write(self, p: WorkerProc, slot: int, offset: int, data: bytes, token: Token) -> None:
        """``data`` into slot ``slot``'s region at ``offset``, complete on the device when this
        returns; ``token``: the content it holds then."""
        view = memoryview(data)
        for at in range(0, max(len(view), 1), WRITE_CHUNK):
            part = bytes(view[at : at + WRITE_CHUNK])
            try:
                await p.ask(Op.WRITE, WriteReq(slot, offset + at, part).encode())
            except WorkerError as e:
                self._regions.get(p, {}).pop(slot, None)  # what it holds now is not known
                raise e.prefixed(f"write (slot {slot})") from e
        have = self._regions.get(p, {}).get(slot)
        if have is not None:
            self._regions[p][slot] = (token, have[1])

    async def free(self, p: WorkerProc, slot: int | None = None) -> None:
        """Slot ``slot``'s region in ``p`` freed (None: every region it holds); a worker gone or
        unfit frees them with its exit, and a failure is logged, never raised."""
        held = self._regions.get(p, {})
        slots = list(held) if slot is None else [slot] if slot in held else []
        for s in slots:
            held.pop(s, None)
            if p.dead or p.unfit or not self._speaks_data(p):
                continue
            try:
                await p.ask(Op.DATA, DataReq(s, 0).encode())
            except MeshError as e:
                log.warning(f"worker {p.pid}: slot {s}'s program data not freed: {e}", pid=p.pid, slot=s)

    def used_memory(self, device: int) -> int:
        """The bytes of program data our live workers of GPU ``device`` hold."""
        return sum(alloc for p, held in list(self._regions.items()) if p.device == device and not p.dead
                   for _token, alloc in held.values())

    async def free_memory(self, device: int) -> tuple[int, int] | None:
        """GPU ``device``'s (total, free) memory in bytes; None where it cannot be read (no NVML:
        the worker's allocation is then what refuses data that does not fit)."""
        if self.gpu == "sim":
            total = simulated_memory()
            return total, max(0, total - self.used_memory(device))

        def read() -> tuple[int, int]:
            n = Nvml.open()
            try:
                return n.memory(device)
            finally:
                n.close()

        try:
            with anyio.fail_after(self.deadlines.nvml):
                return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        except (MeshError, TimeoutError) as e:
            log.warning(f"GPU {device}: its free memory not read ({e}): a load's data is not checked against it", device=device)
            return None
