"""The sections in order, each under a deadline of its own (one that fails is an ERROR row and
the others still run), and (b) once more on the plain asyncio loop where another loop ran it."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import anyio

from meshd_mps.base import eventloop
from meshd_mps.bench.ask import sec_ask
from meshd_mps.bench.data import sec_data
from meshd_mps.bench.done import sec_done
from meshd_mps.bench.idle import sec_idle
from meshd_mps.bench.limits import sec_limits
from meshd_mps.bench.load import sec_load
from meshd_mps.bench.payloads import sec_payloads
from meshd_mps.bench.pool import sec_pool
from meshd_mps.bench.recovery import sec_recovery
from meshd_mps.bench.report import Row, describe
from meshd_mps.bench.restart import sec_restart
from meshd_mps.bench.rig import Bench
from meshd_mps.bench.ring import sec_ring
from meshd_mps.bench.stall import sec_stall
from meshd_mps.bench.versus import sec_versus

SECTIONS = [("a", "stall", sec_stall), ("b", "ask", sec_ask), ("c", "done", sec_done), ("d", "pool", sec_pool),
            ("e", "load", sec_load), ("f", "ring", sec_ring), ("g", "idle", sec_idle),
            ("h", "limits", sec_limits), ("i", "recovery", sec_recovery), ("j", "restart", sec_restart),  # (k): sec_restart
            ("m", "data", sec_data), ("p", "payloads", sec_payloads), ("v", "versus", sec_versus)]


async def run_all(bench: Bench, sections: list[tuple[str, str, Any]] | None = None) -> list[Row]:
    rows: list[Row] = []
    for id, name, fn in sections or SECTIONS:
        print(f"bench: ({id}) {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        limit = bench.n(300, 120)
        try:
            with anyio.fail_after(limit):
                rows += await fn(bench)
        except Exception as e:  # the row is ERROR; the other sections still run
            why = describe(e) if str(e) else f"{type(e).__name__}: the section did not finish in {limit} s"
            rows.append(Row(id, name, error=why))
        print(f"bench: ({id}) {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


def run_bench(bench: Bench, only: str | None = None) -> list[Row]:
    """The sections: all, or those whose letters (or names) ``only`` lists."""
    chosen = [sec for sec in SECTIONS if only is None or {sec[0], sec[1]} & set(only.split(","))]
    rows = eventloop.run(lambda: run_all(bench, chosen), bench.loop)
    other = "asyncio" if eventloop.factory(bench.loop)[1] is not None else None
    if other is None or "b" not in {sec[0] for sec in chosen}:
        return rows

    async def again(b: Bench) -> list[Row]:  # (b) once more on the plain asyncio loop, for comparison
        return [dataclasses.replace(r, name=f"{r.name} [asyncio]", target="-", ok=None) for r in await sec_ask(b)
                if "1 worker" in r.name or "at once" in r.name or ("busy" in r.name and "p99" in r.name)]

    extra = eventloop.run(lambda: run_all(bench, [("b", "ask [asyncio]", again)]), other)
    last_b = max(i for i, r in enumerate(rows) if r.id == "b")
    return rows[: last_b + 1] + extra + rows[last_b + 1 :]
