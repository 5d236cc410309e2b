"""The worker handle, retire, cleanup, the pool and client checks: real worker
processes over real pipes, a simulated GPU, the stand-in MPS daemon."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import pytest
from structlog.testing import capture_logs

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import ClientLimit, MeshError, MpsError, WorkerError
from meshd_mps.mps import clients as mpsmod
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Op

from ..rigs.deadlines import HANGS, NO_REPLY, RETIRE
from ..rigs.mps import DAEMON_DIED
from ..rigs.procs import alive, fds_exhausted
from ..rigs.sim import sim
from ..rigs.waits import until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


async def preload(m, name="prog", **script):
    return await m.preload(name, sim(**script), 32, 0, 0)


async def start_bystander(r, m):
    """A heartbeat on slot BYSTANDER in its own worker, beating: (its Worker, its DONE's future)."""
    by = await preload(m, "bystander", kernel="heartbeat")
    r.mailbox.run(BYSTANDER)
    by_done = await by.start(BYSTANDER, 1)
    await beating(r.mailbox, BYSTANDER)
    return by, by_done


async def test_prewarm_load_launch_done_and_reuse(mps_rig):
    async with mps_rig(pool_cap=2) as m:
        with capture_logs() as logs:
            await m.prewarm(2)
        pooled = set(m.pool.pids())
        assert len(pooled) == 2 and len(m.pool) == 2
        assert any("pool of 2 idle workers" in e["event"] and "ready in" in e["event"] for e in logs)
        w = await preload(m, kernel="sleep", ms=20)
        assert w.proc.pid in pooled and not w.fresh
        assert w.info.sms == 132 and w.info.rt_abi == 1
        done = await w.start(slot=3, nodes=1)
        assert not w.query() or done.done()
        d = await asyncio.wait_for(done, 10)
        assert d.ok and d.gen == 1 and w.query()
        assert await m.give_back(w)
        assert w.proc.pid in m.pool.pids()
        again = await preload(m, kernel="sleep")
        assert again.proc.pid in pooled  # the same process serves the next image


async def test_asks_at_once_to_one_worker_are_answered_in_order(mps_rig):
    # The supervisor writes each ask at once (no lock: replies are matched in order); a real worker
    # reads them back to back off its pipe and answers each, in order.
    async with mps_rig() as m:
        w = await preload(m, kernel="sleep", ms=0)
        p = w.proc
        first, done, last = await asyncio.gather(p.ask(Op.READY), w.start(slot=5, nodes=1), p.ask(Op.READY))
        assert frames.ready_pid(first) == frames.ready_pid(last) == p.pid
        d = await asyncio.wait_for(done, 10)
        assert d.ok and d.gen == 1 and not p.asking and p.unfit is None


async def test_fresh_worker_is_verified_as_client(mps_rig):
    async with mps_rig(pool_cap=0) as m:
        w = await preload(m, "fresh")
        assert w.fresh and m.mps.server is not None
        assert w.proc.pid in await m.mps.clients(m.mps.server)
        assert not await m.give_back(w)  # cap 0: retired, not kept


async def test_pool_cap_keeps_one_retires_other(mps_rig):
    async with mps_rig(pool_cap=1) as m:
        a = await preload(m, "a")
        b = await preload(m, "b")
        assert await m.give_back(a)
        assert not await m.give_back(b)
        assert m.pool.pids() == [a.proc.pid]
        with anyio.fail_after(10):
            await b.proc.exited.wait()
            await b.proc.process.wait()
        assert b.proc.process.returncode == 0  # it obeyed QUIT


async def test_worker_not_our_client_is_refused(mps_rig, monkeypatch):
    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")
    async with mps_rig(pool_cap=2) as m:
        with pytest.raises(MpsError, match=r"our daemon runs no server: they are not MPS clients; refusing"):
            await m.prewarm(2)
        assert len(m.pool) == 0
        monkeypatch.delenv("MESHD_MPS_SIM_STARTUP")
        await m.prewarm(1)  # a real client starts the server
        monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")
        with pytest.raises(MpsError, match=r"mps: worker \d+ is not among server \d+'s clients \[\d+\]; refusing"):
            await preload(m, "x") if len(m.pool) == 0 else await m.prewarm(1)


async def test_ready_deadline(mps_rig, monkeypatch):
    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "hang")
    async with mps_rig(deadlines=Deadlines(ready=1.0, retire_quit=0.5)) as m:
        with pytest.raises(WorkerError, match=r"mps: pool: worker \d+: no reply in 1s"):
            await m.prewarm(1)


async def test_worker_dies_at_startup(mps_rig, monkeypatch):
    """A worker that exits before its READY fails the prewarm, naming it; nothing is pooled."""
    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "exit")
    async with mps_rig() as m:
        with pytest.raises(WorkerError, match=r"^mps: pool: worker \d+ exited$"):
            await m.prewarm(1)
        assert len(m.pool) == 0


async def test_stream_error_is_reported_and_worker_not_reused(mps_rig):
    async with mps_rig() as m:
        w = await preload(m, "bad", kernel="fail", message="CUDA_ERROR_LAUNCH_FAILED: oops")
        d = await asyncio.wait_for(await w.start(0, 1), 10)
        assert not d.ok and d.message == "CUDA_ERROR_LAUNCH_FAILED: oops"
        with pytest.raises(WorkerError, match=r"^bad: worker \d+: CUDA_ERROR_LAUNCH_FAILED: oops$"):
            w.query()
        assert not await m.give_back(w)
        assert w.proc.pid not in m.pool.pids()


async def test_unsolicited_reply_makes_worker_unfit(mps_rig):
    async with mps_rig() as m:
        w = await preload(m, "chatty", launch="unsolicited")
        done = await w.start(0, 1)  # answered, then a READY nobody asked for
        with anyio.fail_after(10):
            await w.proc.exited.wait()  # retired at once
        assert w.proc.unfit == f"worker {w.proc.pid}: bad frame: unsolicited reply READY"
        assert not w.proc.idle() and w.proc.pid not in m.sup.workers
        assert done.done()


async def test_worker_ignoring_quit_is_killed(mps_rig):
    async with mps_rig(deadlines=Deadlines(retire_quit=0.5, retire_kill=2.0), pool_cap=0) as m:
        w = await preload(m, "stubborn", quit="ignore")
        with capture_logs() as logs:
            assert not await m.give_back(w)
            with anyio.fail_after(10):
                await w.proc.process.wait()
            with anyio.fail_after(5):
                while not any("exited" in e["event"] for e in logs):
                    await anyio.sleep(0.01)
        assert w.proc.process.returncode == -9
        assert any(f"mps: worker {w.proc.pid} did not exit in 0.5 s; killing it" == e["event"] for e in logs)


async def test_cleanup_kills_everything_within_its_deadline(mps_rig):
    r = mps_rig(pool_cap=2)
    async with r as m:
        await m.prewarm(2)
        busy = await preload(m, "busy", kernel="hang", quit="ignore")
        await busy.start(0, 1)
        pids = r.sup.children()
        assert len(pids) == 2
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
    assert not any(alive(p) for p in pids)
    assert r.sup.left_behind == []
    assert not os.path.exists(r.daemon.dir)


async def test_a_worker_reaped_in_the_grace_period_is_not_left_behind(mps_rig):
    """At exit, a worker still there when the shared deadline ends (a CUDA teardown takes longer on
    the GPU; here the deadline is 0) is waited for up to the grace period, said in a warning, and
    counted as left behind only if it outlives that."""
    r = mps_rig(deadlines=Deadlines(cleanup_reap=0.0, cleanup_grace=10.0), pool_cap=2)
    with capture_logs() as logs:
        async with r as m:
            await m.prewarm(2)
            pids = r.sup.children()
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert r.sup.left_behind == []
    late = [e for e in logs if "after SIGKILL" in e["event"]]
    assert late and all(e["log_level"] == "warning" and "waiting up to 10 s more" in e["event"] for e in late), late
    assert not any("left behind" in e["event"] for e in logs), logs


async def test_client_limit_refuses_a_load(mps_rig):
    async with mps_rig(max_clients=2, pool_cap=0) as m:
        a = await preload(m, "a")
        b = await preload(m, "b")
        with pytest.raises(ClientLimit, match=r"2 clients already: the MPS server takes at most 2 .*for c"):
            await preload(m, "c")
        assert a.proc.idle() and b.proc.idle()


async def test_spawning_many_does_not_freeze_the_loop(mps_rig):
    gaps = []

    async def ticker():
        last = time.monotonic()
        while True:
            await anyio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with mps_rig(pool_cap=8) as m:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await m.prewarm(8)
            tg.cancel_scope.cancel()
        assert len(m.pool) == 8
    assert max(gaps) < 1.0, f"the loop stalled {max(gaps):.3f} s while spawning"


async def test_no_mps_binary_on_path(monkeypatch, tmp_path):
    from meshd_mps.mps.control import ControlDaemon

    monkeypatch.setenv("PATH", str(tmp_path))
    d = ControlDaemon(str(tmp_path / "mps"), temporary=True)
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control not found on PATH"):
        await d.start()


# ---- faults, one table: what the caller sees, and that nothing else is touched -----------------

BYSTANDER, VICTIM = 7, 9  # mailbox slots


async def beating(mailbox, slot: int, within: float = 10.0) -> int:
    """The slot's heartbeat advances (its program still runs); the new count."""
    n = mailbox.heartbeat(slot)
    await until(lambda: mailbox.heartbeat(slot) > n, within, f"slot {slot}'s heartbeat past {n}", every=0.005)
    return mailbox.heartbeat(slot)


@dataclass(frozen=True)
class Fault:
    error: str  # what the caller sees (the whole message, a regex)
    script: dict = field(default_factory=dict)  # the victim image's sim script
    kill: str | None = None  # SIGKILL the victim while its "load" or "launch" is asked, or once its "kernel" runs
    spawn: str | None = None  # the victim's spawn fails: "no-binary", or "emfile[-N]" (N fds free)
    status: int | None = None  # the victim's exit status (-9: killed, by the test or by its retirement)
    deadlines: dict = field(default_factory=dict)



#: The faults MPS keeps to their client.  A kill while the victim's kernel is on the GPU is not
#: one of them (test_a_kill_with_its_kernel_running_faults_its_gpu).
FAULTS = {
    "sigkill-during-load": Fault(r"load: worker \d+ exited", {"load": "hang"}, kill="load", status=-9),
    # A worker that never replies reads no QUIT and no EOF: its retirement kills it.
    "no-reply-to-load": Fault(r"load: worker \d+: no reply in 1s", {"load": "hang"}, status=-9,
                              deadlines={"load": NO_REPLY, **HANGS}),
    "no-reply-to-launch": Fault(r"victim \(worker \d+: no reply in 1s\)", {"launch": "hang"}, status=-9,
                                deadlines={"launch": NO_REPLY, **HANGS}),
    "closes-stdout-stays-alive": Fault(r"load: worker \d+ exited", {"load": "close-stdout"}, status=-9, deadlines=HANGS),
    # A worker that broke the protocol but still reads its stdin exits at its retirement's EOF.
    "garbage": Fault(r"load: worker \d+: bad frame: frame length \d+ is over the \d+-byte limit", {"load": "garbage"}, status=0),
    "wrong-op": Fault(r"load: worker \d+: reply LAUNCHED, expected LOADED", {"load": "wrong-op"}, status=0),
    "short-reply": Fault(r"load: worker \d+: bad frame: LOADED reply of 1 bytes, no ok word", {"load": "short"}, status=0),
    "missing-binary": Fault(r"load: mps worker: /nonexistent/meshd-mps-worker: No such file or directory", spawn="no-binary"),
    # Out of fds before the spawn's first pipe, and after it (Popen closes the pipe it made).
    "emfile": Fault(r"load: mps worker: .+: Too many open files", spawn="emfile"),
    "emfile-after-one-pipe": Fault(r"load: mps worker: .+: Too many open files", spawn="emfile-2"),
}


@contextmanager
def spawn_fault(how: str | None, monkeypatch):
    """Inside: a worker spawn fails as ``how`` says."""
    with monkeypatch.context() as mp:
        if how == "no-binary":
            mp.setattr(mpsmod, "worker_argv", lambda *a, **kw: ["/nonexistent/meshd-mps-worker"])
        if how and how.startswith("emfile"):
            with fds_exhausted(int(how.partition("-")[2] or 0)):
                yield
        else:
            yield


def spy_spawns(m, monkeypatch) -> list:
    """The workers ``m`` spawns from now on, in order (a list that fills as they come)."""
    spawned: list = []
    spawn = m.sup.spawn

    async def spy(*a, **kw):
        spawned.append(await spawn(*a, **kw))
        return spawned[-1]

    monkeypatch.setattr(m.sup, "spawn", spy)
    return spawned


async def kill_when_asked(m, spawned: list, phase: str, mailbox=None) -> None:
    """SIGKILL the victim while its LOAD (it is up: a client of the server) or LAUNCH is in flight
    (and its kernel runs: a heartbeat's slot says RUNNING)."""
    with anyio.fail_after(20):
        while True:
            w = spawned[0] if spawned else None
            if w is not None and w.asking:
                if phase == "launch" and w.gen and mailbox.u32(VICTIM, abi.STATE) == abi.RUNNING:
                    break
                if phase == "load" and not w.gen and m.mps.server and w.pid in await m.mps.clients(m.mps.server):
                    break
            await anyio.sleep(0.005)
    os.kill(w.pid, signal.SIGKILL)


async def victim(m, case: Fault) -> MeshError | None:
    """Load, launch and await the victim as a caller does; the error it met."""
    try:
        w = await preload(m, "victim", **case.script)
    except MeshError as e:
        return e
    try:
        done = await w.start(VICTIM, 1)
        if case.kill == "kernel":
            os.kill(w.proc.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            await done
    except MeshError as e:
        if case.kill == "kernel":  # polled, it says the same, naming the program
            with pytest.raises(WorkerError, match=f"^victim: {re.escape(str(e))}$"):
                w.query()
        assert not await m.give_back(w)  # retired, never pooled
        return e
    return None


@pytest.mark.parametrize("case", list(FAULTS.values()), ids=list(FAULTS))
async def test_a_fault_stays_with_its_worker(mps_rig, monkeypatch, case):
    """Each fault of a worker: the caller gets its own error; the worker is retired and reaped;
    a program running in another worker keeps beating; the pool refills and serves the next
    load (and the fixtures: no fd, temporary entry or process left)."""
    r = mps_rig(pool_cap=2, deadlines=Deadlines(**{**RETIRE, **case.deadlines}))
    async with r as m:
        await m.prewarm(1)
        by, by_done = await start_bystander(r, m)  # takes the pooled worker: the victim's is fresh

        spawned = spy_spawns(m, monkeypatch)
        with spawn_fault(case.spawn, monkeypatch):
            async with anyio.create_task_group() as tg:
                if case.kill in ("load", "launch"):
                    tg.start_soon(kill_when_asked, m, spawned, case.kill)
                err = await victim(m, case)
        assert isinstance(err, WorkerError) and re.fullmatch(case.error, str(err)), repr(err)

        # The victim is retired and reaped (or never started) ...
        assert len(spawned) == (0 if case.spawn else 1)
        await until(lambda: m.sup.children() == [by.proc.pid], 30,
                    lambda: f"only the bystander {by.proc.pid} left, not {m.sup.children()}")
        if spawned:
            assert spawned[0].process.returncode == case.status
        assert m.sup.live() == [by.proc.pid] and m.sup.left_behind == [] and len(m.pool) == 0
        # ... and nothing else is touched: the bystander kept running and still runs.
        assert not by_done.done() and by.proc.unfit is None and by.proc.err is None
        await beating(r.mailbox, BYSTANDER)

        # The pool refills, and serves the next load.
        await m.prewarm(m.pool.cap)
        nxt = await preload(m, "next", kernel="sleep", ms=1)
        assert not nxt.fresh
        with anyio.fail_after(10):
            d = await (await nxt.start(VICTIM, 1))
        assert d.ok and await m.give_back(nxt) and len(m.pool) == m.pool.cap

        r.mailbox.halt(BYSTANDER)
        with anyio.fail_after(10):
            d = await by_done
        assert d.ok, d.message
        await m.give_back(by)


#: A SIGKILL from outside while the victim's kernel is on the GPU: during its LAUNCH (the kernel
#: launched, the reply hung) or while it runs.  What the caller sees is its own.
KILLED_RUNNING = {
    "sigkill-during-launch": Fault(r"victim \(worker \d+ exited\)", {"launch": "hang", "kernel": "heartbeat"},
                                   kill="launch", status=-9),
    "sigkill-while-running": Fault(r"worker \d+ exited while its kernel ran", {"kernel": "hang"}, kill="kernel", status=-9),
}


@pytest.mark.parametrize("case", list(KILLED_RUNNING.values()), ids=list(KILLED_RUNNING))
async def test_a_kill_with_its_kernel_running_faults_its_gpu(mps_rig, monkeypatch, case):
    """On the H200 an MPS client that exits with its kernel running faults the other clients of
    its GPU (scripts/kill_probe.py, docs/reliability.md), and the stand-in does the same: the
    caller gets its own error; the bystander's DONE and the pooled worker's next load say
    ILLEGAL_ADDRESS; the server log names a fatal GPU error; new clients are refused until the
    torn-down ones exit, then a fresh worker loads and runs.  (Programs' recovery of this:
    test_faults.py; meshd-mps's own retire of such a worker terminates its client first and
    faults nobody: the no-reply-to-launch case above.)"""
    r = mps_rig(pool_cap=2, deadlines=Deadlines(**RETIRE))
    async with r as m:
        await m.prewarm(2)
        by, by_done = await start_bystander(r, m)
        spawned = spy_spawns(m, monkeypatch)
        pooled = m.pool.take()  # the victim gets a fresh worker; this one stays idle, a client too
        async with anyio.create_task_group() as tg:
            if case.kill == "launch":
                tg.start_soon(kill_when_asked, m, spawned, "launch", r.mailbox)
            err = await victim(m, case)
        assert isinstance(err, WorkerError) and re.fullmatch(case.error, str(err)), repr(err)
        await until(lambda: spawned[0].process.returncode is not None, 10, "the victim reaped")
        assert spawned[0].process.returncode == case.status

        with anyio.fail_after(10):
            d = await by_done
        assert not d.ok and d.message == "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (simulated)", d
        with open(os.path.join(r.daemon.log_dir, "server.log")) as f:
            log = f.read()
        assert f"Client {{PID: {by.proc.pid}, Context: 1}} encountered a fatal GPU error." in log, log
        m.pool.add(pooled)
        with pytest.raises(WorkerError, match=rf"^load: worker {pooled.pid}: cuModuleLoadData: CUDA_ERROR_ILLEGAL_ADDRESS: "):
            await preload(m, "after")  # the torn-down pooled worker: refused, and retired

        assert not await m.give_back(by)  # its stream failed: retired
        await until(lambda: m.sup.children() == [], 10, lambda: f"the torn-down workers reaped, not {m.sup.children()}")
        nxt = await preload(m, "next", kernel="sleep", ms=1)
        assert nxt.fresh
        with anyio.fail_after(10):
            assert (await (await nxt.start(VICTIM, 1))).ok
        await m.give_back(nxt)


async def test_a_dead_worker_is_retired_at_once(mps_rig):
    """A worker that dies while its kernel runs is retired and reaped at once, not only when its
    program is unloaded: meanwhile it is not a live worker, nor counted against the client limit."""
    async with mps_rig(max_clients=2, pool_cap=0) as m:
        a = await preload(m, "a", kernel="exit")
        with pytest.raises(WorkerError, match=r"^worker \d+ exited while its kernel ran$"):
            with anyio.fail_after(10):
                await (await a.start(0, 1))
        await until(lambda: m.sup.live() == [] and m.sup.children() == [], 10,
                    lambda: f"the dead worker forgotten: live {m.sup.live()}, children {m.sup.children()}")
        b = await preload(m, "b")
        c = await preload(m, "c")  # the limit's two clients: b and c, not the dead a
        assert not await m.give_back(a)  # its program unloaded later: nothing left to do
        await m.give_back(b)
        await m.give_back(c)


async def test_out_of_fds_to_verify_a_fresh_worker(mps_rig, monkeypatch):
    """The worker started, but the control command that verifies it cannot (EMFILE): an MpsError
    naming the command and the cause, not a bare OSError; the worker is retired, not pooled; the
    next load works."""
    async with mps_rig(pool_cap=1) as m:
        check = m.mps.check_clients

        async def starved(want):
            with fds_exhausted(0):
                return await check(want)

        monkeypatch.setattr(m.mps, "check_clients", starved)
        with pytest.raises(MpsError,
                           match=r"^mps: get_server_list: cannot start .*/nvidia-cuda-mps-control: Too many open files$"):
            await preload(m, "victim")
        assert m.pool.pids() == []
        await until(lambda: m.sup.children() == [], 10, lambda: f"the victim reaped, not {m.sup.children()}")
        monkeypatch.undo()
        w = await preload(m, "after")
        assert w.fresh and w.proc.pid in await m.mps.clients(m.mps.server)
        await m.give_back(w)


async def test_out_of_fds_for_the_pidfd(mps_rig, monkeypatch):
    """No fd left for a worker's pidfd: the worker still works, and its exit is seen by polling."""
    from meshd_mps.supervision import child

    def emfile(pid):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    async with mps_rig(pool_cap=0) as m:
        monkeypatch.setattr(child.os, "pidfd_open", emfile)
        w = await preload(m, "polled", kernel="sleep", ms=1)
        monkeypatch.undo()
        assert w.proc.process._pidfd == -1 and w.proc.process._poll is not None
        with anyio.fail_after(10):
            assert (await (await w.start(0, 1))).ok
        assert not await m.give_back(w)
        with anyio.fail_after(10):
            assert await w.proc.process.wait() == 0  # QUIT obeyed, the exit seen through the poll
        await until(lambda: m.sup.children() == [], 10, lambda: f"the worker reaped, not {m.sup.children()}")


async def test_a_worker_that_failed_verification_is_never_pooled(mps_rig, monkeypatch):
    """A fresh worker that is not our server's client is refused, and not kept for the next load."""
    async with mps_rig(pool_cap=2) as m:
        await m.prewarm(1)  # the server is up
        held = await preload(m, "held")
        monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")  # a plain context, as with another pipe dir
        with pytest.raises(MpsError, match=r"^mps: worker \d+ is not among server \d+'s clients \[\d+\]; refusing$"):
            await preload(m, "foreign")
        monkeypatch.delenv("MESHD_MPS_SIM_STARTUP")
        try:
            assert m.pool.pids() == [], "a worker that failed verification was pooled"
        finally:
            await m.give_back(held)


async def test_daemon_killed_underneath(mps_rig):
    """The control daemon SIGKILLed, as it went on the H200 (scripts/kill_probe.py
    orphan-server, tests/gpu/test_faults_real.py): its server exits with it (a zombie of ours,
    reaped at the next refusal), yet the running program goes on beating, its completion no longer
    seen; loads and the pool's refill are refused at once, naming the daemon's death (a pooled
    worker would fail its LOAD with MPS_RPC_FAILURE, a fresh one run as a plain context), and no
    pooled worker is spent on them; the running one is retired at its unload, without the server to
    terminate it first; at close nothing is left (no_child_left, no_leaks)."""
    r = mps_rig(pool_cap=2)
    async with r as m:
        await m.prewarm(2)
        by, by_done = await start_bystander(r, m)
        daemon = r.daemon.pid
        os.kill(daemon, signal.SIGKILL)
        await until(lambda: not r.daemon.alive(), 10, "the daemon's death seen (waitpid)")
        with anyio.fail_after(30):
            with pytest.raises(MpsError, match=DAEMON_DIED):
                await preload(m, "after")
            with pytest.raises(MpsError, match=DAEMON_DIED):
                await m.prewarm(1)
        assert r.daemon.died == f"the MPS control daemon {daemon} died (killed by SIGKILL)"
        assert len(m.pool) == 1  # none spent on a refused load

        def server_reaped() -> bool:  # it exits with its daemon; the next refusal reaps it
            with pytest.raises(MpsError, match=DAEMON_DIED):
                r.daemon.check_alive()
            return not os.path.exists(f"/proc/{m.mps.server}")

        await until(server_reaped, 10, lambda: f"the server {m.mps.server} reaped, not left a zombie till close")
        await beating(r.mailbox, BYSTANDER)
        assert not by_done.done()
        await beating(r.mailbox, BYSTANDER)  # still, well after the daemon went
        r.mailbox.halt(BYSTANDER)
        await until(lambda: r.mailbox.u32(BYSTANDER, abi.STATE) == abi.EXITED, 10, "the bystander's kernel ended at HALT")
        assert not by_done.done()  # ... unseen by its worker
        assert not await m.give_back(by)  # retired: its DONE never came
        await until(lambda: m.sup.children() == [m.pool.pids()[0]], 10, lambda: f"the bystander reaped, not {m.sup.children()}")


async def test_mps_dir_removed_underneath(mps_rig):
    """The MPS directory removed: the daemon's sockets go with it.  Programs already running keep
    running and pooled workers (verified when they started) still load; a fresh worker cannot be
    verified: refused with the control's own error, without a hang; the directory is not re-made."""
    import shutil

    r = mps_rig(pool_cap=2)
    async with r as m:
        await m.prewarm(2)
        by, by_done = await start_bystander(r, m)
        shutil.rmtree(r.daemon.dir)
        a = await preload(m, "a")
        assert not a.fresh
        with anyio.fail_after(30):
            with pytest.raises(MpsError, match=r"^mps: get_server_list: Cannot find MPS control daemon process$"):
                await preload(m, "b")
            with pytest.raises(MpsError, match=r"^mps: get_server_list: Cannot find MPS control daemon process$"):
                await m.prewarm(1)
        assert a.proc.idle() and not by_done.done()
        await beating(r.mailbox, BYSTANDER)
        r.mailbox.halt(BYSTANDER)
        with anyio.fail_after(10):
            assert (await by_done).ok
        await m.give_back(a)
        await m.give_back(by)
    assert not os.path.exists(r.daemon.dir)


async def test_a_pooled_worker_that_hangs_on_load_is_not_retried(mps_rig):
    """Only a pooled worker that died while idle is replaced by the next one; a live one that
    does not answer LOAD fails the load after one deadline (a retry would cost a second one)."""
    d = Deadlines(load=1.0, retire_quit=1.0, retire_kill=2.0)
    async with mps_rig(pool_cap=2, deadlines=d) as m:
        await m.prewarm(2)
        pooled = m.pool.pids()
        t0 = time.monotonic()
        with capture_logs() as logs, pytest.raises(WorkerError, match=r"^load: worker (\d+): no reply in 1s$") as e:
            await preload(m, "hangs", load="hang")
        took = time.monotonic() - t0
        hung = int(re.match(r"^load: worker (\d+)", str(e.value)).group(1))
        assert hung in pooled
        assert not any("was gone" in x["event"] for x in logs), logs
        assert m.pool.pids() == [p for p in pooled if p != hung]  # the other pooled worker was not spent on it
        assert took < 1.9, f"the load took {took:.1f}s: retried after the first deadline?"
