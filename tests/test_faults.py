"""GPU-fault recovery in MPS mode, on the simulated GPU: the stand-in server tears
every client down when one faults, as the H200's does (probe/RESULTS.md)."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.programs import Programs

from .conftest import TEST_DEADLINES
from .test_backend import beats, example

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


async def wait_for(cond, within=20.0):
    with anyio.fail_after(within):
        while not cond():
            await anyio.sleep(0.01)


@pytest.mark.parametrize("restart", [True, False])
async def test_fault_is_survived_and_innocents_relaunched(standin_on_path, restart):
    async with await Backend.open(isolation="mps", gpu="sim", pool=2, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b, restart=restart)
        hb = await progs.load(*example("heartbeat"))
        await progs.load(*example("echo"))
        await beats(b, hb.slot, 10)
        old_pids = {p.kernel.pid for p in progs.by_name.values()} | set(b.mps.pool.pids())
        await progs.load(*example("fault"))
        await wait_for(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        assert r.gpu_wide and r.faulted == "fault" and "ILLEGAL_ADDRESS" in r.error
        assert sorted(r.lost) == ["echo", "heartbeat"]
        states = {row["name"]: row for row in progs.list()}
        assert states["fault"]["state"] == "faulted"
        if restart:
            assert sorted(r.relaunched) == ["echo", "heartbeat"] and r.not_relaunched == {}
            assert states["heartbeat"]["state"] == "running" and states["heartbeat"]["restarts"] == 1
            new_pids = {progs.by_name[n].kernel.pid for n in ("heartbeat", "echo")}
            assert not new_pids & old_pids  # fresh workers
            n = b.mailbox.heartbeat(hb.slot)
            await beats(b, hb.slot, n)
            assert await progs.call("echo", b"after the fault") == b"after the fault"
            assert len(b.mps.pool) == 2  # refilled
        else:
            assert r.relaunched == [] and set(r.not_relaunched) == {"echo", "heartbeat"}
            assert states["heartbeat"]["state"] == "failed"
        await progs.unload("fault")
        await progs.close()


@pytest.mark.parametrize("how", ["retired", "sigkilled"])
async def test_a_failure_that_is_not_a_fault_stays_local(standin_on_path, how):
    """A program's worker dies (retired, or SIGKILLed while its kernel runs) with no GPU fault:
    only that program fails, with the worker's death (or, retired, the server's termination of
    its client, done before a worker with a running kernel exits) as its error; the others never stop and are
    not restarted; the dead worker is reaped and forgotten at once; the pool refills and serves the
    next load; the failed program unloads."""
    async with await Backend.open(isolation="mps", gpu="sim", pool=1, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        victim = await progs.load(*example("echo"))  # resident: it runs until halted, or until its worker dies
        pid = victim.kernel.pid
        if how == "retired":
            b.sup.retire(victim.kernel.worker.proc)
        else:
            os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: progs.faults)
        r = progs.faults[-1]
        assert not r.gpu_wide and r.faulted == "echo" and r.pid == pid and r.lost == [] and r.relaunched == []
        if how == "retired":  # terminated by the server first (Mps.terminate), as on the H200
            assert r.error == "CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS client has been terminated by the server (simulated)"
        else:
            assert r.error == f"worker {pid} exited while its kernel ran"
        rows = {row["name"]: row for row in progs.list()}
        assert rows["echo"]["state"] == "failed" and rows["echo"]["error"] == r.error
        assert rows["heartbeat"]["state"] == "running" and rows["heartbeat"]["restarts"] == 0
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n)  # the other program never stopped
        assert progs.by_name["heartbeat"].kernel.pid == hb.kernel.pid
        await wait_for(lambda: pid not in b.sup.children() and pid not in b.sup.live() and not os.path.exists(f"/proc/{pid}"))
        await b.mps.prewarm(b.mps.pool.cap - len(b.mps.pool))  # the pool refills ...
        spin = await progs.load(*example("spin"))  # ... and serves the next load
        assert not spin.kernel.worker.fresh
        with anyio.fail_after(10):
            assert (await spin.launch.wait()).ok  # spin: 100 ms, then it returns
        await progs.unload("echo")
        await progs.close()
