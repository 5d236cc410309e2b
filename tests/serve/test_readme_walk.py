"""README's CPU path, walked as a new user walks it: its shell block's lines run as written, in
both modes, so that the README's commands work as written.

What the test adds around the lines, and nothing else: the venv (README's ``.venv``) is this test's
interpreter's; ``make`` is told not to reinstall it (``-o``: the venv is already installed, and a
test must not run pip); the daemon's socket and state dir are in a temporary directory, through the
environment a session would have (``XDG_RUNTIME_DIR``, systemd's ``STATE_DIRECTORY``), never the
real service's; "terminal 1" is a process group of its own, as a shell job is, so that
``kill -TERM %1`` is a signal to that group."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..rigs.made import MadeClients
from ..rigs.serve import leftovers
from ..rigs.waits import poll

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
STOP_S = 30.0


def cpu_block() -> list[str]:
    """The shell block of README's CPU section, as its lines (comments cut)."""
    readme = (REPO / "README.md").read_text()
    at = readme.index("To try everything anyway, on the CPU")
    m = re.search(r"```sh\n(.*?)```", readme[at:], re.S)
    assert m is not None, "README's CPU section has no ```sh block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def command(line: str) -> str:
    return line.split("  #", 1)[0].strip()


def lines_by_role() -> tuple[dict[str, str], list[str], str]:
    """The serve lines by mode (the MPS one is given commented out, as an alternative), the client
    lines after ``. .venv/bin/activate``, and the stop."""
    block = cpu_block()
    serves = {"blink": command(block[0])}
    assert "make serve" in serves["blink"] and "--isolation" not in serves["blink"], block[0]
    alt = block[1].lstrip("# ").strip()
    assert "--isolation mps" in alt and "meshd_mps/standin" in alt, block[1]
    serves["mps"] = alt
    assert command(block[2]) == ". .venv/bin/activate", block[2]
    client = [command(line) for line in block[3:-1]]
    stop = command(block[-1])
    assert stop == "kill -TERM %1", block[-1]
    return serves, client, stop


def environment(tmp: str) -> dict[str, str]:
    """A session's environment, the daemon's places moved into ``tmp``; PATH as the user's (the venv
    not activated: README's terminal 1 does not)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_MPS_") and k != "CUDA_MPS_PIPE_DIRECTORY"}
    e["XDG_RUNTIME_DIR"] = tmp
    e["STATE_DIRECTORY"] = os.path.join(tmp, "state")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def members(pgid: int) -> dict[int, str]:
    """The processes of process group ``pgid``, by pid, with their command lines."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            out[int(d)] = cmd
    return out


def reaped(pids: dict[int, str]) -> dict[int, int] | None:
    """Each of ``pids`` reaped by us (they are our children, or were re-parented to us), with its
    exit code; None while one still runs."""
    codes = {}
    for pid in pids:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # bash: reaped by Popen.wait
            codes[pid] = 0
            continue
        if got == 0:
            return None
        codes[pid] = os.waitstatus_to_exitcode(status)
    return codes


def shell(line: str, env: dict[str, str], **kw) -> subprocess.Popen[str]:
    """``line`` in bash, in the checkout, README's ``.venv`` being this interpreter's."""
    venv = shlex.quote(str(VENV))
    preamble = (f'make() {{ command make -o {venv}/.installed VENV={venv} "$@"; }}; '
                f"activate() {{ . {venv}/bin/activate; }}; ")
    line = line.replace(". .venv/bin/activate", "activate")
    return subprocess.Popen(["bash", "-c", preamble + line], cwd=REPO, env=env, text=True, **kw)


@pytest.mark.skipif(not (VENV / "bin" / "activate").exists(), reason="the tests do not run in a venv: README's path assumes one")
@pytest.mark.parametrize("mode", ["blink", "mps"])
def test_readme_cpu_path_as_written(tmp, mode):
    serves, client, stop = lines_by_role()
    env = environment(tmp)
    log = Path(tmp, "serve.log")
    with log.open("w") as out:  # the child has its own copy
        daemon = shell(serves[mode], env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
    sock = os.path.join(tmp, "meshd-mps-sim.sock")
    try:
        def up():
            assert daemon.poll() is None, f"make serve exited with {daemon.returncode}:\n{log.read_text()}"
            return os.path.exists(sock)

        poll(up, 60.0, f"the daemon's socket {sock}")
        made = None
        if mode == "mps":  # the MPS clients made from here on, as the stand-in daemon counts them
            st = shell("activate; meshd-mps status --gpu sim --json", env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = st.communicate(timeout=60)  # answered once the start (its pool) is done
            assert st.returncode == 0, out + err
            made = MadeClients(json.loads(out)["mps_dir"])
            made.mark()
        said: dict[str, str] = {}
        for line in client:
            p = shell(f"activate; {line}", env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, f"{line!r} exited {p.returncode}:\n{out}{err}"
            assert "Traceback" not in err, err
            said[line] = out
        ps = said["meshd-mps ps --gpu sim"]
        for name in ("heartbeat", "echo"):
            assert re.search(rf"^{name}\s.*\brunning\b", ps, re.M), ps
        assert "hello" in said["meshd-mps call --gpu sim echo hello"], said
        if made is not None:
            # MPS mode's promise at serve's defaults: the loads and the upgrade take workers made at
            # the start; none makes an MPS client, which would stall every running program once.
            assert made.made() == [], (made.since(), said)
            assert not any("a new MPS client" in out for out in said.values()), said
        assert stop == "kill -TERM %1"
        job = members(daemon.pid)
        (serve_pid,) = [p for p, cmd in job.items() if "meshd-mps serve" in cmd]
        # The job's processes (bash, make, the daemon) all get the signal, as from a shell's kill %1;
        # make dies of it at once, and the daemon, re-parented to this test (a subreaper: conftest),
        # shuts down on its own: its exit status is read here.
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(STOP_S)
        statuses = poll(lambda: reaped(job), STOP_S, lambda: f"every process of terminal 1's job ended: {job}")
        said_last = log.read_text()
        assert statuses[serve_pid] == 0, said_last[-4000:]
        assert '"msg": "meshd-mps stopped"' in said_last, said_last[-4000:]
        assert '"level": "error"' not in said_last, said_last[-4000:]
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        for pid in members(daemon.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    assert not os.path.exists(sock), "the socket is left behind"
    poll(lambda: not leftovers([sock, tmp]), 10.0, lambda: f"nothing of the daemon left: {leftovers([sock, tmp])}")
