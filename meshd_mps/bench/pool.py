"""Row (d) pool: MpsIsolation.prewarm of 1, 8, 32 workers (spawn to every READY and the
client check), and VmRSS per worker, against as many bare clients
started under the same daemon: python + import cuda.bindings + cuInit +
primary context + one 1 MiB alloc (probe/pool.py's child); with --gpu sim
a bare client is python importing cuda.bindings only.
"""

from __future__ import annotations

import statistics
import time

from meshd_mps.bench.clients import bare_clients
from meshd_mps.bench.measure import gpu_mib, vmrss_mib
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, mps_gpu, retire_idle


async def sec_pool(bench: Bench) -> list[Row]:
    rows, rss = [], (0.0, 0.0, 0)
    bare = ("bare clients: python + cuda.bindings + cuInit + primary context + 1 MiB alloc" if bench.gpu == "cuda"
            else "sim: bare clients are python importing cuda.bindings only")
    async with await bench.backend("mps", pool=0) as b:
        gpu = mps_gpu(b)
        # The MPS server starts with the first client of a daemon: paid by neither side's timing.
        first, *_ = await bare_clients(bench, b, 1)
        bare += f"; the MPS server started beforehand by one bare client ({first * 1e3:.0f} ms)"
        for n in (1, 4) if bench.quick else (1, 8, 32):
            t0 = time.perf_counter()
            await gpu.prewarm(n)
            tw = time.perf_counter() - t0
            t1 = time.perf_counter()
            await gpu.mps.check_clients(gpu.pool.pids())  # the check alone, once more, for the note
            tc = time.perf_counter() - t1
            rw = statistics.median(vmrss_mib(p) for p in gpu.pool.pids())
            gw = gpu_mib(bench.gpu, gpu.pool.pids())
            await retire_idle(b)
            tb, rb, seen, gb = await bare_clients(bench, b, n)
            listed = f"; {seen}/{n} bare clients in the server's client list" if seen is not None else ""
            pl = "s" if n > 1 else ""
            rows.append(Row("d", f"pool: prewarm {n} worker{pl}", "ms", tw * 1e3, tb * 1e3, f"{n} bare client{pl}", "<= 1.2x",
                            tw <= 1.2 * tb,
                            f"spawn to all READY + client check (the check alone: {tc * 1e3:.0f} ms); {bare}{listed}"))
            rss, mem = (rw, rb, n), (gw, gb, n)
    rows.append(Row("d", "pool: VmRSS per worker", "MiB", rss[0], rss[1], "bare client", "<= 1.2x", rss[0] <= 1.2 * rss[1],
                    f"median of {rss[2]} idle pooled workers vs {rss[2]} bare clients"))
    if mem[0] is not None:  # what an idle worker holds of the GPU's memory (docs/operations.md, "The pool")
        rows.append(Row("d", "pool: GPU memory per idle worker", "MiB", mem[0], mem[1], "bare client",
                        note=f"NVML's used memory, median of {mem[2]} idle pooled workers vs {mem[2]} bare clients"))
    return rows
