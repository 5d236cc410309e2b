"""Which CUDA calls wait for a resident kernel of the same context (a program's data, blink mode).

One context with CUDA_DEVICE_MAX_CONNECTIONS=4 (four hardware work queues) and four streams made
first (one per queue).  Resident kernels (each polls a host-mapped flag until it reads 1) run on
some of them; then each call below is made in a thread and timed: one that has not returned within
``BLOCKED_S`` is "blocked" (the kernels are then released, and it is timed to its end).  Cases:
``held``: a kernel on every queue (a stream made now shares a queue with one); ``free``: a kernel
on queue 0 only, the calls on stream 1 (a queue of its own).  Prints one JSON line per call.

    python3 scripts/data_probe.py        # on a GPU machine; needs cuda-bindings and NVRTC
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "4"

from cuda.bindings import driver as cu, nvrtc

BLOCKED_S = 2.0
SRC = b"""
extern "C" __global__ void resident(volatile unsigned int *flag, volatile unsigned long long *beat) {
    while (flag[0] == 0) { beat[threadIdx.x] += 1; }
}
extern "C" __device__ unsigned long long g = 0;
"""


def ok(r):
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err):
        raise RuntimeError(f"{err}")
    return v[0] if len(v) == 1 else v


def compile_() -> bytes:
    prog = ok(nvrtc.nvrtcCreateProgram(SRC, b"p.cu", 0, [], []))
    major = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0))
    minor = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0))
    r = nvrtc.nvrtcCompileProgram(prog, 1, [f"--gpu-architecture=sm_{major}{minor}".encode()])
    if int(r[0]):
        n = ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.decode())
    n = ok(nvrtc.nvrtcGetCUBINSize(prog))
    out = b" " * n
    ok(nvrtc.nvrtcGetCUBIN(prog, out))
    return out


def main() -> None:
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    mod = ok(cu.cuModuleLoadData(compile_()))
    fn = ok(cu.cuModuleGetFunction(mod, b"resident"))
    gptr, _ = ok(cu.cuModuleGetGlobal(mod, b"g"))
    streams = [ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(4)]
    flag_host = ok(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP))
    flag = ctypes.c_uint32.from_address(int(flag_host))
    flag_dev = ok(cu.cuMemHostGetDevicePointer(flag_host, 0))
    beat = ok(cu.cuMemAlloc(4096))
    host = ok(cu.cuMemAllocHost(16 << 20))

    def launch(on: list[int]) -> None:
        flag.value = 0
        a, b = ctypes.c_uint64(int(flag_dev)), ctypes.c_uint64(int(beat))
        params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
        for i in on:
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, streams[i], ctypes.addressof(params), 0))
        time.sleep(0.2)

    def timed(case: str, name: str, call) -> None:
        out: dict = {}

        def run() -> None:
            ok(cu.cuCtxSetCurrent(ctx))
            t0 = time.perf_counter()
            try:
                call()
                out["ok"] = True
            except Exception as e:
                out["error"] = str(e)
            out["ms"] = round((time.perf_counter() - t0) * 1e3, 3)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(BLOCKED_S)
        blocked = t.is_alive()
        flag.value = 1  # release the kernels (they may be what it waits for)
        t.join(30)
        ok(cu.cuCtxSynchronize())
        print(json.dumps({"case": case, "call": name, "blocked": blocked, **out}), flush=True)

    new_stream: list = []
    bufs: dict = {}

    def alloc() -> None:
        bufs["d"] = ok(cu.cuMemAlloc(1 << 30))

    def pinned() -> None:
        bufs["h"] = ok(cu.cuMemAllocHost(8 << 20))

    def stream_new() -> None:
        new_stream.append(ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))

    def copy_on(s):
        def f() -> None:
            ok(cu.cuMemcpyHtoDAsync(bufs["d"], host, 16 << 20, s))
            ok(cu.cuStreamSynchronize(s))
        return f

    def memset_on(s):
        def f() -> None:
            ok(cu.cuMemsetD8Async(bufs["d"], 0, 16 << 20, s))
            ok(cu.cuStreamSynchronize(s))
        return f

    def global_on(s):
        def f() -> None:
            v = ctypes.c_uint64(7)
            ok(cu.cuMemcpyHtoDAsync(gptr, ctypes.addressof(v), 8, s))
            ok(cu.cuStreamSynchronize(s))
        return f

    def copy_sync() -> None:
        v = ctypes.c_uint64(7)
        ok(cu.cuMemcpyHtoD(bufs["d"], ctypes.addressof(v), 8))

    def free() -> None:
        ok(cu.cuMemFree(bufs.pop("d")))

    def free_pinned() -> None:
        ok(cu.cuMemFreeHost(bufs.pop("h")))

    def async_alloc_free(s):
        def f() -> None:
            p = ok(cu.cuMemAllocAsync(1 << 30, s))
            ok(cu.cuMemFreeAsync(p, s))
            ok(cu.cuStreamSynchronize(s))
        return f

    for case, on, s_of in (("free", [0], lambda: streams[1]), ("held", [0, 1, 2, 3], lambda: new_stream[-1])):
        steps = [("cuMemAlloc 1 GiB", alloc), ("cuMemAllocHost 8 MiB", pinned), ("cuStreamCreate", stream_new),
                 ("cuMemcpyHtoDAsync 16 MiB + sync", None), ("cuMemsetD8Async + sync", None),
                 ("module global HtoDAsync + sync", None), ("cuMemcpyHtoD 8 B (null stream)", copy_sync),
                 ("cuMemAllocAsync+FreeAsync 1 GiB", None), ("cuMemFreeHost", free_pinned), ("cuMemFree 1 GiB", free)]
        for name, call in steps:
            if call is None:
                s = s_of()
                call = {"cuMemcpyHtoDAsync 16 MiB + sync": copy_on, "cuMemsetD8Async + sync": memset_on,
                        "module global HtoDAsync + sync": global_on, "cuMemAllocAsync+FreeAsync 1 GiB": async_alloc_free}[name](s)
            launch(on)
            timed(case, name, call)


if __name__ == "__main__":
    main()
