"""Row (p) payloads: requests and responses over a ring entry's 188 bytes, through echo's payload
region (its manifest here declares 1 MiB each): a 4 KiB request with its 4 KiB response against the
64 B call, in the same rounds, and 1 MiB ones: one at a time, against the host's own copy of the
same bytes in and out, and eight outstanding with every response kept, against the host's own
copies kept (the fresh memory that 64 MiB of new responses take bounds both).  echo answers a
large request in place (its response names the request's own bytes), so that the figures are the
transport's: the host's writes and reads of the region, the ring, and the GPU's look at the entry,
not a copy made on the GPU."""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

from meshd_mps.bench.measure import ROUNDS, median, pct, timed
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import Bench, placement
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

MIB = 1 << 20
SMALL, MEDIUM = 64, 4096


def host_copy(n: int, reps: int) -> float:
    """Bytes a second of the host copying ``n`` bytes into shared memory and back out as new bytes
    (what a call of ``n`` in and ``n`` out costs the host at least), the median of ``reps``."""
    m = mmap.mmap(-1, n)
    src = os.urandom(n)
    try:
        xs = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            m[:n] = src
            if len(m[:n]) != n:
                raise RuntimeError("short read")
            xs.append(time.perf_counter() - t0)
        return n / median(xs[2:])
    finally:
        m.close()


def host_copy_kept(payloads: list[bytes]) -> float:
    """Bytes a second of the host copying ``payloads`` in turn into RING areas of shared memory and
    each back out as new bytes, all kept (what ``call_many`` returns): the copies and the fresh
    memory that its responses take, which the host must fault in."""
    n = len(payloads[0])
    m = mmap.mmap(-1, abi.RING * n)
    try:
        m[:] = bytes(len(m))  # its pages made, as the region's are
        t0 = time.perf_counter()
        out = []
        for i, x in enumerate(payloads):
            at = i % abi.RING * n
            m[at : at + n] = x
            out.append(m[at : at + n])
        took = time.perf_counter() - t0
        if out != payloads:
            raise RuntimeError("the copy differs")
        return len(payloads) * n / took
    finally:
        m.close()


async def payload_round(progs: Programs, n: int, nb: int) -> dict[str, float]:
    """One round: the 64 B and 4 KiB calls' round trips (us), 1 MiB ones' bytes a second (one way)."""

    def caller(payload: bytes) -> Any:
        async def call() -> float:  # the call's time; its check after it (a 1 MiB compare is ~60 us)
            t0 = time.perf_counter()
            got = await progs.call("echo", payload)
            took = time.perf_counter() - t0
            if got != payload:
                raise RuntimeError("echo answered something else")
            return took
        return call

    out: dict[str, float] = {}
    for size in (SMALL, MEDIUM):
        xs = await timed(n, caller(os.urandom(size)))
        out[f"call{size}.0.5"], out[f"call{size}.0.99"] = pct(xs, 0.5) * 1e6, pct(xs, 0.99) * 1e6
    big = [os.urandom(MIB) for _ in range(nb)]
    await progs.call_many("echo", [big[0]] * abi.RING)  # every area written once (its pages made), untimed
    t0 = time.perf_counter()
    got = await progs.call_many("echo", big)
    out["many"] = nb * MIB / (time.perf_counter() - t0)
    if got != big:
        raise RuntimeError("echo answered something else")
    del got
    out["one"] = MIB / median(await timed(nb, caller(big[0]), warm=2))
    out["host"] = host_copy(MIB, nb)
    out["host_kept"] = host_copy_kept(big)
    return out


async def sec_payloads(bench: Bench) -> list[Row]:
    n, nb, k = bench.n(2000, 100), bench.n(64, 4), bench.n(ROUNDS, 1)
    with placement(bench.ring_cpu):  # where (f) placed the ring's host, if it ran
        async with await bench.backend("mps", pool=2) as b:
            progs = Programs(b)
            try:
                m, ptx = await bench.src(b, "echo")
                await progs.load({**m, "max_request": MIB, "max_response": MIB}, ptx)
                rounds = [await payload_round(progs, n, nb) for _ in range(k)]
            finally:
                await progs.close()
    m = {key: median([r[key] for r in rounds]) for key in rounds[-1]}
    gpu = bench.gpu == "cuda"  # the targets are the GPU's; the simulated GPU's figures are the CPU's
    s50, s99, c50, c99 = m[f"call{SMALL}.0.5"], m[f"call{SMALL}.0.99"], m[f"call{MEDIUM}.0.5"], m[f"call{MEDIUM}.0.99"]
    each = "; rounds: " + ", ".join(f"{r[f'call{MEDIUM}.0.5']:.2f} against {r[f'call{SMALL}.0.5']:.2f} us, 1 MiB"
                                    f" {r['many'] / 1e9:.2f} GB/s" for r in rounds)
    call_note = (f"Programs.call on echo (its manifest: 1 MiB requests and responses), {n} calls of each size a round,"
                 f" the median of {k} rounds; 4 KiB through its payload region, answered in place")
    gbs = (f"GB/s: request bytes a second, each answered with as many (twice that crosses the bus); {nb} requests of"
           " 1 MiB, echo answering in place; baseline: the host copying 1 MiB into shared memory and back out")
    return [
        Row("p", f"payloads: Programs.call {MEDIUM // 1024} KiB in, {MEDIUM // 1024} KiB out, p50", "us", c50, s50,
            f"Programs.call {SMALL} B p50", "<= 2x" if gpu else "-", c50 <= 2 * s50 if gpu else None, call_note + each),
        Row("p", f"payloads: Programs.call {MEDIUM // 1024} KiB in, {MEDIUM // 1024} KiB out, p99", "us", c99, s99,
            f"Programs.call {SMALL} B p99", note=call_note),
        Row("p", "payloads: 1 MiB in, 1 MiB out, one at a time", "GB/s", m["one"] / 1e9, m["host"] / 1e9,
            "the host's own copy in and out", ">= 5 GB/s" if gpu else "-", m["one"] >= 5e9 if gpu else None,
            "Programs.call, the median call (its check of the response after its time); " + gbs),
        Row("p", "payloads: 1 MiB in, 1 MiB out, 8 outstanding, all kept", "GB/s", m["many"] / 1e9,
            m["host_kept"] / 1e9, "the host's own copies in and out, all kept", ">= 0.8x" if gpu else "-",
            m["many"] >= 0.8 * m["host_kept"] if gpu else None,
            f"Programs.call_many of {nb} requests, which returns every response: {nb} MiB of new bytes that the host"
            " faults in as it copies them out, which bounds it as it bounds the baseline (the same copies through"
            f" {abi.RING} areas of shared memory into new bytes, kept); " + gbs.split("; ", 1)[0]),
    ]
