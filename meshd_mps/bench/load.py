"""Row (e) load: a program's PTX to running (Programs.load: prepare, preload into a
pooled MPS worker, launch; until its first heartbeat), from the cubin
cache, against the same with a cold JIT (a fresh Compiler, no cache).
"""

from __future__ import annotations

import statistics
import time

from meshd_mps.bench.measure import until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench
from meshd_mps.gpu.compiler import Compiler
from meshd_mps.programs import Programs


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
