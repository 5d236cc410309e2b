"""GPU-fault recovery in MPS mode, on the simulated GPU: the stand-in server tears
every client down when one faults, as the H200's does (probe/RESULTS.md)."""

from __future__ import annotations

import dataclasses
import os
import signal

import anyio
import pytest

from meshd_mps.base.errors import WorkerError
from meshd_mps.programs import RECOVERY_STEPS, Programs, ProgramState
from workers.sim_gpu import EXIT_LINGER_ENV

from ..rigs.backend import beats, example, into, kill_in_launch, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.procs import children
from ..rigs.waits import until

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


@pytest.mark.parametrize("policy", ["on-failure", "never"])
async def test_fault_is_survived_and_innocents_relaunched(standin_on_path, policy):
    """The innocents come back under on-failure, not under never; the culprit (never, so that it
    faults once) stays faulted; the pool refills once the lost programs are back."""
    restart = policy == "on-failure"
    async with await open_sim("mps", pool=2, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b, restart=policy)
        hb = await progs.load(*example("heartbeat"))
        await progs.load(*example("echo"))
        await beats(b, hb.slot, 10)
        old_pids = {p.kernel.pid for p in progs.by_name.values()} | set(b.isolations[0].pool.pids())
        await progs.load(*example("fault"), restart="never")
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
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
            await until(lambda: len(b.isolations[0].pool) == 2)  # refilled, paced, after the relaunch
            assert list(r.steps) == list(RECOVERY_STEPS) and abs(sum(r.steps.values()) - r.ms) < 5, r.steps
        else:
            assert r.relaunched == [] and r.not_relaunched == {"echo": "restart policy never",
                                                               "heartbeat": "restart policy never"}
            assert states["heartbeat"]["state"] == "failed"
        await progs.unload("fault")
        await progs.close()


async def test_a_retired_worker_stays_local(standin_on_path):
    """A program's worker retired with its kernel running (a hung LAUNCH reply, an unfit worker):
    the server terminates its client first (Mps.terminate, as the H200 needs), so only that
    program fails, with the server's termination as its error; the others never stop and are
    not restarted; the dead worker is reaped and forgotten at once; the pool refills and serves the
    next load; the failed program unloads."""
    # pool 2: a load takes one, never the last (the pool's reserve, kept for upgrades);
    # the terminate_client given time even on a loaded machine (a stand-in control command is a
    # Python start): past retire_quit the worker is retired anyway and, its kernel running, it
    # faults the GPU, as on the H200, which is another test's subject
    slow = dataclasses.replace(TEST_DEADLINES, retire_quit=15.0)
    async with await open_sim("mps", pool=2, deadlines=slow) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        # resident: it runs until halted, or until its worker dies; never: it stays failed
        victim = await progs.load(*example("echo"), restart="never")
        pid, hb_pid = victim.kernel.pid, hb.kernel.pid
        b.sup.retire(victim.kernel.proc)
        await until(lambda: progs.faults)
        r = progs.faults[-1]
        assert not r.gpu_wide and r.faulted == "echo" and r.pid == pid and r.lost == [] and r.relaunched == []
        assert r.error == "CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS client has been terminated by the server (simulated)"
        rows = {row["name"]: row for row in progs.list()}
        assert rows["echo"]["state"] == "failed" and rows["echo"]["error"] == r.error
        assert rows["heartbeat"]["state"] == "running" and rows["heartbeat"]["restarts"] == 0
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n)  # the other program never stopped
        assert progs.by_name["heartbeat"].kernel.pid == hb_pid
        await until(lambda: pid not in b.sup.children() and pid not in b.sup.live() and not os.path.exists(f"/proc/{pid}"))
        pool = b.isolations[0].pool
        await b.isolations[0].prewarm(pool.cap - len(pool))  # the pool refills ...
        spin = await progs.load(*example("spin"))  # ... and serves the next load
        assert not spin.kernel.module.fresh
        with anyio.fail_after(10):
            assert (await spin.launch.wait()).ok  # spin: 100 ms, then it returns
        await progs.unload("echo")
        await progs.close()


async def test_a_worker_killed_in_a_loads_launch_is_a_gpu_fault(standin_on_path, monkeypatch):
    """A worker SIGKILLed during its LAUNCH (the kernel launched, the reply not yet written), no
    program's yet: the load fails with the worker's death, and as on the H200 the GPU's other
    clients are torn down.  The recovery names the load's image (its worker, not any program),
    so every program there is innocent: relaunched, none left faulted."""
    async with await open_sim("mps", pool=2, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))  # takes a pooled worker, not the reserve: echo's is fresh
        await beats(b, hb.slot, 10)
        monkeypatch.setenv("MESHD_MPS_WORKER_INJECT", "launch:hang")
        async with anyio.create_task_group() as tg:
            killed: list[int] = []
            tg.start_soon(into, killed, kill_in_launch(b, set(b.sup.workers), progs._free_slot(), monkeypatch))
            with pytest.raises(WorkerError, match=r"^echo \(worker \d+ exited\)$"):
                await progs.load(*example("echo"))
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        assert r.gpu_wide and r.faulted == "echo" and r.pid == killed[0], r
        assert r.error == f"worker {killed[0]} exited while its kernel ran"
        assert r.lost == ["heartbeat"] and r.relaunched == ["heartbeat"], r
        rows = {row["name"]: row for row in progs.list()}
        assert list(rows) == ["heartbeat"] and rows["heartbeat"]["state"] == "running"
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        await until(lambda: len(b.isolations[0].pool) == 2)  # refilled, paced, after the relaunch
        echo = await progs.load(*example("echo"))  # the load works again
        assert await progs.call("echo", b"again") == b"again" and not echo.kernel.module.fresh
        await progs.close()


@pytest.mark.parametrize("linger", [0.0, 0.3])
async def test_a_worker_killed_with_its_kernel_running_is_a_gpu_fault(standin_on_path, monkeypatch, linger):
    """A SIGKILL from outside while a program's kernel runs: on the H200 that faults every other
    client of the GPU (the server names one of *them*), and the stand-in does the same.  The
    recovery takes the killed program for the culprit (its worker exited on its own; the torn-down
    ones live on until retired), reports its death as the fault, and relaunches the others on fresh
    workers with a refilled pool; the killed one comes back with them, in the same relaunch (restart
    policy on-failure: nothing was wrong with it), and unloads.  ``linger``: the killed worker's EOF comes
    that long after its death, as on the H200, so the recovery
    takes its program over before its worker is seen gone."""
    monkeypatch.setenv(EXIT_LINGER_ENV, str(linger))
    before = children()
    async with await open_sim("mps", pool=2, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        victim = await progs.load(*example("echo"))
        await beats(b, hb.slot, 10)
        pid, hb_pid = victim.kernel.pid, hb.kernel.pid
        os.kill(pid, signal.SIGKILL)
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        print(f"fault report: {r}")
        assert r.gpu_wide and r.faulted == "echo" and r.pid == pid, r
        assert r.error == f"worker {pid} exited while its kernel ran"
        assert r.lost == ["heartbeat"] and r.relaunched == ["heartbeat", "echo"] and r.not_relaunched == {}
        with open(os.path.join(b.daemon.log_dir, "server.log")) as f:
            assert f"Client {{PID: {hb_pid}, Context: 1}} encountered a fatal GPU error." in f.read()  # an innocent named
        rows = {row["name"]: row for row in progs.list()}
        assert rows["heartbeat"]["state"] == "running" and rows["heartbeat"]["restarts"] == 1
        assert progs.by_name["heartbeat"].kernel.pid != hb_pid
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        await until(lambda: progs.by_name["echo"].restarts == 1 and progs.by_name["echo"].observe() is ProgramState.RUNNING)
        assert await progs.call("echo", b"back") == b"back" and len(progs.faults) == 1
        await until(lambda: len(b.isolations[0].pool) == 2)  # refilled
        await progs.unload("echo")
        await until(lambda: not os.path.exists(f"/proc/{pid}") and not os.path.exists(f"/proc/{hb_pid}"))
        await progs.close()
    # Each simulated worker's lingering child outlives it by ``linger``, re-parented to us (a subreaper).
    with anyio.fail_after(10):
        for pid in children() - before:
            await anyio.to_thread.run_sync(os.waitpid, pid, 0)
