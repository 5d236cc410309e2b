"""What counting each call (meshd_mps/base/callstats.py: its outcome, time and bytes) costs the ring's fast
path: the bench's row (f) figures, Programs.call's round trip and call_many's throughput on echo, with
the counting on and off in turns in one process (off: CallStats' two recorders replaced by no-ops),
so that the machine's load falls on both alike.

    python scripts/call_metrics_cost.py [--gpu sim|cuda] [-n 2000] [--rounds 5]

Prints per round and their medians: call p50/p99 (us, 64 B), this process's CPU per call (us, user
and system: the host's share, which the counting adds to) and call_many k/s at 1 and 8 outstanding,
on and off, and on/off; and what one ``CallStats.answered`` costs alone (timeit).  docs/benchmarks.md, "Call metrics", cites it.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd_mps.base.callstats import CallStats
from meshd_mps.bench import measure as M
from meshd_mps.bench.rig import Bench, echo_loaded
from meshd_mps.programs import Programs

ON = (CallStats.answered, CallStats.failed)


def counting(on: bool) -> None:
    if on:
        CallStats.answered, CallStats.failed = ON  # type: ignore[method-assign]
    else:
        CallStats.answered = CallStats.failed = lambda *a, **k: None  # type: ignore[method-assign, assignment]


async def one_round(progs: Programs, n: int, nt: int) -> dict[str, float]:
    payload = bytes(range(64))

    async def call() -> None:
        if await progs.call("echo", payload) != payload:
            raise RuntimeError("echo answered something else")

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    xs = await M.timed(n, call)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (n + 10) * 1e6
    out = {"p50": M.pct(xs, 0.5) * 1e6, "p99": M.pct(xs, 0.99) * 1e6, "cpu/call": cpu}
    for w in (1, 8):
        t0 = time.perf_counter()
        got = await progs.call_many("echo", [payload] * nt, window=w)
        out[f"k/s {w}"] = nt / (time.perf_counter() - t0) / 1e3
        assert got == [payload] * nt
    return out


async def main(gpu: str, n: int, nt: int, rounds: int) -> None:
    bench = Bench(gpu, False, None, "auto", "off")
    try:
        async with await bench.backend("mps", pool=2) as b, echo_loaded(bench, b) as (progs, _ring):
            got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for i in range(rounds):
                for on in (True, False) if i % 2 == 0 else (False, True):
                    counting(on)
                    got[on].append(await one_round(progs, n, nt))
                    r = got[on][-1]
                    print(f"round {i} {'on ' if on else 'off'}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()),
                          flush=True)
            counting(True)
            s = CallStats()
            k = 200000
            each = min(timeit.repeat(lambda: s.answered(64, 64, 9e-6), number=k, repeat=5)) / k * 1e6
            print(f"CallStats.answered alone: {each:.3f} us a call (timeit, the best of 5 x {k})")
            med = {on: {k: M.median([r[k] for r in rs]) for k in rs[0]} for on, rs in got.items()}
            print("median  : " + "; ".join(f"{k} on {med[True][k]:.2f} off {med[False][k]:.2f}"
                                          f" ({med[True][k] / med[False][k]:.3f}x)" for k in med[True]))
    finally:
        bench.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", choices=("sim", "cuda"), default="sim")
    ap.add_argument("-n", type=int, default=2000, help="calls timed per round (default 2000)")
    ap.add_argument("--pipelined", type=int, default=20000, help="call_many's requests per round (default 20000)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    asyncio.run(main(a.gpu, a.n, a.pipelined, a.rounds))
