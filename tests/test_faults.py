"""GPU-fault recovery in MPS mode, on the simulated GPU: the stand-in server tears
every client down when one faults, as the H200's does (probe/RESULTS.md)."""

from __future__ import annotations

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


async def test_a_failure_that_is_not_a_fault_stays_local(standin_on_path):
    async with await Backend.open(isolation="mps", gpu="sim", pool=1, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        spin = await progs.load(*example("spin"))
        b.sup.retire(spin.kernel.worker.proc)  # its worker dies: no server-wide fault
        await wait_for(lambda: progs.faults)
        r = progs.faults[-1]
        assert not r.gpu_wide and r.faulted == "spin" and r.lost == []
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n)  # the other program never stopped
        assert progs.by_name["heartbeat"].restarts == 0
        await progs.close()
