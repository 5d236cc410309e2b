"""Where a blink-mode recovery's time goes, outside meshd-mps: each step of a new context measured
alone, on a quiet GPU and right after a context that faulted has exited.

Bench row (i) in blink mode split its ``server_ready`` step (the first new context after the fault)
at 474 ms where a bare context took 118 ms.  This probe takes the new context apart, in processes of
its own (no meshd-mps code in the path but its worker's imports, timed in (a)):

(a) imports: a fresh ``python -c "import workers.main, cuda.bindings.driver"``, spawn to done;
(b) a context, in a process imported and waiting: cuInit + cuDevicePrimaryCtxRetain, then a 1 MiB
    memfd registered (cuMemHostRegister DEVICEMAP|PORTABLE, as the mailbox), then one stream per
    hardware queue (CUDA_DEVICE_MAX_CONNECTIONS 8 and 32, the blink context's);
(c) the same, released the moment a process whose context faulted (a kernel writing to 0x10, beside
    N resident spinning kernels) has exited: how long the GPU takes before it gives the next context;
(d) detect: from the faulting kernel's launch to its stream's error, beside N residents.

    python3 scripts/blink_recovery_probe.py [--reps 3]

One line per figure, medians of ``--reps``; every child is ended before the next case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child: waits for "go" on stdin, then makes its context and says how long each step took (ms).
CONTEXT = r'''
import ctypes, mmap, os, sys, time
from cuda.bindings import driver as cu
def ck(r):
    e = r[0] if isinstance(r, tuple) else r
    if int(e): raise SystemExit(f"CUDA error {e}")
    return r[1] if isinstance(r, tuple) and len(r) > 1 else None
print("held", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
ck(cu.cuInit(0)); dev = ck(cu.cuDeviceGet(0))
cu.cuDevicePrimaryCtxSetFlags(dev, int(cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC))
ctx = ck(cu.cuDevicePrimaryCtxRetain(dev)); ck(cu.cuCtxSetCurrent(ctx))
t1 = time.perf_counter()
fd = os.memfd_create("mb", 0); os.ftruncate(fd, 1 << 20); mm = mmap.mmap(fd, 1 << 20)
buf = (ctypes.c_char * (1 << 20)).from_buffer(mm)
ck(cu.cuMemHostRegister(ctypes.addressof(buf), 1 << 20, cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE))
t2 = time.perf_counter()
q = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
streams = [ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(q)]
t3 = time.perf_counter()
print(f"ok {(t1 - t0) * 1e3:.2f} {(t2 - t1) * 1e3:.2f} {(t3 - t2) * 1e3:.2f}", flush=True)
'''

# A child: a context with N resident kernels spinning on their own streams, then a faulting kernel;
# says when the fault was seen (ms from its launch), then exits.
FAULT = r'''
import os, sys, time
sys.path.insert(0, os.environ["REPO"])
from cuda.bindings import driver as cu
from meshd_mps.gpu.compiler import cuda_to_ptx, ptx_to_cubin
SRC = b"""
extern "C" __global__ void spin(unsigned long long f) { volatile unsigned *p = (volatile unsigned *)f; while (*p == 0) {} }
extern "C" __global__ void boom(unsigned long long f) { *(volatile unsigned long long *)0x10 = 1; }
"""
def ck(r):
    e = r[0] if isinstance(r, tuple) else r
    if int(e): raise SystemExit(f"CUDA error {e}")
    return r[1] if isinstance(r, tuple) and len(r) > 1 else None
n = int(sys.argv[1])
ck(cu.cuInit(0)); dev = ck(cu.cuDeviceGet(0)); ctx = ck(cu.cuDevicePrimaryCtxRetain(dev)); ck(cu.cuCtxSetCurrent(ctx))
mod = ck(cu.cuModuleLoadData(ptx_to_cubin(cuda_to_ptx(SRC, "probe", "compute_90"), "sm_90", 64)))
spin, boom = ck(cu.cuModuleGetFunction(mod, b"spin")), ck(cu.cuModuleGetFunction(mod, b"boom"))
flag = ck(cu.cuMemAlloc(4)); ck(cu.cuMemsetD32(flag, 0, 1))
import ctypes
arg = ctypes.c_uint64(int(flag)); params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
streams = [ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(n + 1)]
for s in streams[:n]:
    ck(cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, s, ctypes.addressof(params), 0))
time.sleep(0.2)
t0 = time.perf_counter()
ck(cu.cuLaunchKernel(boom, 1, 1, 1, 1, 1, 1, 0, streams[n], ctypes.addressof(params), 0))
r = cu.cuStreamSynchronize(streams[n])
print(f"fault {(time.perf_counter() - t0) * 1e3:.2f} {r[0]}", flush=True)
'''


def held(env: dict[str, str]) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def release(p: subprocess.Popen[str]) -> tuple[float, float, float, float]:
    """(wall ms from release to the context's streams, context ms, register ms, streams ms)."""
    assert p.stdin is not None and p.stdout is not None
    t0 = time.perf_counter()
    p.stdin.write("go\n")
    p.stdin.flush()
    line = p.stdout.readline().split()
    wall = (time.perf_counter() - t0) * 1e3
    p.stdin.close()
    p.wait(30)
    if not line or line[0] != "ok":
        raise RuntimeError(f"the context's child said {line}")
    return wall, float(line[1]), float(line[2]), float(line[3])


def show(what: str, rows: list[tuple[float, ...]], names: tuple[str, ...]) -> None:
    cols = list(zip(*rows, strict=True))
    print(f"{what}: " + ", ".join(f"{n} {statistics.median(c):.1f} ms (of {', '.join(f'{x:.0f}' for x in c)})"
                                   for n, c in zip(names, cols, strict=True)), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    reps = ap.parse_args().reps
    base = {**os.environ, "REPO": REPO, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    names = ("wall", "context", "register", "streams")

    rows = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import workers.main, cuda.bindings.driver"], env=base, check=True)
        rows.append(((time.perf_counter() - t0) * 1e3,))
    show("(a) a worker's imports, spawn to done", rows, ("wall",))

    for q in (8, 32):
        env = {**base, "CUDA_DEVICE_MAX_CONNECTIONS": str(q)}
        show(f"(b) a context on a quiet GPU, {q} queues", [release(held(env)) for _ in range(reps)], names)

    for n in (0, 8):
        after, detect, exits = [], [], []
        for _ in range(reps):
            h = held({**base, "CUDA_DEVICE_MAX_CONNECTIONS": "32"})
            f = subprocess.Popen([sys.executable, "-c", FAULT, str(n)], stdout=subprocess.PIPE, text=True,
                                 env={**base, "CUDA_DEVICE_MAX_CONNECTIONS": "32"})
            assert f.stdout is not None
            said = f.stdout.readline().split()
            t_seen = time.perf_counter()
            f.wait(60)
            exits.append(((time.perf_counter() - t_seen) * 1e3,))
            after.append(release(h))
            detect.append((float(said[1]),) if said and said[0] == "fault" else (float("nan"),))
            print(f"    fault said {said}", flush=True)
        show(f"(d) detect, {n} residents beside the faulting kernel", detect, ("launch to error",))
        show(f"(c) the faulted process's exit after its error, {n} residents", exits, ("exit",))
        show(f"(c) a context right after that exit, 32 queues, {n} residents faulted", after, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
