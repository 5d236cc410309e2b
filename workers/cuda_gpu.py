"""The real GPU of a worker: cuda.bindings.driver, one context, modules loaded from cubins.

One context per worker process: the device's primary context, or with
``--sms N`` a green context of N SMs (rounded up by the driver to its
partition granularity: multiples of 8 on an H200; the LOADED reply reports the
count really given).  Both use blocking sync, so a thread waiting for a kernel
sleeps instead of spinning a CPU.

The mailbox (the memfd every worker maps) is registered as host-mapped memory
(DEVICEMAP | PORTABLE); programs get its device address as their first
parameter.  The context's non-blocking streams are made when it opens, one per
hardware work queue (``--queues``, workers/warm.py) in creation order, so each
is a queue of its own; a module takes the lowest-numbered free one and gives it
back at unload (workers.gpu.Streams), so its kernel never waits behind another
module's resident one.  Each launch records a blocking-sync event after the
kernel, and the module's waiter thread (one per module, started at load: a
thread started per launch cost each LAUNCH ~50 us on the H200 host) sleeps in
cuEventSynchronize on each in launch order, the order its stream runs them,
then reports DONE exactly once.  cuda.bindings
releases the GIL in every driver call, so waiters do not hold up the frame loop.

Every driver error raises GpuError naming the call and the error, e.g.
``cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)``;
one that is the image's fault (by its CUresult: ``IMAGE_ERRORS``, ``NO_ENTRY``)
is marked refused.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from meshd_mps.gpu.device import error_name, is_no_driver
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import DataReq, Done, Load, Loaded, WriteReq
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.payloads import Layout

from . import wlog
from .cuda_data import Regions
from .gpu import DoneCallback, GpuError, Streams
from .hostmem import PayloadRegions, cuda_register, cuda_unregister
from .warm import Warm, driver_queues

try:
    from cuda.bindings import driver as cu
except ImportError as _e:  # reported by the constructor
    cu = None
    _IMPORT_ERROR: str | None = str(_e)
else:
    _IMPORT_ERROR = None

log = wlog.log

#: cuModuleLoadData's errors that are the image's fault, not the worker's: a LOADED refusal.
IMAGE_ERRORS: frozenset[int] = frozenset(
    int(getattr(cu.CUresult, n)) for n in (
        "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_NO_BINARY_FOR_GPU",
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_SOURCE",
    )
) if cu is not None else frozenset()
#: cuModuleGetFunction's "the image has no such entry": refused as well.
NO_ENTRY: frozenset[int] = frozenset({int(cu.CUresult.CUDA_ERROR_NOT_FOUND)}) if cu is not None else frozenset()

#: Dynamic shared memory above this needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
SMEM_DEFAULT_LIMIT = 48 << 10
SCRATCH_SYMBOL = "mesh_scratch"


def _fmt(err: Any) -> str:
    name, text = error_name(err)
    return f"{name} ({text})" if text else name


def _done_text(err: Any) -> str:
    name, text = error_name(err)
    return f"{name}: {text}" if text else name


def check(result: Any, call: str, refuse: frozenset[int] = frozenset(), word: int = frames.REFUSED) -> Any:
    """A driver call's ``(err, *values)`` (or a bare ``err``): the value(s), or GpuError (with the
    ok word ``word``, the image's fault, when the error is one of ``refuse``).

    Like cuda.core's handle_return: no value gives None, one value that value,
    several a tuple.
    """
    if isinstance(result, tuple):
        err, *vals = result
    else:
        err, vals = result, []
    if int(err) != 0:
        raise GpuError(f"{call}: {_fmt(err)}", word=word if int(err) in refuse else frames.FAILED)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


def _code(result: Any) -> int:
    return int(result[0] if isinstance(result, tuple) else result)


@dataclass
class _Module:
    id: int
    name: str
    mod: Any
    fn: Any = None
    hw_queue: int = -1  # its hardware work queue's number in the context's Streams, -1 if none yet
    stream: Any = None
    threads: int = 0
    smem: int = 0
    scratch: int = 0  # device pointer, 0 if none
    scratch_bytes: int = 0
    running: set[int] = field(default_factory=set)  # gens launched, not yet DONE
    waits: queue.SimpleQueue[tuple[int, Any, DoneCallback] | None] = field(default_factory=queue.SimpleQueue)
    waiter: threading.Thread | None = None
    events: list[Any] = field(default_factory=list)  # idle events, for the next launches


class CudaGpu:
    """workers.gpu.Gpu on the real device ``device`` (a CUDA ordinal, ``--device``)."""

    def __init__(self, mailbox: Mailbox, sms: int, warm: Warm | None = None, device: int = 0):
        self.mailbox = mailbox
        self.device = device
        self._warm = warm
        self.requested_sms = sms
        self.sms = 0
        self.dev = 0  # the mailbox's device address
        self._ctx: Any = None
        self._green: Any = None
        self._primary: Any = None  # the CUdevice whose primary context we retained
        self._anchor: Any = None  # ctypes view keeping the mmap's buffer exported while registered
        self._host = 0
        self._registered = False
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._params: dict[int, tuple[Any, ...]] = {}  # slot -> (its kernel parameters, kept alive, their address)
        self._modules: dict[int, _Module] = {}
        self._streams: Streams[Any] = Streams([])
        self._data = Regions(check)  # the programs' data, by slot (workers/cuda_data.py)
        self._regions = PayloadRegions(mailbox, lambda _fd, mm, size, path: cuda_register(
            check, mm, size, f"payload region {path}"), cuda_unregister)
        self._closed = False
        if cu is None:
            raise GpuError(f"cuda-python is not installed: {_IMPORT_ERROR}")
        self._event_flags = int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC) | int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        try:
            self._open(sms)
        except GpuError:
            self.close()
            raise
        except Exception as e:
            self.close()
            if is_no_driver(e):
                raise GpuError(f"no NVIDIA driver: {e}") from e
            raise GpuError(f"opening the GPU: {type(e).__name__}: {e}") from e

    # ---- the context ------------------------------------------------------------------
    def _open(self, sms: int) -> None:
        check(cu.cuInit(0), "cuInit")
        dev = check(cu.cuDeviceGet(self.device), f"cuDeviceGet({self.device})")
        total = int(check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                          "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))
        if sms < 0:
            raise GpuError(f"sms {sms}: must be 0 (the whole device) or a count of SMs")
        if sms > total:
            raise GpuError(f"sms {sms}: the device has {total}")
        blocking = int(cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC)
        if sms:
            self._open_green(dev, sms, total)
            self._ctx = check(cu.cuCtxFromGreenCtx(self._green), "cuCtxFromGreenCtx")
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            r = cu.cuCtxSetFlags(blocking)
            if _code(r):
                # Waiters use blocking-sync events, which sleep whatever the context's flags.
                log.warning("green context keeps its scheduling flags", error=_fmt(_code(r)))
        else:
            warm, self._warm = self._warm, None
            if warm is not None and warm.ctx is not None and warm.device != self.device:
                # Warmed for another GPU (argv read differently): give that retain back.
                log.warning("warm context is for another GPU; releasing it", warm_device=warm.device)
                cu.cuDevicePrimaryCtxRelease(warm.dev)
                warm = None
            if warm is not None and warm.ctx is not None:  # retained by warm.py's thread: ours now
                self._ctx, self._primary, flags_error = warm.ctx, warm.dev, warm.flags_error
            else:
                flags_error = _code(cu.cuDevicePrimaryCtxSetFlags(dev, blocking))
                self._ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                self._primary = dev
            if flags_error:
                log.warning("primary context keeps its scheduling flags", error=_fmt(flags_error))
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self.sms = total
        self._anchor, self.dev = cuda_register(check, self.mailbox.mm, self.mailbox.size, "")
        self._host = ctypes.addressof(self._anchor)
        self._registered = True
        made: list[Any] = []
        try:
            for _ in range(driver_queues()):  # the count the driver read at cuInit: one stream per queue, in order
                made.append(check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
        finally:
            self._streams = Streams(made)  # close destroys what was made, even after a failure
        log.info(
            "GPU opened", device=self.device, sms=self.sms, green=bool(sms), mailbox_dev=hex(self.dev), queues=len(made)
        )

    def _open_green(self, dev: Any, sms: int, total: int) -> None:
        SM = cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        res = check(cu.cuDeviceGetDevResource(dev, SM), "cuDeviceGetDevResource(SM)")
        # The driver's rounding: at least minSmPartitionSize, a multiple of smCoscheduledAlignment
        # (8 and 8 on an H200); the figures are only there with a CUDA 13 driver.
        part = int(getattr(res.sm, "minSmPartitionSize", 0) or 1)
        align = int(getattr(res.sm, "smCoscheduledAlignment", 0) or 1)
        want = max(part, -(-sms // align) * align)
        r = cu.cuDevSmResourceSplitByCount(1, res, 0, sms)
        if _code(r):
            raise GpuError(
                f"sms {sms}: cuDevSmResourceSplitByCount: {_fmt(_code(r))}; the driver makes groups of "
                f"{want} SMs for this request (multiples of {align}, at least {part}) from the device's {total}"
            )
        _, groups, n, _rest = r
        got = int(groups[0].sm.smCount) if n and groups else 0
        if got < sms:
            raise GpuError(
                f"sms {sms}: the driver's split gives {'no group' if not got else f'{got} SMs'}, fewer than asked "
                f"(groups come in multiples of {align} SMs, at least {part}; the device has {total})"
            )
        desc = check(cu.cuDevResourceGenerateDesc([groups[0]], 1), "cuDevResourceGenerateDesc")
        self._green = check(
            cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate"
        )
        self.sms = got
        try:  # what the green context really holds
            mine = check(cu.cuGreenCtxGetDevResource(self._green, SM), "cuGreenCtxGetDevResource(SM)")
            if int(mine.sm.smCount):
                self.sms = int(mine.sm.smCount)
        except GpuError as e:
            log.warning("green context resource not read back", error=str(e))
        if self.sms != sms:
            log.info("green context rounded by the driver", asked=sms, sms=self.sms)

    def _current(self) -> None:
        """Contexts do not follow threads: make ours current in the calling one (once per thread:
        only this class sets contexts, and always this one)."""
        if self._ctx is None:
            raise GpuError("the GPU is closed")
        if getattr(self._tls, "ctx", None) is not self._ctx:
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._tls.ctx = self._ctx

    # ---- modules ------------------------------------------------------------------------
    def load(self, req: Load) -> Loaded:
        with self._lock:
            if req.module in self._modules:
                raise GpuError(f"module {req.module} is already loaded ({self._modules[req.module].name})")
        if req.threads < 1:
            raise GpuError(f"{req.name}: {req.threads} threads per block")
        self._current()
        mod = check(cu.cuModuleLoadData(req.cubin), "cuModuleLoadData", IMAGE_ERRORS)
        m = _Module(req.module, req.name, mod, threads=req.threads, smem=req.smem)
        try:
            m.fn = check(cu.cuModuleGetFunction(mod, abi.ENTRY.encode()), f"cuModuleGetFunction({abi.ENTRY})", NO_ENTRY,
                         frames.NO_ENTRY)
            A = cu.CUfunction_attribute
            if req.smem > SMEM_DEFAULT_LIMIT:
                check(
                    cu.cuFuncSetAttribute(m.fn, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, req.smem),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={req.smem})",
                )
            regs = int(check(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, m.fn), "cuFuncGetAttribute(NUM_REGS)"))
            local = int(
                check(
                    cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, m.fn),
                    "cuFuncGetAttribute(LOCAL_SIZE_BYTES)",
                )
            )
            per_sm = int(
                check(
                    cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(m.fn, req.threads, req.smem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                )
            )
            if req.scratch > 0:
                m.scratch = int(check(cu.cuMemAlloc(req.scratch), f"cuMemAlloc({req.scratch})"))
                m.scratch_bytes = req.scratch
                check(cu.cuMemsetD8(m.scratch, 0, req.scratch), "cuMemsetD8(scratch)")
                at = self._global(mod, SCRATCH_SYMBOL, 8)
                if at is not None:
                    v = ctypes.c_uint64(m.scratch)
                    check(cu.cuMemcpyHtoD(at, ctypes.addressof(v), 8), f"cuMemcpyHtoD({SCRATCH_SYMBOL})")
            rt_abi = 0
            at = self._global(mod, abi.RT_ABI_SYMBOL, 4)
            if at is not None:
                v32 = ctypes.c_uint32(0)
                check(cu.cuMemcpyDtoH(ctypes.addressof(v32), at, 4), f"cuMemcpyDtoH({abi.RT_ABI_SYMBOL})")
                rt_abi = int(v32.value)
            m.hw_queue, m.stream = self._streams.take()
            m.waiter = threading.Thread(target=self._waits, args=(m,), name=f"done-{req.module}", daemon=True)
            m.waiter.start()
        except BaseException:
            self._release(m)
            raise
        with self._lock:
            self._modules[req.module] = m
        return Loaded(
            rt_abi=rt_abi, regs=regs, per_sm=per_sm, local=local, sms=self.sms, dev=self.dev, scratch=m.scratch_bytes
        )

    def payloads(self, module: int, path: str, layout: Layout) -> int:
        """The module's payload region registered as the mailbox is, no kernel of it running yet
        (blink: within the load's blink); its device address."""
        with self._lock:
            m = self._modules.get(module)
        if m is None:
            raise GpuError(f"module {module} is not loaded")
        self._current()
        return self._regions.map(module, m.name, path, layout)

    def _global(self, mod: Any, name: str, size: int) -> Any:
        """A module global's device address (None where the module has no such symbol)."""
        r = cu.cuModuleGetGlobal(mod, name.encode())
        if _code(r) == int(cu.CUresult.CUDA_ERROR_NOT_FOUND):
            return None
        ptr, n = check(r, f"cuModuleGetGlobal({name})")
        if int(n) != size:
            raise GpuError(f"global {name} is {int(n)} bytes, expected {size}")
        return ptr

    def _release(self, m: _Module) -> str | None:
        """Free what a module holds; the first failure's text (the rest are still tried)."""
        first = None
        if m.waiter is not None:  # idle (nothing running): it takes the None and ends
            m.waits.put(None)
            m.waiter.join(5)
            m.waiter = None
        steps = [("cuEventDestroy", partial(cu.cuEventDestroy, ev)) for ev in m.events]
        m.events = []
        if m.scratch:
            steps.append(("cuMemFree(scratch)", partial(cu.cuMemFree, m.scratch)))
        steps.append(("cuModuleUnload", partial(cu.cuModuleUnload, m.mod)))
        for call, f in steps:
            try:
                check(f(), call)
            except GpuError as e:
                first = first or str(e)
        if m.stream is not None:  # the context's, idle now: the next module's
            self._streams.give(m.hw_queue)
        m.scratch, m.hw_queue, m.stream = 0, -1, None
        if err := self._regions.unmap(m.id):
            first = first or f"cuMemHostUnregister(payload region): {err}"
        return first

    def stack_limit(self, set_to: int | None) -> int:
        self._current()
        limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
        if set_to is not None:
            check(cu.cuCtxSetLimit(limit, set_to), "cuCtxSetLimit")
        return int(check(cu.cuCtxGetLimit(limit), "cuCtxGetLimit"))

    def unload(self, module: int) -> None:
        with self._lock:
            m = self._modules.get(module)
            if m is None:
                raise GpuError(f"module {module} is not loaded")
            if m.running:
                gens = ", ".join(str(g) for g in sorted(m.running))
                raise GpuError(f"module {module} ({m.name}): launch gen {gens} still running; halt the program first")
            del self._modules[module]
        self._current()
        err = self._release(m)
        if err:
            raise GpuError(err)

    # ---- launches -----------------------------------------------------------------------
    def launch(self, module: int, gen: int, slot: int, nodes: int, on_done: DoneCallback) -> None:
        with self._lock:
            m = self._modules.get(module)
        if m is None:
            raise GpuError(f"module {module} is not loaded")
        if not 0 <= slot < abi.SLOTS:
            raise GpuError(f"slot {slot} out of range 0..{abi.SLOTS - 1}")
        if nodes < 1:
            raise GpuError(f"{m.name}: a launch of {nodes} blocks")
        self._current()
        try:
            ev = m.events.pop()  # recycled by the waiter: events are cheap to keep, not to create
        except IndexError:
            ev = check(cu.cuEventCreate(self._event_flags), "cuEventCreate")
        self._regions.launching(module, slot)  # its payload region in the slot's words, before the kernel reads them
        if (p := self._params.get(slot)) is None:  # (mailbox_dev, slot): the same for every launch on a slot
            a, b = ctypes.c_uint64(self.dev), ctypes.c_uint32(slot)
            params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
            p = self._params[slot] = (a, b, params, ctypes.addressof(params))
        try:
            self._data.bind(m.mod, m.stream, slot, self._global)
            check(cu.cuLaunchKernel(m.fn, nodes, 1, 1, m.threads, 1, 1, m.smem, m.stream, p[3], 0), "cuLaunchKernel")
        except GpuError:
            cu.cuEventDestroy(ev)
            raise
        r = cu.cuEventRecord(ev, m.stream)
        if _code(r):  # the kernel runs: wait on its stream instead
            log.warning("cuEventRecord failed; waiting on the stream", error=_fmt(_code(r)))
            cu.cuEventDestroy(ev)
            ev = None
        with self._lock:
            m.running.add(gen)
        m.waits.put((gen, ev, on_done))

    def _waits(self, m: _Module) -> None:
        """The module's waiter thread: each launch's end, in launch order, as a DONE."""
        current = cu.cuCtxSetCurrent(self._ctx)
        while (item := m.waits.get()) is not None:
            gen, ev, on_done = item
            ok, message = True, ""
            try:
                r = current
                if _code(r) == 0:
                    r = cu.cuEventSynchronize(ev) if ev is not None else cu.cuStreamSynchronize(m.stream)
                if _code(r):
                    ok, message = False, _done_text(_code(r))
            except BaseException as e:  # never lose the DONE
                ok, message = False, f"waiting for the kernel: {type(e).__name__}: {e}"
            finally:
                if ev is not None:
                    m.events.append(ev)
                with self._lock:
                    m.running.discard(gen)
                try:
                    on_done(Done(m.id, gen, ok, message))
                except Exception as e:
                    log.error("DONE not delivered", module=m.id, gen=gen, error=str(e))

    def data(self, req: DataReq) -> int:
        self._current()
        return self._data.place(req)

    def write(self, req: WriteReq) -> None:
        self._current()
        self._data.write(req)

    def misbehaviour(self, phase: str) -> str | None:
        return None

    # ---- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Best effort and idempotent.  With a kernel still running nothing is torn down:
        the process's exit ends the context (a teardown would wait for the kernel)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            busy = [m for m in self._modules.values() if m.running]
            mods = list(self._modules.values())
            self._modules.clear()
        if cu is None or (self._ctx is None and self._green is None):
            self._anchor = None
            return
        if busy:
            log.warning("closing with kernels running; the process exit ends them", modules=[m.id for m in busy])
            return
        try:
            if self._ctx is not None:
                cu.cuCtxSetCurrent(self._ctx)
            for m in mods:
                err = self._release(m)
                if err:
                    log.warning("module not released", module=m.id, error=err)
            for err in self._data.close():
                log.warning("program data not released", error=err)
            failed = [_code(r) for r in (cu.cuStreamDestroy(st) for st in self._streams.streams) if _code(r)]
            if failed:
                log.warning("streams not destroyed", streams=len(failed), error=_fmt(failed[0]))
            self._streams = Streams([])
            if self._registered:
                r = cu.cuMemHostUnregister(self._host)
                if _code(r):
                    log.warning("mailbox not unregistered", error=_fmt(_code(r)))
                self._registered = False
            self._anchor = None
            if self._green is not None:
                cu.cuCtxSetCurrent(cu.CUcontext(0))
                cu.cuGreenCtxDestroy(self._green)
                self._green = None
            elif self._primary is not None:
                cu.cuDevicePrimaryCtxRelease(self._primary)
                self._primary = None
        except Exception as e:
            log.warning("GPU teardown incomplete", error=f"{type(e).__name__}: {e}")
        self._ctx = None
