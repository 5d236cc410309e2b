"""The programs' data on the simulated GPU: a region of "device memory" per mailbox slot.

As on the GPU (workers/cuda_data.py): a region belongs to a slot, not to a module (a blink-mode
upgrade keeps it), it is allocated from the GPU's memory (``$MESHD_MPS_SIM_GPU_MEMORY``,
meshd_mps/gpu/device.py ``simulated_memory``; more than is free fails as cuMemAllocAsync fails,
CUDA_ERROR_OUT_OF_MEMORY), the file is copied in a chunk at a time, and a write is complete when
it returns.  The memory is an anonymous mapping, whose pages cost the host only once written: a
chunk of the file that is all zeroes (a sparse file's hole) is not copied, the page is zero already.
Nothing here waits for a running kernel, as nothing does on the GPU (the probe's figures are in
cuda_data.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass

from meshd_mps.protocol.frames import DataReq, WriteReq

from .gpu import GpuError, write_target

CHUNK = 8 << 20
_ZERO = memoryview(bytes(CHUNK))
#: The "device address" of slot s's region: recognisable, distinct per slot.
FAKE_DATA = 0x7E00_0000_0000


@dataclass
class SimRegion:
    mem: mmap.mmap
    alloc: int


class SimRegions:
    """One simulated context's program data, by slot, out of ``total`` bytes of GPU memory."""

    def __init__(self, total: int, device: int = 0):
        self.total = total
        self.device = device
        self.by_slot: dict[int, SimRegion] = {}
        self._lock = threading.Lock()

    def used(self) -> int:
        return sum(r.alloc for r in self.by_slot.values())

    def place(self, req: DataReq) -> int:
        with self._lock:
            old = self.by_slot.pop(req.slot, None)
            if old is not None:
                with contextlib.suppress(BufferError):  # a kernel reads it this moment: freed with its last view
                    old.mem.close()
            if not req.alloc:
                return 0
            free = self.total - self.used()
            if req.alloc > free:
                raise GpuError(f"cuMemAllocAsync({req.alloc}): CUDA_ERROR_OUT_OF_MEMORY: the program's data does not fit the"
                               f" GPU's free memory (simulated: {free} of {self.total} bytes free)")
            mem = mmap.mmap(-1, req.alloc)
            try:
                if req.length:
                    _copy_in(req.path, mem, req.length)
            except BaseException:
                mem.close()
                raise
            self.by_slot[req.slot] = SimRegion(mem, req.alloc)
            return FAKE_DATA + (self.device << 40) + (req.slot << 32)

    def write(self, req: WriteReq) -> None:
        with self._lock:
            r = write_target(self.by_slot, req)
            r.mem[req.offset : req.offset + len(req.data)] = req.data

    def view(self, slot: int) -> memoryview | None:
        """What a simulated kernel of ``slot`` reads as its data (None: it has none)."""
        r = self.by_slot.get(slot)
        return None if r is None else memoryview(r.mem)

    def close(self) -> None:
        with self._lock:
            for r in self.by_slot.values():
                with contextlib.suppress(BufferError):  # a kernel's view is still out: the process's exit frees it
                    r.mem.close()
            self.by_slot.clear()


def _copy_in(path: str, mem: mmap.mmap, length: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise GpuError(f"program data {path}: {e.strerror}") from e
    buf = bytearray(CHUNK)
    try:
        done = 0
        while done < length:
            n = min(CHUNK, length - done)
            view = memoryview(buf)[:n]
            got = os.preadv(fd, [view], done)
            if got != n:
                raise GpuError(f"program data {path}: {done + got} bytes read, {length} expected (the file shrank)")
            if view != _ZERO[:n]:  # a hole's zeroes are there already: the page stays untouched
                mem[done : done + n] = view
            done += n
    except OSError as e:
        raise GpuError(f"program data {path}: {e.strerror}") from e
    finally:
        os.close(fd)
