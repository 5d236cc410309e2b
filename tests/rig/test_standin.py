"""The stand-in ``nvidia-cuda-mps-control``, driven as the supervisor drives it: as subprocesses.

Every test leaves no process behind: the pytest process is made a child
subreaper, so the daemon (re-parented when ``-d``'s parent exits) becomes our
child, and after ``quit`` it is reaped here and its server is checked gone.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from meshd_mps.standin import BIN_DIR, CLIENT_SOCKET, StandinRefused, connect_client

from ..rigs.waits import poll

BIN = "nvidia-cuda-mps-control"
DEADLINE = 10.0
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="module", autouse=True)
def subreaper() -> None:
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.fail("prctl(PR_SET_CHILD_SUBREAPER) failed")


def gone(pid: int) -> bool:
    """True once ``pid`` no longer exists; reaps it where it is our child."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def reap(pid: int) -> int:
    """Wait (under the deadline) for our child ``pid`` to exit; its exit status."""
    end = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            pytest.fail(f"process {pid} did not exit within {DEADLINE} s")
        time.sleep(0.01)


class Standin:
    """One pipe and log directory, and the processes started in it."""

    def __init__(self, root: Path, **extra_env: str) -> None:
        self.pipe = root / "pipe"
        self.logs = root / "log"
        self.env = dict(os.environ)
        self.env.pop("MESHD_MPS_STANDIN_MAX_CLIENTS", None)
        # The script's "#!/usr/bin/env python3" finds this interpreter's python3 (quick to start).
        path = os.pathsep.join([BIN_DIR, os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        self.env.update(PATH=path,
                        CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.logs),
                        **extra_env)
        self.daemon_pid: int | None = None
        self.servers: set[int] = set()
        self.sockets: list[socket.socket] = []

    def run(self, *args: str, input: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([BIN, *args], input=input, env=self.env, capture_output=True,
                              text=True, timeout=DEADLINE)

    def ask(self, *lines: str) -> str:
        r = self.run(input="".join(line + "\n" for line in lines))
        assert r.returncode == 0, r
        return r.stdout

    def server_list(self) -> list[int]:
        pids = [int(x) for x in self.ask("get_server_list").split()]
        self.servers.update(pids)
        return pids

    def client_list(self, server: int) -> list[int]:
        return [int(x) for x in self.ask(f"get_client_list {server}").split()]

    def client(self, pid: int) -> socket.socket | None:
        s = connect_client(str(self.pipe), pid)
        if s is not None:
            self.sockets.append(s)
        return s

    def start(self) -> int:
        r = self.run("-d")
        assert r.returncode == 0, r
        assert r.stdout == "" and r.stderr == ""
        self.daemon_pid = int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())
        return self.daemon_pid

    def quit(self, *lines: str) -> None:
        """Send quit, reap the daemon and check that it and its servers are gone."""
        assert self.daemon_pid is not None
        r = self.run(input="".join(line + "\n" for line in lines or ("quit",)))
        assert r.returncode == 0 and r.stdout == "", r
        for name in ("control", CLIENT_SOCKET, "nvidia-cuda-mps-control.pid"):
            assert not (self.pipe / name).exists(), name
        assert reap(self.daemon_pid) == 0
        self.daemon_pid = None
        for pid in self.servers:
            poll(lambda pid=pid: gone(pid), DEADLINE, f"server {pid} to exit")

    def cleanup(self) -> None:
        for s in self.sockets:
            s.close()
        if self.daemon_pid is not None and not gone(self.daemon_pid):
            os.kill(self.daemon_pid, signal.SIGKILL)
            reap(self.daemon_pid)
            for pid in self.servers:
                poll(lambda pid=pid: gone(pid), DEADLINE, f"server {pid} to exit")
            pytest.fail("the test left its daemon running")


@pytest.fixture
def root():
    # Short, so that PIPE_DIR/standin-clients fits AF_UNIX's 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mps(root):
    m = Standin(root)
    yield m
    m.cleanup()


@pytest.fixture
def daemon(mps):
    mps.start()
    yield mps
    if mps.daemon_pid is not None:
        mps.quit()


def recv_all(s: socket.socket) -> bytes:
    s.settimeout(DEADLINE)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


# -- command line -------------------------------------------------------------------------

def test_found_on_path_and_executable(mps):
    path = shutil.which(BIN, path=mps.env["PATH"])
    assert path == os.path.join(BIN_DIR, BIN)
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert Path(path).read_text().startswith("#!/usr/bin/env -S python3 -S\n")  # stdlib only: no site packages


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_says_stand_in(mps, flag):
    r = mps.run(flag)
    assert r.returncode == 0
    assert "STAND-IN" in r.stdout and "not NVIDIA's binary" in r.stdout


def test_no_daemon(mps):
    r = mps.run(input="get_server_list\n")
    assert r.returncode == 1
    assert "Cannot find MPS control daemon process" in r.stderr
    assert r.stdout == ""
    assert connect_client(str(mps.pipe), 1) is None


def test_stale_sockets_mean_no_daemon(mps):
    mps.pipe.mkdir()
    for name in ("control", CLIENT_SOCKET):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(mps.pipe / name))
        s.close()  # the file stays; nobody listens: ECONNREFUSED
    assert mps.run(input="quit\n").returncode == 1
    assert connect_client(str(mps.pipe), 1) is None
    mps.start()  # a stale socket does not stop a new daemon
    assert mps.server_list() == []
    mps.quit()


# -- the daemon -----------------------------------------------------------------------------

def test_start_and_quit(mps):
    pid = mps.start()
    assert not gone(pid)
    assert os.getsid(pid) == pid  # its own session
    assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
    assert os.readlink(f"/proc/{pid}/fd/1") == os.devnull
    assert BIN in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    for d in (mps.pipe, mps.logs):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0
    assert stat.S_ISSOCK((mps.pipe / "control").stat().st_mode)
    assert stat.S_ISSOCK((mps.pipe / CLIENT_SOCKET).stat().st_mode)
    first = (mps.logs / "control.log").read_text().splitlines()[0]
    assert "meshd-mps STAND-IN" in first
    assert mps.server_list() == []  # no server before the first client
    mps.quit()
    log = (mps.logs / "control.log").read_text()
    assert "Cmd:get_server_list" in log and "Cmd:quit" in log
    assert log.startswith("[20")  # timestamped lines


def test_quit_with_timeout(mps):
    mps.start()
    mps.client(100)
    mps.server_list()
    mps.quit("quit -t 5")


def test_second_daemon_refused(daemon):
    r = daemon.run("-d")
    assert r.returncode == 1
    assert "An instance of this daemon is already running" in r.stderr
    assert not gone(daemon.daemon_pid)
    assert daemon.ask("get_default_active_thread_percentage") == "100.0\n"


def test_daemon_start_failure_is_reported(root):
    deep = root / ("d" * 100)  # PIPE_DIR/control is longer than AF_UNIX allows
    m = Standin(root)
    m.env["CUDA_MPS_PIPE_DIRECTORY"] = str(deep)
    r = m.run("-d")
    assert r.returncode == 1
    assert r.stderr.strip()
    assert not (deep / "nvidia-cuda-mps-control.pid").exists()
    try:  # the failed daemon was reaped by its parent: no zombie is left to us
        zombie, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        zombie = 0
    assert zombie == 0


def test_foreground(mps):
    proc = subprocess.Popen([BIN, "-f"], env=mps.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        poll(lambda: mps.run(input="get_server_list\n").returncode == 0, DEADLINE, "the -f daemon")
        assert int((mps.pipe / "nvidia-cuda-mps-control.pid").read_text()) == proc.pid
        mps.client(7)
        server = mps.server_list()[0]
        assert mps.ask("quit") == ""
        assert proc.wait(DEADLINE) == 0
        poll(lambda: gone(server), DEADLINE, "the server to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_sigterm_cleans_up(mps):
    pid = mps.start()
    mps.client(8)
    server = mps.server_list()[0]
    os.kill(pid, signal.SIGTERM)
    assert reap(pid) == 0
    mps.daemon_pid = None
    poll(lambda: gone(server), DEADLINE, "the server to exit")
    assert not (mps.pipe / "control").exists()
    assert not (mps.pipe / "nvidia-cuda-mps-control.pid").exists()


# -- commands -------------------------------------------------------------------------------

def test_unknown_command_and_thread_percentage(daemon):
    r = daemon.run(input="no_such_command 1 2\n")
    assert r.returncode == 0 and r.stdout == "Unknown command\n"
    assert daemon.ask("quit -t soon") == "Unknown command\n"  # not a quit: the daemon stays
    assert not gone(daemon.daemon_pid)
    assert daemon.ask("get_default_active_thread_percentage") == "100.0\n"
    assert daemon.ask("set_default_active_thread_percentage 25") == "25\n"
    assert daemon.ask("get_default_active_thread_percentage") == "25.0\n"


def test_several_commands_one_connection(daemon):
    """One client process kept open, a command written and its answer read at a time."""
    proc = subprocess.Popen([BIN], env=daemon.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    try:
        for _ in range(3):
            proc.stdin.write("get_default_active_thread_percentage\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "100.0\n"  # answered before stdin closes
        proc.stdin.close()
        assert proc.wait(DEADLINE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_server_and_clients(daemon):
    a = daemon.client(1001)
    assert a is not None
    [server] = daemon.server_list()
    assert not gone(server)
    assert Path(f"/proc/{server}/cmdline").read_bytes().startswith(b"/")  # a real process
    assert daemon.ask(f"get_server_status {server}") == "ACTIVE\n"
    assert daemon.client_list(server) == [1001]
    daemon.client(1002)
    assert daemon.server_list() == [server]  # one server for all clients
    assert sorted(daemon.client_list(server)) == [1001, 1002]
    assert daemon.ask("get_client_list 1") == ""  # an unknown server
    ps = daemon.ask("ps").splitlines()
    assert ps[0].split() == ["PID", "ID", "SERVER", "DEVICE", "NAMESPACE", "COMMAND"]
    assert sorted(int(row.split()[0]) for row in ps[1:]) == [1001, 1002]
    assert {int(row.split()[2]) for row in ps[1:]} == {server}
    a.close()  # EOF: no longer a client
    poll(lambda: daemon.client_list(server) == [1002], DEADLINE, "client 1001 to be removed")
    log = (daemon.logs / "control.log").read_text()
    assert "1001" in log and "Client 1001 disconnected" in log
    survivor = daemon.sockets[1]
    daemon.quit()
    assert recv_all(survivor) == b""  # quit closes the clients' connections


def test_terminate_client(daemon):
    a = daemon.client(2001)
    daemon.client(2002)
    [server] = daemon.server_list()
    assert daemon.ask(f"terminate_client {server} 2001") == "0\n"
    assert recv_all(a) == b"TERMINATED\n"  # then EOF
    assert daemon.client_list(server) == [2002]


def test_server_death_is_noticed(daemon):
    a = daemon.client(3001)
    [server] = daemon.server_list()
    os.kill(server, signal.SIGKILL)
    poll(lambda: daemon.server_list() == [], DEADLINE, "the dead server to leave the list")
    assert recv_all(a) == b""  # its clients are gone with it
    daemon.client(3002)
    [new] = daemon.server_list()
    assert new != server
    assert daemon.client_list(new) == [3002]


# -- client limit ---------------------------------------------------------------------------

def test_default_limit_is_48(daemon):
    for i in range(48):
        assert daemon.client(4000 + i) is not None
    with pytest.raises(StandinRefused, match=r"Maximum number of clients \(48\) reached"):
        daemon.client(4048)
    [server] = daemon.server_list()
    assert len(daemon.client_list(server)) == 48
    log = (daemon.logs / "server.log").read_text().splitlines()
    assert any(line.endswith("Failed to accept new client. Maximum number of clients (48) reached.")
               for line in log)


def test_limit_override_and_slot_reuse(root):
    m = Standin(root, MESHD_MPS_STANDIN_MAX_CLIENTS="2")
    try:
        m.start()
        first = m.client(1)
        m.client(2)
        with pytest.raises(StandinRefused, match=r"Maximum number of clients \(2\) reached"):
            m.client(3)
        [server] = m.server_list()
        first.close()
        poll(lambda: m.client_list(server) == [2], DEADLINE, "a free slot")
        assert m.client(4) is not None
        assert sorted(m.client_list(server)) == [2, 4]
        m.quit()
    finally:
        m.cleanup()


def test_bad_hello_is_refused(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(daemon.pipe / CLIENT_SOCKET))
        s.sendall(b"HI there\n")
        assert recv_all(s).startswith(b"ERR ")
    finally:
        s.close()
    assert daemon.server_list() == []


# -- a fatal GPU error's recovery ----------------------------------------------------------
# As the H100's server (driver 580, scripts/mps_recovery_probe.py,
# docs/runs/recovery-and-restarts.md): no new client of the device while a torn-down client lives; once the last has exited,
# the server recreates its contexts for a time that grows with the clients torn down, and a client
# connecting meanwhile waits (its context creation blocks) instead of being refused.  Other devices'
# clients are taken at once.

#: Per torn-down client, here (the stand-in's default is scaled down for the CPU suite).
RECOVER_MS = 200


@pytest.fixture
def standin(root, request):
    m = Standin(root, MESHD_MPS_STANDIN_RECOVER_MS=str(getattr(request, "param", RECOVER_MS)))
    m.start()
    yield m
    if m.daemon_pid is not None:
        m.quit()
    m.cleanup()


def test_a_new_client_waits_for_the_devices_recovery_which_grows_with_the_clients_torn_down(standin):
    a, b, c = (standin.client(5000 + i) for i in range(3))
    other = connect_client(str(standin.pipe), 5100, device=1)
    assert a and b and c and other
    standin.sockets.append(other)
    a.sendall(b"FAULT\n")  # a's fatal GPU error tears down a, b and c (device 0), not device 1's
    for s in (a, b, c):
        assert recv_all_line(s) == b"FAULT\n"
    with pytest.raises(StandinRefused, match="handling a fatal GPU error"):
        connect_client(str(standin.pipe), 5200)  # torn clients still live: refused, as on the GPU
    for s in (a, b, c):
        s.close()
    gone = time.monotonic()
    late = connect_client(str(standin.pipe), 5201, timeout=DEADLINE)  # waits, is not refused
    waited = time.monotonic() - gone
    assert late is not None
    standin.sockets.append(late)
    assert waited >= 3 * RECOVER_MS / 1e3 * 0.9, waited  # 3 clients torn down: 3 x RECOVER_MS
    log = (standin.logs / "server.log").read_text()
    assert "Device 0: every client torn down has exited; recreating its contexts (3 clients)" in log


@pytest.mark.parametrize("standin", [10 * DEADLINE * 1e3], indirect=True)  # device 0 recovers for 10 deadlines
def test_another_devices_client_is_taken_during_the_recovery(standin):
    a = standin.client(6000)
    assert a is not None
    a.sendall(b"FAULT\n")
    assert recv_all_line(a) == b"FAULT\n"
    a.close()
    with pytest.raises(TimeoutError):  # device 0 still recovering: its new client waits
        connect_client(str(standin.pipe), 6001, timeout=0.5)
    s = connect_client(str(standin.pipe), 6100, device=1, timeout=DEADLINE)  # not held by device 0's
    assert s is not None
    standin.sockets.append(s)


def recv_all_line(s) -> bytes:
    s.settimeout(DEADLINE)
    with s.makefile("rb") as f:
        return f.readline()
