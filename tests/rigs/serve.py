"""``meshd-mps serve`` as a subprocess (``--gpu sim``, or the real GPU in tests/gpu): the daemon
(``Serve``), the CLI (``cli``), the example programs as the API takes them, the metrics' text
format, and what a daemon leaves behind (processes, its control daemon, its log's events)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshd_mps import standin
from meshd_mps.mps.control import MARKER, Owner
from meshd_mps.serving.client import Client, ClientError
from meshd_mps.supervision import procfs

from .waits import poll

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
READY_S = 30.0
STOP_S = 30.0


def env() -> dict[str, str]:
    """The stand-in MPS daemon first on PATH, then this interpreter's bin dir; the source tree importable."""
    e = {k: v for k, v in os.environ.items() if k not in ("MESHD_MPS_SOCKET", "CUDA_MPS_PIPE_DIRECTORY")}
    e["PATH"] = os.pathsep.join([standin.BIN_DIR, os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.pop("MESHD_MPS_LOG_LEVEL", None)
    return e


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd_mps", *args], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=timeout)


class Serve:
    """One ``meshd-mps serve --gpu sim`` subprocess (``gpu="cuda"``: the real GPU and NVIDIA's MPS
    control, tests/gpu), its log in a file."""

    def __init__(self, dir: str, isolation: str, sock: str, *extra: str, group: bool = False, gpu: str = "sim"):
        """``group``: the leader of a process group of its own, as a shell job is (a signal to the
        group is then what a terminal, or ``kill %1``, sends)."""
        self.dir, self.isolation, self.sock = dir, isolation, sock
        self.logpath = os.path.join(dir, f"serve-{time.monotonic_ns()}.log")
        # A state dir of its own unless given (a restart test gives the same one twice): else the
        # next daemon would restore this one's programs, or be refused the dir while this one runs.
        state = [] if "--state-dir" in extra else ["--state-dir", os.path.join(dir, f"state-{time.monotonic_ns()}")]
        argv = [sys.executable, "-m", "meshd_mps", "serve", "--gpu", gpu, "--isolation", isolation,
                "--socket", sock, "--log-format", "json", *state, *extra]
        e = env() if gpu == "sim" else {**env(), "PATH": os.environ.get("PATH", "")}
        with open(self.logpath, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=REPO,
                                         process_group=0 if group else None, preexec_fn=_stop_with_us)
        self.client = Client(sock, timeout=60)

    def log(self) -> str:
        with open(self.logpath, errors="replace") as f:
            return f.read()

    def wait_ready(self) -> dict:
        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"meshd-mps serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return Client(self.sock, timeout=5).status()
            except ClientError:
                return None

        return poll(up, READY_S, f"meshd-mps serve answering on {self.sock}", every=0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"meshd-mps serve did not stop {STOP_S:g}s after {signal.Signals(sig).name}:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- helpers: processes, metrics --------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def _stop_with_us() -> None:
    """In the daemon's child, before exec: a SIGTERM when the test process dies (a pytest-xdist
    worker ended by a crash or a timeout runs no ``finally``), so that no daemon outlives the suite."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def leftovers(marks: list[str]) -> list[str]:
    """Processes whose command line or environment mentions one of ``marks``."""
    out = []
    bmarks = [m.encode() for m in marks if m]
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        cmd = _read(f"/proc/{d}/cmdline")
        envb = _read(f"/proc/{d}/environ")
        if any(m in cmd or m in envb for m in bmarks):
            text = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
            out.append(f"{d}: {text}")
    return out


def assert_clean_exit(s: Serve, mps_dir: str | None) -> None:
    assert not os.path.exists(s.sock), "the socket is left behind"
    if mps_dir:
        assert not os.path.exists(mps_dir), f"the MPS dir {mps_dir} is left behind"
    marks = [s.sock, mps_dir or "", f"/proc/{s.proc.pid}/fd/"]
    poll(lambda: not leftovers(marks), 10.0, f"no process of the daemon left: {leftovers(marks)}")


_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:\\.|[^"\\])*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:\\.|[^"\\])*")*\})?'
    r" (-?[0-9][0-9.eE+-]*|NaN|\+Inf|-Inf)$"
)


def parse_metrics(text: str) -> dict[str, float]:
    """The text format 0.0.4, checked line by line: {'name{labels}': value}."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert name not in types, f"{name}: TYPE twice"
            types[name] = kind
            continue
        assert not line.startswith("#"), f"a stray comment: {line}"
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name = m[1]
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or base in types, f"{name}: a sample before its TYPE"
        out[name + (m[2] or "")] = float(m[3])
    return out


def exchange(sock: str, data: bytes) -> bytes:
    """``data`` sent on a connection of its own; all that comes back until the daemon closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(sock)
        raw.sendall(data)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    return answer


def ptx_of(name: str) -> str:
    from meshd_mps.gpu.compiler import cuda_to_ptx

    return cuda_to_ptx((EXAMPLES / name / f"{name}.cu").read_bytes(), name, "compute_90").decode()


def manifest(example: str, **over) -> dict:
    m = json.loads((EXAMPLES / example / "manifest.json").read_text())
    m.update(over)
    return m


NOBODY = 65534  # the uid of nobody: another user than the daemon's


def events(s: Serve) -> list[dict]:
    """The daemon's log lines that are JSON, parsed (it logs with --log-format json)."""
    out = []
    for line in s.log().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def left_by(o: Owner) -> list[int]:
    """The control daemon of ``o`` and its children (the server): what a SIGKILL of its meshd-mps
    leaves running."""
    return [o.daemon_pid or 0, *(p.pid for p in procfs.processes() if p.ppid == o.daemon_pid)]


def reap(pids: list[int]) -> None:
    """This test process is a subreaper (conftest): what the dead meshd-mps left was re-parented
    to it, and is reaped here once gone, as init would reap it on a host."""

    def gone() -> bool:
        for p in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p, os.WNOHANG)
        return all(procfs.starttime(p) is None for p in pids)

    poll(gone, 10.0, f"{pids} gone and reaped")


def owner_of(mps_dir: str) -> Owner:
    """The owner marker a daemon of ``mps_dir`` wrote (a test failure if there is none)."""
    o = Owner.read(mps_dir)
    assert o is not None, f"no {MARKER} in {mps_dir}"
    return o
