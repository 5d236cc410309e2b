"""Fault recovery in blink mode: the cases run on the simulated GPU (tests/rig/test_restart.py) and on
the H200 (tests/gpu/test_reliability_real.py).  ``warm``: the beats seen before the fault; ``more``:
the beats to see after the recovery."""

from __future__ import annotations

import functools
import os
import signal
import sys

from meshd_mps.backend import Backend
from meshd_mps.programs import RECOVERY_STEPS, Programs

from ..rigs.backend import beats, example
from ..rigs.deadlines import QUICK_RESTARTS
from ..rigs.waits import until as _until

until = functools.partial(_until, within=30.0)  # test_restart.py's waits: 30 s

QUICK = QUICK_RESTARTS


async def heartbeat_and_echo(b: Backend, warm: int):
    """heartbeat and echo running on ``b``: (programs, heartbeat, the blink context's pid)."""
    progs = Programs(b)
    hb = await progs.load(*example("heartbeat"))
    await progs.load(*example("echo"))
    await beats(b, hb.slot, warm)
    return progs, hb, b.isolations[0].proc.pid


async def blink_fault_case(gpu: str, warm: int, more: int) -> None:
    """A fault in the one context fails every program of it (the error is sticky): the context is
    retired, a new one started (held ahead, during the teardown), and the innocents relaunched in
    it; the culprit is the one whose slot says it ran to its end (EXITED) and failed."""
    async with await Backend.open(isolation="blink", gpu=gpu, deadlines=QUICK) as b:
        progs, hb, ctx = await heartbeat_and_echo(b, warm)
        await progs.load(*example("fault"), restart="never")
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        print(f"blink fault report: {r}", file=sys.stderr)
        assert r.gpu_wide and r.faulted == "fault" and r.by == "ended" and "ILLEGAL_ADDRESS" in r.error, r
        assert sorted(r.lost) == ["echo", "heartbeat"] and sorted(r.relaunched) == ["echo", "heartbeat"]
        assert list(r.steps) == list(RECOVERY_STEPS)
        new = b.isolations[0].proc.pid
        assert new != ctx and ctx not in b.sup.live()
        rows = {p["name"]: p for p in progs.list()}
        assert rows["fault"]["state"] == "faulted" and rows["heartbeat"]["restarts"] == 1
        assert rows["heartbeat"]["pid"] == rows["echo"]["pid"] == new
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + more)
        assert await progs.call("echo", b"new context") == b"new context"
        await progs.unload("fault")
        await progs.close()


async def blink_killed_case(gpu: str, warm: int, more: int) -> None:
    """The context's worker SIGKILLed from outside: no program is the culprit, the worker is; every
    program is relaunched in a new context."""
    async with await Backend.open(isolation="blink", gpu=gpu, deadlines=QUICK) as b:
        progs, hb, ctx = await heartbeat_and_echo(b, warm)
        os.kill(ctx, signal.SIGKILL)
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        print(f"blink context killed: {r}", file=sys.stderr)
        assert r.faulted == f"worker {ctx}" and r.by == "stray" and sorted(r.relaunched) == ["echo", "heartbeat"], r
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + more)
        assert await progs.call("echo", b"x") == b"x"
        await progs.close()
