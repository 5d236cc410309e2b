"""WorkerProc.ask (meshd_mps/supervision/proc.py): a worker answers in the order it is asked, so asks
are matched to replies in order, none waits for another, and each one's deadline runs from when the
worker is done with the ones before it.  Driven by hand over a FrameReader and a writer that keeps
what is sent: no process, no pipe."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import NoReply, WorkerUnfit
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision import proc
from meshd_mps.supervision.proc import WorkerProc, WorkerState
from meshd_mps.supervision.wire import FrameReader, SocketWriter

LAUNCH = frames.LAUNCH_BODY.pack(1, 1, 0, 1)


class Kept:
    """The transport's write side: every frame sent, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[Op, bytes]] = []

    def write(self, data: bytes) -> None:
        op, body, used = frames.decode(data)
        assert used == len(data)
        self.sent.append((op, body))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass


def worker(d: Deadlines = Deadlines()) -> tuple[WorkerProc, FrameReader, Kept]:
    reader, kept = FrameReader(), Kept()
    link: Any = (reader, SocketWriter(kept, reader))  # type: ignore[arg-type]
    w = WorkerProc(SimpleNamespace(pid=7, returncode=None), lambda _w: None, d, link=link)
    reader.attach(w._frame)
    return w, reader, kept


async def until_sent(kept: Kept, n: int) -> None:
    """The asks' tasks have run up to their frames' writes (each is written at once, unanswered)."""
    with anyio.fail_after(5):
        while len(kept.sent) < n:
            await anyio.lowlevel.checkpoint()


def launched(n: int) -> bytes:
    return frames.encode(Op.LAUNCHED, frames.ok_reply(frames.U32.pack(n)))


async def the_next_ask_gets_its_own_reply(w: WorkerProc, reader: FrameReader, kept: Kept) -> None:
    """After one ask given up (its frame written): the next ask's reply is its own, the given-up
    one's, which comes first, dropped; the worker stays fit."""
    box: list[bytes] = []

    async def ask() -> None:
        box.append(await w.ask(Op.LAUNCH, LAUNCH))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        await until_sent(kept, 2)
        reader.data_received(launched(1))  # the given-up one's
        reader.data_received(launched(2))
    assert box == [frames.U32.pack(2)] and w.unfit is None and not w.asking


async def test_asks_at_once_are_all_sent_and_answered_in_order():
    w, reader, kept = worker()
    got: dict[int, bytes] = {}

    async def ask(i: int) -> None:
        got[i] = await w.ask(Op.LAUNCH, LAUNCH)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(ask, i)
        await until_sent(kept, 3)  # every frame written before any reply: no ask waits for another
        assert w.asking and [op for op, _ in kept.sent] == [Op.LAUNCH] * 3
        reader.data_received(launched(10) + launched(11))
        reader.data_received(launched(12))
    assert got == {0: frames.U32.pack(10), 1: frames.U32.pack(11), 2: frames.U32.pack(12)}
    assert not w.asking and w.state == WorkerState.READY and w.unfit is None


async def test_a_cancelled_asks_reply_is_dropped_and_the_worker_stays_fit():
    w, reader, kept = worker()
    with anyio.move_on_after(0.01):
        await w.ask(Op.LAUNCH, LAUNCH)  # never answered in time: its caller gives up
    assert len(kept.sent) == 1 and w.asking
    await the_next_ask_gets_its_own_reply(w, reader, kept)


async def test_a_queued_asks_deadline_runs_from_the_reply_before_it():
    w, reader, kept = worker(Deadlines(launch=60.0))
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(w.ask, Op.LAUNCH, LAUNCH)
        await until_sent(kept, 2)
        first = w._deadline
        before = time.monotonic()
        reader.data_received(launched(1))
        assert w._deadline >= before + 60.0 > first  # the second's 60 s start now, not when it was sent
        reader.data_received(launched(2))


async def test_no_reply_in_time_makes_the_worker_unfit_even_if_its_caller_gave_up():
    w, _, _ = worker(Deadlines(launch=0.05))
    with pytest.raises(NoReply):
        await w.ask(Op.LAUNCH, LAUNCH)
    assert w.unfit == "worker 7: no reply in 0.05s" and w.state == WorkerState.UNFIT

    w, _, _ = worker(Deadlines(launch=0.05))
    with anyio.move_on_after(0.001):
        await w.ask(Op.LAUNCH, LAUNCH)
    with anyio.fail_after(5):  # the watchdog, not the caller, sees the deadline pass
        while w.unfit is None:
            await anyio.sleep(0.01)
    assert w.unfit == "worker 7: no reply in 0.05s"


async def test_a_missed_deadline_makes_the_worker_unfit_even_if_its_ask_is_cancelled_at_once(monkeypatch):
    """The watchdog fires and its ask's caller is cancelled in the same turn of the loop (its own
    timeout of the same length): the worker is unfit all the same, and the next ask is refused,
    not left waiting with no deadline (once the ask's task marked it, if it ran)."""
    w, _, _ = worker(Deadlines(launch=0.05))
    task = asyncio.ensure_future(w.ask(Op.LAUNCH, LAUNCH))
    watch = w._watch

    def watch_then_cancel() -> None:
        watch()
        task.cancel()

    monkeypatch.setattr(w, "_watch", watch_then_cancel)
    with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
        await task
    assert w.unfit == "worker 7: no reply in 0.05s" and w.state == WorkerState.UNFIT and not w.asking
    with pytest.raises(WorkerUnfit):
        await w.ask(Op.LAUNCH, LAUNCH)


async def test_a_reply_nobody_asked_for_ends_the_reading():
    _, reader, _ = worker()
    reader.data_received(launched(1))
    assert reader.ended.is_set() and "unsolicited reply LAUNCHED" in str(reader.why)


async def test_an_ask_cancelled_while_its_frame_drains_keeps_its_place():
    w, reader, kept = worker()
    kept.get_write_buffer_size = lambda: 1  # type: ignore[method-assign]  # a full pipe: the ask waits to drain
    reader.pause_writing()
    with anyio.move_on_after(0.01):
        await w.ask(Op.LAUNCH, LAUNCH)  # written, then given up while it drains
    assert len(kept.sent) == 1 and w.asking
    reader.resume_writing()
    kept.get_write_buffer_size = lambda: 0  # type: ignore[method-assign]
    await the_next_ask_gets_its_own_reply(w, reader, kept)


async def test_the_loop_is_looked_up_once_per_worker(monkeypatch):
    """get_running_loop() costs a getpid(2) a call on CPython 3.11 (its fork check): a launch's
    ask, its DONE's future and the ask's watchdog take the loop the worker was first asked on."""
    w, reader, kept = worker()
    real, ours = asyncio.get_running_loop, []

    def counted() -> asyncio.AbstractEventLoop:
        if sys._getframe(1).f_code.co_filename == proc.__file__:
            ours.append(sys._getframe(1).f_code.co_name)
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counted)
    for i in range(1, 4):
        gen, done = w.next_gen(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.ask, Op.LAUNCH, frames.LAUNCH_BODY.pack(1, gen, 0, 1))
            await until_sent(kept, i)
            reader.data_received(launched(i) + frames.encode(Op.DONE, frames.Done(1, gen, True).encode()))
        assert (await done).ok
    assert ours == ["_on_loop"]  # once, at the first launch
