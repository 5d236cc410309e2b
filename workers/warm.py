"""The worker's CUDA context, created while the rest of the worker is still importing.

An MPS client's context takes ~115 ms to create on the H200, and the driver
holds no GIL meanwhile; the worker's own imports (structlog, meshd-mps's frame
and mailbox code) need the GIL but not the GPU.  So ``meshd-mps worker``
starts this thread before it imports anything else, and CudaGpu takes the
primary context it retained.  Any failure here is only remembered: CudaGpu
then opens the GPU itself and reports the error in its own words.  A green
context (``--sms``) is not made here (it needs the device's SM split); only
cuInit runs early then.

This module imports nothing but the standard library until its thread runs.
"""

from __future__ import annotations

import threading
from typing import Any


class Warm:
    def __init__(self, sms: int, device: int = 0):
        self.sms = sms
        self.device = device  # the ordinal whose primary context is retained
        self.ctx: Any = None  # the retained primary context (None: CudaGpu opens it itself)
        self.dev: Any = None
        self.flags_error = 0  # cuDevicePrimaryCtxSetFlags's CUresult, if it failed
        self._thread = threading.Thread(target=self._run, name="warm-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            from cuda.bindings import driver as cu

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


def options(argv: list[str]) -> tuple[str, int, int]:
    """(gpu, sms, device) as ``meshd-mps worker``'s argparse reads them (``--x V`` or ``--x=V``, the
    last one wins, no abbreviations); a value that is not a count is left for argparse to refuse
    (here: the default).  CudaGpu checks the warmed device against its own ``--device`` anyway."""
    got = {"--gpu": "cuda", "--sms": "0", "--device": "0"}
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

    def count(v: str) -> int:
        return int(v) if v.isdigit() else 0

    return got["--gpu"], count(got["--sms"]), count(got["--device"])


def start(argv: list[str]) -> None:
    """From the worker's argv: warm the GPU if it is the real one."""
    global _started
    gpu, sms, device = options(argv)
    if gpu == "cuda":
        _started = Warm(sms, device)


def take() -> Warm | None:
    global _started
    w, _started = _started, None
    return w.take() if w is not None else None
