"""The one-off measurements behind docs/runs/ring-and-control-path.md (the ring and the control
path under load), kept so that they can be run again (on the GPU machine: python3 scripts/ring_probes.py WHICH).

  ask       32 workers asking at once (bench row b's phase), 5 rounds under each scheduling of
            the workers and the loop: as they are, workers SCHED_BATCH, the loop at nice -10, both
            (root); p50/p90/p99 and the loop's user and sys CPU per ask
  ask-cpu   the same phase with the loop's thread as it is, alone on the CPU with the fastest floor
            (B.place_ring's survey), and there with every worker's threads kept off that CPU;
            interleaved, 3 rounds
  ring-ab   the ring's host side, variants swapped in on one echo and interleaved over 3 rounds:
            the spin as it is (the clock read each turn), reading the clock every 128 turns or
            twice a turn, a pause of 1-3 us before the first poll, Programs.call yielding first (as it does) or
            spinning at once; Programs.call and the host spin p50/p99, call_many 1 and 8 outstanding
  hold      Programs.call_many's throughput with 1 and 8 outstanding, yielding to the loop every
            20, 50 or 100 us (Calls.HOLD), interleaved over 3 rounds.  (Once this was "batches",
            posts published 8, 4 or 2 at a time: no faster than 8, and that knob is gone.)
  modes     echo's host spin in an MPS worker and in blink mode's context, beside the floor, 3 rounds
  mps-floor the bench's floor as a plain context, as a native client of our MPS server, and as
            such a client on registered shared memory (a memfd, cuMemHostRegister'ed, as the
            mailbox is) instead of cuMemHostAlloc's, then echo's host spin, 3 rounds

Several names run in turn, in one process. --loop picks its event loop: asyncio by default, as the
probes in docs/runs ran, while serve and the bench take uvloop where installed. --gpu sim runs each
on the simulated GPU and the stand-in MPS daemon, one round each and fewer samples (the figures mean
nothing there; it checks that the script runs). The floor on a spread of SMs, once "sm" here, is
scripts/ring_variants.py --sm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd_mps import bench as B
from meshd_mps.base import eventloop
from meshd_mps.bench import floor as F  # the module whose FLOOR_CUDA ring_floor reads (mps_floor patches it)
from meshd_mps.isolation.base import Module
from meshd_mps.programs.calls import Calls
from meshd_mps.protocol import ring as R
from meshd_mps.protocol.ring import Ring
from meshd_mps.supervision import cpus


def us(xs: list[float], q: float) -> float:
    return B.pct(xs, q) * 1e6


# ---- ask -------------------------------------------------------------------------------------
async def asking(ws: list[Module], each: int, tag: str) -> None:
    many: list[float] = []

    async def asker(i: int) -> None:
        many.extend(await B.timed(each, lambda: B.launch_sync(ws[i], 100 + i, ask_only=True)))

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(len(ws)):
            tg.start_soon(asker, i)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    n, user, sys_ = len(many), r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    print(f"{tag:10} p50 {us(many, .5):5.0f} p90 {us(many, .9):5.0f} p99 {us(many, .99):5.0f} us; per ask user"
          f" {user / n * 1e6:4.1f} sys {sys_ / n * 1e6:4.1f} us; {(user + sys_) / (t1 - t0) * 100:3.0f} % of a core", flush=True)


def schedule(ws: list[Module], batch: bool, nice: bool) -> None:
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    for w in ws:
        for t in os.listdir(f"/proc/{w.proc.pid}/task"):
            with contextlib.suppress(OSError):  # a thread gone meanwhile
                os.sched_setscheduler(int(t), policy, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, -10 if nice else 0)


async def ask(bench: B.Bench) -> None:
    nw = bench.n(32, 8)
    async with await bench.backend("mps", pool=nw + 1) as b:
        ws = [await B.returning_worker(bench, b, 100 + i) for i in range(nw)]
        for _ in range(bench.n(2, 1)):
            for tag, batch, nice in (("as-is", False, False), ("batch", True, False), ("nice", False, True),
                                     ("both", True, True)):
                schedule(ws, batch, nice)
                await asking(ws, bench.n(200, 20), tag)
        schedule(ws, False, False)


async def ask_cpu(bench: B.Bench) -> None:
    nw = bench.n(32, 8)
    async with await bench.backend("mps", pool=nw + 1) as b:
        survey = await B.place_ring(bench)
        cpu = bench.ring_cpu
        print(f"floor survey (64 B p50, us): {survey}; fastest: CPU {cpu}", flush=True)
        ws = [await B.returning_worker(bench, b, 100 + i) for i in range(nw)]
        every = os.sched_getaffinity(0)
        others = every - {cpu} if cpu is not None and len(every) > 1 else every

        def workers_on(where: set[int]) -> None:
            for w in ws:
                for t in os.listdir(f"/proc/{w.proc.pid}/task"):
                    with contextlib.suppress(OSError):  # a thread gone meanwhile
                        os.sched_setaffinity(int(t), where)

        for _ in range(bench.n(3, 1)):
            for tag, loop_cpu, off in (("as-is", None, False), ("pinned", cpu, False), ("alone", cpu, True)):
                workers_on(others if off else every)
                # the loop's thread alone there; its other threads and the workers where they are
                with cpus.thread_on(None if loop_cpu is None else frozenset({loop_cpu})):
                    await asking(ws, bench.n(200, 20), tag)
        workers_on(every)


# ---- ring-ab -----------------------------------------------------------------------------------
Spin = Callable[[Ring, int, float], "bytes | None"]


def spin_turns(self: Ring, seq: int, budget: float = R.SPIN) -> bytes | None:
    """The spin with the clock read every 128 turns, RESP_HEAD compared with its last value."""
    w, at = self._w, self._resp_head
    v = w[at]
    if (v - seq - 1) & R.MASK >= 0x7FFFFFFF:
        clock = time.perf_counter
        end, k = clock() + budget, 128
        while (v - seq - 1) & R.MASK >= 0x7FFFFFFF:
            while w[at] == v:
                k -= 1
                if not k:
                    if clock() > end:
                        return None
                    k = 128
            v = w[at]
    return self._take(seq)


def spin_slower(self: Ring, seq: int, budget: float = R.SPIN) -> bytes | None:
    """The spin with the clock read twice a turn: a slower poll of RESP_HEAD."""
    w, at = self._w, self._resp_head
    if (w[at] - seq - 1) & R.MASK >= 0x7FFFFFFF:
        clock = time.perf_counter
        end = clock() + budget
        while (w[at] - seq - 1) & R.MASK >= 0x7FFFFFFF:
            if clock() > end or clock() > end:
                return None
    return self._take(seq)


def paused(pause: float) -> Spin:
    def spin(self: Ring, seq: int, budget: float = R.SPIN) -> bytes | None:
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass
        return AS_IS(self, seq, budget)
    return spin


async def call_at_once(self: Calls, name: str, payload: bytes, within: float | None = None) -> bytes:
    within = self.reg.d.call if within is None else within
    p, gen, ring = self._ring(name)
    seq = ring.post(payload)
    try:
        return await self._answer(p, gen, ring, seq, within, time.monotonic() + within)
    except BaseException:
        ring.forget(seq)
        raise


AS_IS: Spin = Ring.spin
CALL: Callable[..., Awaitable[bytes]] = Calls.call
VARIANTS: dict[str, tuple[Spin, Callable[..., Awaitable[bytes]]]] = {
    "as-is": (AS_IS, CALL), "spin 128 turns": (spin_turns, CALL), "call spins at once": (AS_IS, call_at_once),
    "slower poll": (spin_slower, CALL),
    "pause 1 us": (paused(1e-6), CALL), "pause 2 us": (paused(2e-6), CALL), "pause 3 us": (paused(3e-6), CALL),
}


async def ring_ab(bench: B.Bench) -> None:
    n, nt = bench.n(2000, 100), bench.n(20000, 400)
    async with await bench.backend("mps", pool=2) as b:
        fl = await B.ring_floor(bench, b, bench.n(10000, 500))
        print(f"floor 64 B p50 {us(fl[64], .5):.2f} p99 {us(fl[64], .99):.2f} us", flush=True)
        async with B.echo_loaded(bench, b) as (progs, ring):
            payload = bytes(range(64))

            async def call() -> None:
                if await progs.call("echo", payload) != payload:
                    raise RuntimeError("echo answered something else")

            try:
                for rnd in range(bench.n(3, 1)):
                    for name, (spin, callf) in VARIANTS.items():
                        Ring.spin, Calls.call = spin, callf  # type: ignore[assignment, method-assign]
                        c, s = await B.timed(n, call), B.spun_round_trips(ring, payload, n)
                        r1, r8 = await B.throughput(progs, payload, 1, nt), await B.throughput(progs, payload, 8, nt)
                        print(f"{rnd} {name:20} call {us(c, .5):5.2f}/{us(c, .99):5.1f}  spin {us(s, .5):5.2f}/"
                              f"{us(s, .99):5.1f} us  1 outstanding {r1 / 1e3:4.0f} k/s, 8 {r8 / 1e3:4.0f} k/s"
                              f" ({r8 / r1:.2f}x)", flush=True)
            finally:
                Ring.spin, Calls.call = AS_IS, CALL  # type: ignore[method-assign]


# ---- hold ----------------------------------------------------------------------------------------
async def hold(bench: B.Bench) -> None:
    nt = bench.n(20000, 100)
    async with await bench.backend("mps", pool=2) as b, B.echo_loaded(bench, b) as (progs, _):
        payload, as_is = bytes(range(64)), Calls.HOLD
        try:
            for rnd in range(bench.n(3, 1)):
                for every in (20e-6, 50e-6, 100e-6):
                    Calls.HOLD = every
                    r1, r8 = await B.throughput(progs, payload, 1, nt), await B.throughput(progs, payload, 8, nt)
                    print(f"{rnd} a yield every {every * 1e6:3.0f} us: 1 outstanding {r1 / 1e3:4.0f} k/s,"
                          f" 8 {r8 / 1e3:4.0f} k/s ({r8 / r1:.2f}x)", flush=True)
        finally:
            Calls.HOLD = as_is


# ---- modes ---------------------------------------------------------------------------------------
async def echo_spin(bench: B.Bench, b: Any, n: int) -> list[float]:
    """echo's host-spin round trips at 64 B (seconds), echo loaded for them and unloaded."""
    async with B.echo_loaded(bench, b) as (_, ring):
        return B.spun_round_trips(ring, bytes(range(64)), n)


async def modes(bench: B.Bench) -> None:
    n = bench.n(3000, 100)
    for rnd in range(bench.n(3, 1)):
        async with await bench.backend("mps", pool=2) as b:
            fl = await B.ring_floor(bench, b, bench.n(10000, 500))
            mps = await echo_spin(bench, b, n)
        async with await bench.backend("blink") as b:
            blink = await echo_spin(bench, b, n)
        print(f"{rnd} floor 64 B {us(fl[64], .5):.2f}/{us(fl[64], .99):.2f} | echo's host spin, 64 B: MPS worker"
              f" {us(mps, .5):.2f}/{us(mps, .99):.2f}, blink context {us(blink, .5):.2f}/{us(blink, .99):.2f} us", flush=True)


# ---- mps-floor -----------------------------------------------------------------------------------
ALLOC = "host = ck(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))"
REGISTERED = """import mmap
_fd = os.memfd_create("floor"); os.ftruncate(_fd, 1 << 20); _mm = mmap.mmap(_fd, 1 << 20)
_anchor = (ctypes.c_char * (1 << 20)).from_buffer(_mm); host = ctypes.addressof(_anchor)
ck(cu.cuMemHostRegister(host, 1 << 20, cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE))"""


async def mps_floor(bench: B.Bench) -> None:
    assert ALLOC in F.FLOOR_CUDA, "the floor's host no longer allocates as this probe expects"
    async with await bench.backend("mps", pool=2) as b:
        env = {**os.environ, **b.native_env()}
        for rnd in range(bench.n(3, 1)):
            plain = await B.ring_floor(bench, b, bench.n(10000, 500))
            client = await B.ring_floor(bench, b, bench.n(10000, 500), env=env)
            alloc = F.FLOOR_CUDA
            F.FLOOR_CUDA = alloc.replace(ALLOC, "import os\n" + REGISTERED)
            try:
                reg = await B.ring_floor(bench, b, bench.n(10000, 500), env=env)
            finally:
                F.FLOOR_CUDA = alloc
            s = await echo_spin(bench, b, bench.n(3000, 100))

            def f(d: dict[int, list[float]], k: int) -> str:
                return f"{us(d[k], .5):.2f}/{us(d[k], .99):.2f}"

            print(f"{rnd} floor, a plain context: 0 B {f(plain, 0)}, 64 B {f(plain, 64)} | an MPS client: 0 B"
                  f" {f(client, 0)}, 64 B {f(client, 64)} | the same on registered memory: 0 B {f(reg, 0)}, 64 B"
                  f" {f(reg, 64)} | echo's host spin, 64 B {us(s, .5):.2f}/{us(s, .99):.2f} us", flush=True)


PROBES: dict[str, Callable[[B.Bench], Awaitable[None]]] = {"ask": ask, "ask-cpu": ask_cpu, "ring-ab": ring_ab, "hold": hold,
                                                            "modes": modes, "mps-floor": mps_floor}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=sorted(PROBES), nargs="+", help="one or more, run in turn")
    ap.add_argument("--gpu", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("--loop", choices=eventloop.CHOICES, default="asyncio",
                    help="the event loop (default asyncio, as the probes in docs/runs ran; serve's is auto)")
    a = ap.parse_args()
    try:
        loop = eventloop.factory(a.loop)[0]
    except eventloop.LoopError as e:
        sys.exit(f"ring_probes.py: {e}")
    bench = B.Bench(a.gpu, a.gpu == "sim", None)

    async def run() -> Any:
        try:
            for which in a.which:
                print(f"== {which}", flush=True)
                await PROBES[which](bench)
        finally:
            bench.cleanup()

    print(f"loop: {loop}", flush=True)
    eventloop.run(run, a.loop)


if __name__ == "__main__":
    main()
