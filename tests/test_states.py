"""The lifecycle tables: every move either is in the table or is refused (StateError)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from meshd_mps.errors import StateError
from meshd_mps.programs import PROGRAM_MOVES, Program, ProgramState
from meshd_mps.supervision.proc import MOVES, WorkerProc, WorkerState


def worker() -> WorkerProc:
    # WorkerProc.to touches only its own fields: a stand-in for the child's pipes is enough.
    child: Any = SimpleNamespace(pid=4242, stdin=object(), stdout=object())
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


async def test_worker_exited_records_where_from_and_retiring_is_ours():
    w = worker()
    w.to(WorkerState.READY)
    w.retiring()
    assert w.killed and not w.dead
    w.to(WorkerState.EXITED)
    assert w.dead and w.exited_from == WorkerState.RETIRING and w.killed
    w2 = worker()
    w2.to(WorkerState.READY)
    w2.to(WorkerState.EXITED)  # on its own: not ours
    assert w2.dead and not w2.killed


async def test_mark_unfit_moves_once_and_keeps_why():
    seen: list[WorkerProc] = []
    child: Any = SimpleNamespace(pid=7, stdin=object(), stdout=object())
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
