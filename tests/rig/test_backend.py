"""Backend.open in both modes, blinks, and the Programs layer, on the simulated GPU
with real NVRTC + nvJitLink compiles of the example programs."""

from __future__ import annotations

import anyio
import pytest

from meshd_mps.backend import Backend, Image
from meshd_mps.base.errors import AlreadyLoaded, ConfigError, MeshError, NoDriver, NotLoaded, NotServedHere, WorkerError
from meshd_mps.gpu.compiler import Prepared
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

from ..rigs.backend import beats, example, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.sim import sim

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["blink", "mps"])
async def backend(request, standin_on_path):
    b = await open_sim(request.param, pool=2)
    try:
        yield b
    finally:
        await b.close()


async def test_load_launch_halt(backend):
    man, ptx = example("heartbeat")
    k = await backend.load(await backend.prepare(man, ptx))
    assert k.rt_abi == abi.RT_ABI and k.regs > 0
    run = await backend.launch(k, slot=5)
    await beats(backend, 5, 10)
    assert not backend.query(k)
    backend.mailbox.halt(5)
    with anyio.fail_after(10):
        d = await run
    assert d.ok and backend.query(k)
    assert backend.mailbox.u32(5, abi.STATE) == abi.EXITED
    await backend.unload(k)


async def test_programs_load_call_upgrade_unload(backend):
    progs = Programs(backend)
    hb = await progs.load(*example("heartbeat"))
    echo = await progs.load(*example("echo"))
    assert (hb.slot, echo.slot) == (0, 1)
    await beats(backend, hb.slot, 10)
    assert await progs.call("echo", b"hello") == b"hello"
    before = backend.mailbox.heartbeat(hb.slot)
    up = await progs.upgrade("echo", *example("echo"))
    assert up.slot == 1 and up.upgrades == 1 and up.cached  # the second compile came from the cache
    assert await progs.call("echo", b"again") == b"again"
    await beats(backend, hb.slot, before)  # the heartbeat kept (or resumed) running
    rows = {r["name"]: r for r in progs.list()}
    assert rows["heartbeat"]["state"] == "running" and rows["echo"]["upgrades"] == 1
    with pytest.raises(AlreadyLoaded, match="already loaded"):
        await progs.load(*example("echo"))
    with pytest.raises(NotLoaded, match="'nope' is not loaded"):
        await progs.unload("nope")
    await progs.unload("echo")
    await progs.unload("heartbeat")
    assert progs.list() == []
    if backend.isolation == "blink":
        assert backend.isolations[0].blinks >= 2


async def test_blink_halts_and_relaunches_running_programs(standin_on_path):
    async with await Backend.open(gpu="sim", deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb = await progs.load(*example("heartbeat"))
        await beats(b, hb.slot, 10)
        ctx = b.isolations[0]
        gen_before = ctx.proc.gen[hb.kernel.module.module]
        await progs.load(*example("spin"))
        assert ctx.blinks == 1 and ctx.last_blink_ms is not None
        assert ctx.proc.gen[hb.kernel.module.module] == gen_before + 1  # relaunched
        assert not hb.launch.finished()  # the caller never saw the blink as an ending
        n = b.mailbox.heartbeat(hb.slot)
        await beats(b, hb.slot, n)
        await progs.close()


async def test_blink_refuses_when_a_program_does_not_halt(standin_on_path):
    async with await Backend.open(gpu="sim", deadlines=TEST_DEADLINES) as b:
        b.isolations[0].halt_s = 0.5
        man, _ = example("spin")
        stuck = await b.load(Image(Prepared(man_parse(man, "stuck"), 1, sim(kernel="hang"), 0, False, 64, 32)))
        run = await b.launch(stuck, 3)
        with pytest.raises(MeshError, match=r"blink: stuck \(slot 3\) did not halt within 0.5s"):
            await b.load(await b.prepare(*example("spin")))
        assert not run.finished()


def man_parse(man: dict, name: str):
    from meshd_mps.gpu.compiler import Manifest

    return Manifest.parse({**man, "name": name})


async def test_rt_abi_mismatch_is_refused(backend):
    man, _ = example("spin")
    img = await backend.isolations[0].prepare(Prepared(man_parse(man, "old"), 1, sim(rt_abi=7), 0, False, 64, 32))
    with pytest.raises(MeshError, match="old: mesh_rt_abi is 7, this meshd-mps runs program ABI 1"):
        await backend.load(img)


async def test_sms_over_the_device_is_refused(standin_on_path):
    for iso in ("blink", "mps"):
        with pytest.raises(ConfigError, match=r"^sms 200: the device has 132$"):
            await Backend.open(isolation=iso, gpu="sim", sms=200)


async def test_green_context_sm_count_is_checked(standin_on_path):
    async with await Backend.open(isolation="mps", gpu="sim", sms=16, pool=1) as b:
        assert b.caps.sms == 16 and b.caps.green
        k = await b.load(await b.prepare(*example("spin")))
        assert k.sms == k.module.info.sms == 16
        await b.unload(k)
        with pytest.raises(MeshError, match="load: the worker's green context has 8 SMs, not 16"):
            await b.isolations[0].preload("liar", sim(sms=8), 32, 0, 0)


async def test_no_driver_is_a_plain_error(standin_on_path):
    try:
        from meshd_mps.gpu.device import query_device

        query_device()
    except NoDriver:
        pass
    else:
        pytest.skip("this machine has an NVIDIA driver")
    for iso in ("blink", "mps"):
        with pytest.raises(NoDriver, match=r"^no NVIDIA driver"):
            await Backend.open(isolation=iso, gpu="cuda")


async def test_stack_limit(backend):
    if backend.isolation == "mps":
        assert await backend.stack_limit() is None  # each worker's own context: nothing to share
        assert await backend.stack_limit(4096) is None
        return
    before = await backend.stack_limit()
    assert before > 0
    assert await backend.stack_limit(before * 2) == before * 2
    assert await backend.stack_limit() == before * 2


async def test_native_client_check(standin_on_path, monkeypatch):
    async with await Backend.open(isolation="mps", gpu="sim", pool=1) as b:
        assert b.mps.native_pipe_dir() == b.daemon.pipe_dir
        with pytest.raises(MeshError, match=r"mps: worker 1 is not among server \d+'s clients"):
            await b.mps.check_native(1)  # pid 1 is nobody's MPS client
        assert 1 not in b.mps.native  # forgotten after the failed check
        pooled = b.isolations[0].pool.pids()[0]
        await b.mps.check_native(pooled)  # a native worker that is a client passes and is remembered
        assert pooled in b.mps.native


async def test_failed_upgrade_restores_the_old_version(backend, monkeypatch):
    progs = Programs(backend)
    echo = await progs.load(*example("echo"))
    real = backend.launch
    calls = []

    async def failing_once(k, slot, nodes=1):
        calls.append(k.name)
        if len(calls) == 1:
            raise MeshError("injected: the new image's launch failed")
        return await real(k, slot, nodes)

    monkeypatch.setattr(backend, "launch", failing_once)
    with pytest.raises(MeshError, match="injected"):
        await progs.upgrade("echo", *example("echo"))
    again = progs.get("echo")  # nothing lost: the old version runs again, on its slot
    assert again.slot == echo.slot and again.state()[0] == "running"
    assert await progs.call("echo", b"still here") == b"still here"
    await progs.close()


async def test_open_as_a_context_runs_the_supervisor_in_our_task(standin_on_path):
    """``async with Backend.open()``: the supervisor's task group is entered in the caller's task
    (no task of its own), and a failure of one of its tasks reaches the caller; at the block's end
    the backend is closed.  ``await Backend.open()`` (every other test) runs the group in a task."""
    for iso in ("blink", "mps"):
        async with Backend.open(isolation=iso, gpu="sim", pool=1, deadlines=TEST_DEADLINES) as b:
            assert b.sup._runner is None and not b.sup.closed
            k = await b.load(await b.prepare(*example("spin")))
            b.mailbox.reset_slot(2)
            with anyio.fail_after(10):
                assert (await (await b.launch(k, 2))).ok  # spin: 100 ms, then it returns
            await b.unload(k)
            pids = b.sup.live()
        assert b.sup.closed and b.sup.children() == [] and pids

    async def fails() -> None:
        raise RuntimeError("a task of the supervisor's failed")

    with pytest.raises(ExceptionGroup) as e:
        async with Backend.open(gpu="sim", deadlines=TEST_DEADLINES) as b:
            b.sup.start_soon(fails, name="fails")
            await anyio.sleep(30)  # cancelled: the failure reaches us
    assert e.group_contains(RuntimeError, match="failed") and b.sup.children() == []


@pytest.mark.usefixtures("no_leaks")
async def test_a_failed_open_as_a_context_leaves_nothing(standin_on_path):
    for iso in ("blink", "mps"):
        with pytest.raises(ConfigError, match=r"^sms 200: the device has 132$"):
            async with Backend.open(isolation=iso, gpu="sim", sms=200):
                pytest.fail("opened")


async def test_teardown_and_refill(backend):
    """After a fault of a GPU: ``teardown`` retires every worker of it (MPS: the programs' and the
    pool's; blink: the context) and their launches fail, while the successors start, held;
    ``refill`` brings up a worker for each lost program (MPS) or a new context, ``recovered`` the
    pool (paced), and loads work again."""
    k = await backend.load(await backend.prepare(*example("heartbeat")))
    run = await backend.launch(k, 4)
    await beats(backend, 4, 10)
    iso = backend.isolations[0]
    # Blink: the next context's worker stands by (imported, no context), and is no part of the fault.
    standby = getattr(iso, "standby", None)
    before = sorted(set(backend.sup.live()) - ({standby.pid} if standby is not None else set()))
    torn = await backend.teardown(0, ahead=1)
    assert sorted(w.pid for w in torn) == before and k.pid in before
    assert all(w.process.returncode is not None for w in torn)
    with anyio.fail_after(30):  # started by the teardown, not waited for by it: refill waits
        await backend.isolations[0].held_started()
    held = backend.sup.live()
    assert len(held) == 1 and not set(held) & set(before)  # the lost program's next worker, or the next context
    with pytest.raises(WorkerError), anyio.fail_after(10):
        await run
    assert standby is None or held == [standby.pid]  # blink: the standby is the next context, started before
    assert await backend.refill(0, extra=1)
    assert set(held) <= set(backend.sup.live()) and not set(backend.sup.live()) & set(before)
    assert iso.first_context_at > 0
    iso.recovered()
    if backend.isolation == "mps":
        assert len(iso.pool) == 1  # the lost program's worker, not taken, pooled; the rest follows paced
        with anyio.fail_after(10):
            while len(iso.pool) < 2:
                await anyio.sleep(0.01)
    await backend.unload(k)  # its worker went with the fault: nothing left to do
    again = await backend.load(await backend.prepare(*example("heartbeat")))
    rerun = await backend.launch(again, 4)
    await beats(backend, 4, backend.mailbox.heartbeat(4))
    backend.mailbox.halt(4)
    with anyio.fail_after(10):
        assert (await rerun).ok
    await backend.unload(again)


async def test_an_error_in_the_block_is_raised_as_it_is(standin_on_path):
    with pytest.raises(NotServedHere):
        async with Backend.open(gpu="sim", deadlines=TEST_DEADLINES) as b:
            b.device_or_first(3)
    assert b.sup.closed and b.sup.children() == []
