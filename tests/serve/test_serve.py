"""``meshd-mps serve`` end to end: a real daemon subprocess (``--gpu sim``), driven by
the CLI (subprocesses) and by the client module, in both isolation modes; the
control API's errors; signals; the plain no-driver message."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import warnings

import pytest

from meshd_mps import standin
from meshd_mps.base.defaults import POOL_BY_ISOLATION
from meshd_mps.serving.client import MAX_BODY, Client, ClientError, NoDaemon, program_body

from ..rigs.serve import (
    EXAMPLES,
    NOBODY,
    REPO,
    STOP_S,
    Serve,
    assert_clean_exit,
    cli,
    env,
    exchange,
    manifest,
    parse_metrics,
    ptx_of,
)
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(120)


# ---- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["blink", "mps"])
def test_serve_end_to_end(serve, tmp, isolation):
    sock = os.path.join(tmp, "s.sock")
    if isolation == "blink":  # a stale socket file (nobody listens) is replaced
        st = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        st.bind(sock)
        st.close()
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    s = serve(isolation)
    status = s.wait_ready()
    c = s.client
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
    assert status["isolation"] == isolation and status["gpu"] == "sim" and status["programs"] == 0
    assert status["pid"] == s.proc.pid and status["caps"]["sms_total"] == 132
    assert set(status["versions"]) >= {"meshd-mps", "python", "cuda-bindings", "nvjitlink"}
    mps_dir = status["mps_dir"]
    if isolation == "mps":
        pool = POOL_BY_ISOLATION["mps"]  # serve's default
        assert len(status["pool"]["idle"]) == pool and status["pool"]["capacity"] == pool
        assert status["server_pid"] and sorted(status["clients"]) == sorted(status["pool"]["idle"])
        assert status["daemon_pid"] and os.path.isdir(mps_dir)
    else:
        assert status["context_pid"] and mps_dir is None
    assert '"msg": "meshd-mps' in s.log() and f"serves on {sock}: isolation {isolation}, gpu sim" in s.log()

    # A second daemon on the same socket is refused, the first one untouched.
    second = cli("serve", "--gpu", "sim", "--isolation", isolation, "--socket", sock)
    assert second.returncode == 1 and f"another meshd-mps serves on {sock}" in second.stderr
    assert "Traceback" not in second.stderr

    # Load: a program directory through the CLI (the CLI compiles its .cu, the daemon gets PTX), and through
    # the client module (program_body compiles it the same way).
    r = cli("load", str(EXAMPLES / "heartbeat"), "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert re.match(r"heartbeat loaded on slot 0 \(pid \d+, hash [0-9a-f]{16}, ", r.stdout), r.stdout
    ans = c.load(program_body(str(EXAMPLES / "echo")))
    echo = ans["program"]
    assert ans["program"]["name"] == "echo" and echo["state"] == "running" and echo["slot"] == 1 and echo["upgrades"] == 0

    # ps: both running, heartbeats advancing.
    r = cli("ps", "--socket", sock)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SLOT", "STATE", "PID"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert set(rows) == {"heartbeat", "echo"} and all(row[2] == "running" for row in rows.values())
    first = {p["name"]: p["heartbeat"] for p in c.programs()}
    poll(lambda: all(p["heartbeat"] > first[p["name"]] for p in c.programs()), 10.0, "heartbeats advancing")
    listed = {p["name"]: p for p in json.loads(cli("ps", "--json", "--socket", sock).stdout)["programs"]}
    assert listed["heartbeat"]["pid"] > 0 and listed["echo"]["uptime_s"] >= 0
    if isolation == "mps":
        assert listed["heartbeat"]["pid"] != listed["echo"]["pid"]  # each its own MPS client
    else:
        assert listed["heartbeat"]["pid"] == listed["echo"]["pid"] == status["context_pid"]

    # call: the CLI prints the response; the client gets text and hex.
    r = cli("call", "echo", "hello meshd", "--socket", sock)
    assert r.returncode == 0 and r.stdout == "hello meshd\n", (r.stdout, r.stderr)
    got = c.call("echo", b"\x00\xffbin", timeout=5)
    assert got["hex"] == "00ff62696e" and got["bytes"] == 5
    r = cli("call", "echo", "00ff10", "--hex", "--timeout", "3", "--socket", sock)
    assert r.returncode == 0 and r.stdout == "00ff10\n", r.stderr

    # upgrade: same slot, upgrades 1; the expected hash checked.
    r = cli("upgrade", "echo", str(EXAMPLES / "echo"), "--hash", echo["hash"], "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("echo upgraded on slot 1 (upgrade 1, "), r.stdout
    up = c.program("echo")
    assert up["slot"] == echo["slot"] and up["upgrades"] == 1 and up["state"] == "running"
    assert c.call("echo", "after upgrade")["data"] == "after upgrade"

    # status: the table and the JSON.
    r = cli("status", "--socket", sock)
    assert r.returncode == 0, r.stderr
    table = dict(re.split(r"\s{2,}", ln, maxsplit=1) for ln in r.stdout.splitlines())
    assert table["isolation"] == isolation and table["gpu"] == "sim" and table["programs"] == "2"
    assert table["loads"] == "3" and table["socket"] == sock
    js = json.loads(cli("status", "--json", "--socket", sock).stdout)
    assert js["ok"] and js["programs"] == 2 and js["loads"] == 3

    # metrics: the text format parses.
    m = parse_metrics(c.metrics())
    assert m["meshd_mps_loads_total"] == 3 and m["meshd_mps_load_seconds_count"] == 3
    assert m['meshd_mps_programs{state="running"}'] == 2 and m["meshd_mps_faults_total"] == 0
    assert m["meshd_mps_worker_deaths_total"] == 0 and m["meshd_mps_workers"] >= 1
    assert m['meshd_mps_program_heartbeat{program="heartbeat"}'] > 0
    if isolation == "blink":
        assert m["meshd_mps_blinks_total"] >= 1 and "meshd_mps_last_blink_seconds" in m
        assert m["meshd_mps_pool_idle"] == 0
    else:
        assert "meshd_mps_blinks_total" not in m and m["meshd_mps_pool_capacity"] == POOL_BY_ISOLATION["mps"]

    before = {p["name"]: (p["slot"], p["hash"], p["pid"], p["upgrades"]) for p in c.programs()}
    check_errors(s, c, isolation)
    # Every bad request changed nothing.
    assert {p["name"]: (p["slot"], p["hash"], p["pid"], p["upgrades"]) for p in c.programs()} == before
    assert all(p["state"] == "running" for p in c.programs())
    assert c.status()["loads"] == 3

    # unload both.
    for name in ("echo", "heartbeat"):
        r = cli("unload", name, "--socket", sock)
        assert r.returncode == 0 and r.stdout.startswith(f"{name} unloaded from slot"), r.stderr
    assert c.programs() == []
    assert "(no programs loaded)" in cli("ps", "--socket", sock).stdout

    # A program that faults (restart policy never: it stays so): faulted in both modes (blink: its
    # context was poisoned and replaced; mps: a GPU fault), counted, its error in ps; unloaded like any other.
    c.load(program_body(str(EXAMPLES / "fault"), restart="never"))
    state = "faulted"
    poll(lambda: c.program("fault")["state"] == state, 10.0, f"fault {state}")
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in c.program("fault")["error"]
    r = cli("ps", "--socket", sock)
    assert "ERROR" in r.stdout.splitlines()[0] and "CUDA_ERROR_ILLEGAL_ADDRESS" in r.stdout
    m = parse_metrics(c.metrics())
    assert m["meshd_mps_faults_total"] == 1 and m[f'meshd_mps_programs{{state="{state}"}}'] == 1
    assert m["meshd_mps_worker_deaths_total"] == 0
    refused = c.call
    with pytest.raises(ClientError) as ei:
        refused("fault", "x")
    assert ei.value.status == 409 and f"is not running ({state})" in str(ei.value)
    c.unload("fault")
    assert c.programs() == []

    # SIGTERM: a clean stop, nothing left behind.
    assert s.stop(signal.SIGTERM) == 0, s.log()
    assert "SIGTERM: shutting down" in s.log() and "meshd-mps stopped" in s.log()
    assert_clean_exit(s, mps_dir)


def check_errors(s: Serve, c: Client, isolation: str) -> None:
    def refused(fn, status: int, *words: str) -> str:
        with pytest.raises(ClientError) as ei:
            fn()
        assert ei.value.status == status, (ei.value.status, str(ei.value))
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
        return str(ei.value)

    # Unknown program: 404, the CLI says so plainly.
    refused(lambda: c.unload("nope"), 404, "'nope' is not loaded")
    refused(lambda: c.call("nope", "x"), 404, "not loaded")
    refused(lambda: c.upgrade("nope", program_body(str(EXAMPLES / "echo")) | {"manifest": manifest("echo", name="nope")}), 404)
    r = cli("call", "nope", "x", "--socket", s.sock)
    assert r.returncode == 1 and r.stderr == "meshd-mps: program 'nope' is not loaded\n"
    # Duplicate load: 409.
    refused(lambda: c.load(program_body(str(EXAMPLES / "heartbeat"))), 409, "already loaded")
    r = cli("load", str(EXAMPLES / "echo"), "--socket", s.sock)
    assert r.returncode == 1 and "already loaded" in r.stderr
    # Bad manifest field, bad PTX, wrong hash: 400.
    ptx = ptx_of("spin")
    refused(lambda: c.load({"manifest": manifest("spin", colour=1), "ptx": ptx}), 400, "manifest: unknown field 'colour'")
    refused(lambda: c.load({"manifest": manifest("spin", warps=0), "ptx": ptx}), 400, "'warps'")
    msg = refused(lambda: c.load({"manifest": manifest("spin"), "ptx": ".version 9.0\n.target sm_90\ngarbage"}), 400)
    assert msg.startswith("jit: "), msg
    # CUDA C: the daemon takes PTX only (it never compiles, so no #include of a file of its own).
    refused(lambda: c.load({"manifest": manifest("spin"), "cuda": "this is not C"}), 400, "takes PTX only",
            "meshd-mps load DIR")
    refused(lambda: c.load({"manifest": manifest("spin"), "ptx": ptx, "hash": "0000000000000000"}), 400,
            "expected 0000000000000000")
    refused(lambda: c.load({"manifest": manifest("spin"), "ptx": ptx, "hash": "xyz"}), 400, "16 hex digits")
    refused(lambda: c.upgrade("echo", program_body(str(EXAMPLES / "echo"), hash="0123456789abcdef")), 400,
            "expected 0123456789abcdef")
    refused(lambda: c.upgrade("echo", {"manifest": manifest("echo"), "ptx": "garbage"}), 400, "jit: ")
    refused(lambda: c.upgrade("echo", {"manifest": manifest("heartbeat"), "ptx": ptx}), 400, "the manifest names 'heartbeat'")
    # Unknown JSON fields, bad bodies.
    refused(lambda: c.load({"manifest": manifest("spin"), "ptx": ptx, "extra": 1}), 400, "unknown field 'extra'")
    refused(lambda: c.request("POST", "/v1/programs/echo/call", {"data": "x", "when": 1}), 400, "unknown field 'when'")
    refused(lambda: c.request("POST", "/v1/programs/echo/call", {"data": "x", "hex": "00"}), 400)
    refused(lambda: c.request("POST", "/v1/programs/echo/call", {"data": "x" * 65537}), 413,
            "request of 65537 bytes is over its most, 65536 bytes")
    refused(lambda: c.request("POST", "/v1/programs/echo/call", {"data": "x", "timeout": -1}), 400, "'timeout'")
    refused(lambda: c.request("POST", "/v1/programs", None), 400, "empty body")
    refused(lambda: c.load({"ptx": ptx}), 400, "'manifest' is missing")
    refused(lambda: c.load({"manifest": manifest("spin")}), 400, "'ptx'")
    refused(lambda: c.load({"manifest": manifest("spin"), "ptx": ptx, "nodes": 0}), 400, "'nodes'")
    st, _h, body = c.raw("POST", "/v1/programs", b"{not json")
    assert st == 400 and "not JSON" in json.loads(body)["error"]
    # Program names in URLs.
    for path in ("/v1/programs/..", "/v1/programs/a%2Fb", "/v1/programs/a..b", "/v1/programs/.hidden",
                 "/v1/programs/%2E%2E", "/v1/programs/../status"):
        st, _h, body = c.raw("GET", path)
        assert st == 400, (path, st, body)
        assert json.loads(body)["ok"] is False
    st, _h, body = c.raw("DELETE", "/v1/programs/echo/../heartbeat")
    assert st == 400
    st, _h, body = c.raw("GET", "/v1/programs/a/b")
    assert st == 404 and json.loads(body) == {"ok": False, "error": "no route GET /v1/programs/a/b"}
    refused(lambda: c.unload("x/../echo"), 400, "program name")
    # Routes and methods.
    st, h, _b = c.raw("PATCH", "/v1/programs")
    assert st == 405 and h["allow"] == "GET, POST"
    st, _h, _b = c.raw("GET", "/v2/anything")
    assert st == 404
    # Oversized bodies: 413, announced (refused before any byte of it is read) and sent.
    answer = exchange(s.sock, f"POST /v1/programs HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n{{".encode())
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"ok": false' in answer and b"64 MiB" in answer
    if isolation == "blink":  # once is enough: 64 MiB through the socket
        st, _h, body = c.raw("POST", "/v1/programs", b" " * (MAX_BODY + 1))
        assert st == 413, body
    # Chunked bodies: 411 (a valid chunked body: invalid chunk framing is the parser's 400).
    answer = exchange(s.sock, b"POST /v1/programs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 411 ") and b"send Content-Length" in answer, answer[:300]
    # A request line the parser refuses: answered (aiohttp answers what it cannot parse as HTTP/1.0).
    answer = exchange(s.sock, b"NONSENSE\r\n\r\n")
    assert re.match(rb"HTTP/1\.[01] 400 ", answer), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("request head: ")
    # The daemon still serves.
    assert c.status()["ok"]



def connect_as(uid: int, sock: str) -> list[str]:
    """In a forked child that drops to ``uid`` (groups too): can it see the socket, and connect to
    it?  Its answers, e.g. ["stat ok", "connect PermissionError 13"]."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # a child that only makes syscalls and _exits: fork is fine
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = []
            try:
                os.stat(sock)
                out.append("stat ok")
            except OSError as e:
                out.append(f"stat {type(e).__name__} {e.errno}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(10)
                try:
                    c.connect(sock)
                    out.append("connect ok")
                except OSError as e:
                    out.append(f"connect {type(e).__name__} {e.errno}")
            os.write(w, "\n".join(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode().splitlines()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and got, (status, got)
    return got


def test_another_user_is_refused_by_the_socket_mode(serve, tmp):
    """The control socket is 0600: another uid (nobody, in a forked child of ours run as root)
    cannot connect (EACCES), while the directories on the way let it reach the socket, so it is the
    socket's own mode that refuses; the daemon never sees the attempt and serves its owner as before."""
    if os.geteuid() != 0:
        reason = f"needs root to run a child as another uid ({NOBODY}); running as uid {os.geteuid()}"
        print(f"skipping the other-user test: {reason}", file=sys.stderr)
        pytest.skip(reason)
    os.chmod(tmp, 0o711)  # searchable by others (the session's temporary dir is too): only the socket refuses
    s = serve("blink")
    s.wait_ready()
    c = s.client
    c.load(program_body(str(EXAMPLES / "echo")))

    def requests() -> float:
        return sum(v for k, v in parse_metrics(c.metrics()).items() if k.startswith("meshd_mps_http_requests_total"))

    def state():
        st = c.status()
        return ([(p["name"], p["slot"], p["pid"], p["hash"], p["state"], p["upgrades"]) for p in c.programs()],
                st["loads"], st["programs"], st["pid"])

    before, n0 = state(), requests()
    assert connect_as(NOBODY, s.sock) == ["stat ok", f"connect PermissionError {errno.EACCES}"]
    n1 = requests()
    n2 = requests()
    assert n1 - n0 == n2 - n1  # the refused connection was never a request: only our own metrics calls count
    assert state() == before
    assert c.call("echo", "still the owner's")["data"] == "still the owner's"
    assert stat.S_IMODE(os.lstat(s.sock).st_mode) == 0o600
    assert s.stop(signal.SIGTERM) == 0, s.log()
    assert_clean_exit(s, None)


def test_second_signal_forces_exit(serve):
    s = serve("mps", "--pool", "1")
    status = s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "echo")))
    # A request that keeps the shutdown waiting: echo's worker stopped, its kernel answers nothing.
    # (heartbeat never polls its ring: a call to it is
    # refused at once.)  The forced exit's SIGKILL ends a stopped process too.
    os.kill(s.client.program("echo")["pid"], signal.SIGSTOP)
    errors: list[BaseException] = []

    def hang() -> None:
        try:
            s.client.call("echo", "anyone?", timeout=60)
        except BaseException as e:  # the forced exit cuts it
            errors.append(e)

    t = threading.Thread(target=hang)
    t.start()
    try:
        poll(lambda: s.client.status()["requests_in_flight"] >= 2, 10.0, "the call in flight")
        s.proc.send_signal(signal.SIGTERM)
        poll(lambda: "shutdown: waiting up to" in s.log(), 10.0, "the shutdown waiting for the call")
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(STOP_S)
    finally:
        t.join(70)
    log = s.log()
    assert rc == 128 + signal.SIGINT, log
    assert "SIGINT during shutdown: forcing the exit" in log and "Traceback" not in log
    assert errors and isinstance(errors[0], ClientError)
    assert_clean_exit(s, status["mps_dir"])


def test_mps_daemon_killed_under_serve(serve):
    """The MPS control daemon SIGKILLed under ``serve``: status notices it (``daemon_died``), the
    CLI's status names it, a load is refused with 500 and the reason, the running program is still
    listed as running, and the stop is clean (nothing left: no worker, no zombie server)."""
    s = serve("mps", "--pool", "2")
    status = s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "heartbeat")))
    daemon = status["daemon_pid"]
    os.kill(daemon, signal.SIGKILL)
    died = f"the MPS control daemon {daemon} died (killed by SIGKILL)"
    poll(lambda: s.client.status()["daemon_died"] == died, 10.0, "status noticing the daemon's death")
    with pytest.raises(ClientError, match=rf"^mps: {re.escape(died)}: no new worker can be verified") as e:
        s.client.load(program_body(str(EXAMPLES / "echo")))
    assert e.value.status == 500
    r = cli("status", "--socket", s.sock)
    assert r.returncode == 0 and re.search(rf"mps daemon +{re.escape(died)} \(", r.stdout), r.stdout
    assert [(p["name"], p["state"]) for p in s.client.programs()] == [("heartbeat", "running")]
    assert s.stop() == 0, s.log()
    assert_clean_exit(s, status["mps_dir"])


def test_sigint_during_idle_is_clean(serve):
    s = serve("blink")
    s.wait_ready()
    assert s.stop(signal.SIGINT) == 0, s.log()
    assert_clean_exit(s, None)


# ---- without a daemon, without a GPU ------------------------------------------------------


def test_no_driver_is_plain(tmp):
    from meshd_mps.base.errors import NoDriver
    from meshd_mps.gpu.device import query_device

    try:
        query_device()
    except NoDriver:
        pass
    except Exception:
        pytest.skip("a driver is here (the device query failed otherwise)")
    else:
        pytest.skip("this machine has an NVIDIA driver")
    sock = os.path.join(tmp, "s.sock")
    r = cli("serve", "--gpu", "cuda", "--socket", sock, "--state-dir", os.path.join(tmp, "state"))
    assert r.returncode == 1
    assert "meshd-mps: no NVIDIA driver: " in r.stderr
    assert 'to try meshd-mps without a GPU, use the simulated one: gpu="sim"' in r.stderr
    assert "meshd-mps: on the command line: meshd-mps serve --gpu sim" in r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(sock)


def test_a_refused_start_makes_nothing(tmp):
    """The README's first command where there is no GPU, in either isolation: the driver is looked
    for first (MPS mode asked for its control binary first, and never spoke of the simulated GPU),
    and nothing is made.  A start refused later (MPS mode on the sim, the stand-in not on PATH)
    removes the socket's directory and the state dir it made."""
    from meshd_mps.base.errors import NoDriver
    from meshd_mps.gpu.device import check_driver

    def gone(*paths: str) -> None:
        assert not any(os.path.lexists(p) for p in paths), [p for p in paths if os.path.lexists(p)]

    try:
        check_driver()
    except NoDriver:
        for iso in ("mps", "blink"):
            run, state = os.path.join(tmp, f"run-{iso}"), os.path.join(tmp, f"state-{iso}")
            r = cli("serve", "--isolation", iso, "--socket", os.path.join(run, "s.sock"), "--state-dir", state)
            assert r.returncode == 1 and "meshd-mps: no NVIDIA driver: " in r.stderr, r.stderr
            assert "meshd-mps serve --gpu sim" in r.stderr and "Traceback" not in r.stderr, r.stderr
            gone(run, state)
    run, state = os.path.join(tmp, "run-sim"), os.path.join(tmp, "state-sim")
    path = os.pathsep.join(p for p in env()["PATH"].split(os.pathsep) if p != standin.BIN_DIR)
    r = subprocess.run([sys.executable, "-m", "meshd_mps", "serve", "--gpu", "sim", "--isolation", "mps", "--socket",
                        os.path.join(run, "s.sock"), "--state-dir", state], capture_output=True, text=True,
                       env=env() | {"PATH": path}, cwd=REPO, timeout=60)
    assert r.returncode == 1 and "nvidia-cuda-mps-control not found on PATH" in r.stderr, r.stderr
    gone(run, state)


def test_client_without_daemon(tmp):
    sock = os.path.join(tmp, "none.sock")
    for args in (["ps"], ["status"], ["unload", "x"], ["call", "x", "y"], ["load", str(EXAMPLES / "echo")]):
        r = cli(*args, "--socket", sock)
        assert r.returncode == 1
        assert r.stderr == f"meshd-mps: no daemon on {sock} (start one with: meshd-mps serve)\n", r.stderr
    with pytest.raises(NoDaemon):
        Client(sock).status()
    e = env() | {"MESHD_MPS_SOCKET": sock}
    r = subprocess.run([sys.executable, "-m", "meshd_mps", "ps"], capture_output=True, text=True, env=e, cwd=REPO)
    assert f"no daemon on {sock}" in r.stderr
    r = cli("load", "--ptx", "x.ptx", "--socket", sock)
    assert r.returncode == 1 and "--manifest" in r.stderr


def test_help_says_what_each_does():
    r = cli("--help")
    assert r.returncode == 0
    for cmd in ("serve", "worker", "load", "upgrade", "unload", "ps", "status", "call"):
        assert re.search(rf"^\s+{cmd}\s+\S", r.stdout, re.M), cmd
    assert "examples:" in r.stdout
    for cmd in ("serve", "load", "upgrade", "unload", "ps", "status", "call"):
        h = cli(cmd, "--help")
        assert h.returncode == 0 and "example:" in h.stdout and f"meshd-mps {cmd}" in h.stdout, cmd
    assert "--gpu {cuda,sim}" in cli("serve", "--help").stdout


def test_worker_fast_path_and_light_client():
    code = ("import sys; from meshd_mps.serving import cli, client; cli.parser(); "
            "heavy = [m for m in ('meshd_mps.serving.server', 'meshd_mps.serving.api', 'meshd_mps.supervision.supervisor',"
            " 'meshd_mps.backend', 'anyio', 'aiohttp', 'prometheus_client') if m in sys.modules]; "
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    r = cli("worker", "--help")
    assert r.returncode == 0 and "--mailbox" in r.stdout


def test_metrics_text_format():
    """The exposition (prometheus_client) of families read from live objects: HELP and label
    escaping, NaN, a family without a sample, a histogram's buckets, and a failing reader left
    out (and logged), never the others."""
    from prometheus_client import Histogram, generate_latest
    from structlog.testing import capture_logs

    from meshd_mps.serving.metrics import Family, Live, new_registry

    r = new_registry()
    h = Histogram("h_seconds", "h", buckets=(0.1, 1), registry=r)
    h.observe(0.05)
    h.observe(0.5)
    r.register(Live([
        Family("x_total", "counter", "a\\b\nc", lambda: 3),
        Family("g", "gauge", "labels", lambda: [({"a": 'q"\\\n'}, 1.5), ({"a": "b"}, float("nan"))], ("a",)),
        Family("none", "gauge", "no sample", lambda: None),
        Family("broken", "gauge", "fails", lambda: 1 / 0),
    ]))
    with capture_logs() as logs:
        text = generate_latest(r).decode()
    assert "# HELP x_total a\\\\b\\nc\n# TYPE x_total counter\nx_total 3.0\n" in text
    assert 'g{a="q\\"\\\\\\n"} 1.5\n' in text and 'g{a="b"} NaN\n' in text
    assert 'h_seconds_bucket{le="0.1"} 1.0\nh_seconds_bucket{le="1.0"} 2.0\nh_seconds_bucket{le="+Inf"} 2.0\n' in text
    assert "h_seconds_count 2.0\n" in text and "_created" not in text
    assert "# TYPE none gauge\n" in text and "\nnone " not in text
    assert "broken" not in text and [e["metric"] for e in logs if "collector failed" in e["event"]] == ["broken"]
    with pytest.raises(ValueError):
        Family("bad", "counter", "not _total", lambda: 0)
    assert parse_metrics(text)["x_total"] == 3
