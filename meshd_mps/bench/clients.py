"""Bare clients, the baselines of (d) pool and (i) recovery: plain processes that make a CUDA
context (with --gpu sim: import cuda.bindings, or connect to the stand-in server), started, awaited
until they say so, and ended whatever happens."""

from __future__ import annotations

import os
import statistics
import sys
import time

import anyio

from meshd_mps.backend import Backend
from meshd_mps.bench.measure import gpu_mib, vmrss_mib
from meshd_mps.bench.rig import Bench, mps_gpu
from meshd_mps.supervision import child

BARE_CUDA = r"""
import os, sys
from cuda.bindings import driver as cu
def ck(r, what):
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        print("error", what, err, flush=True); sys.exit(1)
    return v[0] if v else None
ck(cu.cuInit(0), "cuInit")
ctx = ck(cu.cuDevicePrimaryCtxRetain(ck(cu.cuDeviceGet(0), "cuDeviceGet")), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ck(cu.cuMemAlloc(1 << 20), "cuMemAlloc")
print("ok", os.getpid(), flush=True)
sys.stdin.readline()
"""


BARE_SIM = "import os, sys\nfrom cuda.bindings import driver\nprint('ok', os.getpid(), flush=True)\nsys.stdin.readline()\n"


# A bare client started ahead: imported, its context created only at "go" (what a held worker does).
HELD_CUDA = BARE_CUDA.replace("ck(cu.cuInit(0)", "print('held', flush=True)\nsys.stdin.readline()\nck(cu.cuInit(0)", 1)


HELD_SIM = r"""
import os, sys
from meshd_mps.standin import connect_client
print('held', flush=True)
sys.stdin.readline()
s = connect_client(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), os.getpid())
print('ok', os.getpid(), flush=True)
sys.stdin.readline()
"""


async def end_all(procs: list[child.Child]) -> None:
    """Bare clients ended: stdin closed (they exit), then killed if they linger; all reaped."""
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()
    with anyio.move_on_after(10, shield=True):
        for p in procs:
            await p.wait()
    for p in procs:
        if p.returncode is None:
            p.kill()
    with anyio.move_on_after(5, shield=True):
        for p in procs:
            await p.wait()


async def said(p: child.Child, word: str, what: str) -> None:
    """``p``'s next line starts with ``word``; RuntimeError naming ``what`` and the line otherwise."""
    assert p.stdout is not None
    line = (await p.stdout.readline()).decode(errors="replace").split()
    if line[:1] != [word]:
        raise RuntimeError(f"{what} {p.pid}: {' '.join(line) or 'exited before it said ' + word}")


async def spawned(procs: list[child.Child], code: str, env: dict[str, str], n: int, word: str, what: str) -> None:
    """n children of ``code`` spawned into ``procs`` (the caller ends them, whatever happens), each
    awaited until it says ``word`` (2 minutes in all)."""
    for _ in range(n):
        procs.append(await child.spawn([sys.executable, "-c", code], env))
    with anyio.fail_after(120):
        for p in procs:
            await said(p, word, what)


async def bare_clients(bench: Bench, b: Backend, n: int) -> tuple[float, float, int | None, float | None]:
    """n bare clients under b's daemon: (all ready s, median VmRSS MiB, how many are in the client
    list, median GPU memory MiB as NVML says it: None on the simulated GPU)."""
    mps = mps_gpu(b).mps
    env = {**os.environ, **mps.daemon.env}
    code = BARE_CUDA if bench.gpu == "cuda" else BARE_SIM
    procs: list[child.Child] = []
    t0 = time.perf_counter()
    try:
        await spawned(procs, code, env, n, "ok", "bare client")
        t = time.perf_counter() - t0
        rss = statistics.median(vmrss_mib(p.pid) for p in procs)
        seen = None
        if bench.gpu == "cuda":
            server = await mps.server_pid()
            listed = set(await mps.clients(server)) if server else set()
            seen = sum(p.pid in listed for p in procs)
        return t, rss, seen, gpu_mib(bench.gpu, [p.pid for p in procs])
    finally:
        await end_all(procs)


async def held_contexts(bench: Bench, env: dict[str, str], n: int) -> float:
    """The floor of n new contexts: n bare processes, imported and waiting, released at once; seconds
    until every one has a context (an MPS server, where ``env`` names one, creates them one at a time)."""
    code = HELD_CUDA if bench.gpu == "cuda" else HELD_SIM
    procs: list[child.Child] = []
    try:
        await spawned(procs, code, env, n, "held", "held client")
        with anyio.fail_after(120):
            t0 = time.perf_counter()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"go\n")
            for p in procs:
                await said(p, "ok", "held client")
            return time.perf_counter() - t0
    finally:
        await end_all(procs)
