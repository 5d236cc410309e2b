"""The GPU's real limits, refused before a load changes anything, and the start check, on the
simulated GPU (which has the H200's hardware queues, client limit and co-residency).

Each refusal is checked to leave everything as it was: the programs, the slots, the pool, the
blink count and the workers."""

from __future__ import annotations

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import CapacityError, LimitError, NotStarted
from meshd_mps.isolation.limits import BLINK_QUEUES
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

from ..rigs.backend import ScriptCompiler, beats, example, man, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.sim import sim

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["blink", "mps"])
async def backend(request, standin_on_path):
    b = await open_sim(request.param, pool=2, max_clients=8)
    b.compiler = ScriptCompiler(b.infos[b.devices[0]])
    try:
        yield b
    finally:
        await b.close()


def snapshot(b: Backend, progs: Programs) -> dict:
    """What a refused load must leave as it was."""
    s = b.status()
    return {"programs": sorted(progs.by_name), "workers": s["workers"], "pool": s.get("pool"),
            "blinks": s.get("blinks"),
            "modules": [len(c.modules) for c in b.isolations.values() if b.isolation == "blink"]}  # blink: each context's


async def test_blink_context_takes_one_program_per_hardware_queue(standin_on_path):
    """32 heartbeats beat in one context (its worker asked for 32 queues and gave each its own);
    the 33rd is refused up front, naming the limit.  With the driver's default of 8 queues the
    9th would be launched and never start (test_sim_limits.py)."""
    b = await open_sim("blink", deadlines=TEST_DEADLINES)
    try:
        progs = Programs(b)
        man_hb, ptx = example("heartbeat")
        for i in range(BLINK_QUEUES):
            await progs.load({**man_hb, "name": f"heartbeat-{i}"}, ptx)
        seen = {p.slot: b.mailbox.heartbeat(p.slot) for p in progs.by_name.values()}
        for slot, n in seen.items():
            await beats(b, slot, n)  # every one of them runs
        before = snapshot(b, progs)
        with pytest.raises(CapacityError, match="hardware work queue") as e:
            await progs.load({**man_hb, "name": "heartbeat-32"}, ptx)
        assert e.value.limit == "hardware queues" and e.value.have == BLINK_QUEUES
        assert snapshot(b, progs) == before
        assert all(r["state"] == "running" for r in progs.list())
    finally:
        await b.close()


async def test_mps_programs_are_the_clients_less_the_pool(standin_on_path):
    """max_clients 8 with a pool of 2: 6 programs, and the 7th refused before a worker is taken."""
    b = await open_sim("mps", pool=2, deadlines=TEST_DEADLINES, max_clients=8)
    b.compiler = ScriptCompiler(b.infos[0])
    try:
        progs = Programs(b)
        assert b.device_status(0)["capacity"] == 6  # the status says it: the fleet advertises it to Ray
        for i in range(6):
            await progs.load(man(f"p{i}"), sim(kernel="heartbeat"))
        before = snapshot(b, progs)
        with pytest.raises(CapacityError, match="MPS server takes 8 clients") as e:
            await progs.load(man("p6"), sim(kernel="heartbeat"))
        assert e.value.limit == "MPS clients"
        assert snapshot(b, progs) == before
        # An upgrade takes its predecessor's place: it is not refused.
        up = await progs.upgrade("p0", man("p0"), sim(kernel="heartbeat", regs=40))
        assert up.kernel.regs == 40
    finally:
        await b.close()


async def test_a_kernel_that_never_starts_is_rolled_back(backend):
    progs = Programs(backend)
    hb = await progs.load(man("heartbeat"), sim(kernel="heartbeat"))
    before = snapshot(backend, progs)
    with pytest.raises(NotStarted, match="did not start within 2s") as e:
        await progs.load(man("silent"), sim(kernel="heartbeat", start=False))
    assert e.value.program == "silent" and "STATE = RUNNING" in e.value.likely
    after = snapshot(backend, progs)
    assert after["programs"] == before["programs"] and after["modules"] == before["modules"]
    if backend.isolation == "mps":
        # Its worker (its kernel ran, HALT ended it) went back to the pool, or was retired.
        assert set(after["workers"]) <= set(before["workers"]) | set(after["pool"])
    else:
        assert after["blinks"] == before["blinks"] + 2  # the load's blink, and the discard's
    n = backend.mailbox.heartbeat(hb.slot)
    await beats(backend, hb.slot, n)  # the resident program runs on
    assert progs.list()[0]["state"] == "running"
    # Nothing is left of it: the slot is free again.
    again = await progs.load(man("again"), sim(kernel="heartbeat"))
    assert again.slot == 1


async def test_nodes_beyond_the_grid_or_the_gpu_refused_up_front(backend):
    progs = Programs(backend)
    info = backend.infos[0]
    before = snapshot(backend, progs)
    jits = backend.compiler.jit_count
    with pytest.raises(CapacityError, match="grid limit of 2147483647") as e:
        await progs.load(man("big"), sim(kernel="heartbeat"), nodes=4294967296)
    assert e.value.limit == "grid"
    most = info.blocks_per_sm * info.sms_total
    with pytest.raises(CapacityError, match=f"holds at most {most} blocks") as e:
        await progs.load(man("big"), sim(kernel="heartbeat"), nodes=1_000_000_000)
    assert e.value.limit == "resident blocks"
    with pytest.raises(LimitError, match="at least 1 block"):
        await progs.load(man("none"), sim(kernel="heartbeat"), nodes=0)
    assert snapshot(backend, progs) == before and backend.compiler.jit_count == jits
    await progs.load(man("fits"), sim(kernel="heartbeat"), nodes=8 * info.sms_total)  # the sim reports 8 per SM


async def test_real_occupancy_and_co_residency(backend):
    """One block per SM (the module's occupancy, known once loaded): 133 blocks never fit 132 SMs;
    100 fit, and then 40 more of another program do not fit beside them."""
    progs = Programs(backend)
    before = snapshot(backend, progs)
    with pytest.raises(CapacityError, match="holds 132 of its blocks") as e:
        await progs.load(man("wide"), sim(kernel="heartbeat", per_sm=1), nodes=133)
    assert e.value.limit == "resident blocks"
    after = snapshot(backend, progs)
    assert after["programs"] == before["programs"] and after["modules"] == before["modules"]
    if backend.isolation == "blink":
        assert after["blinks"] == before["blinks"]  # the refusal happened inside the load's blink
    await progs.load(man("a"), sim(kernel="heartbeat", per_sm=1), nodes=100)
    before = snapshot(backend, progs)
    with pytest.raises(CapacityError, match="do not fit beside") as e:
        await progs.load(man("b"), sim(kernel="heartbeat", per_sm=1), nodes=40)
    assert e.value.limit == "co-resident blocks" and e.value.have == 32
    assert snapshot(backend, progs)["programs"] == before["programs"]
    await progs.load(man("b"), sim(kernel="heartbeat", per_sm=1), nodes=32)
    assert all(r["state"] == "running" for r in progs.list())


async def test_start_check_time_is_recorded(backend):
    progs = Programs(backend)
    await progs.load(man("hb"), sim(kernel="heartbeat"))
    assert len(progs.start_ms) == 1 and 0 <= progs.start_ms[0] < TEST_DEADLINES.start * 1e3
    assert backend.mailbox.u32(0, abi.STATE) == abi.RUNNING
    with anyio.fail_after(5):
        await progs.unload("hb")


async def test_a_program_whose_heartbeat_stops_is_stalled_and_logged_once(backend):
    """Stalled after stall_after without a beat (not running); the stall's start and end are
    logged once each; a program that never beats is never stalled."""
    from structlog.testing import capture_logs

    progs = Programs(backend, stall_after=0.3)
    with capture_logs() as logs:
        p = await progs.load(man("sticky"), sim(kernel="heartbeat", pause_after=50, pause_ms=1500))
        quiet = await progs.load(man("quiet"), sim(kernel="spin", start=True))
        with anyio.fail_after(10):
            while progs.describe(p)["state"] != "stalled":
                await anyio.sleep(0.02)
        row = progs.describe(p)
        assert row["beat_age_s"] >= 0.3 and "no heartbeat for" in row["error"]
        with anyio.fail_after(10):
            while progs.describe(p)["state"] != "running":
                await anyio.sleep(0.02)
        assert progs.describe(p)["beat_age_s"] < 0.3
    started = [e for e in logs if "stalled: its heartbeat has not advanced" in e["event"]]
    ended = [e for e in logs if "no longer stalled" in e["event"] and "beats again" in e["event"]]
    assert len(started) == 1 and len(ended) == 1, [e["event"] for e in logs]
    assert progs.describe(quiet)["beat_age_s"] is None and progs.describe(quiet)["state"] != "stalled"
