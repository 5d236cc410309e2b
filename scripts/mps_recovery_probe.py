"""Where an MPS fault's recovery spends its time, outside meshd-mps.

A private ``nvidia-cuda-mps-control -d``; N resident clients (a kernel spinning on the GPU, its
stream polled every 0.5 ms); M held processes (imported, waiting); then a client whose kernel
faults.  Timed on CLOCK_MONOTONIC (shared by every process) from the faulting launch: when each
resident sees the error (``seen``), when the residents are gone (``exited``: SIGKILLed by this
process at the first ``seen``, or each exiting by itself), and when each held process has a context
and a first kernel done (``ctx``, ``kernel``).  Variants change one thing each (VARIANTS).

    python3 scripts/mps_recovery_probe.py [--reps 3] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SRC = r"""
extern "C" __global__ void spin(volatile int *flag) { while (*flag == 0) { } }
extern "C" __global__ void fault(int x) { volatile int *p = (volatile int *)0x10; *p = x; }
extern "C" __global__ void one(int *out) { *out = 1; }
"""

#: name -> (residents, held, how the residents go, env of every client, env of the control daemon,
#:          release the held processes: "exited" (after the residents are gone) or "seen" (at once,
#:          retrying while the server is not ready), held processes cuInit before the fault)
VARIANTS: dict[str, dict] = {
    "base8": dict(n=8, m=8),
    "self-exit8": dict(n=8, m=8, how="exit"),
    "base2": dict(n=2, m=2),
    "held-early8": dict(n=8, m=8, release="seen"),
    "conn2-clients8": dict(n=8, m=8, client_env={"CUDA_DEVICE_MAX_CONNECTIONS": "2"}),
    "conn2-server8": dict(n=8, m=8, daemon_env={"CUDA_DEVICE_MAX_CONNECTIONS": "2"}),
    "preinit8": dict(n=8, m=8, preinit=True),
    "lazy-off8": dict(n=8, m=8, client_env={"CUDA_MODULE_LOADING": "EAGER"}),
    "limits8": dict(n=8, m=8, client_env={"PROBE_LIMITS": "stack=256,heap=0,printf=4096"}),
    "atp25-8": dict(n=8, m=8, client_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),
    "pinned1g8": dict(n=8, m=8, client_env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"}),
    "destroy8": dict(n=8, m=8, how="destroy"),
    "base4": dict(n=4, m=4),
    "base16": dict(n=16, m=8),
    "idle4-8": dict(n=8, m=8, idle=4),
    "sync8": dict(n=8, m=8, how="sync"),
}

LIMITS = {"stack": "CU_LIMIT_STACK_SIZE", "heap": "CU_LIMIT_MALLOC_HEAP_SIZE", "printf": "CU_LIMIT_PRINTF_FIFO_SIZE"}


def cu():
    from cuda.bindings import driver
    return driver


def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err!r}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def say(*a):
    print(*a, flush=True)


def compile_cubin(path: str) -> None:
    from cuda.bindings import nvrtc
    _err, prog = nvrtc.nvrtcCreateProgram(SRC.encode(), b"probe.cu", 0, [], [])
    r = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90"])
    if int(r[0]) != 0:
        raise RuntimeError(f"nvrtc {r}")
    _err, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    with open(path, "wb") as f:
        f.write(buf)


def context():
    d = cu()
    ok(d.cuInit(0))
    dev = ok(d.cuDeviceGet(0))
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
    ok(d.cuCtxSetCurrent(ctx))
    return ctx


def launch(fn, stream, *args_c):
    d = cu()
    ptrs = (ctypes.c_void_p * len(args_c))(*[ctypes.addressof(a) for a in args_c])
    ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(ptrs), 0))


def role_resident(cubin: str, how: str) -> None:
    d = cu()
    ctx = context()
    for kv in filter(None, os.environ.get("PROBE_LIMITS", "").split(",")):
        k, v = kv.split("=")
        ok(d.cuCtxSetLimit(getattr(d.CUlimit, LIMITS[k]), int(v)))
    mod = ok(d.cuModuleLoadData(read(cubin)))
    fn = ok(d.cuModuleGetFunction(mod, b"spin"))
    flag = ok(d.cuMemAlloc(4))
    ok(d.cuMemsetD32(flag, 0, 1))
    st = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    launch(fn, st, ctypes.c_uint64(int(flag)))
    _err, free, _total = d.cuMemGetInfo()
    say(f"ready {free}")
    if how == "sync":  # blocked in the driver, not polling: its error seen when the sync returns
        r = d.cuStreamSynchronize(st)[0]
        say(f"seen {time.monotonic():.6f} {r.name}")
        while True:
            time.sleep(1)
    while True:
        r = d.cuStreamQuery(st)[0]
        if r != d.CUresult.CUDA_ERROR_NOT_READY:
            say(f"seen {time.monotonic():.6f} {r.name}")
            if how == "destroy":
                d.cuDevicePrimaryCtxReset(ok(d.cuDeviceGet(0)))
                del ctx
            if how in ("exit", "destroy"):
                os._exit(0)
            while True:
                time.sleep(1)
        time.sleep(0.0005)


def role_held(cubin: str, release: str, preinit: str) -> None:
    d = cu()
    if preinit == "1":
        ok(d.cuInit(0))
    blob = read(cubin)
    say("ready")
    sys.stdin.readline()
    t = time.monotonic()
    tries, last = 0, None
    while True:
        tries += 1
        try:
            context()
            break
        except RuntimeError as e:
            last = e
            if release != "seen" or time.monotonic() - t > 20:
                say(f"failed {e}")
                return
            time.sleep(0.001)
    t_ctx = time.monotonic()
    mod = ok(d.cuModuleLoadData(blob))
    fn = ok(d.cuModuleGetFunction(mod, b"one"))
    out = ok(d.cuMemAlloc(4))
    st = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    launch(fn, st, ctypes.c_uint64(int(out)))
    ok(d.cuStreamSynchronize(st))
    say(f"ctx {t:.6f} {t_ctx:.6f} {time.monotonic():.6f} tries {tries} last {last}")
    sys.stdin.readline()


def role_idle() -> None:
    """A pooled worker: a context, nothing running."""
    context()
    say("ready 0")
    while True:
        time.sleep(1)


def role_fault(cubin: str) -> None:
    d = cu()
    context()
    mod = ok(d.cuModuleLoadData(read(cubin)))
    fn = ok(d.cuModuleGetFunction(mod, b"fault"))
    st = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    say("ready")
    sys.stdin.readline()
    t0 = time.monotonic()
    launch(fn, st, ctypes.c_int32(1))
    r = d.cuStreamSynchronize(st)
    say(f"fault {t0:.6f} {time.monotonic():.6f} {r[0].name}")
    os._exit(0)


class Child:
    def __init__(self, argv: list[str], env: dict[str, str]):
        self.p = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self.cv:
                self.lines.append(line.strip())
                self.cv.notify_all()

    def wait_for(self, prefix: str, within: float = 60.0) -> str:
        end = time.monotonic() + within
        with self.cv:
            while True:
                for x in self.lines:
                    if x.startswith(prefix):
                        return x
                left = end - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self.cv.wait(0.2)):
                    raise RuntimeError(f"no {prefix!r} from {self.p.args[2:]}: {self.lines[-5:]}")
                self.cv.wait(min(left, 0.2))

    def send(self, s: str = "go\n") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(s)
        self.p.stdin.flush()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


def control(env: dict[str, str], cmd: str) -> str:
    return subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", capture_output=True, text=True, env=env,
                          timeout=20).stdout.strip()


def one_run(name: str, v: dict, cubin: str) -> dict[str, float] | str:
    n, m = v["n"], v["m"]
    how, release, preinit = v.get("how", "kill"), v.get("release", "exited"), v.get("preinit", False)
    tmp = tempfile.mkdtemp(prefix="mrp-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{tmp}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{tmp}/log"}
    os.makedirs(f"{tmp}/pipe"), os.makedirs(f"{tmp}/log")
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**env, **v.get("daemon_env", {})}, check=True, timeout=20)
    cenv = {**env, **v.get("client_env", {})}
    kids: list[Child] = []
    try:
        res = [Child(["resident", cubin, how], cenv) for _ in range(n)]
        kids += res
        idle = [Child(["idle"], cenv) for _ in range(v.get("idle", 0))]
        kids += idle
        for c in idle:
            c.wait_for("ready")
        free = [int(c.wait_for("ready").split()[1]) for c in res]
        per_client_mb = (max(free) - min(free)) / max(1, n - 1) / 2**20
        server = control(env, "get_server_list")
        held = [Child(["held", cubin, release, "1" if preinit else "0"], cenv) for _ in range(m)]
        kids += held
        f = Child(["fault", cubin], cenv)
        kids.append(f)
        for c in [*held, f]:
            c.wait_for("ready")
        time.sleep(0.3)  # the new clients' stall settled (a probe, not a test)
        f.send()
        t0 = float(f.wait_for("fault").split()[1])
        first = res[0].wait_for("seen")
        t_first_seen = min(float(c.wait_for("seen").split()[1]) for c in res)
        if release == "seen":
            for c in held:
                c.send()
        if how in ("kill", "sync"):
            for c in [*res, *idle]:
                c.p.kill()
        for c in [*res, *idle]:
            c.p.wait(30)
        t_exit = time.monotonic()
        f.p.wait(30)
        if release == "exited":
            for c in held:
                c.send()
        ctxs = []
        for c in held:
            line = c.wait_for("ctx")
            parts = line.split()
            ctxs.append((float(parts[1]), float(parts[2]), float(parts[3]), int(parts[5])))
        server_after = control(env, "get_server_list")
        out = {
            "detect": (t_first_seen - t0) * 1e3,
            "exited": (t_exit - t0) * 1e3,
            "first_ctx": (min(x[1] for x in ctxs) - t0) * 1e3,
            "last_ctx": (max(x[1] for x in ctxs) - t0) * 1e3,
            "last_kernel": (max(x[2] for x in ctxs) - t0) * 1e3,
            "tries_max": max(x[3] for x in ctxs),
            "server_changed": float(server != server_after),
            "client_mb": per_client_mb,
        }
        say(f"  {name}: " + ", ".join(f"{k} {val:.0f}" for k, val in out.items()) + f"  ({first.split()[2]})")
        return out
    except Exception as e:  # a probe: the failure is its finding
        say(f"  {name}: FAILED {e}")
        return f"FAILED {e}"
    finally:
        for c in kids:
            c.kill()
        control(env, "quit")
        for _ in range(100):
            if subprocess.run(["pgrep", "-f", f"{tmp}"], capture_output=True).returncode != 0:
                break
            time.sleep(0.1)
        log = f"{tmp}/log/server.log"
        if os.path.exists(log):
            lines = read(log).decode(errors="replace").splitlines()
            words = ("fault", "exception", "recover", "ready", "terminat", "start")
            keep = [x for x in lines if any(k in x.lower() for k in words)]
            say("   server.log: " + " | ".join(keep[-8:]))
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    names = [x for x in args.only.split(",") if x] or list(VARIANTS)
    tmp = tempfile.mkdtemp(prefix="mrp-bin-")
    cubin = f"{tmp}/probe.cubin"
    compile_cubin(cubin)
    say(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,persistence_mode", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip())
    results: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    for rep in range(args.reps):
        say(f"rep {rep}")
        for k in names:
            r = one_run(k, VARIANTS[k], cubin)
            if isinstance(r, dict):
                results[k].append(r)
    say("\nmedians (ms from the faulting launch):")
    for k, rs in results.items():
        if rs:
            med = {f: statistics.median(r[f] for r in rs) for f in rs[0]}
            say(f"{k:16s} " + ", ".join(f"{f} {x:.0f}" for f, x in med.items()) + f"  ({len(rs)} runs)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("resident", "held", "fault", "idle"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        roles = {"resident": role_resident, "held": role_held, "fault": role_fault, "idle": role_idle}
        roles[sys.argv[1]](*sys.argv[2:])
    else:
        main()
