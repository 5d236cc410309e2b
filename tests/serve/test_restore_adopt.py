"""A program's restore mode (so that replicas whose node comes back are not run twice), end to end on
the simulated GPU through the real daemon: a program loaded with restore ``adopt`` is adopted by the
next start while it runs (live restore), and when it no longer runs (the node lost: the daemon and
its workers SIGKILLed) the next start does not load it again, drops its record and says so, while a
``reload`` program beside it is loaded again as before; a bad mode is refused with a 400 and changes
nothing."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from meshd_mps.base.restore import LEFT
from meshd_mps.serving.client import ClientError, program_body
from meshd_mps.state.record import ProgramRecord
from meshd_mps.state.store import Store

from ..cases.live_restore import nothing_left, reap_orphans, rows, serve
from ..rigs.serve import EXAMPLES, cli, leftovers
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(150)


def lose_node(s, state: str) -> None:
    """What a node's loss does to its daemon: it and every process of its state dir (the
    workers) SIGKILLed, nothing stopped in order."""
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(30)
    for line in leftovers([state]):
        pid = int(line.split(":")[0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    poll(lambda: (reap_orphans(), not leftovers([state]))[1], 20.0, lambda: f"the node's processes gone: {leftovers([state])}")


def test_an_adopt_program_is_adopted_while_it_runs_and_left_when_it_does_not(tmp):
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, "blink", name="a")
    try:
        # The CLI's word: load --restore adopt.
        out = cli("load", str(EXAMPLES / "heartbeat"), "--restore", "adopt", "--socket", a.sock)
        assert out.returncode == 0, out.stderr
        a.client.load(program_body(str(EXAMPLES / "echo")))  # restore reload, the default
        before = rows(a)
        assert before["heartbeat"]["restore"] == "adopt" and before["echo"]["restore"] == "reload", before
        with Store(state, lock=False) as st:
            assert {n: r.restore for n, r in st.programs().items()} == {"heartbeat": "adopt", "echo": "reload"}
        assert a.stop() == 0, a.log()[-4000:]  # live restore: both run on
    finally:
        a.kill()

    b = serve(tmp, state, "blink", name="b")
    try:
        after = rows(b)
        assert {n: (p["pid"], p["restore"]) for n, p in after.items()} == {
            n: (p["pid"], p["restore"]) for n, p in before.items()}, "adopted as they run, their mode kept"
        r = b.client.status()["state"]["restore"]
        assert r["adopted"] == ["heartbeat", "echo"] and not r["restored"] and r["left"] == {}, r
        lose_node(b, state)
    finally:
        b.kill()

    c = serve(tmp, state, "blink", name="c")
    try:
        r = c.client.status()["state"]["restore"]
        assert r["left"] == {"heartbeat": LEFT} and r["restored"] == ["echo"] and not r["adopted"], r
        # The lost kernels' slots still said RUNNING: zeroed at once, no HALT waited on (their
        # workers died with the node, and a kernel ends with its process).
        assert "halted the kernels on slots" not in c.log(), c.log()[-4000:]
        assert "said RUNNING, but their workers are gone: zeroed" in c.log(), c.log()[-4000:]
        assert list(rows(c)) == ["echo"], "the adopt program not loaded again; the reload one is"
        assert c.client.call("echo", "back")["data"] == "back"
        with Store(state, lock=False) as st:
            assert list(st.programs()) == ["echo"], "its record dropped"
        shown = cli("status", "--socket", c.sock)
        assert f"left heartbeat ({LEFT})" in shown.stdout, shown.stdout
        assert c.stop() == 0, c.log()[-4000:]
    finally:
        c.kill()

    d = serve(tmp, state, "blink", name="d")  # and at the start after: no trace of it, echo adopted
    try:
        r = d.client.status()["state"]["restore"]
        assert r["adopted"] == ["echo"] and r["left"] == {} and list(rows(d)) == ["echo"], r
        d.client.unload("echo")
        assert d.stop() == 0, d.log()[-4000:]
    finally:
        d.kill()
    nothing_left(state)


def test_a_bad_restore_mode_is_refused_and_changes_nothing(tmp):
    state = os.path.join(tmp, "state")
    s = serve(tmp, state, "blink", name="s", live=False)
    try:
        for bad in ("sometimes", 1, "ADOPT", ["adopt"]):
            with pytest.raises(ClientError) as e:
                s.client.load({**program_body(str(EXAMPLES / "echo")), "restore": bad})
            assert e.value.status == 400, e.value
            assert "field 'restore'" in str(e.value) and "reload, adopt" in str(e.value), str(e.value)
            assert e.value.body.get("value") == str(bad), e.value.body
        assert rows(s) == {}
        with Store(state, lock=False) as st:
            assert st.programs() == {}, "nothing recorded"
        refused = cli("load", str(EXAMPLES / "echo"), "--restore", "sometimes", "--socket", s.sock)
        assert refused.returncode == 2 and "--restore" in refused.stderr, refused.stderr

        loaded = s.client.load({**program_body(str(EXAMPLES / "echo")), "restore": "adopt"})["program"]
        # An upgrade keeps the mode chosen at load: another one is refused, and nothing changes.
        with pytest.raises(ClientError) as e:
            s.client.upgrade("echo", {**program_body(str(EXAMPLES / "echo")), "restore": "reload"})
        assert e.value.status == 400 and "field 'restore'" in str(e.value), e.value
        now = s.client.program("echo")
        assert (now["pid"], now["upgrades"], now["restore"]) == (loaded["pid"], 0, "adopt"), now
        up = s.client.upgrade("echo", program_body(str(EXAMPLES / "echo")))["program"]
        assert up["upgrades"] == 1 and up["restore"] == "adopt", up
        with Store(state, lock=False) as st:
            assert st.programs()["echo"].restore == "adopt", "kept by the upgrade's record"
        s.client.unload("echo")
        assert s.stop() == 0, s.log()[-4000:]
    finally:
        s.kill()


def test_records_without_a_restore_mode_read_as_reload_and_reload_ones_are_written_as_before():
    old = ProgramRecord.of("echo", {"name": "echo"}, b"ptx", slot=0, nodes=1, device=0, hash=1).to_json()
    assert "restore" not in old, "a reload record is written as an older meshd-mps reads it"
    assert ProgramRecord.from_json(old).restore == "reload"
    adopt = ProgramRecord.of("echo", {"name": "echo"}, b"ptx", slot=0, nodes=1, device=0, hash=1, restore="adopt")
    assert adopt.to_json()["restore"] == "adopt" and ProgramRecord.from_json(adopt.to_json()) == adopt
    with pytest.raises(ValueError, match="restore 'sometimes'"):
        ProgramRecord.from_json({**old, "restore": "sometimes"})
