"""Fault injection against the REAL GPU and the real nvidia-cuda-mps-control.

The faults of tests/rig/test_workers.py's table, each with examples/heartbeat running in another
worker: the caller's error, the heartbeat still beating, the victim retired and reaped, the pool
refilled and serving the next load; after each test no MPS process, fd or temporary entry left.
Protocol misbehaviours come from the workers' test hook (``MESHD_MPS_WORKER_INJECT``,
workers/main.py), set only while the one worker that is to misbehave is spawned.  A SIGKILL with
the victim's kernel on the GPU is not in that table: on the H200 it tears every client of the GPU
down, like a GPU fault (test_mps_real.py's test_gpu_fault_is_survived), and its test expects
Programs' recovery.  So does the control daemon's death its own behaviour (the server lives on).

Skipped, with the reason printed, where there is no NVIDIA driver, or no nvidia-cuda-mps-control
on PATH, or it is meshd-mps's stand-in.  On the device:
``python3 -m pytest tests/gpu/test_faults_real.py -v -rA`` (well under 2 minutes on an H200).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import MeshError, MpsError, WorkerError
from meshd_mps.mps import clients as mpsmod
from meshd_mps.programs import Programs, ProgramState
from meshd_mps.protocol import abi

from ..rigs.backend import beats, example, into, kill_in_launch
from ..rigs.gpu import mps_processes
from ..rigs.mps import DAEMON_DIED
from ..rigs.procs import fds_exhausted
from ..rigs.waits import until

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(120), pytest.mark.usefixtures("counted")]

INJECT_ENV = "MESHD_MPS_WORKER_INJECT"
BYSTANDER, VICTIM = 7, 9  # mailbox slots
NO_DAEMON = r"^mps: get_server_list: Cannot find MPS control daemon process"


@pytest.fixture
def counted(real_gpu_and_mps, no_leaks):
    """The GPU checks first (the driver's fds open), then the fd and temporary-entry count."""
    yield


async def start_bystander(b: Backend):
    """examples/heartbeat on its own worker (the pooled one), beating."""
    k = await b.load(await b.prepare(*example("heartbeat")))
    b.mailbox.reset_slot(BYSTANDER)
    run = await b.launch(k, BYSTANDER)
    await beats(b, BYSTANDER, 1000)
    return k, run


async def still_beating(b: Backend, run) -> None:
    assert not run.finished(), "the bystander ended"
    await beats(b, BYSTANDER, b.mailbox.heartbeat(BYSTANDER) + 100)


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    error: str  # what the caller sees (the whole message, a regex)
    inject: str = ""  # MESHD_MPS_WORKER_INJECT for the victim's worker
    kill: str | None = None  # "load": SIGKILL the victim while its LOAD is asked
    spawn: str | None = None  # the victim's spawn fails: "no-binary" | "emfile"
    status: int | None = None  # the victim's exit status
    deadlines: dict = field(default_factory=dict)


RETIRE = {"retire_quit": 10.0, "retire_kill": 5.0}  # a worker that exits at EOF has time to (context teardown)
HANGS = {"retire_quit": 1.0, "retire_kill": 5.0}  # one that hangs is killed soon

#: The faults MPS keeps to their client.  A SIGKILL while the victim's kernel is on the GPU is
#: not one of them on the H200: test_a_kill_with_its_kernel_running_is_a_gpu_fault.
FAULTS = {
    "sigkill-during-load": Fault(r"load: worker \d+ exited", "load:hang", kill="load", status=-9),
    "no-reply-to-load": Fault(r"load: worker \d+: no reply in 5s", "load:hang", status=-9, deadlines={"load": 5.0, **HANGS}),
    "no-reply-to-launch": Fault(r"echo \(worker \d+: no reply in 2s\)", "launch:hang", status=-9, deadlines=HANGS),
    "closes-stdout-stays-alive": Fault(r"load: worker \d+ exited", "load:close-stdout", status=-9, deadlines=HANGS),
    "garbage": Fault(r"load: worker \d+: bad frame: frame length \d+ is over the \d+-byte limit", "load:garbage", status=0),
    "wrong-op": Fault(r"load: worker \d+: reply LAUNCHED, expected LOADED", "load:wrong-op", status=0),
    "short-reply": Fault(r"load: worker \d+: bad frame: LOADED reply of 1 bytes, no ok word", "load:short", status=0),
    "missing-binary": Fault(r"load: mps worker: /nonexistent/meshd-mps-worker: No such file or directory", spawn="no-binary"),
    "emfile": Fault(r"load: mps worker: .+: Too many open files", spawn="emfile"),
}


@contextmanager
def victim_spawn(b: Backend, case: Fault, monkeypatch, spawned: list):
    """Inside: the next worker spawned is the victim (recorded in ``spawned``), with the case's
    fault: the hook in its environment, a missing binary, or no fd left for its pipes."""
    with monkeypatch.context() as mp:
        spawn = b.sup.spawn

        async def victims(*a, **kw):
            if case.spawn == "emfile":
                with fds_exhausted(0):
                    w = await spawn(*a, **kw)
            else:
                w = await spawn(*a, **kw)
            spawned.append(w)
            return w

        mp.setattr(b.sup, "spawn", victims)
        if case.inject:
            mp.setenv(INJECT_ENV, case.inject)
        if case.spawn == "no-binary":
            mp.setattr(mpsmod, "worker_argv", lambda *a, **kw: ["/nonexistent/meshd-mps-worker"])
        yield


async def kill_in_load(b: Backend, spawned: list) -> None:
    """SIGKILL the victim while its LOAD is in flight (it is up: a client of our server)."""
    with anyio.fail_after(30):
        while True:
            w = spawned[0] if spawned else None
            if w is not None and w.asking and b.mps.server and w.pid in await b.mps.clients(b.mps.server):
                break
            await anyio.sleep(0.005)
    os.kill(w.pid, signal.SIGKILL)


async def victim(b: Backend, case: Fault) -> MeshError | None:
    """examples/echo prepared, loaded, launched and awaited as a caller does; the error it met."""
    try:
        img = await b.prepare(*example("echo"))
    except MeshError as e:
        return e
    k = await b.load(img)
    try:
        b.mailbox.reset_slot(VICTIM)
        run = await b.launch(k, VICTIM)
        with anyio.fail_after(30):
            await run
    except MeshError as e:
        await b.unload(k)  # its worker is retired, never pooled
        return e
    await b.unload(k)
    return None


@pytest.mark.parametrize("case", list(FAULTS.values()), ids=list(FAULTS))
async def test_a_fault_stays_with_its_worker(monkeypatch, case):
    """Each fault of a worker on the real GPU: the caller gets its own error; the worker is retired
    and reaped; the heartbeat in another MPS client keeps beating; the pool refills and serves the
    next load; nothing is left (the fixtures)."""
    deadlines = Deadlines(**{**RETIRE, **case.deadlines})
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1, deadlines=deadlines) as b:
        by_k, by_run = await start_bystander(b)  # it takes the pooled worker: the victim's is fresh

        spawned: list = []
        with victim_spawn(b, case, monkeypatch, spawned):
            async with anyio.create_task_group() as tg:
                if case.kill == "load":
                    tg.start_soon(kill_in_load, b, spawned)
                err = await victim(b, case)
        print(f"{case.error!r}: the caller saw {err!r}", file=sys.stderr)
        assert isinstance(err, WorkerError) and re.fullmatch(case.error, str(err)), repr(err)

        # The victim is retired and reaped (or never started), the bystander untouched.
        assert len(spawned) == (0 if case.spawn else 1)
        await until(lambda: b.sup.children() == [by_k.pid], 30,
                    lambda: f"only the bystander {by_k.pid} left, not {b.sup.children()}")
        if spawned:
            assert spawned[0].process.returncode == case.status
        await still_beating(b, by_run)

        # The pool refills and serves the next load.
        gpu = b.isolations[0]
        await gpu.prewarm(gpu.pool.cap - len(gpu.pool))
        assert len(gpu.pool) == gpu.pool.cap
        img = await b.prepare(*example("spin"))
        assert not img.preloaded.fresh
        k = await b.load(img)
        b.mailbox.reset_slot(VICTIM)
        with anyio.fail_after(30):
            d = await (await b.launch(k, VICTIM))  # spin: 100 ms, then it returns
        assert d.ok, d.message
        await b.unload(k)
        await still_beating(b, by_run)

        b.mailbox.halt(BYSTANDER)
        with anyio.fail_after(30):
            d = await by_run
        assert d.ok, d.message
        await b.unload(by_k)


# ---- the MPS daemon and its directory ------------------------------------------------------------


def servers() -> list[str]:
    return [p for p in mps_processes() if "nvidia-cuda-mps-server" in p.split(" ", 2)[1]]


async def test_control_daemon_killed():
    """The control daemon SIGKILLed with a program running: on the H200 its server exits with it (a
    zombie) yet the running kernel goes on beating and ends at HALT, its DONE
    never seen (scripts/kill_probe.py orphan-server); loads and the pool's refill are refused at
    once, naming the daemon's death (a pooled worker's LOAD would fail with MPS_RPC_FAILURE, a fresh
    worker run as a plain context), no pooled worker spent; at close nothing is left."""
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2) as b:
        by_k, by_run = await start_bystander(b)
        assert b.daemon.pid is not None and servers()
        server = int(servers()[0].split(":")[0])
        daemon = b.daemon.pid
        os.kill(daemon, signal.SIGKILL)
        await until(lambda: not b.daemon.alive(), 10, "the daemon's death seen (waitpid)")
        with anyio.fail_after(60):
            with pytest.raises(MpsError, match=DAEMON_DIED):
                await b.prepare(*example("spin"))
            with pytest.raises(MpsError, match=DAEMON_DIED):
                await b.isolations[0].prewarm(1)
        assert b.daemon.died == f"the MPS control daemon {daemon} died (killed by SIGKILL)"
        assert len(b.isolations[0].pool) == 1 and b.status()["daemon_died"] == b.daemon.died
        await still_beating(b, by_run)
        print(f"the server after its daemon died: {proc_state(server)}", file=sys.stderr)  # H200: Z (zombie)
        b.mailbox.halt(BYSTANDER)
        await until(lambda: b.mailbox.u32(BYSTANDER, abi.STATE) == abi.EXITED, 10, "the heartbeat ended at HALT")
        with anyio.move_on_after(5):
            d = await by_run
            print(f"the heartbeat's DONE after its daemon died: {d}", file=sys.stderr)
        print(f"the heartbeat's DONE came: {by_run.finished()}; the server: {proc_state(server)}", file=sys.stderr)
        await b.unload(by_k)
    await until(lambda: proc_state(server) == "gone", 15, lambda: f"the server {server} reaped, not {proc_state(server)}")


def proc_state(pid: int) -> str:
    """A process's state and command line, from /proc ("gone" once reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("State:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        return "gone"
    return f"{state}, command line {argv!r}"


@pytest.mark.parametrize("when", ["while-running", "during-launch"])
async def test_a_kill_with_its_kernel_running_is_a_gpu_fault(monkeypatch, when):
    """A worker SIGKILLed from outside with its kernel on the GPU (as an OOM killer would), while
    echo runs or during echo's LAUNCH (the reply hung by the test hook): on the H200 the server then
    raises a fatal GPU error in the other clients (scripts/kill_probe.py).  Programs' recovery names
    echo (its worker exited on its own), reports that death, relaunches the heartbeat (and a killed
    running echo with it) on fresh workers and refills the pool; the heartbeat beats again, echo
    answers; nothing left."""
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))  # takes the pooled worker: echo's is fresh
        await beats(b, hb.slot, 1000)
        hb_pid = hb.kernel.pid
        if when == "while-running":
            pid = (await progs.load(*example("echo"))).kernel.pid
            os.kill(pid, signal.SIGKILL)
        else:
            monkeypatch.setenv(INJECT_ENV, "launch:hang")
            async with anyio.create_task_group() as tg:
                killed: list[int] = []
                tg.start_soon(into, killed, kill_in_launch(b, set(b.sup.workers), progs._free_slot(), monkeypatch))
                with pytest.raises(WorkerError, match=r"^echo \(worker \d+ exited\)$"):
                    await progs.load(*example("echo"))
            pid = killed[0]
        with anyio.fail_after(120):
            while not (progs.faults and progs.faults[-1].ms > 0):
                await anyio.sleep(0.01)
        r = progs.faults[-1]
        print(f"fault report: {r}", file=sys.stderr)
        with open(os.path.join(b.daemon.log_dir, "server.log")) as f:
            fatal = [ln.rstrip() for ln in f if "fatal GPU error" in ln or "reset" in ln]
        print("server log:\n" + "\n".join(fatal), file=sys.stderr)
        assert fatal, "the server logged no fatal GPU error"
        assert r.gpu_wide and r.faulted == "echo" and r.pid == pid and r.error == f"worker {pid} exited while its kernel ran", r
        assert r.lost == ["heartbeat"], r
        assert progs.by_name["heartbeat"].kernel.pid != hb_pid
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + 100)
        if when == "while-running":
            # A program killed from outside comes back with the innocents, in the same relaunch
            # (restart policy on-failure), on a worker held during the teardown.
            assert r.relaunched == ["heartbeat", "echo"] and r.not_relaunched == {}, r
            with anyio.fail_after(30):
                while progs.by_name["echo"].observe() is not ProgramState.RUNNING:
                    await anyio.sleep(0.01)
        else:  # a load's launch: no program of that name yet
            assert r.relaunched == ["heartbeat"], r.not_relaunched
            await progs.load(*example("echo"))
        assert await progs.call("echo", b"after the kill") == b"after the kill"
        await progs.close()


async def test_mps_dir_removed():
    """The MPS directory removed underneath: the running program keeps running, a pooled worker
    (verified when it started) still loads and runs; a fresh one cannot be verified: refused
    with the control's own error, no hang; at close the daemon is killed and reaped."""
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2) as b:
        by_k, by_run = await start_bystander(b)
        shutil.rmtree(b.daemon.dir)
        img = await b.prepare(*example("spin"))
        assert not img.preloaded.fresh
        k = await b.load(img)
        b.mailbox.reset_slot(VICTIM)
        with anyio.fail_after(30):
            assert (await (await b.launch(k, VICTIM))).ok
        with anyio.fail_after(60):
            with pytest.raises(MpsError, match=NO_DAEMON):
                await b.prepare(*example("echo"))
        await still_beating(b, by_run)
        await b.unload(k)
        b.mailbox.halt(BYSTANDER)
        with anyio.fail_after(30):
            assert (await by_run).ok
        await b.unload(by_k)
