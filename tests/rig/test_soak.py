"""A bounded soak: thousands of load / launch / DONE / unload cycles across 16
workers with random SIGKILLs, ending with exact counts.

A kill lands between a worker's LOADED and its LAUNCH: its module loaded, no kernel
on the GPU.  That is the kill MPS keeps to its client; one while the kernel runs
faults every client of the GPU on the H200 (docs/reliability.md), so its cost is
Programs' fault recovery (tests/rig/test_faults.py), not one lost cycle."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import pytest

from meshd_mps.base.errors import WorkerError

from ..rigs.procs import Resources, alive
from ..rigs.sim import sim

CYCLES = int(os.environ.get("MESHD_MPS_SOAK_CYCLES", "2000"))
LANES = 16
KILL_P = 0.01

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]


async def test_soak_with_random_kills(mps_rig):
    rnd = random.Random(20261202)
    counts = {"cycles": 0, "faults injected": 0, "faults survived": 0, "programs lost": 0}
    seen: set[int] = set()
    before, t0 = Resources.now(), time.monotonic()
    r = mps_rig(pool_cap=LANES)
    async with r as m:
        await m.prewarm(LANES)

        async def lane(n: int) -> None:
            for _ in range(n):
                w = await m.preload(f"soak{rnd.randrange(1000)}", sim(kernel="sleep", ms=rnd.choice((0, 0, 1, 5))), 32, 0, 0)
                seen.add(w.proc.pid)
                kill = rnd.random() < KILL_P
                try:
                    if kill:
                        counts["faults injected"] += 1
                        os.kill(w.proc.pid, 9)
                    done = await w.start(rnd.randrange(256), 1)
                    d = await asyncio.wait_for(done, 10)
                    if not d.ok:
                        counts["programs lost"] += 1
                except WorkerError:
                    if kill:
                        counts["faults survived"] += 1  # reported as an error, nothing else touched
                    else:
                        counts["programs lost"] += 1
                else:
                    if kill:
                        counts["programs lost"] += 1  # a killed worker cannot have run it
                await m.give_back(w)
                counts["cycles"] += 1

        per, extra = divmod(CYCLES, LANES)
        await asyncio.gather(*(lane(per + (i < extra)) for i in range(LANES)))
        assert len(m.pool) <= LANES
    left = [p for p in seen if alive(p)]
    counts["processes left"] = len(left)
    now = Resources.now()
    counts["fds left"] = len({fd: t for fd, t in now.fds.items() if before.fds.get(fd) != t})
    counts["temporary entries left"] = len(now.temps - before.temps)
    print("soak: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f", in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert counts["cycles"] == CYCLES
    assert counts["faults survived"] == counts["faults injected"] > 0
    assert counts["programs lost"] == 0
    assert left == []
    assert counts["fds left"] == counts["temporary entries left"] == 0, now.leaks_since(before)
