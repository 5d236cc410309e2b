"""The reliability cases against the REAL GPU and NVIDIA's own MPS control: the same cases as
the simulated GPU's tests (tests/rig/test_restart.py, test_pool_truth.py, test_hard_deaths.py,
test_native_clients.py), so that what the sim models is checked where it comes from.

- a program whose worker is killed from outside comes back (restart policy on-failure);
- a program that keeps faulting the GPU becomes a crash loop; its neighbour runs on;
- blink mode recovers from a fault in its one context, and from the context's death;
- a dead idle pooled worker is dropped at once and replaced, paced;
- a terminal's signals to ``meshd-mps serve``'s group reach only the daemon; a SIGKILL of
  ``serve`` leaves nothing that blocks the next start, and faults no GPU (the workers halt their
  kernels at EOF);
- a native client joins our server, is counted, and is dropped when it exits.

Skipped, with the reason printed, where there is no NVIDIA driver or no NVIDIA MPS control.  On
the device: ``python3 -m pytest tests/gpu/test_reliability_real.py -v -rA``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import sys

import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.deadlines import DEFAULT
from meshd_mps.base.restart import CRASH_LOOP_BURST
from meshd_mps.programs import Programs, ProgramState
from meshd_mps.protocol import abi
from meshd_mps.serving.client import program_body
from meshd_mps.supervision import procfs

from ..cases.restart import blink_fault_case, blink_killed_case
from ..rigs.backend import beats, example
from ..rigs.gpu import mps_processes
from ..rigs.serve import EXAMPLES, REPO, Serve, events, left_by, owner_of, reap
from ..rigs.waits import poll, until as _until

until = functools.partial(_until, within=60.0, every=0.005)  # this file's waits: 60 s on the real GPU

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(180), pytest.mark.usefixtures("real_gpu_and_mps")]

QUICK = dataclasses.replace(DEFAULT, restart_backoff=0.05, restart_backoff_max=0.4)


def report(what: str, r) -> None:
    print(f"{what}: {r}", file=sys.stderr)


async def test_a_worker_killed_from_outside_comes_back():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2, deadlines=QUICK) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        echo = await progs.load(*example("echo"))
        await beats(b, hb.slot, 1000)
        pid = echo.kernel.pid
        os.kill(pid, signal.SIGKILL)
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        report("fault report", r)
        # The killed one comes back with the innocent, in the same relaunch.
        assert r.gpu_wide and r.faulted == "echo" and r.pid == pid and r.relaunched == ["heartbeat", "echo"], r
        await until(lambda: progs.by_name["echo"].restarts == 1
                    and progs.by_name["echo"].observe() is ProgramState.RUNNING)
        assert await progs.call("echo", b"back") == b"back"
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + 100)
        await progs.close()
    assert mps_processes() == []


async def test_a_program_that_keeps_faulting_is_a_crash_loop():
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1, deadlines=QUICK) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 1000)
        await progs.load(*example("fault"))
        await until(lambda: progs.by_name["fault"].observe() is ProgramState.CRASH_LOOP, within=120)
        faults = [r for r in progs.faults if r.gpu_wide]
        for r in faults:
            report("fault", r)
        assert len(faults) == CRASH_LOOP_BURST and all(r.faulted == "fault" for r in faults)
        assert all(r.relaunched == ["heartbeat"] for r in faults)
        assert progs.by_name["fault"].error.startswith("crash loop: 5 failures")
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + 100)
        await progs.unload("fault")
        await progs.close()
    assert mps_processes() == []


async def test_blink_recovers_from_a_fault_in_its_context():
    await blink_fault_case("cuda", warm=1000, more=100)


async def test_blink_recovers_when_its_context_is_killed():
    await blink_killed_case("cuda", warm=1000, more=100)


async def test_a_dead_pooled_worker_is_dropped_and_replaced():
    """SIGKILL of an idle pooled worker: out of the pool at once, replaced (paced); a running
    program's worst gap meanwhile is reported (docs/reliability.md)."""
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2, deadlines=QUICK) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 1000)
        pool = b.isolations[0].pool
        idle = len(pool)  # the heartbeat took one: a pool fills again as programs are unloaded
        assert idle == 1
        victim = pool.pids()[0]
        b.mailbox.set_u32(hb.slot, abi.GAP_RESET, 1)
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + 100)
        os.kill(victim, signal.SIGKILL)
        await until(lambda: victim not in pool.pids())
        assert victim not in b.status()["pool"]  # status says what the pool holds
        await until(lambda: len(pool) == idle and victim not in pool.pids())  # replaced
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot) + 1000)
        gap = b.mailbox.u64(hb.slot, abi.MAX_GAP) / 1e3
        print(f"heartbeat's worst gap across an idle pooled worker's SIGKILL and its replacement: {gap:.1f} us",
              file=sys.stderr)
        await progs.close()
    assert mps_processes() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_a_signal_to_serves_group_reaches_only_the_daemon(tmp, sig):
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1", "--log-level", "debug", group=True, gpu="cuda")
    try:
        s.wait_ready()
        s.client.load(program_body(str(EXAMPLES / "heartbeat")))
        workers = s.client.status()["workers"]
        assert workers and all(os.getpgid(w) == w for w in workers)
        os.killpg(s.proc.pid, sig)
        assert s.proc.wait(120) == 0, s.log()
        text = s.log()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        reaped = [e for e in events(s) if e.get("msg") == "workers reaped"]
        statuses = {int(pid): rc for pid, rc in reaped[0]["statuses"].items()}
        assert set(workers) <= set(statuses) and not {-sig} & set(statuses.values()), statuses
    finally:
        s.kill()
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")


def test_a_sigkill_of_serve_faults_nothing_and_blocks_no_restart(tmp):
    """The workers see EOF, halt their kernels and exit (no client exits with its kernel running:
    the control log shows no fault); the next serve in the same --mps-dir quits the left daemon."""
    mps_dir = os.path.join(tmp, "mps")
    first = Serve(tmp, "mps", os.path.join(tmp, "a.sock"), "--pool", "1", "--mps-dir", mps_dir, gpu="cuda")
    try:
        first.wait_ready()
        first.client.load(program_body(str(EXAMPLES / "heartbeat")))
        first.client.load(program_body(str(EXAMPLES / "echo")))
        left = owner_of(mps_dir)
        orphans = left_by(left) + first.client.status()["workers"]
        first.proc.kill()
        first.proc.wait(30)
        assert left.daemon_alive() and not left.meshd_alive()
        workers = [p for p in orphans if p not in left_by(left)]
        poll(lambda: not any(procfs.running(p) for p in workers), 60.0, f"the orphaned workers {workers} exited")
        server_log = os.path.join(mps_dir, "log", "server.log")
        with open(server_log, errors="replace") as f:
            text = f.read()
        print(f"server.log after the SIGKILL:\n{text[-3000:]}", file=sys.stderr)
        assert "fatal GPU error" not in text, "a worker exited with its kernel running"
        second = Serve(tmp, "mps", os.path.join(tmp, "b.sock"), "--pool", "1", "--mps-dir", mps_dir, gpu="cuda")
        try:
            second.wait_ready()
            assert not left.daemon_alive()
            reap(orphans)
            second.client.load(program_body(str(EXAMPLES / "heartbeat")))
            assert second.stop() == 0
        finally:
            second.kill()
    finally:
        first.kill()
    reap([*orphans, left.daemon_pid or 0])  # re-parented to this test (a subreaper), as to init on a host
    reap_mps_orphans()
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")


def reap_mps_orphans() -> None:
    """Reap, and name, any MPS process re-parented to this test process (a subreaper) that nothing
    else reaped: on the H200 one such zombie was left after the successor of a SIGKILLed serve
    quit the dead one's daemon and stopped (docs/reliability.md); on a host init reaps it."""
    me = os.getpid()
    for p in list(procfs.processes()):
        if p.ppid == me and p.comm.startswith("nvidia-cuda-mps") and p.state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p.pid, 0)
            print(f"reaped MPS process {p.pid} ({p.comm}, state {p.state}) re-parented to the test", file=sys.stderr)


NATIVE = ("import os, sys\n"
          "from cuda.bindings import driver as cu\n"
          "assert int(cu.cuInit(0)[0]) == 0\n"
          "err, dev = cu.cuDeviceGet(0)\n"
          "err, ctx = cu.cuDevicePrimaryCtxRetain(dev)\n"
          "assert int(err) == 0, err\n"
          "cu.cuCtxSetCurrent(ctx)\n"
          "err, p = cu.cuMemAlloc(1 << 20)\n"
          "assert int(err) == 0, err\n"
          "print('joined', flush=True)\n"
          "sys.stdin.read()\n")


def test_a_native_client_joins_is_counted_and_is_dropped(tmp):
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1", gpu="cuda")
    try:
        s.wait_ready()
        got = s.client.native()
        p = subprocess.Popen([sys.executable, "-c", NATIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **got["env"]}, cwd=REPO)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "joined"
            ans = s.client.native(add=p.pid)
            assert ans["clients"] == [p.pid] and p.pid in s.client.status()["clients"]

            def seen_native():  # NVML's next look (every 2 s) names it native, not foreign
                n = (s.client.status().get("neighbours") or [{}])[0]
                return p.pid in n.get("native", []) and p.pid not in [f["pid"] for f in n.get("foreign", [])]

            poll(seen_native, 30.0, "NVML seeing the native client as ours")
        finally:
            p.communicate("", timeout=60)
        poll(lambda: s.client.native()["clients"] == [], 30.0, "the exited native client dropped")
        assert s.stop() == 0
    finally:
        s.kill()
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")
