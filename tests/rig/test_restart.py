"""Restart policies and crash loops (restart.py), and fault recovery in blink mode, on the simulated
GPU and the stand-in MPS server: programs come back by themselves, a program that keeps failing
stops being relaunched and says why."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from meshd_mps.base import restart
from meshd_mps.base.errors import BadRestartPolicy
from meshd_mps.base.restart import CRASH_LOOP_BURST, End, Policy, decide
from meshd_mps.programs import Programs, ProgramState

from ..cases.restart import blink_fault_case, blink_killed_case
from ..rigs.backend import beats, example, open_sim
from ..rigs.deadlines import QUICK_RESTARTS as QUICK
from ..rigs.waits import until as _until

until = functools.partial(_until, within=30.0)  # this file's waits: 30 s

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def named(name: str, as_example: str) -> tuple[dict, bytes]:
    """An example under another name (the simulation runs a program by its name's prefix)."""
    man, ptx = example(as_example)
    return {**man, "name": name}, ptx


# ---- the decision, pure ------------------------------------------------------------------------
def test_decide_backs_off_and_declares_a_crash_loop():
    d, fails, t = QUICK, [], 100.0
    delays = []
    for _ in range(CRASH_LOOP_BURST - 1):
        dec = decide(Policy.ON_FAILURE, End.FAILED, fails, t, d)
        assert dec.relaunch and not dec.crash_loop
        delays.append(dec.delay)
        fails = list(dec.failures)
        t += 1
    assert delays == [0.02, 0.04, 0.08, 0.1]  # doubled, capped at restart_backoff_max
    dec = decide(Policy.ON_FAILURE, End.FAULTED, fails, t, d)
    assert dec.crash_loop and not dec.relaunch and len(dec.failures) == CRASH_LOOP_BURST
    assert dec.why.startswith(f"crash loop: {CRASH_LOOP_BURST} failures within 60s")


def test_decide_forgets_failures_outside_the_interval():
    d = QUICK
    old = [0.0, 1.0, 2.0, 3.0]  # four failures, a minute and more ago
    dec = decide(Policy.ON_FAILURE, End.FAILED, old, 3.0 + d.crash_loop_interval + 1, d)
    assert dec.relaunch and dec.failures == (3.0 + d.crash_loop_interval + 1,) and dec.delay == d.restart_backoff


def test_decide_by_policy_and_end():
    d = QUICK
    assert decide(Policy.ON_FAILURE, End.LOST, [1.0], 2.0, d) == restart.Decision(True, 0.0, failures=(1.0,))
    assert not decide(Policy.ON_FAILURE, End.EXITED, [], 2.0, d).relaunch
    assert decide(Policy.ALWAYS, End.EXITED, [], 2.0, d).relaunch
    for end in End:
        dec = decide(Policy.NEVER, end, [], 2.0, d)
        assert not dec.relaunch and dec.why == "restart policy never"
    assert decide(Policy.ALWAYS, End.EXITED, [1, 1.1, 1.2, 1.3], 2.0, d).why.startswith("crash loop: 5 exits")


def test_policy_parse():
    assert Policy.parse("always") is Policy.ALWAYS and Policy.parse(Policy.NEVER) is Policy.NEVER
    for bad in ("sometimes", "", None, 1):
        with pytest.raises(BadRestartPolicy) as e:
            Policy.parse(bad)
        assert e.value.value == str(bad)


# ---- MPS ---------------------------------------------------------------------------------------
async def test_a_failed_program_comes_back_by_itself(standin_on_path):
    """Its worker retired under it (the server ends its context): an own failure, not the GPU's;
    on-failure relaunches it after its backoff, on a fresh worker, and the other never stops."""
    async with await open_sim("mps", pool=1, deadlines=QUICK) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        echo = await progs.load(*example("echo"))
        old, hb_pid = echo.kernel.pid, hb.kernel.pid
        b.sup.retire(echo.kernel.proc)
        await until(lambda: progs.by_name["echo"].restarts == 1
                    and progs.by_name["echo"].observe() is ProgramState.RUNNING)
        r = progs.faults[-1]
        assert not r.gpu_wide and r.faulted == "echo" and r.by == "own"
        assert progs.by_name["echo"].kernel.pid != old and progs.by_name["echo"].slot == echo.slot
        assert await progs.call("echo", b"back") == b"back"
        assert progs.by_name["heartbeat"].kernel.pid == hb_pid and progs.by_name["heartbeat"].restarts == 0
        row = {p["name"]: p for p in progs.list()}["echo"]
        assert row["state"] == "running" and row["restarts"] == 1 and row["restart"] == "on-failure"
        await progs.close()


async def test_never_leaves_a_failed_program_failed(standin_on_path):
    async with await open_sim("mps", pool=1, deadlines=QUICK) as b:
        progs = Programs(b, restart="never")
        echo = await progs.load(*example("echo"))
        b.sup.retire(echo.kernel.proc)
        await until(lambda: progs.faults)
        assert progs.by_name["echo"].observe() is ProgramState.FAILED and progs.by_name["echo"].restarts == 0
        await progs.close()


async def test_a_program_that_keeps_faulting_the_gpu_is_a_crash_loop(standin_on_path):
    """A program faulting the GPU at every launch: each time the innocent comes back at once, the
    culprit after its backoff; at the fifth fault the culprit is a crash loop, not relaunched, and
    says so (ps, the error); the innocent runs on."""
    async with await open_sim("mps", pool=1, deadlines=QUICK) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await progs.load(*example("fault"))
        await until(lambda: progs.by_name["fault"].observe() is ProgramState.CRASH_LOOP, within=60)
        reports = [r for r in progs.faults if r.gpu_wide]
        assert len(reports) == CRASH_LOOP_BURST and all(r.faulted == "fault" for r in reports)
        assert all(r.relaunched == ["heartbeat"] for r in reports)
        row = {p["name"]: p for p in progs.list()}["fault"]
        assert row["state"] == "crash-loop" and row["restarts"] == CRASH_LOOP_BURST - 1
        assert row["error"].startswith(f"crash loop: {CRASH_LOOP_BURST} failures within 60s; not relaunched")
        assert "ILLEGAL_ADDRESS" in row["error"]
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        assert progs.by_name["heartbeat"].restarts == CRASH_LOOP_BURST
        # An upgrade (or a reload) brings it back, with its failures forgotten.
        await progs.unload("fault")
        await progs.close()


async def test_always_relaunches_a_program_that_exits(standin_on_path):
    """spin returns by itself after 100 ms: under always it is relaunched each time, and five
    exits within the interval are a crash loop too."""
    async with await open_sim("mps", pool=1, deadlines=QUICK) as b:
        progs = Programs(b)
        await progs.load(*example("spin"), restart="always")
        await until(lambda: progs.by_name["spin"].observe() is ProgramState.CRASH_LOOP)
        p = progs.by_name["spin"]
        assert p.restarts == CRASH_LOOP_BURST - 1 and p.error.startswith("crash loop: 5 exits")
        await progs.load(*named("spin2", "spin"))  # on-failure: a program that exits is left exited
        await until(lambda: progs.by_name["spin2"].observe() is ProgramState.EXITED)
        assert progs.by_name["spin2"].restarts == 0
        await progs.close()


async def test_an_unload_during_the_backoff_cancels_the_relaunch(standin_on_path):
    slow = dataclasses.replace(QUICK, restart_backoff=30.0, restart_backoff_max=30.0)
    async with await open_sim("mps", pool=1, deadlines=slow) as b:
        progs = Programs(b)
        echo = await progs.load(*example("echo"))
        b.sup.retire(echo.kernel.proc)
        await until(lambda: progs.by_name["echo"].observe() is ProgramState.RESTARTING)
        state, why = progs.by_name["echo"].state()
        assert state == "restarting" and why.startswith("relaunched in ")
        await progs.unload("echo")
        assert "echo" not in progs.by_name
        echo = await progs.load(*example("echo"))  # a fresh load: a program again, its slot reused
        assert echo.restarts == 0 and echo.observe() is ProgramState.RUNNING
        await progs.close()


# ---- blink: the cases (tests/cases/restart.py) on the simulated GPU --------------------------------


async def test_blink_recovers_from_a_fault_in_its_context():
    await blink_fault_case("sim", warm=10, more=0)


async def test_blink_recovers_when_its_context_is_killed():
    await blink_killed_case("sim", warm=10, more=0)
