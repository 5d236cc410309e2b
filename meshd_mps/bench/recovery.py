"""Row (i) recovery: n resident heartbeats (1, 8, 32 in MPS mode with a pool of 4; 1, 8
in blink mode; --quick: 1), then a fault: from its start to every heartbeat beating again, with the recovery's
steps (detect, decide, teardown, server_ready, contexts, relaunch).  The fault is a program that
faults its GPU (``fault``, restart policy never: from its load's return), or, the killed-worker
case, a SIGKILL of one heartbeat's running worker (from the kill; that heartbeat is one that must
beat again).  Each with 8 programs also under live restore (workers on sockets: ``--live-restore``).
Baseline, the floor of the same run: the fault seen, the old workers exited (the server takes no
new client before), and as many bare contexts as the recovery needs (n in MPS mode, 1 in blink
mode), from processes imported and waiting, released at once.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from meshd_mps.bench.clients import bare_clients, held_contexts
from meshd_mps.bench.measure import until
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, mps_gpu
from meshd_mps.programs import Programs, ProgramState

#: The target: 8 programs back within this (s), from the fault, in MPS mode, with and without
#: live restore, the killed program included.
TARGET_S = 0.8


@dataclass(frozen=True)
class Case:
    mode: str
    n: int
    live: bool = False  # live restore: the workers on sockets
    kill: bool = False  # a SIGKILL of a running worker, not a faulting program

    @property
    def name(self) -> str:
        how = (", live restore" if self.live else "") + (", a worker killed" if self.kill else "")
        return f"recovery: {self.mode}{how}, {self.n} program{'s' if self.n > 1 else ''} beating again"


def cases(bench: Bench) -> list[Case]:
    """Every (i) case, in order: the plain ones by size, then the 8-program ones (--quick: one
    program in MPS mode plain, and the two 8-program cases that take both of the changes, live
    restore and a kill, blink's among them: every path of the section, half of the suite's time)."""
    sizes = {"mps": (1,)} if bench.quick else {"mps": (1, 8, 32), "blink": (1, 8)}
    plain = [Case(mode, n) for mode, ns in sizes.items() for n in ns]
    more = [Case("mps", 8, live=True), Case("mps", 8, kill=True)] if not bench.quick else []
    return [*plain, *more, Case("mps", 8, live=True, kill=True), Case("blink", 8, live=True)]


async def recovery(bench: Bench, c: Case) -> tuple[float, dict[str, float], float, float]:
    """``c.n`` resident heartbeats, then the fault: seconds from it to every heartbeat beating again,
    the recovery's steps (ms, with ``detect``: the fault to the failure seen), the teardown's share
    and the daemon's own figure (s)."""
    async with await bench.backend(c.mode, pool=4 if c.mode == "mps" else 0, live=c.live) as b:
        progs, mb = Programs(b, restart="on-failure"), b.mailbox
        try:
            man, ptx = await bench.src(b, "heartbeat")
            for i in range(c.n):
                p = await progs.load({**man, "name": f"heartbeat-{i}"}, ptx)
                await until(lambda mb=mb, s=p.slot: mb.heartbeat(s) > 0, 10, "the first heartbeats")
            slots = [p.slot for p in progs.by_name.values()]
            if c.kill:
                t0 = time.monotonic()
                os.kill(progs.by_name["heartbeat-0"].kernel.pid, signal.SIGKILL)
            else:
                await progs.load(*await bench.src(b, "fault"), restart="never")
                t0 = time.monotonic()
            await until(lambda: progs.faults and progs.faults[-1].ms > 0, 60, "the fault's recovery")
            r = progs.faults[-1]
            innocents = {f"heartbeat-{i}" for i in range(1 if c.kill else 0, c.n)}
            if not r.gpu_wide or not innocents <= set(r.relaunched):
                raise RuntimeError(f"the recovery did not relaunch every innocent heartbeat: {r}")
            # The killed one may come back after the recovery (by its restart policy), where the recovery
            # did not take it.
            beating = [progs.by_name[f"heartbeat-{i}"] for i in range(c.n)]
            await until(lambda: all(p.restarts and p.seen() is ProgramState.RUNNING for p in beating), 30,
                        "every heartbeat relaunched")
            seen = {s: mb.heartbeat(s) for s in slots}
            await until(lambda: all(mb.heartbeat(s) > v for s, v in seen.items()), 30, "every heartbeat again")
            total = time.monotonic() - t0
            steps = {"detect": round((r.seen_at - t0) * 1e3, 2), **r.steps}
            return total, steps, r.steps.get("teardown", 0.0) / 1e3, r.ms / 1e3
        finally:
            await progs.close()


async def bare(bench: Bench, mode: str, n: int) -> float:
    """The floor's contexts (s): n bare MPS clients on a running server, or one plain context."""
    if mode == "mps":
        async with await bench.backend("mps", pool=0) as fb:
            await bare_clients(bench, fb, 1)  # the server started first, as it runs during a fault
            return await held_contexts(bench, {**os.environ, **mps_gpu(fb).mps.daemon.env}, n)
    return await held_contexts(bench, dict(os.environ), 1)  # one plain context, no MPS


async def sec_recovery(bench: Bench) -> list[Row]:
    """From a GPU fault (or a worker's kill) to every innocent (and the killed one) beating again,
    with its steps; against the floor of the same run: the fault seen, the old workers exited (the
    server takes no client before), and as many bare contexts as the recovery needs, released at once."""
    rows: list[Row] = []
    contexts: dict[tuple[str, int], float] = {}
    for c in cases(bench):
        total, steps, teardown, _ms = await recovery(bench, c)
        if (c.mode, c.n) not in contexts:
            contexts[c.mode, c.n] = await bare(bench, c.mode, c.n)
        ctx = contexts[c.mode, c.n]
        floor = max(0.0, steps["detect"] / 1e3) + teardown + ctx
        parts = ", ".join(f"{k} {v:.0f}" for k, v in steps.items())
        target = f"<= {TARGET_S:g} s" if c.n == 8 and c.mode == "mps" else "-"
        rows.append(Row("i", c.name, "ms", total * 1e3, floor * 1e3, "floor: detect + teardown + bare contexts", target,
                        total <= TARGET_S if target != "-" else None,
                        f"steps (ms): {parts}; bare contexts {ctx * 1e3:.0f} ms for {c.n if c.mode == 'mps' else 1}",
                        parts=dict(steps)))
    return rows
