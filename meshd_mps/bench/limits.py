"""Row (h) limits: as many resident heartbeats as each mode takes (blink
32, one per hardware queue; MPS 44: 48 clients less a pool of 4; 8 with
--quick), how many beat, the next load refused; an upgrade at the limit:
in blink mode the blink's length against the same with one program, in
MPS mode a neighbour's MAX_GAP against its idle gap (target: within 2x: the
upgrade takes the pool's reserve and makes no MPS client); the
start check's share of a load (LAUNCHED to STATE = RUNNING) against the
whole load.  And in MPS mode the cost of one new MPS client by the clients
there (8, 16, 32, 44): a neighbour's MAX_GAP across a load beyond the pool
(which makes its client at the load and says so) against its idle gap over
as long a window, beside the daemon's estimate (``stall_estimate_us``).
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from meshd_mps.base.errors import CapacityError
from meshd_mps.bench.measure import beat, pct, until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench
from meshd_mps.isolation.limits import BLINK_QUEUES
from meshd_mps.mps.clients import MAX_CLIENTS, stall_estimate_us
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi


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
                nb_slot = progs.by_name["heartbeat-1"].slot
                for i in range(2, n):
                    if mode == "mps":
                        await beat(b, nb_slot, reset=True)
                    t0 = time.perf_counter()
                    p = await progs.load(named(i), ptx)
                    loads.append((time.perf_counter() - t0) * 1e3)
                    made = p.kernel.module.new_client
                    if made is not None and made.clients in CLIENT_COUNTS:
                        rows.append(await _client_cost(b, nb_slot, made.clients, loads[-1] / 1e3, pool))
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
                                    idle / 1e3, "its idle gap", "<= 2x", gap <= 2 * idle,
                                    f"heartbeat-1's MAX_GAP while heartbeat-0 is upgraded ({window * 1e3:.0f} ms), pool"
                                    f" {pool}: the upgrade takes the pool's reserve, no new MPS client"))
                rows.append(Row("h", f"start check, {mode}: LAUNCHED to STATE = RUNNING, p50", "ms", pct(progs.start_ms, 0.5),
                                pct(loads, 0.5), "the whole load, p50", "-", None,
                                f"p99 {pct(progs.start_ms, 0.99):.3f} ms over {len(progs.start_ms)} launches"))
            finally:
                await progs.close()
    return rows


#: The MPS clients at which (h) gives the cost of one new client.
CLIENT_COUNTS = (8, 16, 32, 44)


async def _client_cost(b: Any, slot: int, clients: int, window: float, pool: int) -> Row:
    """A neighbour's MAX_GAP across the load just done (MAX_GAP zeroed before it), which made a new
    MPS client, against its MAX_GAP over as long a window with nothing happening."""
    await beat(b, slot)
    gap = float(b.mailbox.u64(slot, abi.MAX_GAP))
    await beat(b, slot, reset=True)
    await anyio.sleep(window)
    await beat(b, slot)
    idle = float(b.mailbox.u64(slot, abi.MAX_GAP))
    return Row("h", f"one new MPS client at {clients} clients: a neighbour's worst gap", "us", gap / 1e3, idle / 1e3,
               "its idle gap", "-", None,
               f"a load beyond the pool ({pool}, its reserve kept) made it ({window * 1e3:.0f} ms), said in its answer;"
               f" the daemon's estimate {stall_estimate_us(clients):.0f} us")
