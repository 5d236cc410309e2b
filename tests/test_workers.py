"""The worker handle, retire, cleanup, the pool and client checks: real worker
processes over real pipes, a simulated GPU, the stand-in MPS daemon."""

from __future__ import annotations

import asyncio
import os
import time

import anyio
import pytest
from structlog.testing import capture_logs

from meshd_mps import mps as mpsmod
from meshd_mps.errors import LimitError, MpsError, WorkerError
from meshd_mps.proc import Deadlines

from .conftest import sim
from .procs import alive

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


async def preload(m, name="prog", **script):
    return await m.preload(name, sim(**script), 32, 0, 0)


async def test_prewarm_load_launch_done_and_reuse(rig):
    async with rig(pool_cap=2) as m:
        with capture_logs() as logs:
            await m.prewarm(2)
        pooled = set(m.pool.pids())
        assert len(pooled) == 2 and len(m.pool) == 2
        assert any("pool of 2 idle workers" in e["event"] and "ready in" in e["event"] for e in logs)
        w = await preload(m, kernel="sleep", ms=20)
        assert w.proc.pid in pooled and not w.fresh
        assert w.info.sms == 132 and w.info.rt_abi == 1
        done = await mpsmod.launch(w, slot=3, nodes=1)
        assert not mpsmod.query(w) or done.done()
        d = await asyncio.wait_for(done, 10)
        assert d.ok and d.gen == 1 and mpsmod.query(w)
        assert await m.drop(w)
        assert w.proc.pid in m.pool.pids()
        again = await preload(m, kernel="sleep")
        assert again.proc.pid in pooled  # the same process serves the next image


async def test_fresh_worker_is_verified_as_client(rig):
    async with rig(pool_cap=0) as m:
        w = await preload(m, "fresh")
        assert w.fresh and m.server is not None
        assert w.proc.pid in await m.clients(m.server)
        assert not await m.drop(w)  # cap 0: retired, not kept


async def test_pool_cap_keeps_one_retires_other(rig):
    async with rig(pool_cap=1) as m:
        a = await preload(m, "a")
        b = await preload(m, "b")
        assert await m.drop(a)
        assert not await m.drop(b)
        assert m.pool.pids() == [a.proc.pid]
        with anyio.fail_after(10):
            await b.proc.exited.wait()
            await b.proc.process.wait()
        assert b.proc.process.returncode == 0  # it obeyed QUIT


async def test_worker_not_our_client_is_refused(rig, monkeypatch):
    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")
    async with rig(pool_cap=2) as m:
        with pytest.raises(MpsError, match=r"our daemon runs no server: they are not MPS clients; refusing"):
            await m.prewarm(2)
        assert len(m.pool) == 0
        monkeypatch.delenv("MESHD_MPS_SIM_STARTUP")
        await m.prewarm(1)  # a real client starts the server
        monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")
        with pytest.raises(MpsError, match=r"mps: worker \d+ is not among server \d+'s clients \[\d+\]; refusing"):
            await preload(m, "x") if len(m.pool) == 0 else await m.prewarm(1)


async def test_load_deadline(rig):
    async with rig(deadlines=Deadlines(load=1.0, retire_quit=0.5)) as m:
        with pytest.raises(WorkerError, match=r"load: worker (\d+): no reply in 1s"):
            await preload(m, "slow", load="hang")
        assert m.sup.workers == {}  # retired


async def test_ready_deadline(rig, monkeypatch):
    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "hang")
    async with rig(deadlines=Deadlines(ready=1.0, retire_quit=0.5)) as m:
        with pytest.raises(WorkerError, match=r"mps: pool: worker \d+: no reply in 1s"):
            await m.prewarm(1)


async def test_launch_deadline(rig):
    async with rig(deadlines=Deadlines(launch=1.0, retire_quit=0.5)) as m:
        w = await preload(m, "stuck", launch="hang")
        with pytest.raises(WorkerError, match=r"^stuck \(worker \d+: no reply in 1s\)$"):
            await mpsmod.launch(w, 0, 1)
        assert not w.proc.idle()


@pytest.mark.parametrize("phase", ["startup", "load", "launch", "kernel"])
async def test_worker_dies(rig, monkeypatch, phase):
    if phase == "startup":
        monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "exit")
        async with rig() as m:
            with pytest.raises(WorkerError, match=r"mps: pool: worker \d+ exited"):
                await m.prewarm(1)
        return
    async with rig() as m:
        if phase == "load":
            with pytest.raises(WorkerError, match=r"load: worker \d+ exited"):
                await preload(m, "p", load="exit")
            return
        if phase == "launch":
            w = await preload(m, "p", launch="exit")
            with pytest.raises(WorkerError, match=r"^p \(worker \d+ exited\)$"):
                await mpsmod.launch(w, 0, 1)
            return
        w = await preload(m, "p", kernel="exit")
        done = await mpsmod.launch(w, 0, 1)
        with pytest.raises(WorkerError, match=r"worker \d+ exited while its kernel ran"):
            await asyncio.wait_for(done, 10)
        with pytest.raises(WorkerError, match=r"^p: worker \d+ exited while its kernel ran$"):
            mpsmod.query(w)
        assert not await m.drop(w)


async def test_stream_error_is_reported_and_worker_not_reused(rig):
    async with rig() as m:
        w = await preload(m, "bad", kernel="fail", message="CUDA_ERROR_LAUNCH_FAILED: oops")
        d = await asyncio.wait_for(await mpsmod.launch(w, 0, 1), 10)
        assert not d.ok and d.message == "CUDA_ERROR_LAUNCH_FAILED: oops"
        with pytest.raises(WorkerError, match=r"^bad: worker \d+: CUDA_ERROR_LAUNCH_FAILED: oops$"):
            mpsmod.query(w)
        assert not await m.drop(w)
        assert w.proc.pid not in m.pool.pids()


@pytest.mark.parametrize(
    "how, why",
    [
        ("garbage", r"bad frame: frame length \d+ is over the"),
        ("wrong-op", r"reply LAUNCHED, expected LOADED"),
        ("short", r"bad frame: LOADED reply of 1 bytes, no ok word"),
        ("close-stdout", r"worker \d+ exited"),
    ],
)
async def test_garbage_replies_retire_the_worker(rig, how, why):
    async with rig(deadlines=Deadlines(retire_quit=0.5)) as m:
        with pytest.raises(WorkerError, match=why):
            await preload(m, "liar", load=how)
        assert m.sup.workers == {}


async def test_unsolicited_reply_makes_worker_unfit(rig):
    async with rig() as m:
        w = await preload(m, "chatty", launch="unsolicited")
        done = await mpsmod.launch(w, 0, 1)  # answered, then a READY nobody asked for
        with anyio.fail_after(10):
            await w.proc.exited.wait()  # retired at once
        assert w.proc.unfit == f"worker {w.proc.pid}: bad frame: unsolicited reply READY"
        assert not w.proc.idle() and w.proc.pid not in m.sup.workers
        assert done.done()


async def test_worker_ignoring_quit_is_killed(rig):
    async with rig(deadlines=Deadlines(retire_quit=0.5, retire_kill=2.0), pool_cap=0) as m:
        w = await preload(m, "stubborn", quit="ignore")
        with capture_logs() as logs:
            assert not await m.drop(w)
            with anyio.fail_after(10):
                await w.proc.process.wait()
            with anyio.fail_after(5):
                while not any("exited" in e["event"] for e in logs):
                    await anyio.sleep(0.01)
        assert w.proc.process.returncode == -9
        assert any(f"mps: worker {w.proc.pid} did not exit in 0.5 s; killing it" == e["event"] for e in logs)


async def test_cleanup_kills_everything_within_its_deadline(rig):
    r = rig(pool_cap=2)
    async with r as m:
        await m.prewarm(2)
        busy = await preload(m, "busy", kernel="hang", quit="ignore")
        await mpsmod.launch(busy, 0, 1)
        pids = r.sup.children()
        assert len(pids) == 2
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
    assert not any(alive(p) for p in pids)
    assert r.sup.left_behind == []
    assert not os.path.exists(r.daemon.dir)


async def test_client_limit_refuses_a_load(rig):
    async with rig(max_clients=2, pool_cap=0) as m:
        a = await preload(m, "a")
        b = await preload(m, "b")
        with pytest.raises(LimitError, match=r"2 clients already: the MPS server takes at most 2 .*for c"):
            await preload(m, "c")
        assert a.proc.idle() and b.proc.idle()


async def test_spawning_many_does_not_freeze_the_loop(rig):
    gaps = []

    async def ticker():
        last = time.monotonic()
        while True:
            await anyio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with rig(pool_cap=8) as m:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await m.prewarm(8)
            tg.cancel_scope.cancel()
        assert len(m.pool) == 8
    assert max(gaps) < 1.0, f"the loop stalled {max(gaps):.3f} s while spawning"


async def test_daemon_killed_underneath(rig):
    r = rig(pool_cap=0)
    async with r as m:
        w = await preload(m, "before")
        assert r.daemon.pid is not None
        os.kill(r.daemon.pid, 9)
        with anyio.fail_after(30):
            with pytest.raises((MpsError, WorkerError), match=r"Cannot find MPS control daemon process|MPS_RPC_FAILURE|exited"):
                await preload(m, "after")  # a fresh worker cannot be verified: refused, no hang
        await m.drop(w)
    # the server it left behind was re-parented to us and reaped at close (no_child_left checks)


async def test_spawn_failing_is_a_clear_error_and_leaks_nothing(rig, monkeypatch):
    fds = len(os.listdir("/proc/self/fd"))
    async with rig(pool_cap=0) as m:
        monkeypatch.setattr(mpsmod, "worker_argv", lambda *a: ["/nonexistent/meshd-mps-worker"])
        with pytest.raises(WorkerError, match=r"^load: mps worker: /nonexistent/meshd-mps-worker: No such file or directory$"):
            await preload(m, "nobin")
        monkeypatch.undo()
        w = await preload(m, "after")  # the next load works
        await m.drop(w)
    assert len(os.listdir("/proc/self/fd")) <= fds  # no pipe left open


async def test_no_mps_binary_on_path(monkeypatch, tmp_path):
    from meshd_mps.daemon import ControlDaemon

    monkeypatch.setenv("PATH", str(tmp_path))
    d = ControlDaemon(str(tmp_path / "mps"), temporary=True)
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control not found on PATH"):
        await d.start()


async def test_mps_dir_removed_underneath(rig):
    import shutil

    r = rig(pool_cap=1)
    async with r as m:
        await m.prewarm(1)
        shutil.rmtree(r.daemon.dir)  # the daemon's sockets are gone with it
        a = await preload(m, "a")  # a pooled worker was verified when it started
        with anyio.fail_after(30):
            with pytest.raises(MpsError, match="Cannot find MPS control daemon process"):
                await preload(m, "b")  # a fresh one cannot be verified any more: refused, no hang
        assert a.proc.idle()
    assert not os.path.exists(r.daemon.dir)
