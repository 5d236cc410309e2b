"""The worker's CUDA context, created while the rest of the worker is still importing.

An MPS client's context takes ~115 ms to create on the H200, and the driver
holds no GIL meanwhile; the worker's own imports (meshd-mps's frame
and mailbox code) need the GIL but not the GPU.  So ``meshd-mps worker``
starts this thread before it imports anything else, and CudaGpu takes the
primary context it retained.  Any failure here is only remembered: CudaGpu
then opens the GPU itself and reports the error in its own words.  A green
context (``--sms``) is not made here (it needs the device's SM split); only
cuInit runs early then.

The driver reads ``CUDA_DEVICE_MAX_CONNECTIONS`` (a context's hardware work
queues) once, at cuInit: so ``--queues`` is read here too and put in the
environment before the thread starts.  Its constants live here because this
module is the one every other part of the worker can import early.

This module imports nothing but the standard library until its thread runs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

#: The environment variable the driver reads at cuInit: a context's hardware work queues.
QUEUES_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
#: The driver's count without it (measured on the H200: the 9th resident kernel never started).
DEFAULT_QUEUES = 8
#: The worker's flag: imported, but no context until the first READY (Warm's ``hold``).
HOLD = "--hold"
#: The most the driver takes (with 32 set, 32 resident kernels ran and the 33rd never started).
MAX_QUEUES = 32


def driver_queues(environ: Mapping[str, str] = os.environ) -> int:
    """The hardware work queues a context gets from ``environ`` as the driver reads it at cuInit:
    the default where it is unset or not a count, else clamped to 1..MAX_QUEUES.  Both GPUs count
    their streams with it, so that an inherited value is honoured as the driver honours it."""
    v = environ.get(QUEUES_ENV, "").strip()
    return min(max(int(v), 1), MAX_QUEUES) if v.isdigit() else DEFAULT_QUEUES


class Warm:
    """``hold``: the bindings are imported now, the driver is touched only at ``release`` (a
    worker started ahead, while the MPS server still refuses clients: fault recovery)."""

    def __init__(self, sms: int, device: int = 0, hold: bool = False):
        self.sms = sms
        self.device = device  # the ordinal whose primary context is retained
        self.ctx: Any = None  # the retained primary context (None: CudaGpu opens it itself)
        self.dev: Any = None
        self.flags_error = 0  # cuDevicePrimaryCtxSetFlags's CUresult, if it failed
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self._thread = threading.Thread(target=self._run, name="warm-context", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """A held context may be created now."""
        self._go.set()

    def _run(self) -> None:
        try:
            from cuda.bindings import driver as cu

            self._go.wait()
            if int(cu.cuInit(0)[0]) != 0 or self.sms:
                return
            err, dev = cu.cuDeviceGet(self.device)
            if int(err) != 0:
                return
            (err,) = cu.cuDevicePrimaryCtxSetFlags(dev, int(cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC))
            self.flags_error = int(err)
            err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
            if int(err) == 0:
                self.dev, self.ctx = dev, ctx
        except BaseException:  # no driver, no bindings: CudaGpu finds out and says so
            pass

    def take(self) -> Warm:
        """Wait for the thread; the caller owns the context's retain from here on."""
        self._thread.join()
        return self


_started: Warm | None = None


def _read(argv: list[str]) -> dict[str, str]:
    """The options warm.py needs, as ``meshd-mps worker``'s argparse reads them (``--x V`` or
    ``--x=V``, the last one wins, no abbreviations)."""
    got = {"--gpu": "cuda", "--sms": "0", "--device": "0", "--queues": "0"}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in got and eq:
            got[name] = value
        elif a in got and i + 1 < len(argv):
            got[a] = argv[i + 1]
            i += 1
        i += 1
    return got


def _count(v: str) -> int:
    """A count as argparse would take it; anything else is left for argparse to refuse (here: 0)."""
    return int(v) if v.isdigit() else 0


def options(argv: list[str]) -> tuple[str, int, int]:
    """(gpu, sms, device) as ``meshd-mps worker``'s argparse reads them.  CudaGpu checks the warmed
    device against its own ``--device`` anyway."""
    got = _read(argv)
    return got["--gpu"], _count(got["--sms"]), _count(got["--device"])


def queues(argv: list[str]) -> int:
    """``--queues`` as argparse reads it (0: the driver's default)."""
    return _count(_read(argv)["--queues"])


def start(argv: list[str]) -> None:
    """From the worker's argv: ``--queues`` into the environment (0 leaves the driver's default, or
    what the worker inherited), then warm the GPU if it is the real one.  A ``--queues`` over the
    driver's maximum warms nothing: argparse refuses it next."""
    global _started
    n = queues(argv)
    if n > MAX_QUEUES:
        return
    if n:
        os.environ[QUEUES_ENV] = str(n)
    gpu, sms, device = options(argv)
    if gpu == "cuda":
        _started = Warm(sms, device, hold=HOLD in argv)


def release() -> None:
    """A held worker's context may be created now (nothing to do when none is warming)."""
    if _started is not None:
        _started.release()


def take() -> Warm | None:
    global _started
    w, _started = _started, None
    return w.take() if w is not None else None
