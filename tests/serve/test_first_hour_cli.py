"""What the CLI shows (status's table, ps's BEAT-AGE, the log of a start
without live restore, an unload the config file undoes, the client's socket from --config and
$MESHD_MPS_SOCKET), and a ``--gpu sim`` daemon kept apart from the real service's socket and state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from meshd_mps.base import defaults
from meshd_mps.serving.client import Client, ClientError, client_socket, default_socket, own_socket, program_body
from meshd_mps.serving.unit import unit_text
from meshd_mps.state.statedir import resolve_state_dir

from ..cases.live_restore import nothing_left, serve
from ..rigs.serve import EXAMPLES, READY_S, REPO, STOP_S, Serve, env, events, leftovers
from ..rigs.waits import poll


def run_cli(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """The CLI with ``environ`` over the rigs' environment (which drops $MESHD_MPS_SOCKET)."""
    return subprocess.run([sys.executable, "-m", "meshd_mps", *args], capture_output=True, text=True,
                          env={**env(), **environ}, cwd=REPO, timeout=60)


def table_rows(text: str) -> dict[str, str]:
    """status's table: its first column -> the rest of the line."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("  ")
        out[key] = value.strip()
    return out


def messages(s: Serve) -> list[str]:
    return [str(e.get("msg", "")) for e in events(s)]


# ---- (a) status's table, (c) the log of a start without live restore ------------------------------


def test_the_status_table_says_where_the_state_is_and_what_each_start_did(tmp):
    state = os.path.join(tmp, "state")
    started: list[Serve] = []
    try:
        shown_and_ended(tmp, state, started)
    finally:
        for s in started:
            s.kill()
        if leftovers([state]):  # a live-restore daemon's workers, left by a failure above: ended
            serve(tmp, state, "blink", name="end", live=False).stop()
        nothing_left(state)


def shown_and_ended(tmp: str, state: str, started: list[Serve]) -> None:
    a = serve(tmp, state, "blink", name="a")
    started.append(a)
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        rows = table_rows(run_cli("status", "--socket", a.sock).stdout)
        assert rows["state dir"] == state and rows["live restore"] == "on", rows
        assert rows["at start"] == "nothing to restore", rows
    finally:
        assert a.stop() == 0  # live restore: its worker and kernel run on for the next one
    b = serve(tmp, state, "blink", name="b")
    started.append(b)
    try:
        r = run_cli("status", "--socket", b.sock)
        assert r.returncode == 0, r.stderr
        rows = table_rows(r.stdout)
        st = b.client.status()["state"]
        assert rows["state dir"] == state and rows["live restore"] == "on", r.stdout
        assert rows["at start"] == "adopted heartbeat", r.stdout  # the same facts as --json's
        assert st["restore"]["adopted"] == ["heartbeat"], st
        assert rows["workers left"] == f"adopted {st['adoption']['adopted']}, dismissed [], gone []", r.stdout
        assert st["adoption"]["adopted"], st
        left = st["adoption"]["adopted"]
    finally:
        assert b.stop() == 0
    # A start without live restore ends the worker b left: found and ended, never "adopted".
    c = serve(tmp, state, "blink", name="c", live=False)
    started.append(c)
    try:
        said = messages(c)
        for pid in left:
            assert f"mps: worker {pid} adopted" not in said, said
            assert any(m.startswith(f"mps: worker {pid} found, left running by an earlier meshd-mps: to be halted and"
                                    " ended") for m in said), said
        assert all(m.startswith("restore: 0 adopted") for m in said if "adopted" in m), said  # its summary only
        assert any(m.startswith("without live restore: 1 workers an earlier meshd-mps left running") for m in said), said
        rows = table_rows(run_cli("status", "--socket", c.sock).stdout)
        assert rows["live restore"] == "off" and rows["at start"] == "restored heartbeat", rows
        assert "workers left" not in rows, rows  # adoption is live restore's
    finally:
        assert c.stop() == 0


def test_the_status_table_row_by_row():
    """Every part of status's ``state`` has its words; an older daemon's answer (no ``state``) none."""
    from meshd_mps.serving.tables import state_rows

    assert state_rows(None) == []
    st = {"dir": "/s", "live_restore": False, "adoption": None,
          "restore": {"adopted": [], "restored": ["echo", "spin"], "declared": ["hb"],
                      "halted": [{"program": "old", "pid": 7, "slot": 2, "why": "no record names it"}],
                      "skipped": {"bad": "its file is gone"}}}
    assert state_rows(st) == [["state dir", "/s"], ["live restore", "off"],
                              ["at start", "restored echo, spin; declared hb; halted old; skipped bad (its file is gone)"]]


# ---- (b) ps's BEAT-AGE ------------------------------------------------------------------------


def test_beat_age_is_shown_whenever_the_heartbeat_it_stands_beside_has_advanced(serve):
    """The heartbeat was read at the request, its age at the watcher's last sample (up to 1 s
    before): right after a load ps showed echo's count advancing and its BEAT-AGE "-"."""
    s = serve("blink")
    s.wait_ready()
    seen = 0
    for _ in range(3):
        for ex in ("echo", "heartbeat"):
            s.client.load(program_body(str(EXAMPLES / ex)))
            for p in s.client.programs():  # at once: before the watcher samples, most often
                if p["heartbeat"] > 0:
                    seen += 1
                    assert p["beat_age_s"] is not None and 0 <= p["beat_age_s"] < 60, p
                else:
                    assert p["beat_age_s"] is None, p
        r = run_cli("ps", "--socket", s.sock)
        for line in r.stdout.splitlines()[1:]:
            cols = line.split()
            assert cols[6] != "-" or cols[5] == "0", r.stdout  # BEAT-AGE beside HEARTBEAT
        for ex in ("echo", "heartbeat"):
            s.client.unload(ex)
    assert seen, "no program was seen beating"


# ---- (d) an unload the config file undoes, (e) the client's socket ---------------------------------


def config(tmp: str, socket: str, declare: bool = True) -> str:
    path = os.path.join(tmp, f"c-{os.path.basename(socket)}.toml")
    text = f'[serve]\nsocket = "{socket}"\n'
    if declare:
        text += f'[program.heartbeat]\ndir = "{EXAMPLES / "heartbeat"}"\n'
    with open(path, "w") as f:
        f.write(text)
    return path


def test_an_unload_that_the_next_start_undoes_says_so(serve, tmp):
    sock = os.path.join(tmp, "s.sock")
    cfg = config(tmp, sock)
    s = serve("blink", "--config", cfg)
    s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "echo")))
    r = run_cli("unload", "echo", "--socket", sock)
    assert r.returncode == 0 and r.stdout == "echo unloaded from slot 1\n" and r.stderr == "", r
    r = run_cli("unload", "heartbeat", "--socket", sock)
    assert r.returncode == 0 and r.stdout == "heartbeat unloaded from slot 0\n", r
    warning = (f"heartbeat is declared in {cfg} ([program.heartbeat]): it is loaded again at the next start unless"
               " removed from there")
    assert r.stderr == f"meshd-mps: warning: {warning}\n", r.stderr
    s.client.load(program_body(str(EXAMPLES / "heartbeat")))
    ans = json.loads(run_cli("unload", "heartbeat", "--json", "--socket", sock).stdout)
    assert ans["ok"] and ans["warning"] == warning, ans
    assert sum(1 for m in messages(s) if m == f"unload: {warning}") == 2, messages(s)


def test_the_client_finds_the_socket_where_serve_does(serve, tmp):
    """--socket > $MESHD_MPS_SOCKET > --config's socket > the default."""
    sock = os.path.join(tmp, "s.sock")
    nowhere = os.path.join(tmp, "nowhere.sock")
    good, bad = config(tmp, "s.sock", declare=False), config(tmp, nowhere, declare=False)  # relative: beside the file
    s = serve("blink", "--config", good)
    s.wait_ready()
    r = run_cli("ps", "--config", good)
    assert r.returncode == 0 and r.stdout.startswith("NAME"), r.stderr
    r = run_cli("status", "--json", **{defaults.SOCKET_ENV: sock})
    assert r.returncode == 0 and json.loads(r.stdout)["socket"] == sock, r.stderr
    assert run_cli("ps", "--config", bad, **{defaults.SOCKET_ENV: sock}).returncode == 0  # the variable over the file
    r = run_cli("ps", "--socket", nowhere, **{defaults.SOCKET_ENV: sock})  # the flag over the variable
    assert r.returncode == 1 and r.stderr.startswith(f"meshd-mps: no daemon on {nowhere} "), r.stderr
    r = run_cli("ps", "--config", bad)
    assert r.returncode == 1 and r.stderr.startswith(f"meshd-mps: no daemon on {nowhere} "), r.stderr
    r = run_cli("ps", "--config", os.path.join(tmp, "none.toml"))
    assert r.returncode == 2 and r.stderr.startswith("meshd-mps: ") and "none.toml: cannot read it" in r.stderr, r
    assert "Traceback" not in r.stderr


def test_client_socket_precedence(monkeypatch, tmp):
    monkeypatch.delenv(defaults.SOCKET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", tmp)
    assert client_socket(None) == os.path.join(tmp, "meshd-mps.sock")
    assert client_socket(None, "/f.sock") == "/f.sock"
    monkeypatch.setenv(defaults.SOCKET_ENV, "/e.sock")
    assert client_socket(None, "/f.sock") == "/e.sock"
    assert client_socket("/s.sock", "/f.sock") == "/s.sock"


def test_the_unit_names_the_socket_once_in_the_variable_the_client_reads():
    lines = unit_text("/usr/bin/meshd-mps").splitlines()
    assert f"Environment={defaults.SOCKET_ENV}=/run/meshd-mps/meshd-mps.sock" in lines
    assert not any(line.startswith("ExecStart=") and "--socket" in line for line in lines)


# ---- (6) the simulated GPU's own socket and state ---------------------------------------------------


def test_the_simulation_has_its_own_default_state_dir_and_socket(monkeypatch, tmp):
    h = {"HOME": "/h"}
    assert resolve_state_dir(None, h, uid=0) == "/var/lib/meshd-mps"
    assert resolve_state_dir(None, h, uid=0, gpu="sim") == "/var/lib/meshd-mps-sim"
    assert resolve_state_dir(None, h, uid=1000, gpu="sim") == "/h/.local/state/meshd-mps-sim"
    assert resolve_state_dir(None, {**h, "XDG_STATE_HOME": "/x"}, uid=1000, gpu="sim") == "/x/meshd-mps-sim"
    assert resolve_state_dir("/given", h, uid=0, gpu="sim") == "/given"
    monkeypatch.delenv(defaults.SOCKET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", tmp)
    assert default_socket() == own_socket("cuda") == os.path.join(tmp, "meshd-mps.sock")
    assert default_socket("sim") == own_socket("sim") == os.path.join(tmp, "meshd-mps-sim.sock")
    monkeypatch.setenv(defaults.SOCKET_ENV, "/e.sock")
    assert default_socket("sim") == "/e.sock"  # the variable is a choice: it names the socket for either


def test_a_sim_daemon_keeps_apart_from_the_real_one_and_the_client_finds_it(tmp):
    """serve --gpu sim with no --socket: its own socket beside the real one's default, found by the
    client commands with --gpu sim; without it the client says where the sim's is.  Its state dir is
    the sim's own too (as root that default is /var/lib/meshd-mps-sim, never written by a test:
    --state-dir is given then, and the default is checked above)."""
    e = {**env(), "XDG_RUNTIME_DIR": tmp, "XDG_STATE_HOME": os.path.join(tmp, "xdg")}
    state = [] if os.geteuid() != 0 else ["--state-dir", os.path.join(tmp, "xdg", "meshd-mps-sim")]
    logpath = os.path.join(tmp, "serve.log")
    sim_sock = os.path.join(tmp, "meshd-mps-sim.sock")
    with open(logpath, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "meshd_mps", "serve", "--gpu", "sim", "--log-format", "json",
                                 *state], stdout=log, stderr=subprocess.STDOUT, env=e, cwd=REPO)
    try:
        def up() -> dict | None:
            if proc.poll() is not None:
                with open(logpath) as f:
                    pytest.fail(f"serve exited {proc.returncode}: {f.read()}")
            try:
                return Client(sim_sock, timeout=5).status()
            except ClientError:
                return None

        st = poll(up, READY_S, f"serve --gpu sim on {sim_sock}", every=0.05)
        assert st["socket"] == sim_sock and st["gpu"] == "sim", st
        assert st["state"]["dir"] == os.path.join(tmp, "xdg", "meshd-mps-sim"), st["state"]
        assert not os.path.exists(os.path.join(tmp, "meshd-mps.sock"))

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "meshd_mps", *args], capture_output=True, text=True, env=e,
                                  cwd=REPO, timeout=60)

        r = cli("load", "--gpu", "sim", str(EXAMPLES / "heartbeat"))
        assert r.returncode == 0 and r.stdout.startswith("heartbeat loaded on slot 0"), r.stderr
        r = cli("ps", "--gpu", "sim")
        assert r.returncode == 0 and "heartbeat" in r.stdout, r.stderr
        r = cli("ps")
        assert r.returncode == 1, r
        assert r.stderr == (f"meshd-mps: no daemon on {os.path.join(tmp, 'meshd-mps.sock')} (start one with: meshd-mps"
                            f" serve); a meshd-mps serve --gpu sim has its socket at {sim_sock}: add --gpu sim (or"
                            f" --socket {sim_sock})\n"), r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(STOP_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not os.path.exists(sim_sock)


def test_with_no_daemon_the_advice_names_the_kind_of_daemon_asked_for(tmp):
    """``ps --gpu sim`` with nothing serving: start a ``serve --gpu sim``, not the GPU's."""
    r = run_cli("ps", "--gpu", "sim", XDG_RUNTIME_DIR=tmp)
    assert r.returncode != 0 and "start one with: meshd-mps serve --gpu sim" in r.stderr, r.stderr
    r = run_cli("ps", XDG_RUNTIME_DIR=tmp)
    assert r.returncode != 0 and "start one with: meshd-mps serve)" in r.stderr, r.stderr
