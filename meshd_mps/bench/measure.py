"""How the rows measure, shared so that a figure and its baseline are taken the same way:
percentiles and medians, waits under a deadline (a hot yield, then 1 ms sleeps; a host spin for the
baselines), timed repetitions, a launch and its DONE, a heartbeat's next beat, a process's VmRSS."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from meshd_mps.backend import Backend
from meshd_mps.isolation.base import Module
from meshd_mps.protocol import abi


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


#: Rounds of (f) and of (b)'s concurrent asks: each figure is the median of its rounds, each round's
#: value beside its baseline from the same round.  The lent GPU host is a shared VM whose speed moves
#: by 1.5x within seconds (docs/runs/ring-and-control-path.md): one round is a coin toss near a target.
ROUNDS = 5


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


async def until(pred: Any, within: float, what: str) -> None:
    """Wait for pred(): a hot yield for 5 ms (asyncio sleeps round up to 1 ms), then 1 ms sleeps."""
    t0 = time.perf_counter()
    while not pred():
        dt = time.perf_counter() - t0
        if dt > within:
            raise TimeoutError(f"{what}: not within {within:g} s")
        await asyncio.sleep(0 if dt < 0.005 else 0.001)


def spin(pred: Any, within: float, what: str) -> None:
    """A host busy-wait (for the baselines), bounded."""
    end = time.perf_counter() + within
    while not pred():
        if time.perf_counter() > end:
            raise TimeoutError(f"{what}: not within {within:g} s")


async def timed(n: int, f: Any, warm: int = 10) -> list[float]:
    """Seconds each of n ``await f()`` took (or the float f returns), after ``warm`` untimed ones."""
    out = []
    for i in range(n + warm):
        t0 = time.perf_counter()
        r = await f()
        if i >= warm:
            out.append(r if isinstance(r, float) else time.perf_counter() - t0)
    return out


async def launch_sync(w: Module, slot: int, ask_only: bool = False) -> float:
    """LAUNCH of w's kernel (the launch path: Module.start), then its DONE: seconds to LAUNCHED (ask_only) or to DONE."""
    t0 = time.perf_counter()
    done = await w.start(slot, 1)
    t1 = time.perf_counter()
    d = await done  # no scope of its own (it would cost the concurrent row loop time): the section's deadline holds
    if not d.ok:
        raise RuntimeError(f"{w.name} on worker {w.proc.pid}: DONE says {d.message}")
    return t1 - t0 if ask_only else time.perf_counter() - t0


async def beat(b: Backend, slot: int, reset: bool = False) -> None:
    """The heartbeat's next beat; with ``reset`` the beat that zeroed MAX_GAP (GAP_RESET)."""
    mb, n = b.mailbox, b.mailbox.heartbeat(slot)
    if reset:
        mb.set_u32(slot, abi.GAP_RESET, 1)
        await until(lambda: mb.u32(slot, abi.GAP_RESET) == 0, 10, "the heartbeat to zero MAX_GAP")
    else:
        await until(lambda: mb.heartbeat(slot) > n, 10, "the heartbeat's next beat")


def vmrss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def gpu_mib(gpu: str, pids: list[int], device: int = 0) -> float | None:
    """The median GPU memory NVML says ``pids`` use on ``device`` (MiB); None on the simulated GPU,
    where NVML is not there, or where it does not say for these processes."""
    if gpu != "cuda" or not pids:
        return None
    from meshd_mps.base.errors import DeviceError, NvmlUnavailable
    from meshd_mps.gpu.nvml import Nvml

    try:
        with Nvml.open() as nvml:
            used = {p.pid: p.used_bytes for p in nvml.view(device).processes}
    except (NvmlUnavailable, DeviceError):
        return None
    got = [u / 2**20 for pid in pids if (u := used.get(pid)) is not None]
    return median(got) if got else None
