"""``python -m meshd_mps.bench [--gpu cuda|sim] [--quick] [--json FILE] [--mps-dir DIR] [--cpu N|auto|off]``: one table.

Every figure stands beside a baseline measured in the same run, with the
ratio, the target and PASS / MISS ("-": a figure without a target, shown
for comparison).  The examples are compiled from CUDA C here (NVRTC, then
the backend's nvJitLink); nothing ships as PTX.  Rows (issue 6):

(a) stall: the largest gap between two beats of a running ``heartbeat``
    (MAX_GAP, ns of the kernel's %globaltimer, zeroed through GAP_RESET before
    the window) while ``echo`` is loaded until its first beat: into a pooled
    MPS worker, into a fresh one (pool emptied first), and in blink mode.
    Baseline: the heartbeat's own max gap over a window of the same length
    with nothing happening.  In blink mode the heartbeat is halted and
    relaunched, and a relaunched kernel restarts MAX_GAP, so the gap across
    the blink is estimated from (HEARTBEAT, BEAT_TIME) samples taken by the
    host: the time between two samples less the beats between them at the
    idle beat rate.
(b) ask: the launch path's round trip (Module.start: a LAUNCH through
    WorkerProc.ask) until its LAUNCHED, for a
    kernel that returns at once (``heartbeat`` whose slot already says HALT),
    its DONE awaited before the next ask; one worker alone, then 32 (8 with
    --quick) workers asking concurrently.  Baseline: a raw pipe ping-pong of
    the same frame with a child process that echoes it (os.write / os.read).
(c) done: a kernel's end to the caller's awaitable resolving, measured from
    the host's HALT write on a running ``heartbeat`` to its Launch resolving.
    Baseline: HALT write to STATE = EXITED seen by a host spin on the slot
    (the kernel's end itself, without the DONE path).
(d) pool: MpsIsolation.prewarm of 1, 8, 32 workers (spawn to every READY and the
    client check), and VmRSS per worker, against as many bare clients
    started under the same daemon: python + import cuda.bindings + cuInit +
    primary context + one 1 MiB alloc (probe/pool.py's child); with --gpu sim
    a bare client is python importing cuda.bindings only.
(e) load: a program's PTX to running (Programs.load: prepare, preload into a
    pooled MPS worker, launch; until its first heartbeat), from the cubin
    cache, against the same with a cold JIT (a fresh Compiler, no cache).
(f) ring: one request and its response through ``echo``'s mailbox ring
    (Programs.call), against one kernel launch plus synchronise per request
    (LAUNCH of a kernel that returns at once, DONE awaited), and against the
    floor (a minimal kernel and host loop).  The floor's host and the ring's
    spin run on one host CPU (--cpu; auto: the fastest floor of a survey of
    every CPU), since on the lent H200 the CPU decided the round trip.
(g) idle: this supervisor process's CPU (getrusage user + sys) over 5 s
    (2 s with --quick) with 32 (8) idle pooled workers, in % of one core,
    against the same window before any backend was opened.
(h) limits (issue 14): as many resident heartbeats as each mode takes (blink
    32, one per hardware queue; MPS 44: 48 clients less a pool of 4; 8 with
    --quick), how many beat, the next load refused; an upgrade at the limit:
    in blink mode the blink's length against the same with one program, in
    MPS mode a neighbour's MAX_GAP against its idle gap; the start check's
    share of a load (LAUNCHED to STATE = RUNNING) against the whole load.
(i) recovery (issue 16): n resident heartbeats (1, 8, 32 in MPS mode with a pool of 4; 1, 8 in
    blink mode), then ``fault``: from its load's return to every heartbeat beating again, with the
    recovery's steps (detect, decide, teardown, server_ready, contexts, relaunch).  Baseline, the
    floor of the same run: the fault seen, the old workers exited (the server takes no new client
    before), and as many bare contexts as the recovery needs (n in MPS mode, 1 in blink mode),
    from processes imported and waiting, released at once.
(j) restart (issue 17): ``meshd-mps serve`` with a state dir and ``heartbeat``, stopped (SIGTERM)
    and started again: the heartbeat's largest beat gap across it (polled through the control API)
    against its idle gap, and the stop to the API answering again against the first start's.
    Restore by reload: the program is halted, loaded and launched again.
(k) live restore (issue 17): ``serve --live-restore`` with ``heartbeat``, across a restart
    (SIGTERM), an upgrade (a copy of this source tree with a later version started) and a SIGKILL
    followed by a start: the kernel's own largest beat gap (MAX_GAP, read from the mailbox file)
    against its idle MAX_GAP over a window as long as the longest of them (target: within 2x),
    and the stop to the API answering again against (j)'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import re
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio

from meshd_mps import eventloop
from meshd_mps.backend import Backend, live_paths
from meshd_mps.deadlines import Deadlines
from meshd_mps.errors import CapacityError, ConfigError
from meshd_mps.gpu.compiler import Compiler, cuda_to_ptx, nvjitlink_version
from meshd_mps.gpu.device import query_device
from meshd_mps.isolation.base import Module
from meshd_mps.isolation.limits import BLINK_QUEUES
from meshd_mps.isolation.mps import MpsIsolation
from meshd_mps.log import setup_logging
from meshd_mps.mps.clients import MAX_CLIENTS
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import LaunchReq, Op
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.ring import SPIN, Ring
from meshd_mps.supervision import child, cpus
from meshd_mps.supervision.proc import WorkerProc

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
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
from meshd_mps.mps.standin import connect_client
print('held', flush=True)
sys.stdin.readline()
s = connect_client(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), os.getpid())
print('ok', os.getpid(), flush=True)
sys.stdin.readline()
"""
ECHO_CHILD = "import os\nwhile True:\n    b = os.read(0, 4096)\n    if not b: break\n    os.write(1, b)\n"
# Answers every frame at once with LAUNCHED ok: a worker with nothing to do, for the
# supervisor's own share of an ask (WorkerProc, its reader task, the loop, the pipes).
ANSWER_CHILD = r"""
import os, struct
reply = struct.pack("<IBI", 5, 5, 1)  # LAUNCHED, ok
buf = b""
while True:
    b = os.read(0, 65536)
    if not b: break
    buf += b
    out = b""
    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("<I", buf)[0]:
        buf = buf[4 + struct.unpack_from("<I", buf)[0]:]
        out += reply
    if out: os.write(1, out)
"""


@dataclass
class Row:
    id: str
    name: str
    unit: str = ""
    value: float | None = None
    baseline: float | None = None
    base_name: str = ""
    target: str = "-"
    ok: bool | None = None
    note: str = ""
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.value is not None and self.baseline else None

    @property
    def result(self) -> str:
        return "ERROR" if self.error else "-" if self.ok is None else "PASS" if self.ok else "MISS"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "result": self.result}


class Bench:
    def __init__(self, gpu: str, quick: bool, mps_dir: str | None, loop: str = "auto", cpu: str = "auto"):
        self.gpu, self.quick, self.loop = gpu, quick, loop
        self.cpu = cpu  # --cpu: where (f)'s host spins (place_ring)
        self.ring_cpu: int | None = None
        self.own_base = mps_dir is None
        self.base = mps_dir or tempfile.mkdtemp(prefix="meshd-bench.")  # short: AF_UNIX paths stop at 108 bytes
        self.dirs: list[str] = []
        self.device = ""
        self._src: dict[tuple[str, str], tuple[dict[str, Any], bytes]] = {}

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    async def backend(self, isolation: str, pool: int = 0) -> Backend:
        d = None
        if isolation == "mps":
            d = os.path.join(self.base, str(len(self.dirs)))
            self.dirs.append(d)
        # GPU 0 only: on a several-GPU host every figure stays one GPU's
        b = await Backend.open(isolation=isolation, pool=pool, gpu=self.gpu, mps_dir=d, devices=[0])  # type: ignore[arg-type]
        if not self.device and b.caps is not None:
            c = b.caps
            self.device = f"{c.name} (sm_{c.cc_major}{c.cc_minor}, {c.sms_total} SMs, {c.blocks_per_sm} blocks/SM)"
        return b

    async def src(self, b: Backend, name: str) -> tuple[dict[str, Any], bytes]:
        """An example's manifest and PTX, compiled here from CUDA C for the device's arch."""
        assert b.info is not None
        arch = b.info.compute
        if (name, arch) not in self._src:
            d = EXAMPLES / name
            cu = (d / f"{name}.cu").read_bytes()
            ptx = await anyio.to_thread.run_sync(lambda: cuda_to_ptx(cu, name, arch=arch, include=[str(EXAMPLES / "include")]))
            self._src[name, arch] = (json.loads((d / "manifest.json").read_text()), ptx)
        return self._src[name, arch]

    def cleanup(self) -> None:
        for d in [self.base] if self.own_base else self.dirs:
            shutil.rmtree(d, ignore_errors=True)


# ---- helpers -----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def until(pred: Any, within: float, what: str) -> None:
    """Wait for pred(): a hot yield for 5 ms (asyncio sleeps round up to 1 ms), then 1 ms sleeps."""
    t0 = time.perf_counter()
    while not pred():
        dt = time.perf_counter() - t0
        if dt > within:
            raise TimeoutError(f"{what}: not within {within:g} s")
        await asyncio.sleep(0 if dt < 0.005 else 0.001)


def spin(pred: Any, within: float, what: str) -> None:
    """A host busy-wait (for the baselines), bounded."""
    end = time.perf_counter() + within
    while not pred():
        if time.perf_counter() > end:
            raise TimeoutError(f"{what}: not within {within:g} s")


async def timed(n: int, f: Any, warm: int = 10) -> list[float]:
    """Seconds each of n ``await f()`` took (or the float f returns), after ``warm`` untimed ones."""
    out = []
    for i in range(n + warm):
        t0 = time.perf_counter()
        r = await f()
        if i >= warm:
            out.append(r if isinstance(r, float) else time.perf_counter() - t0)
    return out


async def launch_sync(w: Module, slot: int, ask_only: bool = False) -> float:
    """LAUNCH of w's kernel (the launch path: Module.start), then its DONE: seconds to LAUNCHED (ask_only) or to DONE."""
    t0 = time.perf_counter()
    done = await w.start(slot, 1)
    t1 = time.perf_counter()
    d = await done  # no scope of its own (it would cost the concurrent row loop time): the section's deadline holds
    if not d.ok:
        raise RuntimeError(f"{w.name} on worker {w.proc.pid}: DONE says {d.message}")
    return t1 - t0 if ask_only else time.perf_counter() - t0


def mps_gpu(b: Backend) -> MpsIsolation:
    """The MPS backend's one GPU (the bench drives GPU 0 only)."""
    g = b.isolations[0]
    assert isinstance(g, MpsIsolation)
    return g


async def returning_worker(bench: Bench, b: Backend, slot: int) -> Module:
    """A pooled worker with ``heartbeat`` loaded and its slot set to HALT: each launch returns at once."""
    img = await b.prepare(*await bench.src(b, "heartbeat"))
    assert img.preloaded is not None
    b.mailbox.reset_slot(slot)
    b.mailbox.halt(slot)
    return img.preloaded


async def retire_idle(b: Backend) -> None:
    """Empty the pool: its workers retired and reaped."""
    idle = mps_gpu(b).pool.drain()
    for w in idle:
        b.sup.retire(w)
    pids = {w.pid for w in idle}
    await until(lambda: not pids & set(b.sup.children()), 15, "retired workers to exit")


def vmrss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


# ---- (a) stall -----------------------------------------------------------------------------------
async def beat(b: Backend, slot: int, reset: bool = False) -> None:
    """The heartbeat's next beat; with ``reset`` the beat that zeroed MAX_GAP (GAP_RESET)."""
    mb, n = b.mailbox, b.mailbox.heartbeat(slot)
    if reset:
        mb.set_u32(slot, abi.GAP_RESET, 1)
        await until(lambda: mb.u32(slot, abi.GAP_RESET) == 0, 10, "the heartbeat to zero MAX_GAP")
    else:
        await until(lambda: mb.heartbeat(slot) > n, 10, "the heartbeat's next beat")


def across(samples: list[tuple[int, int, int]], period: float) -> float:
    """The largest gap seen from host samples (n, beat time, max gap): between two samples, the
    time less the beats between them at ``period`` ns a beat (or a sampled MAX_GAP, if larger)."""
    est: float = max((g for _, _, g in samples), default=0)
    for (n0, t0, _), (n1, t1, _) in itertools.pairwise(samples):
        if n1 > n0 and t1 >= t0:
            est = max(est, (t1 - t0) - (n1 - n0 - 1) * period)
    return est


async def stall_window(b: Backend, progs: Programs, slot: int, echo: tuple[dict[str, Any], bytes],
                       sampled: bool) -> tuple[float, float, float]:
    """(max gap us while echo loads until its first beat, max gap us over as long with nothing,
    max gap us over as long with echo resident and idle): the third tells the load's own cost
    from that of a second resident kernel polling host memory beside the heartbeat."""
    mb, samples, stop = b.mailbox, [], asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            samples.append((mb.heartbeat(slot), mb.u64(slot, abi.BEAT_TIME), mb.u64(slot, abi.MAX_GAP)))
            await asyncio.sleep(0)

    await beat(b, slot, reset=True)
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        if sampled:
            tg.start_soon(poll)
        p = await progs.load(*echo)
        await until(lambda: mb.heartbeat(p.slot) > 0, 10, "echo's first beat")
        window = time.perf_counter() - t0
        await beat(b, slot)
        stop.set()
    gap = float(mb.u64(slot, abi.MAX_GAP))
    await beat(b, slot, reset=True)
    await anyio.sleep(window)
    await beat(b, slot)
    beside = float(mb.u64(slot, abi.MAX_GAP))
    await progs.unload(p.name)
    await beat(b, slot, reset=True)
    n0, t0ns = mb.heartbeat(slot), mb.u64(slot, abi.BEAT_TIME)
    await anyio.sleep(window)
    await beat(b, slot)
    idle = float(mb.u64(slot, abi.MAX_GAP))
    if sampled:
        period = (mb.u64(slot, abi.BEAT_TIME) - t0ns) / max(1, mb.heartbeat(slot) - n0)
        gap = max(gap, across(samples, period))
    return gap / 1e3, idle / 1e3, beside / 1e3


async def sec_stall(bench: Bench) -> list[Row]:
    reps, rows = bench.n(3, 1), []
    note = f"echo loaded until its first beat; worst of {bench.n(3, 1)}; heartbeat's MAX_GAP (%globaltimer)"
    for mode in ("mps", "blink"):
        async with await bench.backend(mode, pool=2) as b:
            progs = Programs(b)
            try:
                hb = await progs.load(*await bench.src(b, "heartbeat"))
                echo = await bench.src(b, "echo")
                assert b.compiler is not None
                await b.compiler.prepare(*echo)  # the JIT outside the windows
                await until(lambda s=hb.slot: b.mailbox.heartbeat(s) > 0, 10, "the heartbeat's first beat")
                for case in ("pooled", "fresh") if mode == "mps" else ("blink",):
                    gap = idle = beside = 0.0
                    for _ in range(reps):
                        if case == "fresh":
                            await retire_idle(b)
                        elif case == "pooled" and not len(mps_gpu(b).pool):
                            raise RuntimeError("no pooled worker left for the pooled case")
                        g, i, e = await stall_window(b, progs, hb.slot, echo, sampled=case == "blink")
                        gap, idle, beside = max(gap, g), max(idle, i), max(beside, e)
                    r = Row("a", f"stall: load into a {case} MPS worker" if mode == "mps" else "stall: load in blink mode",
                            "us", gap, idle, "idle gap", note=note)
                    if case == "pooled":
                        r.target, r.ok = "<= 2x idle", gap <= 2 * idle
                    if mode == "mps":
                        r.note += f"; idle gap with echo resident beside it: {beside:.2f} us"
                    if case == "blink":
                        r.note += "; across the halt+relaunch estimated from host samples of HEARTBEAT/BEAT_TIME"
                    rows.append(r)
            finally:
                await progs.close()
    return rows


# ---- (b) ask -----------------------------------------------------------------------------------
def raw_pipe(n: int) -> list[float]:
    """Round trips of a LAUNCH-sized frame with a child process that echoes it."""
    req = frames.encode(Op.LAUNCH, LaunchReq(1, 1, 0, 1).encode())
    child = subprocess.Popen([sys.executable, "-c", ECHO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    assert child.stdin is not None and child.stdout is not None
    wfd, rfd, out = child.stdin.fileno(), child.stdout.fileno(), []
    try:
        for i in range(n + 50):
            t0 = time.perf_counter()
            os.write(wfd, req)
            got = b""
            while len(got) < len(req):
                if not select.select([rfd], [], [], 5)[0]:
                    raise TimeoutError("raw pipe: the echoing child did not answer in 5 s")
                chunk = os.read(rfd, len(req) - len(got))
                if not chunk:
                    raise RuntimeError("raw pipe: the echoing child exited")
                got += chunk
            if i >= 50:
                out.append(time.perf_counter() - t0)
    finally:
        child.stdin.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
    return out


async def answering_child(d: Deadlines) -> tuple[WorkerProc, asyncio.Task[None]]:
    """ANSWER_CHILD as a WorkerProc with its reader task: an ask to it is the supervisor's share alone."""
    w = WorkerProc(await child.spawn([sys.executable, "-c", ANSWER_CHILD], os.environ, framed=True), lambda _w: None, d)
    return w, asyncio.ensure_future(w.read_frames())


async def ask_only(w: WorkerProc) -> None:
    await w.ask(Op.LAUNCH, LaunchReq(1, 1, 0, 1).encode())


async def asking_at_once(ws: list[Module], each: int) -> tuple[float, float, float, float]:
    """Every worker of ``ws`` asked ``each`` times, all at once (heartbeat, HALT preset): p50 and
    p99 of the asks (us), the loop's CPU per ask (us) and its share of a core (%)."""
    many: list[float] = []

    async def asker(i: int) -> None:
        many.extend(await timed(each, lambda: launch_sync(ws[i], 100 + i, ask_only=True)))

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(len(ws)):
            tg.start_soon(asker, i)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return pct(many, 0.5) * 1e6, pct(many, 0.99) * 1e6, cpu / len(many) * 1e6, cpu / (t1 - t0) * 100


async def sec_ask(bench: Bench) -> list[Row]:
    n1, nw, each = bench.n(2000, 100), bench.n(32, 8), bench.n(200, 20)
    raw = await anyio.to_thread.run_sync(raw_pipe, n1)
    rp50, rp99 = pct(raw, 0.5) * 1e6, pct(raw, 0.99) * 1e6
    answerer, reader = await answering_child(Deadlines())
    try:
        bare = await timed(n1, lambda: ask_only(answerer))
    finally:
        answerer.close_stdin()
        await reader
        await answerer.process.wait()
    async with await bench.backend("mps", pool=1) as b:  # one worker: the MPS server has one client
        asked = await returning_worker(bench, b, 99)
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        one = await timed(n1, lambda: launch_sync(asked, 99, ask_only=True))
        c1 = resource.getrusage(resource.RUSAGE_SELF)
    alone = (c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime) / (n1 + 10) * 1e6
    async with await bench.backend("mps", pool=nw + 1) as b:
        asked = await returning_worker(bench, b, 99)
        among_idle = await timed(n1, lambda: launch_sync(asked, 99, ask_only=True))
        ws = [await returning_worker(bench, b, 100 + i) for i in range(nw)]
        dones = []
        for i, w in enumerate(ws):  # each runs heartbeat, busy until halted
            b.mailbox.reset_slot(100 + i)
            dones.append(await w.start(100 + i, 1))
        await until(lambda: all(b.mailbox.u64(100 + i, abi.HEARTBEAT) > 0 for i in range(nw)), 10, "busy heartbeats")
        busy_one = await timed(n1, lambda: launch_sync(asked, 99, ask_only=True))
        for i in range(nw):
            b.mailbox.halt(100 + i)
        with anyio.fail_after(10):
            for d in dones:
                await d
        rounds = [await asking_at_once(ws, each) for _ in range(bench.n(ROUNDS, 1))]
    # The same with the event loop's CPU its own, as ``serve --daemon-cpus`` gives it: no worker
    # woken there takes it from the loop (supervision/cpus.py).
    cpu, placed = daemon_cpu(bench), []
    if cpu is not None:
        with placement(cpu):
            async with await bench.backend("mps", pool=nw) as b:
                ws = [await returning_worker(bench, b, 100 + i) for i in range(nw)]
                placed = [await asking_at_once(ws, each) for _ in range(bench.n(ROUNDS, 1))]
    m50, m99, per_ask, core = (median([r[i] for r in rounds]) for i in range(4))
    note = "WorkerProc.ask LAUNCH->LAUNCHED, heartbeat with HALT preset; raw: pipe ping-pong of the frame with an echoing child"
    p50, p99 = pct(one, 0.5) * 1e6, pct(one, 0.99) * 1e6
    q50, q99 = pct(busy_one, 0.5) * 1e6, pct(busy_one, 0.99) * 1e6
    b50 = pct(bare, 0.5) * 1e6
    each_round = "; rounds (p50/p99, CPU per ask): " + ", ".join(f"{r[0]:.0f}/{r[1]:.0f} us, {r[2]:.1f} us" for r in rounds)
    busy_note = f"the same asks while {nw} other workers each run a heartbeat kernel"
    rows = [
        Row("b", "ask p50, 1 worker", "us", p50, rp50, "raw pipe p50", "<= 3x raw pipe", p50 <= 3 * rp50, note + f"; {n1} asks"),
        Row("b", "ask p99, 1 worker", "us", p99, rp99, "raw pipe p99", note=f"{n1} asks"),
        Row("b", "ask p50, a child that answers at once", "us", b50, rp50, "raw pipe p50",
            note="the supervisor's own share: WorkerProc.ask to a child that answers every frame with LAUNCHED at once"),
        Row("b", f"ask p50, 1 worker of {nw + 1}, the others idle", "us", pct(among_idle, 0.5) * 1e6, rp50, "raw pipe p50",
            note=f"the same asks, {nw} idle pooled workers (MPS clients) beside it"),
        Row("b", f"ask p50, {nw} workers busy", "us", q50, rp50, "raw pipe p50", note=busy_note),
        Row("b", f"ask p99, {nw} workers busy", "us", q99, rp99, "raw pipe p99", "< 1000 us", q99 < 1000, note=busy_note),
        Row("b", f"ask p50, {nw} workers asking at once", "us", m50, rp50, "raw pipe p50",
            note=f"{nw} workers x {each} asks, concurrently: they queue on the one event loop; the median of"
                 f" {len(rounds)} rounds" + each_round),
        Row("b", f"ask p99, {nw} workers asking at once", "us", m99, rp99, "raw pipe p99",
            target="-" if placed else "< 1000 us", ok=None if placed else m99 < 1000,
            note=f"loop CPU {per_ask:.0f} us per ask (LAUNCHED and DONE), {core:.0f} % of a core; the median of"
                 f" {len(rounds)} rounds; every thread where the scheduler puts it"),
        Row("b", f"ask: loop CPU per ask, {nw} workers asking at once", "us", per_ask, alone, "the same, 1 worker",
            note="getrusage(RUSAGE_SELF) user+sys over the asks, LAUNCHED and DONE each, divided by the asks"),
    ]
    if placed:
        n50, n99, n_ask, n_core = (median([r[i] for r in placed]) for i in range(4))
        where = (f"the bench's process on CPU {cpu} and its {nw} workers (and MPS) on the others, as serve"
                 f" --daemon-cpus {cpu} places them; the median of {len(placed)} rounds (p50/p99, CPU per ask): "
                 + ", ".join(f"{r[0]:.0f}/{r[1]:.0f} us, {r[2]:.1f} us" for r in placed))
        rows += [
            Row("b", f"ask p50, {nw} asking at once, the loop's CPU its own", "us", n50, m50, "the same, unplaced",
                note=where),
            Row("b", f"ask p99, {nw} asking at once, the loop's CPU its own", "us", n99, m99, "the same, unplaced",
                "< 1000 us", n99 < 1000, note=f"loop CPU {n_ask:.0f} us per ask, {n_core:.0f} % of a core"),
        ]
    return rows


# ---- (c) done ----------------------------------------------------------------------------------
async def sec_done(bench: Bench) -> list[Row]:
    n, slot = bench.n(200, 30), 10
    done: list[float] = []
    ended: list[float] = []
    async with await bench.backend("mps", pool=1) as b:
        mb = b.mailbox
        k = await b.load(await b.prepare(*await bench.src(b, "heartbeat")))
        mb.reset_slot(slot)
        for i in range(2 * n + 4):  # even: HALT -> Launch resolved; odd: HALT -> STATE = EXITED (the baseline)
            mb.set_u32(slot, abi.STATE, abi.IDLE)
            beats = mb.heartbeat(slot)
            run = await b.launch(k, slot)
            await until(lambda beats=beats: mb.heartbeat(slot) > beats and mb.u32(slot, abi.STATE) == abi.RUNNING, 10,
                        "heartbeat running")
            t0 = time.perf_counter()
            mb.halt(slot)
            if i % 2:
                spin(lambda: mb.u32(slot, abi.STATE) == abi.EXITED, 5, "STATE = EXITED after HALT")
                t1 = time.perf_counter()
            with anyio.fail_after(5):
                d = await run
            if i % 2 == 0:
                t1 = time.perf_counter()
            if not d.ok:
                raise RuntimeError(f"heartbeat: DONE says {d.message}")
            if i >= 4:
                (ended if i % 2 else done).append(t1 - t0)
        await b.unload(k)
    p50, p99 = pct(done, 0.5) * 1e6, pct(done, 0.99) * 1e6
    e50, e99 = pct(ended, 0.5) * 1e6, pct(ended, 0.99) * 1e6
    note = ("from the host's HALT write on a running heartbeat to its Launch resolving (MPS worker);"
            " baseline: HALT to STATE=EXITED by a host spin")
    return [
        Row("c", "done p50", "us", p50, e50, "kernel end p50", "< 200 us", p50 < 200, note + f"; {n} each"),
        Row("c", "done p99", "us", p99, e99, "kernel end p99", note=f"{n} each"),
    ]


# ---- (d) pool ----------------------------------------------------------------------------------
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


async def bare_clients(bench: Bench, b: Backend, n: int) -> tuple[float, float, int | None]:
    """n bare clients under b's daemon: (all ready s, median VmRSS MiB, how many are in the client list)."""
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
        return t, rss, seen
    finally:
        await end_all(procs)


async def sec_pool(bench: Bench) -> list[Row]:
    rows, rss = [], (0.0, 0.0, 0)
    bare = ("bare clients: python + cuda.bindings + cuInit + primary context + 1 MiB alloc" if bench.gpu == "cuda"
            else "sim: bare clients are python importing cuda.bindings only")
    async with await bench.backend("mps", pool=0) as b:
        gpu = mps_gpu(b)
        # The MPS server starts with the first client of a daemon: paid by neither side's timing.
        first, _, _ = await bare_clients(bench, b, 1)
        bare += f"; the MPS server started beforehand by one bare client ({first * 1e3:.0f} ms)"
        for n in (1, 8) if bench.quick else (1, 8, 32):
            t0 = time.perf_counter()
            await gpu.prewarm(n)
            tw = time.perf_counter() - t0
            t1 = time.perf_counter()
            await gpu.mps.check_clients(gpu.pool.pids())  # the check alone, once more, for the note
            tc = time.perf_counter() - t1
            rw = statistics.median(vmrss_mib(p) for p in gpu.pool.pids())
            await retire_idle(b)
            tb, rb, seen = await bare_clients(bench, b, n)
            listed = f"; {seen}/{n} bare clients in the server's client list" if seen is not None else ""
            pl = "s" if n > 1 else ""
            rows.append(Row("d", f"pool: prewarm {n} worker{pl}", "ms", tw * 1e3, tb * 1e3, f"{n} bare client{pl}", "<= 1.2x",
                            tw <= 1.2 * tb,
                            f"spawn to all READY + client check (the check alone: {tc * 1e3:.0f} ms); {bare}{listed}"))
            rss = (rw, rb, n)
    rows.append(Row("d", "pool: VmRSS per worker", "MiB", rss[0], rss[1], "bare client", "<= 1.2x", rss[0] <= 1.2 * rss[1],
                    f"median of {rss[2]} idle pooled workers vs {rss[2]} bare clients"))
    return rows


# ---- (e) load ----------------------------------------------------------------------------------
async def sec_load(bench: Bench) -> list[Row]:
    cold: list[float] = []
    hot: list[float] = []
    jit: list[float] = []
    async with await bench.backend("mps", pool=2) as b:
        progs = Programs(b)
        src = await bench.src(b, "heartbeat")
        try:
            for _ in range(bench.n(5, 2)):
                assert b.info is not None
                b.compiler = Compiler(b.info)  # cold: an empty cache, nothing on disk
                for out in (cold, hot):
                    t0 = time.perf_counter()
                    p = await progs.load(*src)
                    await until(lambda s=p.slot: b.mailbox.heartbeat(s) > 0, 10, "the program's first beat")
                    out.append((time.perf_counter() - t0) * 1e3)
                    if out is cold:
                        jit.append(p.compile_ms)
                    elif not p.cached:
                        raise RuntimeError("the second load did not come from the cubin cache")
                    await progs.unload(p.name)
        finally:
            await progs.close()
    c, h = statistics.median(cold), statistics.median(hot)
    return [Row("e", "load: PTX to running, cached", "ms", h, c, "cold JIT", "< 5 ms", h < 5,
                f"Programs.load into a pooled MPS worker until the first heartbeat; median of {len(hot)};"
                f" cold JIT alone {statistics.median(jit):.1f} ms (nvJitLink already loaded in this process)")]


# ---- (f) ring ----------------------------------------------------------------------------------
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
    scripts/issue18_probes.py): run before any kernel of ``b`` is resident (two contexts' kernels
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


def daemon_cpu(bench: Bench) -> int | None:
    """The CPU (b)'s placed phase gives the bench's event loop (``serve --daemon-cpus`` as the
    bench's process does it): ``--cpu N``, else (auto) the last this process may use; None with
    ``--cpu off`` or a single CPU."""
    every = sorted(os.sched_getaffinity(0))
    if bench.cpu == "off" or len(every) == 1:
        return None
    return every[-1] if bench.cpu == "auto" else int(bench.cpu)


def placement(cpu: int | None) -> contextlib.AbstractContextManager[Any]:
    """The bench's process placed as ``serve --daemon-cpus CPU`` places the daemon (every thread of
    it there, the workers it starts meanwhile elsewhere); None: left alone."""
    return contextlib.nullcontext() if cpu is None else cpus.placed(frozenset({cpu}))


def spun_round_trips(ring: Ring, payload: bytes, n: int, warm: int = 10) -> list[float]:
    """The host-spin path's round trips (seconds): ``Ring.post``, then ``Ring.spin`` on the
    response, in a plain loop as the floor's host is (a coroutine per request would add the
    loop's ~1 us to each).  It holds the event loop meanwhile (~10 ms on the H200)."""
    out, clock = [], time.perf_counter
    for i in range(n + warm):
        t0 = clock()
        if ring.spin(ring.post(payload), 5.0) != payload:
            raise RuntimeError("echo did not answer within 5 s, or answered something else")
        if i >= warm:
            out.append(clock() - t0)
    return out


@contextlib.asynccontextmanager
async def echo_loaded(bench: Bench, b: Backend) -> AsyncIterator[tuple[Programs, Ring]]:
    """``echo`` loaded on ``b`` and beating, with its ring's host end; unloaded (its Programs
    closed) at the end."""
    progs = Programs(b)
    try:
        p = await progs.load(*await bench.src(b, "echo"))
        slot = p.slot
        await until(lambda: b.mailbox.heartbeat(slot) > 0, 10, "echo's first beat")
        ring = p.ring = p.ring or Ring(b.mailbox, slot)
        yield progs, ring
    finally:
        await progs.close()


async def throughput(progs: Programs, payload: bytes, window: int, n: int) -> float:
    """Requests per second through echo's ring, ``window`` outstanding (Programs.call_many)."""
    msgs = [payload] * n
    t0 = time.perf_counter()
    got = await progs.call_many("echo", msgs, window=window)
    dt = time.perf_counter() - t0
    if got != msgs:
        raise RuntimeError("echo answered something else")
    return n / dt


#: Rounds of (f) and of (b)'s concurrent asks: each figure is the median of its rounds, each round's
#: value beside its baseline from the same round.  The lent GPU host is a shared VM whose speed moves
#: by 1.5x within seconds (docs/benchmarks.md, Issue 18): one round is a coin toss near a target.
ROUNDS = 5


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


async def ring_round(bench: Bench, b: Backend, n: int, nf: int, nt: int, sweep: bool) -> dict[str, float]:
    """One round of (f): the floor first (no kernel of ours resident: two contexts' kernels would
    time-slice), then echo loaded and asked, then unloaded.  Its figures in us and k/s."""
    floor = await ring_floor(bench, b, nf)
    out = {f"floor{k}.{q}": pct(v, q) * 1e6 for k, v in floor.items() for q in (0.5, 0.99)}
    async with echo_loaded(bench, b) as (progs, ring):

        def caller(payload: bytes) -> Any:
            async def call() -> None:
                if await progs.call("echo", payload) != payload:
                    raise RuntimeError("echo answered something else")
            return call

        payload = bytes(range(64))
        for key, xs in (("call64", await timed(n, caller(payload))), ("spin64", spun_round_trips(ring, payload, n))):
            out[f"{key}.0.5"], out[f"{key}.0.99"] = pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6
        for w in (1, 4, 8):
            out[f"rate{w}"] = await throughput(progs, payload, w, nt) / 1e3
        if sweep:
            for size in SWEEP:
                if size != 64:
                    xs = await timed(n // 2, caller(bytes(range(size))))
                    out[f"call{size}.0.5"], out[f"call{size}.0.99"] = pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6
                out[f"size{size}"] = await throughput(progs, bytes(range(size)), abi.RING, nt) / 1e3
            relaunched = await returning_worker(bench, b, 20)
            out["launch_sync"] = pct(await timed(n // 4, lambda: launch_sync(relaunched, 20)), 0.5) * 1e6
    return out


async def sec_ring(bench: Bench) -> list[Row]:
    n, nf, nt, k = bench.n(2000, 100), bench.n(20000, 500), bench.n(20000, 400), bench.n(ROUNDS, 1)
    survey = await place_ring(bench)
    # The bench's process on the floor's host CPU, as ``serve --daemon-cpus`` places the daemon: the
    # ring's host spins where the floor's did, and no worker runs there.
    with placement(bench.ring_cpu):
        async with await bench.backend("mps", pool=2) as b:
            rounds = [await ring_round(bench, b, n, nf, nt, sweep=i == k - 1) for i in range(k)]
    m = {key: median([r[key] for r in rounds if key in r]) for key in rounds[-1]}
    us = {size: (m[f"floor{size}.0.5"], m[f"floor{size}.0.99"]) for size in (-1, 0, *SWEEP)}
    c50, c99, s50, s99 = m["call64.0.5"], m["call64.0.99"], m["spin64.0.5"], m["spin64.0.99"]
    lb = m["launch_sync"]
    rates, by_size = {w: m[f"rate{w}"] * 1e3 for w in (1, 4, 8)}, {size: m[f"size{size}"] * 1e3 for size in SWEEP}
    sweep = {size: (m[f"call{size}.0.5"], m[f"call{size}.0.99"]) for size in SWEEP if size != 64}
    each = "; rounds: " + ", ".join(
        f"call {r['call64.0.5']:.2f}/{r['call64.0.99']:.1f}, spin {r['spin64.0.5']:.2f}/{r['spin64.0.99']:.1f}"
        f" against floor {r['floor64.0.5']:.2f}/{r['floor64.0.99']:.2f} us, 8 outstanding {r['rate8'] / r['rate1']:.2f}x"
        for r in rounds)
    where = ("anywhere (--cpu off)" if bench.ring_cpu is None else f"on CPU {bench.ring_cpu}, the workers on the others" + (
        " (--cpu auto: the fastest floor of " + ", ".join(f"{c}: {v:.2f}" for c, v in survey.items()) + " us)"
        if survey else ""))
    fnote = (f"floor: one warp polling a word of host-mapped memory, a word per lane, the host spinning on plain"
             f" memory (payload written before the doorbell, untimed); {nf - nf // 10} requests per size; the median of"
             f" {k} rounds (each figure of (f) is); the floor's host and the ring's spin {where}")
    spin_note = f"Ring.post, then a host spin on RESP_HEAD (Ring.spin), in a plain loop as the floor's host; {n} requests"
    call_note = (f"Programs.call on echo, {n} calls: a yield, then a spin of at most {SPIN * 1e6:.0f} us,"
                 f" then back-off")
    rows = [
        Row("f", "ring floor: doorbell alone, p50", "us", us[0][0], us[-1][0], "the host loop alone", note=fnote),
        Row("f", "ring floor: doorbell alone, p99", "us", us[0][1], us[0][0], "its p50"),
        Row("f", "ring floor: 64 B, p50", "us", us[64][0], us[0][0], "doorbell alone", note=fnote),
        Row("f", "ring floor: 64 B, p99", "us", us[64][1], us[0][1], "doorbell alone p99"),
        Row("f", "ring: Programs.call 64 B, p50", "us", c50, us[64][0], "floor 64 B p50", "<= 2x", c50 <= 2 * us[64][0],
            call_note),
        Row("f", "ring: Programs.call 64 B, p99", "us", c99, us[64][1], "floor 64 B p99", "<= 3x", c99 <= 3 * us[64][1],
            call_note),
        Row("f", "ring: host spin 64 B, p50", "us", s50, us[64][0], "floor 64 B p50", "<= 1.3x", s50 <= 1.3 * us[64][0],
            spin_note + each),
        Row("f", "ring: host spin 64 B, p99", "us", s99, us[64][1], "floor 64 B p99", "<= 3x", s99 <= 3 * us[64][1],
            spin_note),
        Row("f", "ring: Programs.call p50 against relaunching", "us", c50, lb, "launch+sync p50", "<= 0.5x",
            c50 <= 0.5 * lb, "launch+sync: LAUNCH of a kernel that returns at once, its DONE awaited"),
    ]
    for size in SWEEP:
        if size != 64:
            rows.append(Row("f", f"ring: Programs.call {size} B, p50", "us", sweep[size][0], us[size][0], f"floor {size} B p50",
                            note=f"p99 {sweep[size][1]:.1f} us (floor {us[size][1]:.1f}); {n // 2} calls, the last round"))
    tput = f"Programs.call_many on echo, {nt} requests of 64 B"
    rows.append(Row("f", "ring throughput, 1 outstanding", "k/s", rates[1] / 1e3, 1e3 / us[64][0], "1 / floor 64 B p50",
                    note=tput + "; baseline: the floor's round trips back to back"))
    for wdw in (4, 8):
        r = Row("f", f"ring throughput, {wdw} outstanding", "k/s", rates[wdw] / 1e3, rates[1] / 1e3, "1 outstanding",
                note=tput)
        if wdw == 8:
            r.target, r.ok = ">= 4x", rates[8] >= 4 * rates[1]
        rows.append(r)
    rows.append(Row("f", "ring throughput, 8 outstanding, 188 B", "k/s", by_size[188] / 1e3, by_size[4] / 1e3,
                    "the same, 4 B", note="8 outstanding by size: " + ", ".join(
                        f"{k} B {v / 1e3:.0f} k/s" for k, v in by_size.items())))
    return rows


# ---- (g) idle ----------------------------------------------------------------------------------
async def cpu_percent(window: float) -> float:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await anyio.sleep(window)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (t1 - t0) * 100


async def sec_idle(bench: Bench) -> list[Row]:
    window, nw = bench.n(5, 1), bench.n(32, 8)
    base = await cpu_percent(window)
    async with await bench.backend("mps", pool=nw) as b:
        await anyio.sleep(0.5)  # the prewarm's tail settles
        v = await cpu_percent(window)
        # The ring's host side spins only while a call waits: none now.
        async with echo_loaded(bench, b) as (progs, _):
            if await progs.call_many("echo", [b"x"] * 100) != [b"x"] * 100:
                raise RuntimeError("echo answered something else")
            await anyio.sleep(0.5)
            e = await cpu_percent(window)
    how = f"getrusage(RUSAGE_SELF) user+sys over {window} s, % of one core"
    return [Row("g", f"idle: supervisor CPU, {nw} pooled workers", "%", v, base, "no backend", "< 1 %", v < 1, how),
            Row("g", "idle: supervisor CPU, echo resident, nothing asked", "%", e, base, "no backend", "< 1 %", e < 1,
                how + "; after 100 calls")]


# ---- (h) limits --------------------------------------------------------------------------------
async def sec_limits(bench: Bench) -> list[Row]:
    """As many resident heartbeats as each mode takes (blink: one per hardware queue; MPS: the
    server's clients less a pool of 4), every one beating; the next load refused; an upgrade at
    the limit and what it costs a neighbour; the start check's share of a load."""
    rows: list[Row] = []
    for mode in ("blink", "mps"):
        pool = 4 if mode == "mps" else 0
        n = BLINK_QUEUES if mode == "blink" else bench.n(MAX_CLIENTS - pool, 8)
        async with await bench.backend(mode, pool=pool) as b:
            progs, mb = Programs(b), b.mailbox
            try:
                man, ptx = await bench.src(b, "heartbeat")

                def named(i: int, man: dict[str, Any] = man) -> dict[str, Any]:
                    return {**man, "name": f"heartbeat-{i}"}

                for i in (0, 1):
                    p = await progs.load(named(i), ptx)
                    await until(lambda mb=mb, s=p.slot: mb.heartbeat(s) > 0, 10, "the first heartbeats")
                await progs.upgrade("heartbeat-0", named(0), ptx)  # in blink mode it halts heartbeat-1
                two_blink = b.last_blink_ms()
                loads: list[float] = []
                for i in range(2, n):
                    t0 = time.perf_counter()
                    await progs.load(named(i), ptx)
                    loads.append((time.perf_counter() - t0) * 1e3)
                seen = {p.slot: mb.heartbeat(p.slot) for p in progs.by_name.values()}
                with anyio.move_on_after(3):
                    await until(lambda mb=mb, seen=seen: all(mb.heartbeat(s) > v for s, v in seen.items()), 3, "every heartbeat")
                beating = sum(mb.heartbeat(s) > v for s, v in seen.items())
                t0 = time.perf_counter()
                try:
                    await progs.load(named(n), ptx)
                    more = f"a load {n + 1} was taken (not at the limit: --quick)"
                    await progs.unload(f"heartbeat-{n}")
                except CapacityError as e:
                    more = f"load {n + 1} refused up front in {(time.perf_counter() - t0) * 1e3:.2f} ms ({e.limit})"
                rows.append(Row("h", f"limits: {mode}, {n} resident heartbeats", "beating", beating, n, "loaded", "all",
                                beating == n, f"each seen advancing within 3 s of the last load; {more}"))
                nb = progs.by_name["heartbeat-1"]
                if mode == "blink":
                    await progs.upgrade("heartbeat-0", named(0), ptx)
                    rows.append(Row("h", f"limits: blink at {n}, an upgrade halts every program for", "ms",
                                    b.last_blink_ms(), two_blink, "the same with 2 programs", "-", None,
                                    "the blink's halt, reload and relaunch (BlinkIsolation.last_blink_ms)"))
                else:
                    await beat(b, nb.slot, reset=True)
                    t0 = time.perf_counter()
                    await progs.upgrade("heartbeat-0", named(0), ptx)
                    window = time.perf_counter() - t0
                    await beat(b, nb.slot)
                    gap = float(mb.u64(nb.slot, abi.MAX_GAP))
                    await beat(b, nb.slot, reset=True)
                    await anyio.sleep(window)
                    await beat(b, nb.slot)
                    idle = float(mb.u64(nb.slot, abi.MAX_GAP))
                    rows.append(Row("h", f"limits: mps at {n}, an upgrade: a neighbour's worst gap", "us", gap / 1e3,
                                    idle / 1e3, "its idle gap", "-", None,
                                    f"heartbeat-1's MAX_GAP while heartbeat-0 is upgraded ({window * 1e3:.0f} ms), pool {pool}"))
                rows.append(Row("h", f"start check, {mode}: LAUNCHED to STATE = RUNNING, p50", "ms", pct(progs.start_ms, 0.5),
                                pct(loads, 0.5), "the whole load, p50", "-", None,
                                f"p99 {pct(progs.start_ms, 0.99):.3f} ms over {len(progs.start_ms)} launches"))
            finally:
                await progs.close()
    return rows


# ---- (i) recovery -------------------------------------------------------------------------------
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


async def recovery(bench: Bench, mode: str, n: int) -> tuple[float, dict[str, float], float, float]:
    """n resident heartbeats, then a program that faults its GPU (restart policy never): seconds from
    its load's return to every heartbeat beating again, the recovery's steps (ms, with ``detect``: the
    load's return to the failure seen), the teardown's share and the server's (old workers exited)."""
    async with await bench.backend(mode, pool=4 if mode == "mps" else 0) as b:
        progs, mb = Programs(b, policy="on-failure"), b.mailbox
        try:
            man, ptx = await bench.src(b, "heartbeat")
            for i in range(n):
                p = await progs.load({**man, "name": f"heartbeat-{i}"}, ptx)
                await until(lambda mb=mb, s=p.slot: mb.heartbeat(s) > 0, 10, "the first heartbeats")
            slots = [p.slot for p in progs.by_name.values()]
            await progs.load(*await bench.src(b, "fault"), policy="never")
            t0 = time.monotonic()
            await until(lambda: progs.faults and progs.faults[-1].ms > 0, 60, "the fault's recovery")
            r = progs.faults[-1]
            if not r.gpu_wide or sorted(r.relaunched) != sorted(f"heartbeat-{i}" for i in range(n)):
                raise RuntimeError(f"the recovery did not relaunch every heartbeat: {r}")
            seen = {s: mb.heartbeat(s) for s in slots}
            await until(lambda: all(mb.heartbeat(s) > v for s, v in seen.items()), 30, "every heartbeat again")
            total = time.monotonic() - t0
            steps = {"detect": round((r.seen_at - t0) * 1e3, 2), **r.steps}
            return total, steps, r.steps.get("teardown", 0.0) / 1e3, r.ms / 1e3
        finally:
            await progs.close()


async def sec_recovery(bench: Bench) -> list[Row]:
    """From a GPU fault to every innocent beating again, for 1, 8 and 32 programs, with its steps;
    against the floor of the same run: the fault seen, the old workers exited (the server takes no
    client before), and as many bare contexts as the recovery needs, released at once."""
    rows: list[Row] = []
    for mode in ("mps", "blink"):
        sizes = (1, 8) if bench.quick or mode == "blink" else (1, 8, 32)
        for n in sizes:
            total, steps, teardown, _ms = await recovery(bench, mode, n)
            if mode == "mps":
                async with await bench.backend("mps", pool=0) as fb:
                    await bare_clients(bench, fb, 1)  # the server started first, as it runs during a fault
                    ctx = await held_contexts(bench, {**os.environ, **mps_gpu(fb).mps.daemon.env}, n)
            else:
                ctx = await held_contexts(bench, dict(os.environ), 1)  # one plain context, no MPS
            floor = max(0.0, steps["detect"] / 1e3) + teardown + ctx
            parts = ", ".join(f"{k} {v:.0f}" for k, v in steps.items())
            target = "<= 1.2 s" if n == 8 and mode == "mps" else "-"
            rows.append(Row("i", f"recovery: {mode}, {n} program{'s' if n > 1 else ''} beating again", "ms", total * 1e3,
                            floor * 1e3, "floor: detect + teardown + bare contexts", target,
                            total <= 1.2 if target != "-" else None,
                            f"steps (ms): {parts}; bare contexts {ctx * 1e3:.0f} ms for {n if mode == 'mps' else 1}"))
    return rows


# ---- (j) restart -------------------------------------------------------------------------------
def _beats(c: Any, name: str, within: float, until_after: float = 0.0) -> list[tuple[float, int]]:
    """(monotonic time, heartbeat) of ``name`` polled through the control API for ``within`` s, or
    (``until_after``) until it has advanced twice after that time."""
    out: list[tuple[float, int]] = []
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            hb = c.program(name)["heartbeat"]
        except Exception:  # not loaded again yet
            hb = None
        if hb is not None:
            out.append((time.monotonic(), hb))
            if until_after and sum(1 for t, _ in out if t > until_after) > 2 and out[-1][1] > out[-2][1]:
                break
        time.sleep(0.001)
    return out


def _largest_gap(samples: list[tuple[float, int]]) -> float:
    """The longest time between two samples whose heartbeat changed (a restart resets it)."""
    changes = [t for (t, hb), (_, prev) in zip(samples[1:], samples, strict=False) if hb != prev]
    return max((b - a for a, b in itertools.pairwise(changes)), default=0.0)


class _Serve:
    """A ``meshd-mps serve`` of the bench's in directory ``d``, started again as often as asked,
    and timed from its start (or an earlier moment) to its control API answering."""

    def __init__(self, d: str, bench: Bench, *extra: str):
        self.d, self.sock, self.state = d, os.path.join(d, "s.sock"), os.path.join(d, "state")
        self.argv = [sys.executable, "-m", "meshd_mps", "serve", "--gpu", bench.gpu, "--isolation", "mps", "--pool",
                     "1", "--socket", self.sock, "--state-dir", self.state, "--log-format", "json", *extra]
        self.p: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> float:
        """Started; the seconds until its API answered (``status``, which answers after the restore)."""
        from meshd_mps.serving.client import Client

        t0 = time.monotonic()
        with open(os.path.join(self.d, "serve.log"), "ab") as log:
            self.p = p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        c = Client(self.sock, timeout=5)
        while True:
            if p.poll() is not None:
                with open(os.path.join(self.d, "serve.log"), errors="replace") as f:
                    tail = f.read()[-600:]
                raise RuntimeError(f"serve exited with {p.returncode}: {tail}")
            try:
                c.status()
                return time.monotonic() - t0
            except Exception:
                time.sleep(0.005)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(sig)
            self.p.wait(60)


def restart_by_reload(bench: Bench) -> tuple[float, float, float, float]:
    """A ``meshd-mps serve`` with a state dir and ``heartbeat`` loaded, stopped (SIGTERM) and started
    again: (idle beat gap, beat gap across the restart, the stop-to-API-answering time, the first
    start's), in seconds, as the control API shows them (polled every ~1 ms)."""
    from meshd_mps.serving.client import Client, program_body

    s = _Serve(tempfile.mkdtemp(prefix="mbr-", dir=bench.base), bench)
    try:
        first = s.start()
        c = Client(s.sock, timeout=60)
        c.load(program_body(str(EXAMPLES / "heartbeat"), arch=c.arch))
        idle = _largest_gap(_beats(c, "heartbeat", 0.3 if bench.quick else 1.0))
        before = _beats(c, "heartbeat", 0.2)
        t_stop = time.monotonic()
        s.stop()
        s.start()
        api = time.monotonic() - t_stop
        after = _beats(Client(s.sock, timeout=60), "heartbeat", 60, until_after=time.monotonic())
        gap = _largest_gap(before + after)
        return idle, gap, api, first
    finally:
        s.stop()
        shutil.rmtree(s.d, ignore_errors=True)


def _gap_since_reset(mb: Mailbox, slot: int, reset: bool) -> int:
    """The kernel's own MAX_GAP (ns); ``reset``: zeroed first (its next beat acknowledges it)."""
    if reset:
        mb.set_u32(slot, abi.GAP_RESET, 1)
        spin(lambda: mb.u32(slot, abi.GAP_RESET) == 0, 10, "the heartbeat to zero MAX_GAP")
        return 0
    n = mb.heartbeat(slot)
    spin(lambda: mb.heartbeat(slot) > n, 10, "the heartbeat's next beat")
    return mb.u64(slot, abi.MAX_GAP)


def _next_release(d: str) -> tuple[dict[str, str], str]:
    """A copy of this meshd-mps's source tree with a later version, as an upgrade installs one: the
    environment that runs it, and its version."""
    src = Path(__file__).resolve().parent.parent
    dst = os.path.join(d, "next")
    for part in ("meshd_mps", "workers"):
        shutil.copytree(src / part, os.path.join(dst, part), ignore=shutil.ignore_patterns("__pycache__"))
    version = "unknown"
    if (src / "pyproject.toml").exists():
        text = (src / "pyproject.toml").read_text()
        m = re.search(r'^version = "([^"]+)"', text, re.M)
        if m:
            version = m.group(1) + ".post1"
            text = text.replace(m.group(0), f'version = "{version}"', 1)
        Path(dst, "pyproject.toml").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([dst, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return env, version


def restart_live(bench: Bench) -> tuple[float, dict[str, tuple[float, float]], str]:
    """``serve --live-restore`` with ``heartbeat`` loaded, stopped and started again three ways
    (SIGTERM; SIGTERM and a later release started; SIGKILL): (the kernel's idle MAX_GAP, and for
    each way its MAX_GAP across it and the stop-to-API-answering time, in seconds; the versions).
    The gaps are the kernel's own (globaltimer), read from the mailbox file: no daemon needed."""
    from meshd_mps.serving.client import Client, program_body

    s = _Serve(tempfile.mkdtemp(prefix="mbl-", dir=bench.base), bench, "--live-restore")
    mb: Mailbox | None = None
    before = _children()
    try:
        s.start()
        c = Client(s.sock, timeout=60)
        old = c.status()["versions"]["meshd-mps"]
        slot = c.load(program_body(str(EXAMPLES / "heartbeat"), arch=c.arch))["program"]["slot"]
        mb = Mailbox.open(live_paths(s.state).mailbox)
        env, new = _next_release(s.d)
        out: dict[str, tuple[float, float]] = {}
        for how in ("restart", "upgrade", "sigkill"):
            _gap_since_reset(mb, slot, reset=True)
            t0 = time.monotonic()
            s.stop(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
            s.start(env if how == "upgrade" else None)
            api = time.monotonic() - t0
            st = Client(s.sock, timeout=60).status()
            if st["state"]["restore"]["adopted"] != ["heartbeat"]:
                raise RuntimeError(f"{how}: heartbeat not adopted: {st['state']['restore']}")
            time.sleep(0.2)
            out[how] = (_gap_since_reset(mb, slot, reset=False) / 1e9, api)
            if how == "upgrade" and st["versions"]["meshd-mps"] != old:
                new = st["versions"]["meshd-mps"]
        # The baseline: as long a window with nothing happening as the longest of the three.
        _gap_since_reset(mb, slot, reset=True)
        time.sleep(max(a for _, a in out.values()) + 0.2)
        idle = _gap_since_reset(mb, slot, reset=False) / 1e9
        Client(s.sock, timeout=60).unload("heartbeat")
        return idle, out, f"{old} -> {new}"
    finally:
        if mb is not None:
            mb.close()
        s.stop()
        # What the SIGKILLed serve left (its workers, its control daemon) became ours: the bench is a
        # subreaper.  Its successor ended them at the full stop above; reaped here, as init would.
        _reap_new_children(before, 10.0)
        shutil.rmtree(s.d, ignore_errors=True)


async def sec_restart(bench: Bench) -> list[Row]:
    """meshd-mps itself restarted: (j) restore by reload, the program halted and loaded again; (k)
    live restore, the program adopted as it runs (a restart, an upgrade to a later release, a SIGKILL
    and a restart)."""
    idle, gap, api, first = await anyio.to_thread.run_sync(restart_by_reload, bench)
    rows = [
        Row("j", "restart by reload: heartbeat's largest beat gap", "ms", gap * 1e3, idle * 1e3,
            "its idle gap, polled", "-", None,
            "serve stopped (SIGTERM) and started again on its --state-dir: the program halted, then loaded and"
            " launched again on its slot; polled through the control API every ~1 ms"),
        Row("j", "restart by reload: the stop to the API answering again", "ms", api * 1e3, first * 1e3,
            "the first start to its API answering", "-", None,
            "the old daemon's whole stop, the new one's start and the restore (status answers only after it)"),
    ]
    live_idle, live, versions = await anyio.to_thread.run_sync(restart_live, bench)
    what = {"restart": "a restart (SIGTERM, then serve)", "upgrade": f"an upgrade of meshd-mps ({versions})",
            "sigkill": "a SIGKILL, then serve"}
    for how, (g, _) in live.items():
        rows.append(Row("k", f"live restore across {what[how]}: heartbeat's largest beat gap", "us", g * 1e6,
                        live_idle * 1e6, "its idle gap (MAX_GAP, as long a window)", "<= 2x", g <= 2 * live_idle,
                        "the kernel's own MAX_GAP (globaltimer) read from the mailbox file: it beats on while no"
                        " daemon runs; adopted, never halted"))
    for how, (_, a) in live.items():
        rows.append(Row("k", f"live restore across {what[how]}: the stop to the API answering again", "ms", a * 1e3,
                        api * 1e3, "restore by reload's (j)", "-", None,
                        "the new daemon answers once it has adopted the daemon, the workers and the program"))
    return rows


SECTIONS = [("a", "stall", sec_stall), ("b", "ask", sec_ask), ("c", "done", sec_done), ("d", "pool", sec_pool),
            ("e", "load", sec_load), ("f", "ring", sec_ring), ("g", "idle", sec_idle),
            ("h", "limits", sec_limits), ("i", "recovery", sec_recovery), ("j", "restart", sec_restart)]  # (k): sec_restart


def describe(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


async def run_all(bench: Bench, sections: list[tuple[str, str, Any]] | None = None) -> list[Row]:
    rows: list[Row] = []
    for id, name, fn in sections or SECTIONS:
        print(f"bench: ({id}) {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        limit = bench.n(300, 120)
        try:
            with anyio.fail_after(limit):
                rows += await fn(bench)
        except Exception as e:  # the row is ERROR; the other sections still run
            why = describe(e) if str(e) else f"{type(e).__name__}: the section did not finish in {limit} s"
            rows.append(Row(id, name, error=why))
        print(f"bench: ({id}) {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


def run_bench(bench: Bench, only: str | None = None) -> list[Row]:
    """The sections: all, or those whose letters ``only`` lists."""
    chosen = [sec for sec in SECTIONS if only is None or sec[0] in only.split(",")]
    rows = eventloop.run(lambda: run_all(bench, chosen), bench.loop)
    other = "asyncio" if eventloop.factory(bench.loop)[1] is not None else None
    if other is None or "b" not in {sec[0] for sec in chosen}:
        return rows

    async def again(b: Bench) -> list[Row]:  # (b) once more on the plain asyncio loop, for comparison
        return [dataclasses.replace(r, name=f"{r.name} [asyncio]", target="-", ok=None) for r in await sec_ask(b)
                if "1 worker" in r.name or "at once" in r.name or ("busy" in r.name and "p99" in r.name)]

    extra = eventloop.run(lambda: run_all(bench, [("b", "ask [asyncio]", again)]), other)
    last_b = max(i for i, r in enumerate(rows) if r.id == "b")
    return rows[: last_b + 1] + extra + rows[last_b + 1 :]


# ---- the report ------------------------------------------------------------------------------
def _try(f: Any) -> str:
    try:
        return str(f())
    except Exception as e:
        return f"unknown ({describe(e)})"


def _driver() -> str:
    from cuda.bindings import driver as cu

    v = cu.cuDriverGetVersion()[1]  # no cuInit, no context
    smi = _try(lambda: subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0])
    return f"{smi} (CUDA {v // 1000}.{v % 1000 // 10})"


def header(bench: Bench, argv: list[str]) -> dict[str, str]:
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": bench.device or "unknown (no backend opened)",
            "driver": _try(_driver) if bench.gpu == "cuda" else "none: the simulated GPU (--gpu sim)",
            "cuda-bindings": _try(lambda: metadata.version("cuda-bindings")),
            "nvjitlink": _try(lambda: "{} (library {}.{})".format(metadata.version("nvidia-nvjitlink"), *nvjitlink_version())),
            "nvrtc": _try(lambda: metadata.version("nvidia-cuda-nvrtc")), "python": sys.version.split()[0],
            "loop": eventloop.factory(bench.loop)[0],
            "ring cpu": f"{bench.cpu}" + (f" (CPU {bench.ring_cpu})" if bench.ring_cpu is not None else ""),
            "command": " ".join(["python -m meshd_mps.bench", *argv])}


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return (f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}") + f" {unit}"


def table(h: dict[str, str], rows: list[Row]) -> str:
    out = [f"meshd-mps bench  {h['date']}", *(f"  {k}: {v}" for k, v in h.items() if k != "date"), ""]
    cells = [["row", "figure", "value", "baseline", "ratio", "target", "result", "note"]]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        base = f"{fmt(r.baseline, r.unit)} ({r.base_name})" if r.base_name else fmt(r.baseline, r.unit)
        cells.append([f"({r.id})", r.name, fmt(r.value, r.unit), base, ratio, r.target, r.result, r.error or r.note])
    widths = [max(len(c[i]) for c in cells) for i in range(7)]
    for c in cells:
        out.append("  ".join(x.ljust(w) for x, w in zip(c[:7], widths, strict=True)) + "  " + c[7])
    return "\n".join(out)


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return int(s[s.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError):
        return -1


def _children() -> set[int]:
    """Our children, running or zombie."""
    return {int(d) for d in os.listdir("/proc") if d.isdigit() and _ppid(d) == os.getpid()}


def _reap_new_children(before: set[int], within: float) -> None:
    """Children that were not ``before`` (orphans re-parented to us), reaped as they exit, for up to
    ``within`` seconds; any still there then is the leftover check's to report."""
    end = time.monotonic() + within
    while (new := _children() - before) and time.monotonic() < end:
        for pid in new:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


def leftovers() -> list[int]:
    """Our children still there (running or zombie), killed and reaped; their pids."""
    left = sorted(_children())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return left


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m meshd_mps.bench", description="meshd-mps's figures, each beside its baseline.")
    ap.add_argument("--gpu", choices=("cuda", "sim"), default="cuda", help="the real GPU (default) or the CPU simulation")
    ap.add_argument("--quick", action="store_true", help="smaller counts (8 workers, fewer samples): a CPU smoke run")
    ap.add_argument("--json", metavar="FILE", help="also write the header and rows as JSON")
    ap.add_argument("--mps-dir", metavar="DIR", help="where the private MPS daemons' directories go (default: a temporary one)")
    ap.add_argument("--loop", choices=eventloop.CHOICES, default="auto",
                    help="the event loop (default auto: uvloop where installed; (b) then runs once more on asyncio)")
    ap.add_argument("--only", metavar="a,b,...", help="run only these sections (letters a-j, comma-separated)")
    ap.add_argument("--cpu", default="auto", metavar="N|auto|off",
                    help="the host CPU that (f)'s floor and ring spin on (default auto: the fastest floor of a survey)")
    args = ap.parse_args(argv)
    if args.cpu not in ("auto", "off"):
        try:  # checked as serve checks --daemon-cpus: (f) and (b) place the bench's process so
            one = cpus.parse(args.cpu, "--cpu")
            if len(one) != 1:
                raise ConfigError(f"--cpu {args.cpu}: one CPU, auto or off")
            cpus.split(one, "--cpu")
        except ConfigError as e:
            print(f"meshd-mps bench: {e}", file=sys.stderr)
            return 2
    os.environ.setdefault("MESHD_MPS_LOG_LEVEL", "warning")  # workers inherit it
    setup_logging(component="bench")
    try:
        eventloop.factory(args.loop)
    except eventloop.LoopError as e:
        print(f"meshd-mps bench: {e}", file=sys.stderr)
        return 2
    if args.only and not set(args.only.split(",")) <= {sec[0] for sec in SECTIONS}:
        print(f"meshd-mps bench: --only {args.only}: expected letters a-j, comma-separated", file=sys.stderr)
        return 2
    bench = Bench(args.gpu, args.quick, args.mps_dir, args.loop, args.cpu)
    try:
        rows = run_bench(bench, args.only)
    finally:
        bench.cleanup()
    left = leftovers()
    h = header(bench, argv)
    print(table(h, rows))
    if left:
        print(f"ERROR: child processes left behind (killed): {left}")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": h, "rows": [r.as_dict() for r in rows], "left_behind": left}, indent=1))
    return 1 if left or any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
