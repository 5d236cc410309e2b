"""Live restore's transport: workers, their kernels and the mailbox outlive a supervisor.

Real worker processes on the simulated GPU, each an MPS client of the stand-in daemon, which
reports a client that exits with its kernel running as a fault (``exited with a kernel running``
in its control.log): every test asserts that none did.  A worker in listen mode serves its frames
on ``DIR/<pid>.sock``; ``Supervisor.detach`` leaves it running, ``Supervisor.adopt`` takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading

import anyio
import pytest

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import ConfigError, NotAdoptable, PeerMismatch, ProtocolMismatch, WorkerGone
from meshd_mps.mps.control import MARKER, PID_FILE, ControlDaemon, Owner
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Hello, HelloLaunch, LaunchReq, Load, Op
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision import child, procfs
from meshd_mps.supervision.argv import worker_argv
from meshd_mps.supervision.proc import WorkerProc, WorkerState
from meshd_mps.supervision.supervisor import Supervisor

from ..rigs.deadlines import LIVE
from ..rigs.live import LiveRig
from ..rigs.sim import sim
from ..rigs.waits import poll, until as _until

until = functools.partial(_until, every=0.005)  # the polling interval these waits had

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]

D = LIVE
EXIT_FAULT = "exited with a kernel running"


@pytest.fixture
def state():
    """A short state directory (AF_UNIX paths stop at 108 bytes): the mailbox, workers/, mps/."""
    d = tempfile.mkdtemp(prefix="mlt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def mps(standin_on_path, state):
    """The stand-in control daemon under ``state/mps``; quit (and checked for exit faults) after."""
    daemon = ControlDaemon(os.path.join(state, "mps"), temporary=False)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.quit()
    assert EXIT_FAULT not in control_log(daemon), control_log(daemon)


def control_log(daemon: ControlDaemon) -> str:
    with open(os.path.join(daemon.log_dir, "control.log")) as f:
        return f.read()


async def beating(mb: Mailbox, slot: int, times: int = 3) -> None:
    for _ in range(times):
        n = mb.heartbeat(slot)
        await until(lambda n=n: mb.heartbeat(slot) > n, what=f"slot {slot} beating past {n}")


async def heartbeat(w: WorkerProc, mb: Mailbox, slot: int) -> asyncio.Future:
    """READY, LOAD a heartbeat as module 0, LAUNCH it on ``slot``: its DONE's future."""
    assert frames.ready_pid(await w.ask(Op.READY)) == w.pid
    await w.ask(Op.LOAD, Load(0, 32, 0, 0, "heartbeat", sim(kernel="heartbeat")).encode())
    mb.reset_slot(slot)
    mb.run(slot)
    gen, done = w.next_gen(0)
    await w.ask(Op.LAUNCH, LaunchReq(0, gen, slot, 1).encode())
    await until(lambda: mb.u32(slot, abi.STATE) == abi.RUNNING, what="the heartbeat running")
    return done


def reap(pid: int, within: float = 30.0) -> int:
    """A detached worker is still this test's child: its exit status, once it exits."""
    got: list[int] = []

    def exited() -> bool:
        p, status = os.waitpid(pid, os.WNOHANG)
        if p == pid:
            got.append(os.waitstatus_to_exitcode(status))
            child.note_reaped(pid, got[0])
        return bool(got)

    poll(exited, within, f"worker {pid} exited")
    return got[0]


@pytest.fixture
async def live_rig(mps, state):
    r = LiveRig(state, mps, D)
    try:
        yield r
    finally:
        await r.close()


# ---- the mailbox ------------------------------------------------------------------------------


def test_a_file_mailbox_is_private_zeroed_and_reopened_as_it_is(state):
    path = os.path.join(state, "mailbox")
    with open(path, "wb") as f:
        f.write(b"\xff" * 10)  # an earlier run's: truncated and zeroed
    os.chmod(path, 0o644)
    mb = Mailbox.create(path)
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == abi.MAILBOX_BYTES and mb.path == path
        assert mb.u32(0, 0) == 0
        mb.set_u64(7, abi.HEARTBEAT, 12345)
        again = Mailbox.open(path)
        try:
            assert again.heartbeat(7) == 12345  # the same memory: what an adopter maps
            again.set_u32(7, abi.CONTROL, abi.HALT)
            assert mb.u32(7, abi.CONTROL) == abi.HALT
        finally:
            again.close()
    finally:
        mb.close()
    assert Mailbox.open(path).close() is None  # it outlives its creator
    memfd = Mailbox.create()  # the non-live default stays a memfd
    try:
        assert memfd.path.startswith(f"/proc/{os.getpid()}/fd/")
    finally:
        memfd.close()


# ---- detach and adopt -------------------------------------------------------------------------


async def test_detach_then_adopt_keeps_the_worker_and_its_kernel(live_rig, mps, state):
    first = await live_rig.sup()
    w = await live_rig.spawn(first)
    assert w.hello is not None and w.hello.pid == w.pid and w.hello.version == frames.PROTOCOL_VERSION
    assert w.hello.launches == () and w.hello.mailbox == live_rig.mailbox.path
    sock = frames.listen_path(live_rig.dir, w.pid)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and os.path.exists(os.path.join(live_rig.dir, f"{w.pid}.log"))
    await heartbeat(w, live_rig.mailbox, 3)
    await beating(live_rig.mailbox, 3)
    assert await first.detach() == [w.pid]
    assert w.state == WorkerState.DETACHED and first.closed and not first.children()
    await beating(live_rig.mailbox, 3, times=10)  # no daemon connected: the kernel runs on
    mailbox = Mailbox.open(live_rig.mailbox.path)  # what the next meshd-mps maps
    try:
        second = await live_rig.sup()
        a = await second.adopt(sock)
        assert a.pid == w.pid and a.hello is not None and a.device == 0
        assert [(m.id, m.name, m.gen) for m in a.hello.modules] == [(0, "heartbeat", 1)]
        assert a.hello.launches == (HelloLaunch(module=0, gen=1, slot=3, nodes=1, running=True),)
        assert set(a.outstanding) == {(0, 1)} and a.running()
        assert frames.ready_pid(await a.ask(Op.READY)) == w.pid  # the same process answers
        await beating(mailbox, 3)
        mailbox.halt(3)
        with anyio.fail_after(10):
            d = await a.outstanding[(0, 1)]
        assert d.ok and d.gen == 1 and mailbox.u32(3, abi.STATE) == abi.EXITED and not a.running()
        # and it still serves: the next launch on the adopted channel
        mailbox.run(3)
        gen, done = a.next_gen(0)
        assert gen == 2
        await a.ask(Op.LAUNCH, LaunchReq(0, gen, 3, 1).encode())
        await beating(mailbox, 3)
        mailbox.halt(3)
        with anyio.fail_after(10):
            assert (await done).ok
        await second.close()
        assert a.process.exited and not os.path.exists(sock)
    finally:
        mailbox.close()


async def test_a_done_while_detached_is_delivered_after_hello(live_rig):
    first = await live_rig.sup()
    w = await live_rig.spawn(first)
    await heartbeat(w, live_rig.mailbox, 5)
    await first.detach()
    live_rig.mailbox.halt(5)
    await until(lambda: live_rig.mailbox.u32(5, abi.STATE) == abi.EXITED, what="the heartbeat halted while detached")
    second = await live_rig.sup()
    a = await second.adopt(frames.listen_path(live_rig.dir, w.pid))
    assert a.pid == w.pid and a.hello is not None
    assert a.hello.launches == (HelloLaunch(module=0, gen=1, slot=5, nodes=1, running=False),)
    with anyio.fail_after(10):
        d = await a.outstanding[(0, 1)]  # its DONE, queued while no daemon was connected
    assert d.ok and d.gen == 1 and a.done[0] == 1 and not a.running()
    # A second adopter gets no DONE twice: the worker's account says nothing is outstanding.
    await second.detach()
    third = await live_rig.sup()
    b = await third.adopt(frames.listen_path(live_rig.dir, w.pid))
    assert b.hello is not None and b.hello.launches == () and b.outstanding == {} and b.gen == {0: 1}


async def test_the_orphan_timeout_halts_the_kernel_and_exits_0(mps, state):
    r = LiveRig(state, mps, Deadlines(retire_quit=1.0, retire_kill=2.0, orphan=1.0))
    try:
        first = await r.sup()
        w = await r.spawn(first)
        await heartbeat(w, r.mailbox, 2)
        await first.detach()
        await beating(r.mailbox, 2)
        assert reap(w.pid, within=20.0) == 0
        assert r.mailbox.u32(2, abi.STATE) == abi.EXITED  # halted by the worker itself, before its exit
        assert not os.path.exists(frames.listen_path(r.dir, w.pid))
        with open(os.path.join(r.dir, f"{w.pid}.log")) as f:
            logged = f.read()
        assert "no daemon connected within 1 s" in logged and "orphan timeout: every kernel halted" in logged, logged
    finally:
        await r.close()
    assert EXIT_FAULT not in control_log(mps)


async def test_stdin_eof_halts_the_running_kernel_before_the_worker_exits(live_rig, mps):
    sup = await live_rig.sup()
    bystander = await live_rig.spawn(sup, listen=False)
    by_done = await heartbeat(bystander, live_rig.mailbox, 1)
    w = await live_rig.spawn(sup, listen=False)
    done = await heartbeat(w, live_rig.mailbox, 2)
    w.close_stdin()  # what a SIGKILL of the daemon gives every worker on a pipe
    with anyio.fail_after(20):
        d = await done
        assert await w.process.wait() == 0
    assert d.ok and live_rig.mailbox.u32(2, abi.STATE) == abi.EXITED  # halted, not torn down
    await beating(live_rig.mailbox, 1)  # the bystander never noticed
    assert not by_done.done() and bystander.state == WorkerState.READY
    assert EXIT_FAULT not in control_log(mps)
    live_rig.mailbox.halt(1)
    with anyio.fail_after(10):
        assert (await by_done).ok


# ---- refusals ---------------------------------------------------------------------------------


class FakeWorker:
    """A socket that answers one connection with the HELLO it is given (in this process, so that
    SO_PEERCRED names us)."""

    def __init__(self, path: str, hello: bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.path = path
        self.hello = hello
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.sock.accept()
            with conn:
                conn.sendall(frames.encode(Op.HELLO, self.hello))
                conn.recv(1)  # until the adopter closes it

    async def close(self) -> None:
        self.sock.close()
        await asyncio.to_thread(self.thread.join, 5)  # it ends once the adopter has closed its end
        os.unlink(self.path)


async def test_another_protocol_version_or_a_pid_that_lies_is_refused(state):
    sup = Supervisor(D)
    await sup.start()
    try:
        path = os.path.join(state, "4242.sock")
        fake = FakeWorker(path, Hello(99, os.getpid(), 0).encode()[:8] + b"a future layout")
        try:
            with pytest.raises(ProtocolMismatch) as e:
                await sup.adopt(path)
            assert (e.value.pid, e.value.theirs, e.value.ours) == (os.getpid(), 99, frames.PROTOCOL_VERSION)
            sup.leave_unadopted()  # never dismiss it: the fake is this process
        finally:
            await fake.close()
        fake = FakeWorker(path, Hello(frames.PROTOCOL_VERSION, os.getpid() + 1, 0).encode())
        try:
            with pytest.raises(PeerMismatch) as p:
                await sup.adopt(path)
            assert (p.value.pid, p.value.claimed) == (os.getpid(), os.getpid() + 1)
        finally:
            await fake.close()
        assert not sup.workers and not sup.children()
    finally:
        await sup.close()


async def test_a_dead_workers_socket_gives_worker_gone_and_is_removed(live_rig):
    first = await live_rig.sup()
    w = await live_rig.spawn(first)
    await first.detach()
    os.kill(w.pid, signal.SIGKILL)  # died while orphaned: nothing of it removes its socket
    assert reap(w.pid) == -signal.SIGKILL
    sock = frames.listen_path(live_rig.dir, w.pid)
    assert os.path.exists(sock)
    second = await live_rig.sup()
    with pytest.raises(WorkerGone) as e:
        await second.adopt(sock)
    assert e.value.pid == w.pid and not os.path.exists(sock)
    with pytest.raises(WorkerGone):  # and now there is nothing at all
        await second.adopt(sock)
    os.unlink(os.path.join(live_rig.dir, f"{w.pid}.log"))


async def test_a_socket_path_over_the_limit_is_refused(live_rig):
    sup = await live_rig.sup()
    with pytest.raises(ConfigError, match="over the 107-byte limit"):
        await sup.spawn(worker_argv(live_rig.mailbox.path, 0, "sim"), live_rig.env, listen="/tmp/" + "x" * 100)
    assert not sup.children()


# ---- the control daemon -----------------------------------------------------------------------


async def test_the_control_daemon_is_adopted_by_pid(standin_on_path, state):
    dir = os.path.join(state, "mps")
    first = ControlDaemon(dir, temporary=False)
    with pytest.raises(NotAdoptable):  # nothing there yet
        await first.adopt()
    await first.start()
    pid = first.pid
    assert pid is not None
    with open(os.path.join(first.pipe_dir, PID_FILE)) as f:
        assert int(f.read()) == pid
    start = procfs.starttime(pid)
    assert start is not None
    first.detach()
    await first.quit()  # nothing: it was detached
    assert procfs.alive(pid, start) and os.path.exists(os.path.join(dir, MARKER))
    second = ControlDaemon(dir, temporary=False)
    await second.adopt()
    try:
        assert second.pid == pid and second.adopted and second.alive() and second.lost() is None
        owner = Owner.read(dir)
        assert owner is not None and owner.meshd_pid == os.getpid() and owner.daemon_pid == pid
        assert owner.daemon_start == start
        assert (await second.control("get_server_list")) == ""  # it answers: no server yet, no client
    finally:
        await second.quit()
    assert not procfs.alive(pid, start) and not os.path.exists(os.path.join(dir, MARKER))


async def test_a_control_daemon_whose_pid_was_reused_is_not_adopted(standin_on_path, state):
    dir = os.path.join(state, "mps")
    first = ControlDaemon(dir, temporary=False)
    await first.start()
    try:
        first.detach()
        o = Owner.read(dir)
        assert o is not None and o.daemon_start is not None
        Owner(o.meshd_pid, o.meshd_start, o.daemon_pid, o.daemon_start + 1, o.boot, False).write(dir)
        with pytest.raises(NotAdoptable, match="the pid was reused") as e:
            await ControlDaemon(dir, temporary=False).adopt()
        assert e.value.dir == os.path.abspath(dir)
        o.write(dir)
    finally:
        again = ControlDaemon(dir, temporary=False)
        await again.adopt()
        await again.quit()


# ---- the HELLO codec ----------------------------------------------------------------------------


def test_hello_round_trips_and_refuses_what_does_not_fit():
    info = frames.Loaded(1, 40, 2, 0, 132, 0x7F0000001000, 4096)
    h = Hello(frames.PROTOCOL_VERSION, 1234, 1, (frames.HelloModule(0, 3, "heartbeat", 0xFEEDFACE12345678, info),
                                                 frames.HelloModule(2, 0, "é")),
              (HelloLaunch(0, 3, 7, 132, True), HelloLaunch(2, 1, 8, 1, False)), "/run/meshd/mailbox")
    body = h.encode()
    assert Hello.decode(body) == h and Hello.head(body) == (frames.PROTOCOL_VERSION, 1234)
    assert Hello.decode(body).modules[0].info == info and Hello.decode(body).modules[0].tag == 0xFEEDFACE12345678
    assert Hello.decode(Hello(1, 5, 0).encode()) == Hello(1, 5, 0)
    m = frames.HELLO_MODULE.size
    for cut in (0, 7, 19, 25, 40, frames.HELLO_HEAD.size + m + 3):
        with pytest.raises(frames.FrameError):
            Hello.decode(body[:cut])
    bad = bytearray(body)
    second = frames.HELLO_HEAD.size + m + 9 + m + 2 + frames.HELLO_LAUNCH.size  # the second launch's
    bad[second + 16 : second + 20] = b"\x02\0\0\0"
    with pytest.raises(frames.FrameError, match="running word 2"):
        Hello.decode(bytes(bad))
