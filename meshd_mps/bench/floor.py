"""(f)'s floor: a minimal resident kernel and its host loop, no framework, in a child process of
its own; and the host CPU (f) spins on, by a survey of every CPU's floor (``--cpu auto``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

from meshd_mps.backend import Backend
from meshd_mps.bench.rig import Bench
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.gpu.device import query_device
from meshd_mps.supervision import cpus

#: The floor: a minimal resident kernel and no framework.  One warp polls a request word of
#: host-mapped memory, copies the payload a word per lane (every load in flight before the stores),
#: fences, writes the response word; the host writes the payload, then the request word, and spins
#: on the response word.  m[0]: request (host), m[1]: response (kernel); 0xffffffff: return.
FLOOR_CU = rb"""
extern "C" __global__ void floor_ring(volatile unsigned int *m, unsigned int words) {
    const unsigned int lane = threadIdx.x;
    unsigned int seen = 0;
    for (;;) {
        const unsigned int r = m[0];
        if (r == seen)
            continue;
        if (r == 0xffffffffu)
            return;
        __threadfence_system();
        const unsigned int a = lane < words ? m[64 + lane] : 0u, b = lane + 32u < words ? m[96 + lane] : 0u;
        if (lane < words)
            m[128 + lane] = a;
        if (lane + 32u < words)
            m[160 + lane] = b;
        __threadfence_system();
        if (lane == 0)
            m[1] = r;
        __threadfence_system();
        seen = r;
    }
}
"""


# The floor's host, in a child process of its own (GPU work stays out of the bench's process):
# argv = PTX file, sizes (JSON), requests per size, CPUs (JSON); prints {size: [ns, ...]}.  Each
# request's payload is written before the doorbell and not timed, as probe/ringfloor.py measured
# it.  The host spins on the one CPU given (none: anywhere); given several, it is the survey
# instead: 64 B on each CPU in turn, one kernel throughout, printing {"survey": {cpu: p50 ns}}.  The placement comes
# after the context is made (the driver's threads keep every CPU).
FLOOR_HOST = r"""
import ctypes, json, os, sys, time
SIZES, N, CPUS = json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
ALLOWED = os.sched_getaffinity(0)
def trips(w, words, lat):
    pc = time.perf_counter_ns
    for i in range(1, N + 1):
        for k in range(words):
            w[64 + k] = i + k
        t0 = pc()
        w[0] = i
        while w[1] != i:
            pass
        lat.append(pc() - t0)
    return lat[N // 10:]
def run(w, start, stop):
    if len(CPUS) > 1:
        ctypes.memset(ctypes.addressof(w), 0, 4096)
        w[2] = 16
        done, out = start(16), {}
        for cpu in CPUS:  # each CPU's count starts at 1 again: the kernel answers any new word
            os.sched_setaffinity(0, {cpu})
            w[3] = 1 + cpu  # where the host spins (the simulated kernel keeps off it)
            lat = sorted(trips(w, 16, []))
            out[cpu] = lat[len(lat) // 2]
        w[0] = 0xFFFFFFFF
        stop(done)
        print(json.dumps({"survey": out}), flush=True)
        return
    if CPUS:  # [] (--cpu off): wherever the scheduler puts it
        os.sched_setaffinity(0, set(CPUS))
    pc = time.perf_counter_ns
    lat = []
    for i in range(1, N + 1):  # the host's own share: the same loop, the word it waits on its own
        t0 = pc()
        w[0] = i
        while w[0] != i:
            pass
        lat.append(pc() - t0)
    out = {-1: lat[N // 10:]}
    for size in SIZES:
        words = (size + 3) // 4
        ctypes.memset(ctypes.addressof(w), 0, 4096)
        w[2], w[3] = words, 1 + CPUS[0] if CPUS else 0
        done = start(words)
        out[size] = trips(w, words, [])
        w[0] = 0xFFFFFFFF
        stop(done)
        if any(w[128 + k] != N + k for k in range(words)):
            sys.exit(f"floor: the {size} B payload came back wrong")
    print(json.dumps(out), flush=True)
"""


FLOOR_CUDA = FLOOR_HOST + r"""
from cuda.bindings import driver as cu
def ck(r):
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        sys.exit(f"floor: {err}")
    return v[0] if len(v) == 1 else v
ck(cu.cuInit(0))
ck(cu.cuCtxSetCurrent(ck(cu.cuDevicePrimaryCtxRetain(ck(cu.cuDeviceGet(0))))))
fn = ck(cu.cuModuleGetFunction(ck(cu.cuModuleLoadData(open(sys.argv[1], "rb").read() + b"\0")), b"floor_ring"))
host = ck(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
dev = ctypes.c_uint64(int(ck(cu.cuMemHostGetDevicePointer(host, 0))))
stream = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
def start(words):
    n = ctypes.c_uint32(words)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(dev), ctypes.addressof(n))
    ck(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(params), 0))
    return n, params
run((ctypes.c_uint32 * 1024).from_address(int(host)), start, lambda _: ck(cu.cuStreamSynchronize(stream)))
"""


# The simulated GPU's floor: its "kernel" a process that polls the word of shared memory without pause.
FLOOR_SIM = FLOOR_HOST + r"""
import mmap, os
mm = mmap.mmap(-1, 4096)
w = (ctypes.c_uint32 * 1024).from_buffer(mm)
def start(words):
    pid = os.fork()
    if pid == 0:
        seen = placed = 0
        while True:
            r = w[0]
            if r != seen:
                if r == 0xFFFFFFFF:
                    os._exit(0)
                if w[3] != placed:  # off the CPU its host spins on (1 + cpu in word 3), as a GPU is
                    placed = w[3]
                    os.sched_setaffinity(0, ALLOWED - {placed - 1} or ALLOWED)
                n = w[2]
                w[128 : 128 + n] = w[64 : 64 + n]
                w[1] = seen = r
    return pid
run(w, start, lambda pid: os.waitpid(pid, 0))
"""


#: The payload sizes of the sweep (bytes); 0 is the doorbell alone (the floor's only).
SWEEP = (4, 64, 128, 188)


async def _floor_child(bench: Bench, n: int, cpus_: list[int], env: dict[str, str] | None) -> Any:
    """FLOOR_HOST's output, from a child process with a plain context of its own, started where
    the bench's children start (``cpus.for_child``): its host thread then moves to ``cpus_``."""
    d = tempfile.mkdtemp(prefix="floor-", dir=bench.base)
    try:
        argv = [sys.executable, "-c", FLOOR_SIM if bench.gpu == "sim" else FLOOR_CUDA, os.path.join(d, "floor.ptx"),
                json.dumps([0, *SWEEP]), str(n), json.dumps(cpus_)]
        if bench.gpu == "cuda":
            arch = (await anyio.to_thread.run_sync(query_device, 0)).compute
            await anyio.to_thread.run_sync(lambda: Path(argv[3]).write_bytes(cuda_to_ptx(FLOOR_CU, "floor", arch=arch)))

        def run() -> subprocess.CompletedProcess[str]:
            with cpus.for_child():
                return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

        r = await anyio.to_thread.run_sync(run)
        if r.returncode != 0:
            raise RuntimeError(f"the floor's child exited {r.returncode}: {r.stderr.strip()[-300:]}")
        return json.loads(r.stdout)
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def ring_floor(bench: Bench, b: Backend, n: int, env: dict[str, str] | None = None) -> dict[int, list[float]]:
    """The floor's round trips (seconds), by payload size, its host on ``bench.ring_cpu`` (``env``:
    another environment, b.native_env()'s for a client of b's MPS server,
    scripts/ring_probes.py): run before any kernel of ``b`` is resident (two contexts' kernels
    would time-slice)."""
    where = [] if bench.ring_cpu is None else [bench.ring_cpu]
    return {int(k): [x / 1e9 for x in v] for k, v in (await _floor_child(bench, n, where, env)).items()}


async def place_ring(bench: Bench) -> dict[int, float]:
    """Where (f) runs on the host, set once (``bench.ring_cpu``): ``--cpu N`` as given, ``off``
    nowhere in particular, ``auto`` the CPU whose floor round trip is shortest, by a survey of
    every CPU this process may use (64 B, 2000 requests each; the p50s in us, returned for the
    notes).  On the lent H200, a VM, the CPU decided the floor by up to 0.9 us (docs/benchmarks.md)."""
    if bench.cpu != "auto":
        bench.ring_cpu = None if bench.cpu == "off" else int(bench.cpu)
        return {}
    every = sorted(os.sched_getaffinity(0))
    if len(every) == 1:
        bench.ring_cpu = None  # nothing to keep the workers off it
        return {}
    got = (await _floor_child(bench, bench.n(2000, 200), every, None))["survey"]
    survey = {int(k): v / 1e3 for k, v in got.items()}
    bench.ring_cpu = min(survey, key=lambda c: (survey[c], c))
    return survey
