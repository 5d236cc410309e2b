"""Operators' signals and hard deaths of ``meshd-mps serve``, end to end
on the simulated GPU and the stand-in MPS daemon:

- a terminal's signals go to the whole process group (Ctrl-C, ``kill -TERM %1``): the workers sit
  in groups of their own, so only the daemon gets them and it halts the programs in order;
- after a SIGKILL of the daemon, what it left (the control daemon and its server) never blocks the
  next start: in the same ``--mps-dir`` it is recognised by its marker and quit, and in the
  default temporary directory it is swept.
"""

from __future__ import annotations

import os
import signal

import pytest

from meshd_mps.mps.control import MARKER, Owner
from meshd_mps.serving.client import program_body
from meshd_mps.supervision import procfs

from ..rigs.serve import EXAMPLES, Serve, assert_clean_exit, env, events, left_by, leftovers, owner_of, reap
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("isolation, sig", [("mps", signal.SIGINT), ("mps", signal.SIGTERM), ("mps", signal.SIGHUP),
                                            ("blink", signal.SIGINT), ("blink", signal.SIGHUP)])
def test_a_signal_to_the_process_group_reaches_only_the_daemon(tmp, isolation, sig):
    s = Serve(tmp, isolation, os.path.join(tmp, "s.sock"), "--log-level", "debug",
              *(["--pool", "1"] if isolation == "mps" else []), group=True)
    try:
        status = s.wait_ready()
        s.client.load(program_body(str(EXAMPLES / "heartbeat")))
        workers = s.client.status()["workers"]
        assert workers and all(os.getpgid(w) == w for w in workers), "each worker leads a process group of its own"
        os.killpg(s.proc.pid, sig)  # what Ctrl-C (SIGINT), the shell's kill -TERM %1 or a hang-up does
        assert s.proc.wait(60) == 0, s.log()
        text = s.log()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        reaped = [e for e in events(s) if e.get("msg") == "workers reaped"]
        assert len(reaped) == 1, text
        statuses = {int(pid): rc for pid, rc in reaped[0]["statuses"].items()}
        # Halted in order by the daemon, then reaped by it: no worker died of the group's signal.
        assert set(workers) <= set(statuses) and not {-sig} & set(statuses.values()), statuses
        assert_clean_exit(s, status["mps_dir"])
    finally:
        s.kill()


def test_a_control_daemon_left_in_the_same_mps_dir_is_quit_before_the_fresh_start(tmp):
    mps_dir = os.path.join(tmp, "mps")
    first = Serve(tmp, "mps", os.path.join(tmp, "a.sock"), "--pool", "1", "--mps-dir", mps_dir)
    try:
        first.wait_ready()
        first.client.load(program_body(str(EXAMPLES / "heartbeat")))
        left = owner_of(mps_dir)
        assert left.meshd_pid == first.proc.pid and left.daemon_alive()
        orphans = left_by(left) + first.client.status()["workers"]  # the workers exit at EOF, re-parented
        first.proc.kill()
        first.proc.wait(30)
        # What a SIGKILL leaves: the control daemon lives on, with its marker naming a dead meshd-mps.
        assert left.daemon_alive() and not left.meshd_alive()
        second = Serve(tmp, "mps", os.path.join(tmp, "b.sock"), "--pool", "1", "--mps-dir", mps_dir)
        try:
            status = second.wait_ready()
            assert not left.daemon_alive(), "the old control daemon was quit"
            reap(orphans)
            assert status["daemon_pid"] != left.daemon_pid and owner_of(mps_dir).meshd_pid == second.proc.pid
            warned = [e for e in events(second) if "was left by meshd-mps" in str(e.get("msg"))]
            assert warned and warned[0]["daemon_pid"] == left.daemon_pid, second.log()
            second.client.load(program_body(str(EXAMPLES / "heartbeat")))
            assert second.stop() == 0, second.log()[-4000:]
            assert not os.path.exists(os.path.join(mps_dir, MARKER)), "the marker goes with its daemon"
        finally:
            second.kill()
    finally:
        first.kill()
    assert not leftovers([mps_dir]), leftovers([mps_dir])


def test_a_daemon_whose_meshd_runs_is_never_taken_over(tmp):
    mps_dir = os.path.join(tmp, "mps")
    first = Serve(tmp, "mps", os.path.join(tmp, "a.sock"), "--pool", "0", "--mps-dir", mps_dir)
    try:
        first.wait_ready()
        second = Serve(tmp, "mps", os.path.join(tmp, "b.sock"), "--pool", "0", "--mps-dir", mps_dir)
        assert second.proc.wait(60) == 1
        assert f"meshd-mps {first.proc.pid} runs the control daemon of {mps_dir}; refusing" in second.log()
        assert first.client.status()["daemon_pid"] == owner_of(mps_dir).daemon_pid  # untouched
    finally:
        first.kill()


def test_what_a_dead_run_left_in_its_temporary_dir_is_swept(tmp, monkeypatch):
    # Both runs make their default MPS directory under this TMPDIR, so the sweep sees only theirs.
    base = os.path.join(tmp, "t")
    os.mkdir(base, 0o700)
    e = env()
    e["TMPDIR"] = base
    monkeypatch.setattr("tests.rigs.serve.env", lambda: e)
    first = Serve(tmp, "mps", os.path.join(tmp, "a.sock"), "--pool", "1")
    try:
        old_dir = first.wait_ready()["mps_dir"]
        assert os.path.dirname(old_dir) == base
        left = owner_of(old_dir)
        assert left.temporary and left.daemon_alive()
        orphans = left_by(left) + first.client.status()["workers"]  # the workers exit at EOF, re-parented
        first.proc.kill()
        first.proc.wait(30)
        stale = os.path.join(base, "meshd-mps.999999999.x")  # no marker, its meshd-mps long gone
        os.mkdir(stale, 0o700)
        second = Serve(tmp, "mps", os.path.join(tmp, "b.sock"), "--pool", "1")
        try:
            new_dir = second.wait_ready()["mps_dir"]
            assert new_dir != old_dir and not os.path.exists(old_dir) and not os.path.exists(stale)
            assert not left.daemon_alive(), "the control daemon the dead run left was quit"
            reap(orphans)
            assert second.stop() == 0, second.log()[-4000:]
        finally:
            second.kill()
    finally:
        first.kill()
    poll(lambda: not leftovers([old_dir]), 10.0, f"nothing of the dead run left: {leftovers([old_dir])}")


def test_owner_marker_names_processes_by_pid_and_start_time(tmp):
    me = Owner.me(os.getpid(), temporary=False)
    me.write(tmp)
    back = Owner.read(tmp)
    assert back == me and back.meshd_alive() and back.daemon_alive()
    gone = Owner(me.meshd_pid, me.meshd_start + 1, None, None, me.boot, False)  # the pid, reused later
    assert not gone.meshd_alive() and not gone.daemon_alive()
    other_boot = Owner(me.meshd_pid, me.meshd_start, None, None, "another-boot", False)
    assert not other_boot.meshd_alive()
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write('{"meshd_pid": 1')  # torn: read as no marker, never as someone's
    assert Owner.read(tmp) is None
    assert procfs.starttime(os.getpid()) == me.meshd_start
