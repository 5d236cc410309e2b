"""Row (m) data: a program's data (docs/program-abi.md, "Data") loaded through ``meshd-mps serve``:
the daemon's RSS while a 1 GiB data file (64 MiB with --quick; sparse: as large to hold, cheap to
make) streams in over its socket and is placed in examples/peek's worker, against its RSS idle
just before (target: within 64 MiB); and the time of the whole load (upload, then load).  The
daemon's RSS is sampled every 10 ms from /proc in a thread of the bench's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from meshd_mps.bench.measure import vmrss_mib
from meshd_mps.bench.report import Row
from meshd_mps.bench.restart import _Serve
from meshd_mps.bench.rig import EXAMPLES, Bench


def data_load(bench: Bench) -> tuple[float, float, float, float]:
    """(idle RSS MiB, peak RSS MiB during the load, upload s, load s)."""
    from meshd_mps.serving.client import Client, program_body

    n = bench.n(1 << 30, 64 << 20)
    s = _Serve(tempfile.mkdtemp(prefix="mbd-", dir=bench.base), bench)
    try:
        s.start()
        assert s.p is not None
        pid = s.p.pid
        c = Client(s.sock, timeout=300)
        body = program_body(str(EXAMPLES / "peek"), arch=c.arch)
        path = os.path.join(s.d, "table.bin")
        with open(path, "wb") as f:
            f.truncate(n)
        time.sleep(0.2)
        idle = vmrss_mib(pid)
        peak = [idle]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], vmrss_mib(pid))

        t = threading.Thread(target=watch, name="rss")
        t.start()
        try:
            t0 = time.monotonic()
            key = c.upload(path)
            t1 = time.monotonic()
            c.load({**body, "data": key})
            t2 = time.monotonic()
        finally:
            done.set()
            t.join()
        c.unload("peek")
        return idle, peak[0], t1 - t0, t2 - t1
    finally:
        s.stop()
        shutil.rmtree(s.d, ignore_errors=True)


async def sec_data(bench: Bench) -> list[Row]:
    import anyio

    idle, peak, up, load = await anyio.to_thread.run_sync(data_load, bench)
    size = "1 GiB" if not bench.quick else "64 MiB"
    return [Row("m", f"data: daemon RSS during a {size} load", "MiB", peak, idle, "idle, just before", "within 64 MiB",
                peak - idle < 64, f"{peak - idle:.1f} MiB over idle (VmRSS every 10 ms)"),
            Row("m", f"data: a {size} load, placed in its worker", "s", load, up, "its upload (streamed in, hashed)", "-",
                None, f"upload {up:.2f} s into the state dir, then the load {load:.2f} s (the worker copies it in)")]
