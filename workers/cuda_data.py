"""The programs' data on the real GPU: one region of device memory per mailbox slot (CudaGpu's).

A region belongs to a slot, not to a module: in blink mode an upgrade unloads the old module and
loads the new one in the same context, and the program's data stays where it is.  Every step
runs on the worker's own data stream and never waits for a resident kernel of the context,
which is what blink mode needs (a module load waits for every running kernel: a blink).  Measured
on an H100 (``scripts/data_probe.py``; docs/program-abi.md, "Data"): cuMemAlloc,
cuMemAllocHost, cuStreamCreate, cuMemcpyHtoDAsync and cuMemsetD8Async (on a new stream too, whose
hardware queue a resident kernel holds), a copy to a module's global and cuMemAllocAsync /
cuMemFreeAsync return at once beside resident kernels; cuMemFree and cuMemFreeHost wait until
every kernel of the context has ended.  So a region is allocated and freed stream-ordered
(cuMemAllocAsync, cuMemFreeAsync), and the pinned staging buffer is allocated once and freed only
when the context closes.

A file is copied in through the staging buffer, a chunk at a time (read into one half while the
other is copied): the worker never holds the file in memory.  Before each launch the module's
``mesh_data`` and ``mesh_data_bytes`` globals get the slot's region (or 0), on the module's stream
ahead of its kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshd_mps.protocol import abi
from meshd_mps.protocol.frames import DataReq, WriteReq

from .gpu import GpuError, write_target

try:
    from cuda.bindings import driver as cu
except ImportError:  # CudaGpu says so
    cu = None

#: The staging buffer's half: the file is read into one half while the other is copied.
CHUNK = 8 << 20

Check = Callable[..., Any]


@dataclass
class Region:
    dev: int
    alloc: int


class Regions:
    """The data regions of one context, by slot; ``check`` is cuda_gpu.check."""

    def __init__(self, check: Check):
        self.check = check
        self.by_slot: dict[int, Region] = {}
        self._lock = threading.Lock()  # DATA and WRITE come from the frame loop; launches too
        self._stream: Any = None
        self._host = 0  # the pinned staging buffer, 2 * CHUNK bytes (0: not made yet)
        self._events: list[Any] = []

    def _ready(self) -> None:
        """The data stream and the staging buffer, made at the first use (a worker without data
        makes neither)."""
        if self._stream is None:
            self._stream = self.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate(data)")
        if not self._host:
            self._host = int(self.check(cu.cuMemAllocHost(2 * CHUNK), f"cuMemAllocHost({2 * CHUNK})"))
            flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
            self._events = [self.check(cu.cuEventCreate(flags), "cuEventCreate(data)") for _ in range(2)]

    def _sync(self) -> None:
        self.check(cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize(data)")

    def place(self, req: DataReq) -> int:
        """DATA: the slot's region replaced by one of ``req.alloc`` bytes holding ``req.path``'s
        first ``req.length`` bytes (the rest zeroed); its device address (0 for a free)."""
        with self._lock:
            self._ready()
            old = self.by_slot.pop(req.slot, None)
            if old is not None:
                self.check(cu.cuMemFreeAsync(old.dev, self._stream), "cuMemFreeAsync(data)")
            if not req.alloc:
                self._sync()
                return 0
            r = cu.cuMemAllocAsync(req.alloc, self._stream)
            if int(r[0]) == int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY):
                raise GpuError(f"cuMemAllocAsync({req.alloc}): CUDA_ERROR_OUT_OF_MEMORY: the program's data does not fit the"
                               " GPU's free memory")
            dev = int(self.check(r, f"cuMemAllocAsync({req.alloc})"))
            try:
                if req.alloc > req.length:
                    self.check(cu.cuMemsetD8Async(dev + req.length, 0, req.alloc - req.length, self._stream),
                               "cuMemsetD8Async(data)")
                if req.length:
                    self._copy_file(req.path, dev, req.length)
                self._sync()
            except BaseException:
                cu.cuMemFreeAsync(dev, self._stream)
                cu.cuStreamSynchronize(self._stream)
                raise
            self.by_slot[req.slot] = Region(dev, req.alloc)
            return dev

    def _copy_file(self, path: str, dev: int, length: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise GpuError(f"program data {path}: {e.strerror}") from e
        try:
            done, half = 0, 0
            while done < length:
                n = min(CHUNK, length - done)
                ev = self._events[half]
                self.check(cu.cuEventSynchronize(ev), "cuEventSynchronize(data)")  # this half's last copy is done
                buf = (ctypes.c_char * n).from_address(self._host + half * CHUNK)
                got = os.preadv(fd, [buf], done)
                if got != n:
                    raise GpuError(f"program data {path}: {done + got} bytes read, {length} expected (the file shrank)")
                self.check(cu.cuMemcpyHtoDAsync(dev + done, self._host + half * CHUNK, n, self._stream),
                           "cuMemcpyHtoDAsync(data)")
                self.check(cu.cuEventRecord(ev, self._stream), "cuEventRecord(data)")
                done += n
                half ^= 1
        except OSError as e:
            raise GpuError(f"program data {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def write(self, req: WriteReq) -> None:
        """WRITE: the bytes copied in at the offset, complete when this returns."""
        with self._lock:
            r = write_target(self.by_slot, req)
            self._ready()
            done, half = 0, 0
            view = memoryview(req.data)
            while done < len(view):
                n = min(CHUNK, len(view) - done)
                ev = self._events[half]
                self.check(cu.cuEventSynchronize(ev), "cuEventSynchronize(data)")
                ctypes.memmove(self._host + half * CHUNK, bytes(view[done : done + n]), n)
                self.check(cu.cuMemcpyHtoDAsync(r.dev + req.offset + done, self._host + half * CHUNK, n, self._stream),
                           "cuMemcpyHtoDAsync(write)")
                self.check(cu.cuEventRecord(ev, self._stream), "cuEventRecord(data)")
                done += n
                half ^= 1
            self._sync()

    def bind(self, mod: Any, stream: Any, slot: int, global_of: Callable[[Any, str, int], Any]) -> None:
        """Before a launch on ``slot``: the module's ``mesh_data`` and ``mesh_data_bytes`` set to
        the slot's region (0 and 0 without one), on the module's stream ahead of its kernel."""
        at = global_of(mod, abi.DATA_SYMBOL, 8)
        size_at = global_of(mod, abi.DATA_BYTES_SYMBOL, 8)
        if at is None and size_at is None:
            return
        with self._lock:
            r = self.by_slot.get(slot)
        vals = (ctypes.c_uint64 * 2)(r.dev if r else 0, r.alloc if r else 0)
        for i, ptr in enumerate((at, size_at)):
            if ptr is not None:
                # Synchronous on the host's side (pageable source), ordered before the kernel on its stream.
                self.check(cu.cuMemcpyHtoDAsync(ptr, ctypes.addressof(vals) + 8 * i, 8, stream),
                           f"cuMemcpyHtoDAsync({abi.DATA_SYMBOL})")

    def close(self) -> list[str]:
        """Everything freed (no kernel runs: CudaGpu.close); the failures' texts."""
        errors: list[str] = []
        steps: list[tuple[str, Callable[[], Any]]] = []
        for r in self.by_slot.values():
            steps.append(("cuMemFreeAsync(data)", functools.partial(cu.cuMemFreeAsync, r.dev, self._stream)))
        self.by_slot.clear()
        if self._stream is not None:
            steps.append(("cuStreamSynchronize(data)", lambda: cu.cuStreamSynchronize(self._stream)))
        for ev in self._events:
            steps.append(("cuEventDestroy(data)", functools.partial(cu.cuEventDestroy, ev)))
        if self._host:
            steps.append(("cuMemFreeHost(data)", lambda: cu.cuMemFreeHost(self._host)))
        if self._stream is not None:
            steps.append(("cuStreamDestroy(data)", lambda: cu.cuStreamDestroy(self._stream)))
        for call, f in steps:
            try:
                self.check(f(), call)
            except GpuError as e:
                errors.append(str(e))
        self._events, self._host, self._stream = [], 0, None
        return errors
