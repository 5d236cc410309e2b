"""The lifecycle tables: every move either is in the table or is refused (StateError)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from meshd_mps.base.errors import StateError
from meshd_mps.programs import PROGRAM_MOVES, Program, ProgramState
from meshd_mps.supervision import procfs
from meshd_mps.supervision.proc import MOVES, WorkerProc, WorkerState
from meshd_mps.supervision.supervisor import _kill


def worker() -> WorkerProc:
    # WorkerProc.to touches only its own fields: a stand-in for the child's pipes is enough.
    child: Any = SimpleNamespace(pid=4242, stdin=SimpleNamespace(transport=object()), frames=object(), returncode=None)
    return WorkerProc(child, on_unfit=lambda w: None)


async def test_every_worker_move_is_allowed_or_refused():
    for frm in WorkerState:
        for to in WorkerState:
            w = worker()
            w.state = frm
            if to == frm:
                assert w.to(to) is False
            elif to == WorkerState.EXITED or to in MOVES[frm]:
                assert w.to(to) is True and w.state == to
            else:
                with pytest.raises(StateError) as e:
                    w.to(to)
                assert (e.value.frm, e.value.to) == (frm.value, to.value) and w.state == frm


async def test_worker_exited_records_where_from():
    w = worker()
    w.to(WorkerState.READY)
    w.retiring()
    assert not w.dead and not w.killed  # told to exit: a SIGKILL of ours is what killed records
    w.to(WorkerState.EXITED)
    assert w.dead and w.exited_from == WorkerState.RETIRING
    w2 = worker()
    w2.to(WorkerState.READY)
    w2.to(WorkerState.EXITED)  # on its own
    assert w2.dead and w2.exited_from == WorkerState.READY


async def test_mark_unfit_moves_once_and_keeps_why():
    seen: list[WorkerProc] = []
    child: Any = SimpleNamespace(pid=7, stdin=SimpleNamespace(transport=object()), frames=object())
    w = WorkerProc(child, on_unfit=seen.append)
    w.to(WorkerState.READY)
    w.mark_unfit("worker 7: bad frame")
    w.mark_unfit("worker 7: later")
    assert w.state == WorkerState.UNFIT and w.unfit == "worker 7: bad frame" and seen == [w]
    w.retiring()
    assert w.state == WorkerState.RETIRING and w.unfit == "worker 7: bad frame" and not w.idle()


def program() -> Program:
    launch: Any = SimpleNamespace(finished=lambda: False)
    return Program("p", 0, kernel=SimpleNamespace(device=0), launch=launch, hash=0, nodes=1)  # type: ignore[arg-type]


def test_every_program_move_is_allowed_or_refused():
    for frm in ProgramState:
        for to in ProgramState:
            p = program()
            p.phase = frm
            if to == frm:
                assert p.to(to) is False
            elif to in PROGRAM_MOVES[frm]:
                assert p.to(to, "why") is True and p.phase == to
            else:
                with pytest.raises(StateError):
                    p.to(to)
                assert p.phase == frm


def test_a_lost_program_shows_as_failed():
    assert ProgramState.LOST.shown == "failed"
    assert [s.shown for s in ProgramState if s is not ProgramState.LOST] == [s.value for s in ProgramState
                                                                             if s is not ProgramState.LOST]


async def test_program_observes_the_end_of_its_launch():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    launch: Any = SimpleNamespace(finished=fut.done, inner=fut)
    p = Program("p", 0, kernel=SimpleNamespace(device=0), launch=launch, hash=0, nodes=1)  # type: ignore[arg-type]
    assert p.observe() is ProgramState.RUNNING
    fut.set_exception(RuntimeError("worker 9 exited while its kernel ran"))
    assert p.observe() is ProgramState.FAILED and p.state() == ("failed", "worker 9 exited while its kernel ran")


async def test_a_worker_retired_after_an_outside_kill_died_on_its_own():
    # H200 (tests/gpu/test_faults_real.py, while-running): the fault's teardown retired
    # the killed worker before its EOF was read; its -9 was still not ours, so it is the culprit.
    w = worker()
    w.to(WorkerState.READY)
    w.retiring()  # the teardown's retire, after the outside SIGKILL
    w.process.returncode = -9
    assert w.died_on_its_own()
    ours = worker()
    ours.to(WorkerState.READY)
    ours.retiring()
    ours.killed = True  # the retire's own SIGKILL, after QUIT was not answered
    ours.process.returncode = -9
    assert not ours.died_on_its_own()


def test_a_process_in_its_exit_is_ending():
    # H200 (test_faults_real.py, while-running): echo's worker, SIGKILLed from outside,
    # stayed ~0.2 s in its exit while the driver tore its context down (its stdout still open, not
    # yet a zombie); the fault's teardown killed it again meanwhile.  That kill is not ours.
    head, rest = "4242 (python3 (x)) ", " 1 4242 4242 0 -1 {flags} 99 0 0 0 0 0 0 0 20 0 1 0 667001 3133440 362"
    assert not procfs.exiting(head + "R" + rest.format(flags=0x400000))
    assert procfs.exiting(head + "R" + rest.format(flags=0x400000 | procfs.PF_EXITING))
    assert procfs.exiting(head + "Z" + rest.format(flags=0x400000))


def test_our_kill_of_a_worker_killed_from_outside_is_not_ours():
    p = subprocess.Popen(["sleep", "60"])
    try:
        w = worker()
        w.process = SimpleNamespace(pid=p.pid, exited=False, returncode=None, kill=lambda: None)
        w.pid = p.pid
        assert not procfs.ending(p.pid)
        os.kill(p.pid, signal.SIGKILL)  # from outside: a zombie until reaped
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # its exit, the zombie left in place
        assert procfs.ending(p.pid)
        _kill(w)
        assert not w.killed and w.state == WorkerState.RETIRING
    finally:
        p.kill()
        p.wait()


def test_our_kill_stays_ours_when_we_kill_again_during_its_exit():
    """A fault's teardown kills a worker; its retire kills it again while the first SIGKILL's exit
    is under way (~0.2 s for a CUDA client, a zombie here): the -9 is still ours, not the fault
    evidence of a worker killed from outside (once the second kill said so)."""
    p = subprocess.Popen(["sleep", "60"])
    try:
        w = worker()
        w.process = SimpleNamespace(pid=p.pid, exited=False, returncode=None, kill=lambda: os.kill(p.pid, signal.SIGKILL))
        w.pid = p.pid
        _kill(w)
        assert w.killed
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # its exit, the zombie left in place
        assert procfs.ending(p.pid)
        _kill(w)
        assert w.killed
    finally:
        p.kill()
        p.wait()
