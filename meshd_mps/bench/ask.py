"""Row (b) ask: the launch path's round trip (Module.start: a LAUNCH through
WorkerProc.ask) until its LAUNCHED, for a
kernel that returns at once (``heartbeat`` whose slot already says HALT),
its DONE awaited before the next ask; one worker alone, then 32 (8 with
--quick) workers asking concurrently.  Baseline: a raw pipe ping-pong of
the same frame with a child process that echoes it (os.write / os.read).
"""

from __future__ import annotations

import asyncio
import os
import resource
import select
import subprocess
import sys
import time

import anyio

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.bench.measure import ROUNDS, launch_sync, median, pct, timed, until
from meshd_mps.bench.report import Row, quantiles
from meshd_mps.bench.rig import Bench, daemon_cpu, placement, returning_worker
from meshd_mps.isolation.base import Module
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import LaunchReq, Op
from meshd_mps.supervision import child
from meshd_mps.supervision.proc import WorkerProc

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
    n1, nw, each = bench.n(2000, 100), bench.n(32, 4), bench.n(200, 20)
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
        Row("b", "ask p50, 1 worker", "us", p50, rp50, "raw pipe p50", "<= 3x raw pipe", p50 <= 3 * rp50, note + f"; {n1} asks",
            dist={"ask, 1 worker": quantiles(one), f"ask, {nw} workers busy": quantiles(busy_one),
                  "a child that answers at once": quantiles(bare), "raw pipe": quantiles(raw)}),
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
