"""Where an ask's round trip goes: one table, each variant against a raw pipe in the same run.

    python scripts/ask_breakdown.py [--gpu cuda|sim] [-n 3000]

Variants (every one a LAUNCH-sized frame out and a reply back, p50/p99):
  raw          os.write/os.read (select) with a child that echoes: the pipes and two wake-ups
  streams      asyncio streams + a reader task + a future (WorkerProc's shape), echoing child
  protocol     an asyncio.Protocol whose data_received resolves the future (one hop less)
  *-uvloop     the same two on uvloop
  answer       WorkerProc.ask itself (lock, fail_after, reply checks) to a child that answers at once
  gpu-launch   in one process, no pipes: CudaGpu.launch + launched() of heartbeat with HALT preset
               (the worker's share of an ask: decode aside, the driver calls and the waiter thread)
The bench's row (b) is WorkerProc.ask to a real worker; this script splits it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshd_mps.base.deadlines import Deadlines  # noqa: E402
from meshd_mps.bench import ECHO_CHILD, answering_child, ask_only  # noqa: E402
from meshd_mps.protocol import frames  # noqa: E402
from meshd_mps.protocol.frames import LaunchReq, Op  # noqa: E402
from meshd_mps.supervision import child  # noqa: E402

REQ = frames.encode(Op.LAUNCH, LaunchReq(1, 1, 0, 1).encode())


def pct(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def raw(n: int) -> list[float]:
    c = subprocess.Popen([sys.executable, "-c", ECHO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    w, r, out = c.stdin.fileno(), c.stdout.fileno(), []
    for i in range(n + 100):
        t = time.perf_counter()
        os.write(w, REQ)
        got = b""
        while len(got) < len(REQ):
            select.select([r], [], [], 5)
            got += os.read(r, 4096)
        if i >= 100:
            out.append(time.perf_counter() - t)
    c.stdin.close()
    c.wait()
    return out


async def streams(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    p = await asyncio.create_subprocess_exec(sys.executable, "-c", ECHO_CHILD, stdin=asyncio.subprocess.PIPE,
                                             stdout=asyncio.subprocess.PIPE, close_fds=True)
    box: list[asyncio.Future[bytes] | None] = [None]

    async def reader() -> None:
        while True:
            try:
                h = await p.stdout.readexactly(4)
            except asyncio.IncompleteReadError:
                return
            (k,) = struct.unpack("<I", h)
            b = await p.stdout.readexactly(k)
            box[0].set_result(b)

    task = asyncio.ensure_future(reader())
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        f = loop.create_future()
        box[0] = f
        p.stdin.write(REQ)
        await p.stdin.drain()
        await f
        if i >= 100:
            out.append(time.perf_counter() - t)
    p.stdin.close()
    await task
    await p.wait()
    return out


class FrameProto(asyncio.SubprocessProtocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.fut: asyncio.Future[bytes] | None = None
        self.gone = asyncio.get_running_loop().create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 4:
            (k,) = struct.unpack_from("<I", self.buf)
            if len(self.buf) < 4 + k:
                break
            body = bytes(self.buf[4 : 4 + k])
            del self.buf[: 4 + k]
            self.fut.set_result(body)

    def process_exited(self) -> None:
        self.gone.set_result(None)


async def protocol(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    pr = FrameProto()
    tr, _ = await loop.subprocess_exec(lambda: pr, sys.executable, "-c", ECHO_CHILD, stderr=None, close_fds=True)
    w = tr.get_pipe_transport(0)
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        pr.fut = loop.create_future()
        w.write(REQ)
        await pr.fut
        if i >= 100:
            out.append(time.perf_counter() - t)
    w.close()
    await pr.gone
    tr.close()
    return out


async def answer(n: int) -> list[float]:
    w, reader = await answering_child(Deadlines())
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        await ask_only(w)
        if i >= 100:
            out.append(time.perf_counter() - t)
    w.close_stdin()
    await reader
    await w.process.wait()
    return out


def heartbeat_load(module: int):
    """heartbeat compiled here for this GPU, as a LOAD request."""
    from meshd_mps.gpu.compiler import Manifest, cuda_to_ptx, ptx_to_cubin, reg_cap
    from meshd_mps.gpu.device import query_device
    from meshd_mps.protocol.frames import Load

    info = query_device()
    d = ROOT / "examples" / "heartbeat"
    m = Manifest.parse((d / "manifest.json").read_bytes())
    ptx = cuda_to_ptx((d / "heartbeat.cu").read_bytes(), "heartbeat", arch=info.compute,
                      include=[str(ROOT / "examples" / "include")])
    cubin = ptx_to_cubin(ptx, info.arch, reg_cap(info, m.warps))
    return Load(module, m.threads, m.smem, m.scratch, m.name, cubin)


async def worker(n: int, gpu: str) -> list[float]:
    """WorkerProc.ask LAUNCH to a real worker process (no MPS), heartbeat with HALT preset, DONE awaited."""
    from meshd_mps.isolation.base import Module
    from meshd_mps.protocol.frames import Loaded
    from meshd_mps.protocol.mailbox import Mailbox
    from meshd_mps.supervision.argv import worker_argv
    from meshd_mps.supervision.proc import WorkerProc

    mb = Mailbox.create()
    argv = worker_argv(mb.path, 0, gpu)
    p = await child.spawn(argv, os.environ, framed=True)
    w = WorkerProc(p, lambda _w: None, Deadlines())
    reader = asyncio.ensure_future(w.read_frames())
    if gpu == "cuda":
        req = heartbeat_load(1)
    else:
        from meshd_mps.protocol.frames import Load
        from workers.sim_gpu import MAGIC
        req = Load(1, 32, 0, 0, "heartbeat", MAGIC + b'{"kernel": "heartbeat"}')
    m = Module("heartbeat", w, 1, Loaded.decode_ok(await w.ask(Op.LOAD, req.encode())))
    mb.reset_slot(3)
    mb.halt(3)
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        done = await m.start(3, 1)  # the launch path: a LAUNCH through WorkerProc.ask
        dt = time.perf_counter() - t
        await asyncio.wait_for(done, 5)
        if i >= 100:
            out.append(dt)
    w.close_stdin()
    await reader
    await p.wait()
    mb.close()
    return out


async def mps_worker(n: int, gpu: str, pool: int = 1, settle: float = 0.0) -> list[float]:
    """The bench's row (b), 1 worker: WorkerProc.ask to a pooled MPS worker of a private daemon,
    with ``pool`` workers started (the others idle) and ``settle`` seconds waited before the asks."""
    from meshd_mps.bench import Bench, launch_sync, returning_worker

    bench = Bench(gpu, quick=False, mps_dir=None)
    try:
        async with await bench.backend("mps", pool=pool) as b:
            w = await returning_worker(bench, b, 99)
            await asyncio.sleep(settle)
            out = []
            for i in range(n + 100):
                dt = await launch_sync(w, 99, ask_only=True)
                if i >= 100:
                    out.append(dt)
            return out
    finally:
        bench.cleanup()


def gpu_launch(n: int) -> list[float]:
    import threading

    from meshd_mps.protocol.mailbox import Mailbox
    from workers.cuda_gpu import CudaGpu

    mb = Mailbox.create()
    gpu = CudaGpu(mb, 0)
    gpu.load(heartbeat_load(1))
    mb.reset_slot(3)
    mb.halt(3)
    out = []
    for i in range(n + 100):
        ev = threading.Event()
        t = time.perf_counter()
        gpu.launch(1, i + 1, 3, 1, lambda _d, ev=ev: ev.set())  # this launch's event, should it end late
        dt = time.perf_counter() - t
        ev.wait(5)
        if i >= 100:
            out.append(dt)
    gpu.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--only", help="run just this variant (e.g. worker, for a profiler)")
    a = ap.parse_args()
    if a.only == "mps":  # the two loops in turn, twice: is the difference the loop or the moment?
        import uvloop

        rows = []
        for k in range(2):
            rows.append((f"mps-asyncio {k}", asyncio.run(mps_worker(a.n, a.gpu))))
            rows.append((f"mps-uvloop {k}", uvloop.run(mps_worker(a.n, a.gpu))))
        # the bench's row starts 33 workers: do idle MPS clients, or their start, slow an ask?
        for pool, settle in ((33, 0.0), (33, 3.0), (8, 0.0)):
            for name, run in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
                rows.append((f"mps-{name} pool {pool} settle {settle:g}s", run(mps_worker(a.n, a.gpu, pool, settle))))
        for name, xs in rows:
            print("{:<36} p50 {:6.1f} us  p99 {:6.1f} us".format(name, *pct(xs)))
        return
    if a.only == "worker":
        xs = asyncio.run(worker(a.n, a.gpu))
        print("worker p50 {:.1f} us p99 {:.1f} us".format(*pct(xs)))
        return
    rows = [("raw", raw(a.n))]
    rows.append(("streams", asyncio.run(streams(a.n))))
    rows.append(("protocol", asyncio.run(protocol(a.n))))
    rows.append(("answer", asyncio.run(answer(a.n))))
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        rows.append(("streams-uvloop", uvloop.run(streams(a.n))))
        rows.append(("protocol-uvloop", uvloop.run(protocol(a.n))))
        rows.append(("answer-uvloop", uvloop.run(answer(a.n))))
    rows.append(("worker", asyncio.run(worker(a.n, a.gpu))))
    if uvloop is not None:
        rows.append(("worker-uvloop", uvloop.run(worker(a.n, a.gpu))))
    if a.gpu == "cuda":
        rows.append(("gpu-launch", gpu_launch(a.n)))
    rows.append(("raw again", raw(a.n)))
    r50 = pct(rows[0][1])[0]
    print(f"{'variant':<18}{'p50 us':>9}{'p99 us':>9}{'p50/raw':>9}")
    for name, xs in rows:
        p50, p99 = pct(xs)
        print(f"{name:<18}{p50:9.1f}{p99:9.1f}{p50 / r50:8.2f}x")


if __name__ == "__main__":
    main()
