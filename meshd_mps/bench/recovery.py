"""Row (i) recovery (issue 16): n resident heartbeats (1, 8, 32 in MPS mode with a pool of 4; 1, 8 in
blink mode), then ``fault``: from its load's return to every heartbeat beating again, with the
recovery's steps (detect, decide, teardown, server_ready, contexts, relaunch).  Baseline, the
floor of the same run: the fault seen, the old workers exited (the server takes no new client
before), and as many bare contexts as the recovery needs (n in MPS mode, 1 in blink mode),
from processes imported and waiting, released at once.
"""

from __future__ import annotations

import os
import time

from meshd_mps.bench.clients import bare_clients, held_contexts
from meshd_mps.bench.measure import until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, mps_gpu
from meshd_mps.programs import Programs


async def recovery(bench: Bench, mode: str, n: int) -> tuple[float, dict[str, float], float, float]:
    """n resident heartbeats, then a program that faults its GPU (restart policy never): seconds from
    its load's return to every heartbeat beating again, the recovery's steps (ms, with ``detect``: the
    load's return to the failure seen), the teardown's share and the server's (old workers exited)."""
    async with await bench.backend(mode, pool=4 if mode == "mps" else 0) as b:
        progs, mb = Programs(b, restart="on-failure"), b.mailbox
        try:
            man, ptx = await bench.src(b, "heartbeat")
            for i in range(n):
                p = await progs.load({**man, "name": f"heartbeat-{i}"}, ptx)
                await until(lambda mb=mb, s=p.slot: mb.heartbeat(s) > 0, 10, "the first heartbeats")
            slots = [p.slot for p in progs.by_name.values()]
            await progs.load(*await bench.src(b, "fault"), restart="never")
            t0 = time.monotonic()
            await until(lambda: progs.faults and progs.faults[-1].ms > 0, 60, "the fault's recovery")
            r = progs.faults[-1]
            if not r.gpu_wide or sorted(r.relaunched) != sorted(f"heartbeat-{i}" for i in range(n)):
                raise RuntimeError(f"the recovery did not relaunch every heartbeat: {r}")
            seen = {s: mb.heartbeat(s) for s in slots}
            await until(lambda: all(mb.heartbeat(s) > v for s, v in seen.items()), 30, "every heartbeat again")
            total = time.monotonic() - t0
            steps = {"detect": round((r.seen_at - t0) * 1e3, 2), **r.steps}
            return total, steps, r.steps.get("teardown", 0.0) / 1e3, r.ms / 1e3
        finally:
            await progs.close()


async def sec_recovery(bench: Bench) -> list[Row]:
    """From a GPU fault to every innocent beating again, for 1, 8 and 32 programs, with its steps;
    against the floor of the same run: the fault seen, the old workers exited (the server takes no
    client before), and as many bare contexts as the recovery needs, released at once."""
    rows: list[Row] = []
    for mode in ("mps", "blink"):
        sizes = (1, 8) if bench.quick or mode == "blink" else (1, 8, 32)
        for n in sizes:
            total, steps, teardown, _ms = await recovery(bench, mode, n)
            if mode == "mps":
                async with await bench.backend("mps", pool=0) as fb:
                    await bare_clients(bench, fb, 1)  # the server started first, as it runs during a fault
                    ctx = await held_contexts(bench, {**os.environ, **mps_gpu(fb).mps.daemon.env}, n)
            else:
                ctx = await held_contexts(bench, dict(os.environ), 1)  # one plain context, no MPS
            floor = max(0.0, steps["detect"] / 1e3) + teardown + ctx
            parts = ", ".join(f"{k} {v:.0f}" for k, v in steps.items())
            target = "<= 1.2 s" if n == 8 and mode == "mps" else "-"
            rows.append(Row("i", f"recovery: {mode}, {n} program{'s' if n > 1 else ''} beating again", "ms", total * 1e3,
                            floor * 1e3, "floor: detect + teardown + bare contexts", target,
                            total <= 1.2 if target != "-" else None,
                            f"steps (ms): {parts}; bare contexts {ctx * 1e3:.0f} ms for {n if mode == 'mps' else 1}"))
    return rows
