"""Host memory a worker registers with its GPU: the mailbox, and its payload regions, one per
module that has one (PAYLOADS; protocol/payloads.py), each mapped by the path its daemon names,
registered by the GPU's own means (the real one's cuMemHostRegister, ``cuda_register``; the
simulation's ``check_shared``), written into the program's slot at each launch of its module, and
unregistered and unmapped at its unload.  The real GPU and the simulation share ``PayloadRegions``;
they differ only in ``Register``."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import sys
from collections.abc import Callable
from typing import Any

from meshd_mps.protocol.mailbox import Mailbox, MailboxError
from meshd_mps.protocol.payloads import Layout, Region, write_slot

from .gpu import GpuError

#: How a GPU registers a region: (its fd, its map, its size, its path) -> (what must be kept while
#: it is registered, its device address); GpuError if it cannot be.
Register = Callable[[int, mmap.mmap, int, str], tuple[Any, int]]
#: How it unregisters one: what ``Register`` kept; the error's text, or None.
Unregister = Callable[[Any], "str | None"]
#: cuda_gpu.check: a driver call's values, or GpuError naming the call.
Check = Callable[..., Any]


class PayloadRegions:
    def __init__(self, mailbox: Mailbox, register: Register, unregister: Unregister):
        self.mailbox = mailbox
        self._register, self._unregister = register, unregister
        self._by_module: dict[int, tuple[Region, Any, int]] = {}  # module -> (region, what register kept, dev)

    def map(self, module: int, name: str, path: str, layout: Layout) -> int:
        """Module ``module``'s region mapped and registered; its device address."""
        if (had := self._by_module.get(module)) is not None:
            raise GpuError(f"module {module} ({name}) has a payload region already ({had[0].path})")
        try:
            region = Region.open(path, layout)
        except MailboxError as e:
            raise GpuError(str(e)) from e
        try:
            kept, dev = self._register(region.fd, region.mm, region.size, path)
        except GpuError:
            region.close()
            raise
        self._by_module[module] = (region, kept, dev)
        return dev

    def launching(self, module: int, slot: int) -> None:
        """Before module ``module``'s kernel is launched on ``slot``: its region in the slot's words."""
        if (r := self._by_module.get(module)) is not None:
            write_slot(self.mailbox, slot, r[2], r[0].layout)

    def view(self, module: int) -> memoryview | None:
        """Module ``module``'s region as its kernels read and write it (the simulated GPU's); None without."""
        r = self._by_module.get(module)
        return None if r is None else memoryview(r[0].mm)

    def unmap(self, module: int) -> str | None:
        """Module ``module``'s region (if any) unregistered and unmapped; the unregistration's error."""
        region, kept, _dev = self._by_module.pop(module, (None, None, 0))
        if region is None:
            return None
        err = self._unregister(kept)
        kept = None  # the view that kept the map exported: released before the map is closed
        region.close()
        return err


#: The simulated "device addresses" of payload regions, from here on, per GPU: each a 2 GiB span of
#: its own (a region has at most 1 GiB).
SIM_REGION_DEV = 0x7E00_0000_0000


def sim_register(device: int) -> Register:
    """The simulation's ``Register`` on GPU ``device``: shared memory only, as the driver takes it
    (``check_shared``); each region a device address span of its own."""
    count = itertools.count()

    def register(fd: int, _mm: mmap.mmap, _size: int, path: str) -> tuple[Any, int]:
        check_shared(fd, f"the payload region {path}")
        return None, SIM_REGION_DEV + (device << 40) + (next(count) << 31)

    return register


#: statfs's f_type of tmpfs, and of shmem (a memfd, /dev/shm).
TMPFS_MAGIC = 0x01021994


def check_shared(fd: int, what: str) -> None:
    """The simulation's cuMemHostRegister of the mailbox or a payload region: the H200's driver
    refused a regular file's pages with CUDA_ERROR_INVALID_VALUE and took shared memory's
    (docs/reliability.md, "Live restore"), so the simulation refuses every file not on
    tmpfs or shmem the same way.  ``what``: the file, as the refusal names it."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type (a long) first
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        raise GpuError(f"cuMemHostRegister: CUDA_ERROR_INVALID_VALUE (simulated: fstatfs: {os.strerror(ctypes.get_errno())})")
    kind = int.from_bytes(buf.raw[:8], sys.byteorder, signed=True) & 0xFFFFFFFF
    if kind != TMPFS_MAGIC:
        raise GpuError(f"cuMemHostRegister: CUDA_ERROR_INVALID_VALUE (invalid argument) (simulated: {what} is on a"
                       f" filesystem of type 0x{kind:x}, not shared memory; the H200's driver refuses a regular file's"
                       " pages)")


def cuda_register(check: Check, mm: mmap.mmap, size: int, what: str) -> tuple[Any, int]:
    """``size`` bytes of the map ``mm`` registered with the current context as host-mapped memory
    (DEVICEMAP | PORTABLE): (the view that keeps its buffer exported meanwhile, the device address);
    ``what``: a note for the calls' errors ("": the mailbox).  The driver is imported here, not by
    the module: the simulation's workers, which share it, import no CUDA at their start."""
    from cuda.bindings import driver as cu

    anchor = (ctypes.c_char * size).from_buffer(mm)
    host = ctypes.addressof(anchor)
    note = f"({what})" if what else ""
    check(cu.cuMemHostRegister(host, size, cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE),
          f"cuMemHostRegister{note}")
    try:
        return anchor, int(check(cu.cuMemHostGetDevicePointer(host, 0), f"cuMemHostGetDevicePointer{note}"))
    except GpuError:
        cu.cuMemHostUnregister(host)
        raise


def cuda_unregister(anchor: Any) -> str | None:
    """``cuda_register`` undone; the driver's error in words (None: none)."""
    from cuda.bindings import driver as cu

    r = cu.cuMemHostUnregister(ctypes.addressof(anchor))
    err = r[0] if isinstance(r, tuple) else r
    if not int(err):
        return None
    from meshd_mps.gpu.device import error_name

    name, text = error_name(err)
    return f"{name} ({text})" if text else name
