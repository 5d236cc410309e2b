"""Programs under interleavings that a caller, the API's drain or a relaunch can bring about
(found by review; each case failed before its fix): a load cancelled half-way, a
relaunch whose old module cannot be unloaded, a close during a relaunch, and a later fault beside
a program left FAILED long before.  On the simulated GPU, through Programs' real paths."""

from __future__ import annotations

import dataclasses
import os
import signal

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import Unavailable
from meshd_mps.programs import Programs, ProgramState

from ..rigs.backend import ScriptCompiler, beats, example, man, open_sim
from ..rigs.deadlines import QUICK_RECOVERY
from ..rigs.sim import sim
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(90)

QUICK = QUICK_RECOVERY


async def opened(isolation: str, pool: int = 2, deadlines=QUICK) -> Backend:  # type: ignore[no-untyped-def]
    b = await open_sim(isolation, deadlines, pool=pool)
    b.compiler = ScriptCompiler(b.infos[b.devices[0]])
    return b


async def test_a_blink_load_cancelled_half_way_relaunches_the_others(standin_on_path):
    """The blink's halt and relaunch are shielded: a load cancelled during its LOAD (a caller's
    timeout) leaves the running program relaunched and tracked, and its module unloaded."""
    b = await opened("blink")
    progs = Programs(b)
    try:
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 5)
        with anyio.move_on_after(0.3):
            await progs.load(man("slow"), sim(kernel="heartbeat", load_ms=1000))
        assert hb.launch._steady.is_set() and not hb.launch.finished()  # relaunched, its Launch knows it
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n)
        with anyio.fail_after(15):
            await progs.unload("heartbeat")  # it halts: the launch running is the one tracked
        g = b.isolations[0]
        await until(lambda: g.room() == g.queues)  # the cancelled one's module unloaded too
    finally:
        await progs.close()
        await b.close()


async def test_an_mps_load_cancelled_in_its_preload_leaves_no_worker_behind(standin_on_path):
    b = await opened("mps")
    progs = Programs(b)
    try:
        g = b.isolations[0]
        with anyio.move_on_after(0.3):
            await progs.load(man("slow"), sim(kernel="heartbeat", load_ms=1000))
        assert g.load_count() == 0 and not progs.by_name
        await until(lambda: all(w.program is None for w in b.sup.workers.values()))  # retired: none holds "slow"
    finally:
        await progs.close()
        await b.close()


async def test_a_relaunch_whose_old_module_is_slow_to_unload_does_not_end_the_supervisor(standin_on_path):
    """Blink, restart policy always: the old module is unloaded before the new kernel starts (that
    unload is a blink, which would halt it: a kernel slower than ``halt`` to see HALT refused it,
    and the error escaped the supervisor's task)."""
    d = dataclasses.replace(QUICK, halt=0.3)
    b = await opened("blink", deadlines=d)
    progs = Programs(b)
    try:
        await progs.load(*example("heartbeat"))
        job = await progs.load(man("job"), sim(kernel="sleep", ms=800), restart="always")
        gen = job.generation  # one Program per name: a relaunch is a new generation of it
        await until(lambda: progs.by_name["job"].generation != gen and progs.by_name["job"].observe() is ProgramState.RUNNING)
        await anyio.sleep(0.5)  # past the halt deadline: the relaunched kernel still runs, the supervisor too
        assert progs.by_name["job"].observe() is ProgramState.RUNNING and not b.sup.closed
    finally:
        await progs.close()
        await b.close()


async def test_close_waits_for_a_relaunch_under_way_and_closes_it_too(standin_on_path):
    b = await opened("mps", pool=1)
    progs = Programs(b)
    try:
        e = await progs.load(man("e"), sim(kernel="echo", load_ms=800))
        b.sup.retire(e.kernel.proc)  # its own failure: relaunched after restart_backoff
        await until(lambda: progs.by_name["e"].observe() is ProgramState.RESTARTING)
        await anyio.sleep(0.3)  # its relaunch's preload (800 ms) is under way
        await progs.close()
        assert not progs.by_name
        await until(lambda: b.isolations[0].load_count() == 0, 5)  # nothing installed after close
        with pytest.raises(Unavailable):
            await progs.load(*example("heartbeat"))
    finally:
        await b.close()


async def test_a_program_failed_long_before_is_no_part_of_a_later_fault(standin_on_path):
    b = await opened("mps")
    progs = Programs(b)
    try:
        await progs.load(man("stale"), sim(kernel="fail", message="its own bug"), restart="never")
        await until(lambda: progs.faults)
        assert progs.faults[-1].faulted == "stale" and not progs.faults[-1].gpu_wide
        hb = await progs.load(*example("heartbeat"))
        echo = await progs.load(*example("echo"))
        await beats(b, hb.slot, 5)
        os.kill(echo.kernel.pid, signal.SIGKILL)  # exits with its kernel running: a fault of the GPU
        await until(lambda: len(progs.faults) == 2 and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        assert r.faulted == "echo" and r.lost == ["heartbeat"], r
        stale = progs.by_name["stale"]
        assert stale.observe() is ProgramState.FAILED and stale.lost_to == "" and stale.state()[1] == "its own bug"
    finally:
        await progs.close()
        await b.close()
