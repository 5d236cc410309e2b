"""Row (g) idle: this supervisor process's CPU (getrusage user + sys) over 5 s
(2 s with --quick) with 32 (4) idle pooled workers, in % of one core,
against the same window before any backend was opened.
"""

from __future__ import annotations

import resource
import time

import anyio

from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, echo_loaded


async def cpu_percent(window: float) -> float:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await anyio.sleep(window)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (t1 - t0) * 100


async def sec_idle(bench: Bench) -> list[Row]:
    window, nw = bench.n(5, 1), bench.n(32, 4)
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
