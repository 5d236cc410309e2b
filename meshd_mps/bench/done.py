"""Row (c) done: a kernel's end to the caller's awaitable resolving, measured from
the host's HALT write on a running ``heartbeat`` to its Launch resolving.
Baseline: HALT write to STATE = EXITED seen by a host spin on the slot
(the kernel's end itself, without the DONE path).
"""

from __future__ import annotations

import time

import anyio

from meshd_mps.bench.measure import pct, spin, until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench
from meshd_mps.protocol import abi


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
