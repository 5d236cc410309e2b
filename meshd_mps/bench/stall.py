"""Row (a) stall: the largest gap between two beats of a running ``heartbeat``
(MAX_GAP, ns of the kernel's %globaltimer, zeroed through GAP_RESET before
the window) while ``echo`` is loaded until its first beat: into a pooled
MPS worker, into a fresh one (pool emptied first), and in blink mode.
Baseline: the heartbeat's own max gap over a window of the same length
with nothing happening.  In blink mode the heartbeat is halted and
relaunched, and a relaunched kernel restarts MAX_GAP, so the gap across
the blink is estimated from (HEARTBEAT, BEAT_TIME) samples taken by the
host: the time between two samples less the beats between them at the
idle beat rate.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import anyio

from meshd_mps.backend import Backend
from meshd_mps.base import defaults
from meshd_mps.bench.measure import beat, until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, mps_gpu, retire_idle
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi


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


async def first_contact(b: Backend, progs: Programs, slot: int, echo: tuple[dict[str, Any], bytes]) -> tuple[float, float, int]:
    """The README's first contact after its first load (the heartbeat running): ``echo`` loaded until
    its first beat, then upgraded until the new version's first beat.  (The heartbeat's max gap us
    across both, its idle max gap us over as long with nothing, MPS clients made meanwhile.)"""
    mb, mps = b.mailbox, b.mps
    assert mps is not None
    made = mps.created
    await beat(b, slot, reset=True)
    t0 = time.perf_counter()
    p = await progs.load(*echo)
    await until(lambda: mb.heartbeat(p.slot) > 0, 10, "echo's first beat")
    await progs.upgrade(p.name, *echo)  # its launch zeroed the slot: a beat now is the new version's
    await until(lambda: mb.heartbeat(p.slot) > 0, 10, "the upgraded echo's first beat")
    window = time.perf_counter() - t0
    await beat(b, slot)
    gap = float(mb.u64(slot, abi.MAX_GAP))
    made = mps.created - made
    await progs.unload(p.name)
    await beat(b, slot, reset=True)
    await anyio.sleep(window)
    await beat(b, slot)
    return gap / 1e3, float(mb.u64(slot, abi.MAX_GAP)) / 1e3, made


async def sec_stall(bench: Bench) -> list[Row]:
    """Row (a): a load's stall of a running program, in each mode, and the README's first contact at
    serve's defaults (MPS mode's default pool: POOL_BY_ISOLATION), whose loads and upgrade must make no
    MPS client after the start.  The pooled case loads into a worker above the pool's reserve, as a
    new program's load does."""
    reps, rows = bench.n(3, 1), []
    pool = defaults.POOL_BY_ISOLATION["mps"]
    note = f"echo loaded until its first beat; worst of {reps}; heartbeat's MAX_GAP (%globaltimer)"
    for mode in ("mps", "blink"):
        async with await bench.backend(mode, pool=pool if mode == "mps" else 0) as b:
            progs = Programs(b)
            try:
                hb = await progs.load(*await bench.src(b, "heartbeat"))
                echo = await bench.src(b, "echo")
                assert b.compiler is not None
                await b.compiler.prepare(*echo)  # the JIT outside the windows
                await until(lambda s=hb.slot: b.mailbox.heartbeat(s) > 0, 10, "the heartbeat's first beat")
                if mode == "mps":
                    gap = idle = 0.0
                    made = 0
                    for _ in range(reps):
                        g, i, m = await first_contact(b, progs, hb.slot, echo)
                        gap, idle, made = max(gap, g), max(idle, i), made + m
                    rows.append(Row("a", "stall: README first contact (load echo, upgrade it), MPS at serve's"
                                    " defaults", "us", gap, idle, "idle gap", "<= 2x idle, no client",
                                    gap <= 2 * idle and made == 0,
                                    f"the heartbeat running; pool {pool}; worst of {reps}; MPS clients made in the"
                                    f" windows: {made}"))
                for case in ("pooled", "fresh") if mode == "mps" else ("blink",):
                    gap = idle = beside = 0.0
                    for _ in range(reps):
                        if case == "fresh":
                            await retire_idle(b)
                        elif case == "pooled" and not mps_gpu(b).pool.for_loads():
                            raise RuntimeError("no pooled worker above the reserve left for the pooled case")
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
