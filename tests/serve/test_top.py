"""``meshd-mps top`` as a person sees it: in a real terminal (tmux), beside a ``--gpu sim`` daemon in
MPS mode (the stand-in MPS daemon), its screen read while programs load, beat, answer calls, stall
and fault, and its keys pressed (filter by name, sort, quit)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from meshd_mps.serving.client import program_body
from meshd_mps.serving.top import PROGRAM_HEAD

from ..rigs.serve import EXAMPLES, cli
from ..rigs.terminal import Tmux
from ..rigs.tools import need

pytestmark = pytest.mark.timeout(240)


def rows(screen: str) -> dict[str, dict[str, str]]:
    """The PROGRAMS table's rows as the terminal shows them, by name: every cell one word."""
    lines = screen.splitlines()
    at = next((i for i, line in enumerate(lines) if line.split()[:2] == PROGRAM_HEAD[:2]), None)
    out: dict[str, dict[str, str]] = {}
    if at is None:
        return out
    for line in lines[at + 1:]:
        cells = line.split()
        if len(cells) != len(PROGRAM_HEAD):
            break
        out[cells[0]] = dict(zip(PROGRAM_HEAD, cells, strict=True))
    return out


def events(screen: str) -> str:
    return screen.split("EVENTS", 1)[-1]


@pytest.fixture
def term(tmp):
    t = Tmux(need("tmux")["tmux"], tmp)
    yield t
    t.close()


def test_top_shows_programs_load_beat_answer_stall_and_fault(serve, standin_on_path, term):
    s = serve("mps", "--pool", "2", "--stall-after", "0.5")
    s.wait_ready()
    c = s.client
    term.start([sys.executable, "-m", "meshd_mps", "top", "--socket", s.sock, "--interval", "0.5"])
    term.wait_for(lambda t: "(no programs loaded)" in t and "simulated NVIDIA H200" in t, "an empty daemon's screen")

    c.load(program_body(str(EXAMPLES / "heartbeat")))
    c.load(program_body(str(EXAMPLES / "echo")))
    screen = term.wait_for(lambda t: {r["STATE"] for r in rows(t).values()} == {"running"} and len(rows(t)) == 2
                           and rows(t)["heartbeat"]["BEAT-AGE"] != "-" and "loaded echo on GPU 0" in events(t),
                           "both programs running, heartbeat beating, their loads among the events")
    gpu = screen.split("GPUS", 1)[1].splitlines()[2].split()
    assert gpu[0] == "0" and "idle" in screen.split("GPUS", 1)[1] and gpu[-3].endswith("%"), screen  # pool, SM use
    assert "140.4G" in screen, screen  # the simulated H200's memory, as its NVML shows it

    for _ in range(40):  # calls answered: their rate, p50/p99 and bytes on echo's row, none on heartbeat's
        assert c.call("echo", "x" * 100)["data"] == "x" * 100
    screen = term.wait_for(lambda t: rows(t)["echo"]["CALLS/S"] not in ("-", "0.0") and rows(t)["echo"]["P99"] != "-",
                           "echo's calls per second and p50/p99")
    echo = rows(screen)["echo"]
    assert echo["IN/S"] == echo["OUT/S"] != "0B" and echo["P50"].endswith(("us", "ms")), echo
    assert rows(screen)["heartbeat"]["CALLS/S"] in ("-", "0.0"), screen

    term.keys("/", "e", "c", "h", "o", "Enter")  # filter by name
    term.wait_for(lambda t: set(rows(t)) == {"echo"} and "filter: echo" in t, "only echo, the filter shown")
    term.keys("Escape", "/", "Escape", "s", "r")  # the filter cleared; sorted by the next column (STATE), reversed
    term.wait_for(lambda t: len(rows(t)) == 2 and "sort STATE v" in t, "both rows again, sorted by STATE, reversed")

    hb = c.program("heartbeat")["pid"]
    os.kill(hb, signal.SIGSTOP)  # its worker stopped: its kernel beats no more
    try:
        term.wait_for(lambda t: rows(t)["heartbeat"]["STATE"] == "stalled" and "heartbeat: running -> stalled"
                      in events(t) and "(1 stalled)" in t, "heartbeat stalled, in its row, the header and the events")
    finally:
        os.kill(hb, signal.SIGCONT)
    term.wait_for(lambda t: rows(t)["heartbeat"]["STATE"] == "running", "heartbeat running again")

    c.load(program_body(str(EXAMPLES / "fault"), restart="never"))  # faults the GPU: the others relaunched
    screen = term.wait_for(lambda t: "GPU fault on GPU 0: fault" in events(t) and rows(t)["echo"]["FAULTS"] == "1"
                           and rows(t)["echo"]["RESTARTS"] == "1" and rows(t)["echo"]["STATE"] == "running"
                           and rows(t)["fault"]["STATE"] == "faulted",
                           "the GPU fault among the events, echo relaunched with its fault counted, fault faulted")
    assert "echo relaunched (restart 1)" in events(screen) and "heartbeat relaunched (restart 1)" in events(screen)

    term.keys("q")
    screen = term.wait_for(lambda t: "exited 0" in t, "top ended by q, with status 0")
    assert "PROGRAMS" not in screen, screen  # the terminal's own screen back (top drew on the alternate one)

    r = cli("top", "--once", "--socket", s.sock, "--sort", "faults", "--reverse")  # one frame, into a pipe: not cut short
    assert r.returncode == 0, r.stderr
    shown = rows(r.stdout)
    faults = [int(row["FAULTS"]) for row in shown.values()]
    assert faults == sorted(faults, reverse=True) and shown["fault"]["STATE"] == "faulted", r.stdout
    assert "simulated NVIDIA H200 (meshd-mps --gpu sim)" in r.stdout and "sort FAULTS v" in r.stdout, r.stdout


def test_top_refuses_what_cannot_work(tmp):
    r = cli("top", "--socket", f"{tmp}/none.sock")
    assert r.returncode == 1 and r.stderr.startswith(f"meshd-mps: no daemon on {tmp}/none.sock"), r.stderr
    r = cli("top", "--socket", f"{tmp}/none.sock", "--sort", "colour")
    assert r.returncode == 2 and r.stderr.startswith("meshd-mps: top --sort colour: one of name, state, gpu,"), r.stderr
    r = cli("top", "--interval", "0")
    assert r.returncode == 2 and r.stderr == "meshd-mps: top --interval: seconds, more than 0\n", r.stderr
