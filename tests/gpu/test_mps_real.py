"""MPS mode end to end against the REAL nvidia-cuda-mps-control and a real GPU.

Skipped, with the reason printed, where there is no NVIDIA driver or no MPS
binary (CI).  Run on the device: `python3 -m pytest tests/gpu -v -rA`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import ClientLimit, MpsError
from meshd_mps.mps.control import LOG_ENV, PIPE_ENV
from meshd_mps.programs import Programs

from ..rigs.backend import beats, example
from ..rigs.gpu import gap_while, mps_processes, skip_without_real_gpu_and_mps

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def gpu_and_mps_here():
    skip_without_real_gpu_and_mps("the MPS tests")


async def test_pool_cycles_no_stall_and_clean_exit():
    d = tempfile.mkdtemp(prefix="meshd-gpu-")
    os.rmdir(d)
    # pool 3: the two loads take one each, never the last (the pool's reserve, kept for upgrades)
    async with await Backend.open(isolation="mps", gpu="cuda", pool=3, mps_dir=d) as b:
        assert b.mps.server is not None and len(b.isolations[0].pool) == 3
        assert (os.stat(d).st_mode & 0o777) == 0o700
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 1000)
        idle_gap, _ = await gap_while(b, hb.slot, lambda: anyio.sleep(0.2))
        pooled_gap, echo = await gap_while(b, hb.slot, lambda: progs.load(*example("echo")))
        print(f"heartbeat max gap: idle {idle_gap:.1f} us, during a pooled load {pooled_gap:.1f} us", file=sys.stderr)
        assert not echo.kernel.module.fresh
        assert pooled_gap < max(10 * idle_gap, 200.0)  # measured 3 us on the H200 (probe)
        assert await progs.call("echo", b"real GPU") == b"real GPU"
        clients = await b.mps.clients(b.mps.server)
        assert hb.kernel.pid in clients and echo.kernel.pid in clients
        for _ in range(20):  # load / launch / DONE / unload cycles
            p = await progs.load(*example("spin"))
            with anyio.fail_after(10):
                d_ = await p.launch.wait()  # spin: 100 ms, then returns
            assert d_.ok, d_.message
            await progs.unload("spin")
        await progs.close()
    assert os.path.isdir(d)  # an --mps-dir of the caller's is kept (only a temporary one is removed)
    shutil.rmtree(d)
    assert mps_processes() == []


async def test_worker_not_our_client_is_refused():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=0) as b:
        elsewhere = tempfile.mkdtemp(prefix="meshd-other-")
        try:
            b.mps.worker_env = {PIPE_ENV: elsewhere, LOG_ENV: elsewhere}  # no daemon there: a plain context
            with pytest.raises(MpsError, match=r"(is not among server|runs no server)"):
                await b.prepare(*example("spin"))
        finally:
            shutil.rmtree(elsewhere, ignore_errors=True)
    assert mps_processes() == []


async def test_daemon_killed_underneath_gives_clear_errors():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1) as b:
        progs = Programs(b)
        await progs.load(*example("heartbeat"))
        os.kill(b.daemon.pid, 9)
        with anyio.fail_after(120):
            while b.daemon.alive():
                await anyio.sleep(0.01)
            with pytest.raises(MpsError, match=r"^mps: the MPS control daemon \d+ died \(killed by SIGKILL\)"):
                await progs.load(*example("echo"))
        await progs.close()
    assert mps_processes() == []


async def test_gpu_fault_is_survived():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await progs.load(*example("echo"))
        await beats(b, hb.slot, 1000)
        await progs.load(*example("fault"), restart="never")
        with anyio.fail_after(120):
            while not (progs.faults and progs.faults[-1].ms > 0):
                await anyio.sleep(0.01)
        r = progs.faults[-1]
        print(f"fault report: {r}", file=sys.stderr)
        for name in ("server.log", "control.log"):
            with open(os.path.join(b.daemon.log_dir, name)) as f:
                noise = ("connected", "worker thread", "new client request", "is associated", "is ACTIVE")
                lines = [ln for ln in f if not any(w in ln for w in noise)]
            print(f"{name}:\n" + "".join(lines[-40:]), file=sys.stderr)
        assert r.gpu_wide and r.faulted == "fault" and "ILLEGAL_ADDRESS" in r.error
        assert sorted(r.relaunched) == ["echo", "heartbeat"], r.not_relaunched
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n + 100)
        assert await progs.call("echo", b"survived") == b"survived"
        await progs.close()
    assert mps_processes() == []


async def test_client_limit_is_counted():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=48) as b:
        assert len(await b.mps.clients(b.mps.server)) == 48  # the server takes 48 (CUDA 13.0)
        with pytest.raises(ClientLimit, match=r"48 clients already: the MPS server takes at most 48"):
            await b.mps.spawn("one too many", 0)
    assert mps_processes() == []


async def test_blink_mode_real():
    async with await Backend.open(isolation="blink", gpu="cuda") as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 1000)
        await progs.load(*example("echo"))
        assert b.isolations[0].blinks == 1
        print(f"blink: {b.isolations[0].last_blink_ms:.2f} ms", file=sys.stderr)
        limit = await b.stack_limit()
        assert limit > 0 and await b.stack_limit(limit * 2) == limit * 2  # cuCtxSet/GetLimit in the context
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n + 100)  # relaunched
        assert await progs.call("echo", b"blink") == b"blink"
        await progs.close()
