"""Row (f) ring: one request and its response through ``echo``'s mailbox ring
(Programs.call), against one kernel launch plus synchronise per request
(LAUNCH of a kernel that returns at once, DONE awaited), and against the
floor (a minimal kernel and host loop).  The floor's host and the ring's
spin run on one host CPU (--cpu; auto: the fastest floor of a survey of
every CPU), since on the lent H200 the CPU decided the round trip.
"""

from __future__ import annotations

import time
from typing import Any

from meshd_mps.backend import Backend
from meshd_mps.bench.floor import SWEEP, place_ring, ring_floor
from meshd_mps.bench.measure import ROUNDS, launch_sync, median, pct, timed
from meshd_mps.bench.report import Row, quantiles
from meshd_mps.bench.rig import Bench, echo_loaded, placement, returning_worker
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi
from meshd_mps.protocol.ring import SPIN, Ring


def spun_round_trips(ring: Ring, payload: bytes, n: int, warm: int = 10) -> list[float]:
    """The host-spin path's round trips (seconds): ``Ring.post``, then ``Ring.spin`` on the
    response, in a plain loop as the floor's host is (a coroutine per request would add the
    loop's ~1 us to each).  It holds the event loop meanwhile (~10 ms on the H200)."""
    out, clock = [], time.perf_counter
    for i in range(n + warm):
        t0 = clock()
        if ring.spin(ring.post(payload), 5.0) != payload:
            raise RuntimeError("echo did not answer within 5 s, or answered something else")
        if i >= warm:
            out.append(clock() - t0)
    return out


async def throughput(progs: Programs, payload: bytes, window: int, n: int) -> float:
    """Requests per second through echo's ring, ``window`` outstanding (Programs.call_many)."""
    msgs = [payload] * n
    t0 = time.perf_counter()
    got = await progs.call_many("echo", msgs, window=window)
    dt = time.perf_counter() - t0
    if got != msgs:
        raise RuntimeError("echo answered something else")
    return n / dt


async def ring_round(bench: Bench, b: Backend, n: int, nf: int, nt: int, sweep: bool) -> dict[str, Any]:
    """One round of (f): the floor first (no kernel of ours resident: two contexts' kernels would
    time-slice), then echo loaded and asked, then unloaded.  Its figures in us and k/s, and under
    ``dist.`` the 64 B round trips' distributions (report.quantiles)."""
    floor = await ring_floor(bench, b, nf)
    out: dict[str, Any] = {f"floor{k}.{q}": pct(v, q) * 1e6 for k, v in floor.items() for q in (0.5, 0.99)}
    out["dist.floor 64 B"] = quantiles(floor[64])
    async with echo_loaded(bench, b) as (progs, ring):

        def caller(payload: bytes) -> Any:
            async def call() -> None:
                if await progs.call("echo", payload) != payload:
                    raise RuntimeError("echo answered something else")
            return call

        payload = bytes(range(64))
        for key, xs in (("call64", await timed(n, caller(payload))), ("spin64", spun_round_trips(ring, payload, n))):
            out[f"{key}.0.5"], out[f"{key}.0.99"] = pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6
            out[f"dist.{'Programs.call' if key == 'call64' else 'host spin'} 64 B"] = quantiles(xs)
        for w in (1, 4, 8):
            out[f"rate{w}"] = await throughput(progs, payload, w, nt) / 1e3
        if sweep:
            for size in SWEEP:
                if size != 64:
                    xs = await timed(n // 2, caller(bytes(range(size))))
                    out[f"call{size}.0.5"], out[f"call{size}.0.99"] = pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6
                out[f"size{size}"] = await throughput(progs, bytes(range(size)), abi.RING, nt) / 1e3
            relaunched = await returning_worker(bench, b, 20)
            out["launch_sync"] = pct(await timed(n // 4, lambda: launch_sync(relaunched, 20)), 0.5) * 1e6
    return out


async def sec_ring(bench: Bench) -> list[Row]:
    n, nf, nt, k = bench.n(2000, 100), bench.n(20000, 500), bench.n(20000, 400), bench.n(ROUNDS, 1)
    survey = await place_ring(bench)
    # The bench's process on the floor's host CPU, as ``serve --daemon-cpus`` places the daemon: the
    # ring's host spins where the floor's did, and no worker runs there.
    with placement(bench.ring_cpu):
        async with await bench.backend("mps", pool=2) as b:
            rounds = [await ring_round(bench, b, n, nf, nt, sweep=i == k - 1) for i in range(k)]
    m = {key: median([r[key] for r in rounds if key in r]) for key in rounds[-1] if not key.startswith("dist.")}
    dist = {k.removeprefix("dist."): v for k, v in rounds[-1].items() if k.startswith("dist.")}  # the last round's
    us = {size: (m[f"floor{size}.0.5"], m[f"floor{size}.0.99"]) for size in (-1, 0, *SWEEP)}
    c50, c99, s50, s99 = m["call64.0.5"], m["call64.0.99"], m["spin64.0.5"], m["spin64.0.99"]
    lb = m["launch_sync"]
    rates, by_size = {w: m[f"rate{w}"] * 1e3 for w in (1, 4, 8)}, {size: m[f"size{size}"] * 1e3 for size in SWEEP}
    sweep = {size: (m[f"call{size}.0.5"], m[f"call{size}.0.99"]) for size in SWEEP if size != 64}
    each = "; rounds: " + ", ".join(
        f"call {r['call64.0.5']:.2f}/{r['call64.0.99']:.1f}, spin {r['spin64.0.5']:.2f}/{r['spin64.0.99']:.1f}"
        f" against floor {r['floor64.0.5']:.2f}/{r['floor64.0.99']:.2f} us, 8 outstanding {r['rate8'] / r['rate1']:.2f}x"
        for r in rounds)
    where = ("anywhere (--cpu off)" if bench.ring_cpu is None else f"on CPU {bench.ring_cpu}, the workers on the others" + (
        " (--cpu auto: the fastest floor of " + ", ".join(f"{c}: {v:.2f}" for c, v in survey.items()) + " us)"
        if survey else ""))
    fnote = (f"floor: one warp polling a word of host-mapped memory, a word per lane, the host spinning on plain"
             f" memory (payload written before the doorbell, untimed); {nf - nf // 10} requests per size; the median of"
             f" {k} rounds (each figure of (f) is); the floor's host and the ring's spin {where}")
    spin_note = f"Ring.post, then a host spin on RESP_HEAD (Ring.spin), in a plain loop as the floor's host; {n} requests"
    call_note = (f"Programs.call on echo, {n} calls: a yield, then a spin of at most {SPIN * 1e6:.0f} us,"
                 f" then back-off")
    rows = [
        Row("f", "ring floor: doorbell alone, p50", "us", us[0][0], us[-1][0], "the host loop alone", note=fnote),
        Row("f", "ring floor: doorbell alone, p99", "us", us[0][1], us[0][0], "its p50"),
        Row("f", "ring floor: 64 B, p50", "us", us[64][0], us[0][0], "doorbell alone", note=fnote),
        Row("f", "ring floor: 64 B, p99", "us", us[64][1], us[0][1], "doorbell alone p99"),
        Row("f", "ring: Programs.call 64 B, p50", "us", c50, us[64][0], "floor 64 B p50", "<= 2x", c50 <= 2 * us[64][0],
            call_note, dist=dist),
        Row("f", "ring: Programs.call 64 B, p99", "us", c99, us[64][1], "floor 64 B p99", "<= 3x", c99 <= 3 * us[64][1],
            call_note),
        Row("f", "ring: host spin 64 B, p50", "us", s50, us[64][0], "floor 64 B p50", "<= 1.3x", s50 <= 1.3 * us[64][0],
            spin_note + each),
        Row("f", "ring: host spin 64 B, p99", "us", s99, us[64][1], "floor 64 B p99", "<= 3x", s99 <= 3 * us[64][1],
            spin_note),
        Row("f", "ring: Programs.call p50 against relaunching", "us", c50, lb, "launch+sync p50", "<= 0.5x",
            c50 <= 0.5 * lb, "launch+sync: LAUNCH of a kernel that returns at once, its DONE awaited"),
    ]
    for size in SWEEP:
        if size != 64:
            rows.append(Row("f", f"ring: Programs.call {size} B, p50", "us", sweep[size][0], us[size][0], f"floor {size} B p50",
                            note=f"p99 {sweep[size][1]:.1f} us (floor {us[size][1]:.1f}); {n // 2} calls, the last round"))
    tput = f"Programs.call_many on echo, {nt} requests of 64 B"
    rows.append(Row("f", "ring throughput, 1 outstanding", "k/s", rates[1] / 1e3, 1e3 / us[64][0], "1 / floor 64 B p50",
                    note=tput + "; baseline: the floor's round trips back to back"))
    for wdw in (4, 8):
        r = Row("f", f"ring throughput, {wdw} outstanding", "k/s", rates[wdw] / 1e3, rates[1] / 1e3, "1 outstanding",
                note=tput)
        if wdw == 8:
            r.target, r.ok = ">= 4x", rates[8] >= 4 * rates[1]
        rows.append(r)
    rows.append(Row("f", "ring throughput, 8 outstanding, 188 B", "k/s", by_size[188] / 1e3, by_size[4] / 1e3,
                    "the same, 4 B", note="8 outstanding by size: " + ", ".join(
                        f"{k} B {v / 1e3:.0f} k/s" for k, v in by_size.items())))
    return rows
