"""A program adopted by live restore keeps its history, as docker keeps a
container's across a live restore: ``started`` and ``uptime`` count from its launch (not from the
adoption), its ``restarts`` count goes on, and the daemon's recent fault reports are carried over.
End to end on the simulated GPU and the stand-in MPS daemon (tests/serve/test_live_restore.py's rig)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from meshd_mps.serving.client import program_body
from meshd_mps.state.history import History, Launched, read_history, write_history

from ..cases.live_restore import nothing_left, rows, serve
from ..rigs.serve import EXAMPLES
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_an_adopted_program_keeps_its_launch_time_restarts_and_faults(tmp, how):
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, "mps", name="a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        a.client.load(program_body(str(EXAMPLES / "echo")))
        echo = rows(a)["echo"]["pid"]
        os.kill(echo, signal.SIGKILL)  # a fault of the GPU: both torn down, both relaunched
        poll(lambda: (r := rows(a)) and all(p["state"] == "running" and p["restarts"] == 1 for p in r.values()),
             60.0, "both programs relaunched once after the fault")
        before, t_before = rows(a), time.monotonic()
        faults = a.client.status()["faults"]
        assert [f["faulted"] for f in faults] == ["echo"] and faults[0]["gpu_wide"], faults
        if how == signal.SIGKILL:
            a.proc.kill()
            a.proc.wait(10)
        else:
            assert a.stop() == 0, a.log()[-4000:]
        b = serve(tmp, state, "mps", name="b")
        try:
            st = b.client.status()
            assert sorted(st["state"]["restore"]["adopted"]) == ["echo", "heartbeat"], st["state"]  # in the workers' order
            after, since = rows(b), time.monotonic() - t_before  # a second or more: b's own start
            for n, p in before.items():
                q = after[n]
                assert q["pid"] == p["pid"], "adopted, as it ran"
                assert q["started"] == p["started"], f"{n}: started at its launch, not at the adoption"
                assert q["restarts"] == p["restarts"] == 1, f"{n}: its restarts counted on"
                assert q["uptime_s"] >= p["uptime_s"] + since - 0.05, f"{n}: its uptime counts from its launch"
            assert st["faults"] == faults, "the fault reports carried over"
            b.client.unload("echo")
            b.client.unload("heartbeat")
            assert b.stop() == 0, b.log()[-4000:]
        finally:
            b.kill()
    finally:
        a.kill()
    nothing_left(state)


def test_a_history_is_taken_only_for_the_launch_it_names(tmp):
    """A relaunch the last daemon did not live to keep: the entry names another worker, and the
    adopted program starts its history again rather than take another launch's (restore checks the
    pid); a history that cannot be read is an empty one."""
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, "mps", name="a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        before = rows(a)["heartbeat"]
        a.proc.kill()
        a.proc.wait(10)
        kept = read_history(state)
        assert kept.programs["heartbeat"].pid == before["pid"] and kept.programs["heartbeat"].restarts == 0
        # As if the last daemon had kept an older launch of it, in another worker, relaunched 3 times.
        write_history(state, History({"heartbeat": Launched(1.0, before["pid"] + 1_000_000, 3)}, kept.faults))
        b = serve(tmp, state, "mps", name="b")
        try:
            after = rows(b)["heartbeat"]
            assert after["pid"] == before["pid"] and after["restarts"] == 0
            assert not after["started"].startswith("1970"), after["started"]
            b.client.unload("heartbeat")
            assert b.stop() == 0, b.log()[-4000:]
        finally:
            b.kill()
    finally:
        a.kill()
    nothing_left(state)
    with open(os.path.join(state, "history.json"), "w") as f:
        f.write("{torn")
    assert read_history(state) == History()
