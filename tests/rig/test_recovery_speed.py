"""On the simulated GPU: a fault's recovery is as quick under live restore as without it,
and a program whose worker was killed comes back with the innocents.

No wall-clock threshold: what made live restore 2.4x slower was a wait (the teardown awaited each
worker it started ahead, and a worker on a socket is spawned only once it has imported and said
HELLO), so the tests hold those workers' start back until the teardown has returned; a teardown
that waited for one would never end.  The killed program's place in the same relaunch is read from
the recovery's own report, and the MPS clients made after it from the spawns the backend asked for.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import anyio
import pytest

from meshd_mps.base import faults
from meshd_mps.base.restart import CRASH_LOOP_BURST
from meshd_mps.programs import RECOVERY_STEPS, Programs, ProgramState

from ..rigs.backend import beats, example, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.waits import until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

LIVE = pytest.mark.parametrize("live", [False, True], ids=["pipes", "live-restore"])


def named(name: str, new: str) -> tuple[dict, bytes]:
    man, ptx = example(name)
    return {**man, "name": new}, ptx


def recovered(progs: Programs) -> bool:
    return bool(progs.faults) and progs.faults[-1].ms > 0


@LIVE
@pytest.mark.parametrize("mode", ["mps", "blink"])
async def test_the_teardown_waits_for_none_of_the_workers_it_starts(standin_on_path, tmp, monkeypatch, mode, live):
    """The lost programs' workers are started during the teardown, held (no context yet), and the
    relaunch takes them; each one's start is held back here until the teardown has returned, so
    the recovery ends only if the teardown waits for the old workers' exit alone (under
    live restore it once awaited each new worker's HELLO in turn)."""
    async with await open_sim(mode, pool=2 if mode == "mps" else 0, live=tmp if live else None) as b:
        g = b.isolations[0]
        gate = anyio.Event()
        held: list[int] = []
        if mode == "mps":
            assert b.mps is not None
            spawn = b.mps.spawn

            async def gated_mps(program, device, hold=False):
                if hold:
                    await gate.wait()
                w = await spawn(program, device, hold=hold)
                if hold:
                    held.append(w.pid)
                return w

            monkeypatch.setattr(b.mps, "spawn", gated_mps)
        else:
            spawn_ctx = g._spawn

            async def gated_blink(hold=False):
                if hold:
                    await gate.wait()
                w = await spawn_ctx(hold=hold)
                if hold:
                    held.append(w.pid)
                return w

            monkeypatch.setattr(g, "_spawn", gated_blink)
            # The standby (the next context's worker, started at open) dies first: the teardown
            # starts the next one itself, as it does for MPS's lost programs.
            await until(lambda: g.standby is not None, 30, "the standby started at open")
            standby = g.standby
            assert standby is not None
            os.kill(standby.pid, signal.SIGKILL)
            await until(lambda: not standby.idle(), 10, "the standby seen dead")
        teardown = g.teardown

        async def tear(ahead=0):
            torn = await teardown(ahead)
            gate.set()  # only now may the workers started ahead come up
            return torn

        monkeypatch.setattr(g, "teardown", tear)
        progs = Programs(b)
        names = [f"heartbeat-{i}" for i in range(3)]
        hbs = [await progs.load(*named("heartbeat", n)) for n in names]
        for p in hbs:
            await beats(b, p.slot, 1)
        await progs.load(*example("fault"), restart="never")
        await until(lambda: recovered(progs), 45, lambda: f"the recovery (the teardown ended: {gate.is_set()})")
        r = progs.faults[-1]
        assert gate.is_set() and r.gpu_wide and r.faulted == "fault" and sorted(r.relaunched) == names, r
        assert list(r.steps) == list(RECOVERY_STEPS), r.steps
        # Every lost program came back on a worker started ahead (blink: the one new context).
        assert held and {p.kernel.pid for p in hbs} <= set(held), (held, [p.kernel.pid for p in hbs])
        for p in hbs:
            await beats(b, p.slot, b.mailbox.heartbeat(p.slot))
        await progs.close()


@LIVE
async def test_a_killed_program_comes_back_with_the_innocents(standin_on_path, tmp, monkeypatch, live):
    """A SIGKILL from outside while its kernel runs faults the GPU (the stand-in, as the H200); its
    program is named the culprit, yet nothing it ran did it: it is relaunched in the recovery's own
    relaunch, on a worker started ahead for it, its failure counted; after the recovery the only
    new MPS clients are the pool's refill."""
    async with await open_sim("mps", pool=2, live=tmp if live else None) as b:
        assert b.mps is not None
        g = b.isolations[0]
        progs = Programs(b)
        spawned: list[tuple[int, bool, bool]] = []  # pid, held, asked for after the recovery
        spawn = b.mps.spawn

        async def counted(program, device, hold=False):
            after = recovered(progs)
            w = await spawn(program, device, hold=hold)
            spawned.append((w.pid, hold, after))
            return w

        monkeypatch.setattr(b.mps, "spawn", counted)
        hb = await progs.load(*example("heartbeat"))
        echo = await progs.load(*example("echo"))
        await beats(b, hb.slot, 10)
        pid = echo.kernel.pid
        os.kill(pid, signal.SIGKILL)
        await until(lambda: recovered(progs), 45, "the recovery")
        r = progs.faults[-1]
        assert r.gpu_wide and r.faulted == "echo" and r.pid == pid and r.by == "died", r
        assert r.lost == ["heartbeat"] and r.relaunched == ["heartbeat", "echo"] and r.not_relaunched == {}, r
        assert echo.observe() is ProgramState.RUNNING and echo.restarts == 1 and len(echo.failures) == 1
        held = {p for p, hold, _ in spawned if hold}
        assert {echo.kernel.pid, hb.kernel.pid} <= held, (spawned, echo.kernel.pid, hb.kernel.pid)
        assert await progs.call("echo", b"back") == b"back"
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        await until(lambda: len(g.pool) == g.pool.cap, 30, lambda: f"the pool refilled: {g.pool.pids()}")
        after = [(p, hold) for p, hold, late in spawned if late]
        assert {p for p, _ in after} <= set(g.pool.pids()), (after, g.pool.pids())  # the paced refill's (held, then READY)
        assert echo.restarts == 1 and len(progs.faults) == 1
        await progs.close()


@pytest.mark.parametrize("case", ["never", "crash-loop"])
async def test_a_killed_program_keeps_its_restart_policy(standin_on_path, case):
    """Relaunched with the innocents only as its restart policy says: under never it stays faulted;
    its kill counts toward a crash loop, and the one that makes it is not relaunched."""
    async with await open_sim("mps", pool=1) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        echo = await progs.load(*example("echo"), restart="never" if case == "never" else None)
        await beats(b, hb.slot, 10)
        if case == "crash-loop":  # its earlier failures (four kills, each a recovery of its own)
            echo.to(None, failures=(time.monotonic(),) * (CRASH_LOOP_BURST - 1))
        os.kill(echo.kernel.pid, signal.SIGKILL)
        await until(lambda: recovered(progs), 45, "the recovery")
        r = progs.faults[-1]
        assert r.faulted == "echo" and r.by == "died" and r.relaunched == ["heartbeat"], r
        if case == "never":
            assert r.not_relaunched == {"echo": "restart policy never"} and echo.observe() is ProgramState.FAULTED
        else:
            assert r.not_relaunched["echo"].startswith(f"crash loop: {CRASH_LOOP_BURST} failures"), r.not_relaunched
            assert echo.observe() is ProgramState.CRASH_LOOP and echo.restarts == 0
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        await progs.close()


async def test_a_live_stop_leaves_no_held_worker_behind(standin_on_path, tmp):
    """A worker started for a recovery and not taken by it (the culprit's, whose backoff is still
    running) has no context yet: left for the next meshd-mps, its READY there would make a new MPS
    client, which stalls every running program.  A live-restore stop retires it; the programs'
    workers are left running, and the next start adopts them."""
    d = dataclasses.replace(TEST_DEADLINES, pool_pace=60.0, restart_backoff=60.0)  # nothing takes it meanwhile
    b = await open_sim("mps", pool=1, live=tmp, deadlines=d)
    try:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 10)
        await progs.load(*example("fault"))  # on-failure: a worker is started for it too, held
        await until(lambda: recovered(progs), 45, "the recovery")
        held = [w.pid for w in b.isolations[0]._held]
        assert held and hb.kernel.pid not in held and progs.by_name["fault"].seen() is ProgramState.RESTARTING
        kept = hb.kernel.pid
        await progs.detach()
        left = await b.detach()
    finally:
        await b.close()
    running = [p for p in held if os.path.exists(f"/proc/{p}")]
    async with await open_sim("mps", pool=1, live=tmp, deadlines=d) as again:  # adopts what was left, then ends it
        adopted = {f.module.proc.pid for f in again.found}
    assert kept in left and kept in adopted and not set(held) & set(left), (held, left)
    assert not running, "a held worker was left running"


def test_only_a_worker_death_with_no_error_of_its_own_is_innocent():
    """``faults.died_innocent``: the culprit named by its worker's death alone comes back with the
    innocents; one whose kernel reported a CUDA error, or that ran to its end and failed, or a
    culprit named by weaker evidence, does not."""
    hb = faults.Suspect("heartbeat", 11, 1.0)

    def verdict(killed: faults.Suspect) -> faults.Verdict:
        return faults.name_culprit([hb, killed], hb, [11], [], 1.0, 2.0)

    killed = faults.Suspect("echo", 12, 1.0, died=True)
    v = verdict(killed)
    assert v.by == "died" and v.culprit == "echo" and faults.died_innocent(v)
    assert not faults.died_innocent(verdict(faults.Suspect("echo", 12, 1.0, died=True,
                                                           kernel_error="CUDA_ERROR_ILLEGAL_ADDRESS")))
    v = verdict(faults.Suspect("echo", 12, 1.0, ended=True, died=True))
    assert v.by == "ended" and not faults.died_innocent(v)
    v = faults.name_culprit([hb], hb, [11], [], 1.0, 2.0)
    assert v.by == "server log" and not faults.died_innocent(v)


@LIVE
async def test_blinks_next_context_stands_by(standin_on_path, tmp, live):
    """Blink mode keeps the next context's worker standing by (imported, no context), so that a
    fault's recovery waits only for the context itself: the lost programs come back on it, and
    another stands by after the recovery."""
    async with await open_sim("blink", live=tmp if live else None) as b:
        g = b.isolations[0]
        await until(lambda: g.standby is not None, 30, "the standby started at open")
        standby = g.standby
        assert standby is not None and standby.pid != g.proc.pid
        progs = Programs(b)
        hb = await progs.load(*named("heartbeat", "heartbeat-0"))
        await beats(b, hb.slot, 1)
        await progs.load(*example("fault"), restart="never")
        await until(lambda: recovered(progs), 45, "the recovery")
        assert progs.faults[-1].relaunched == ["heartbeat-0"], progs.faults[-1]
        assert hb.kernel.pid == standby.pid  # the new context is the standby's
        await until(lambda: g.standby is not None and g.standby.pid != standby.pid, 30, "the next standby")
        await beats(b, hb.slot, b.mailbox.heartbeat(hb.slot))
        await progs.close()
