"""``Program.to`` is the only writer of a program's state, and reading (``state``,
``describe``) changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from meshd_mps.programs import Program, Programs, ProgramState

from ..rigs.backend import beats, example, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(90)

#: The fields of a program's state (``Program.to``'s to write).
STATE = {"phase", "error", "lost_to", "failures", "restart_at", "settled", "failed_at", "stalled_at", "kernel", "launch",
         "hash", "generation", "restarts", "upgrades", "restart", "started", "started_wall", "faults"}


async def test_describe_twice_is_the_same_and_moves_nothing(monkeypatch):
    """A launch that ended and that no watcher has taken in yet: describe shows its end, twice the
    same but for the clock's fields, and calls no transition (describe -> state -> observe must not
    move it)."""
    fut = asyncio.get_running_loop().create_future()
    launch: Any = SimpleNamespace(finished=fut.done, inner=fut)
    kernel: Any = SimpleNamespace(device=0, pid=9, regs=32)
    p = Program("p", 0, kernel=kernel, launch=launch, hash=0, nodes=1)
    progs = Programs.__new__(Programs)  # describe reads the mailbox's heartbeat word, nothing else
    progs.reg = SimpleNamespace(b=SimpleNamespace(mailbox=SimpleNamespace(heartbeat=lambda slot: 3)))  # type: ignore[assignment]
    fut.set_exception(RuntimeError("worker 9 exited while its kernel ran"))
    moves: list[tuple[Any, ...]] = []
    monkeypatch.setattr(Program, "to", lambda self, *a, **kw: moves.append(a) or True)
    first, second = progs.describe(p), progs.describe(p)
    assert (first["state"], first["error"]) == ("failed", "worker 9 exited while its kernel ran")
    clocked = {"uptime_s", "beat_age_s"}  # read time.monotonic() at each describe
    assert {k: v for k, v in first.items() if k not in clocked} == {k: v for k, v in second.items() if k not in clocked}
    assert moves == [] and p.phase is ProgramState.RUNNING and p.state() == ("failed", "worker 9 exited while its kernel ran")


@pytest.mark.usefixtures("standin_on_path")
async def test_a_fault_and_its_recovery_write_state_only_through_to(monkeypatch):
    """A GPU fault (MPS: a worker killed from outside), its recovery and the relaunches: every
    write of a program's state field happens inside Program.to (construction aside)."""
    inside = [0]
    outside: list[str] = []
    real_to, real_set = Program.to, Program.__setattr__

    def to(self: Program, *a: Any, **kw: Any) -> bool:
        inside[0] += 1
        try:
            return real_to(self, *a, **kw)
        finally:
            inside[0] -= 1

    def setattr_(self: Program, name: str, value: Any) -> None:
        if name in STATE and name in self.__dict__ and not inside[0]:
            outside.append(name)
        real_set(self, name, value)

    monkeypatch.setattr(Program, "to", to)
    monkeypatch.setattr(Program, "__setattr__", setattr_)
    d = dataclasses.replace(TEST_DEADLINES, restart_backoff=0.05, fault_window=0.5)
    async with await open_sim("mps", pool=1, deadlines=d) as b:
        progs = Programs(b)
        try:
            hb = await progs.load(*example("heartbeat"))
            echo = await progs.load(*example("echo"))
            gens = (hb.generation, echo.generation)
            await beats(b, hb.slot, 3)
            os.kill(echo.kernel.pid, signal.SIGKILL)
            await until(lambda: progs.faults and progs.faults[-1].ms > 0)
            await until(lambda: all(p.restarts == 1 and p.seen() is ProgramState.RUNNING for p in (hb, echo)))
            assert progs.by_name["heartbeat"] is hb and progs.by_name["echo"] is echo  # one object per name
            assert hb.generation not in gens and echo.generation not in gens  # each a new generation
            assert progs.faults[-1].faulted == "echo" and progs.faults[-1].lost == ["heartbeat"]
            await progs.upgrade("echo", *example("echo"))
            assert echo.upgrades == 1 and echo.restarts == 0 and echo.seen() is ProgramState.RUNNING
        finally:
            with contextlib.suppress(Exception):
                await progs.close()
    assert not outside, f"state written outside Program.to: {outside}"


def test_a_new_launch_is_a_new_generation_from_any_state():
    """``to(RUNNING, run=...)``: from every state, the same object, a new generation, the old launch's
    error and loss forgotten; an upgrade forgets the restarts and failures, a relaunch counts one."""
    from meshd_mps.base.errors import StateError
    from meshd_mps.programs import Run

    for frm in ProgramState:
        for upgraded in (False, True):
            p = Program("p", 0, kernel=SimpleNamespace(device=0), launch=None, hash=0, nodes=1)  # type: ignore[arg-type]
            p.phase, p.error, p.lost_to, p.restarts, p.failures = frm, "why", "other", 2, (1.0,)
            gen = p.generation
            run: Any = Run(kernel=SimpleNamespace(device=0), launch=object(), hash=7)  # type: ignore[arg-type]
            assert p.to(ProgramState.RUNNING, run=run, upgraded=upgraded) is True
            assert p.phase is ProgramState.RUNNING and p.generation > gen and p.launch is run.launch and p.hash == 7
            assert (p.error, p.lost_to) == ("", "")
            assert (p.restarts, p.failures, p.upgrades) == ((0, (), 1) if upgraded else (3, (1.0,), 0))
            with pytest.raises(StateError):
                p.to(ProgramState.EXITED, run=run)
