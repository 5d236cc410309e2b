"""Several GPUs in one host against the REAL driver (and NVIDIA's MPS daemon).

Skipped, with the reason printed, unless at least two GPUs are visible (and,
for the MPS test, NVIDIA's nvidia-cuda-mps-control is on PATH).  Written for
a several-GPU machine and not yet run on one: the CPU suite's
tests/serve/test_devices.py covers the same on the simulated GPU and the stand-in
daemon.  Run on the device: `python3 -m pytest tests/gpu/test_multi_gpu.py -v -rA -s`.
"""

from __future__ import annotations

import shutil
import sys

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import DeviceError, NoDriver
from meshd_mps.programs import Programs

from ..rigs.backend import beats, example
from ..rigs.gpu import gap_while, mps_processes

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def skip(reason: str) -> None:
    print(f"skipping the multi-GPU tests: {reason}", file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def two_real_gpus() -> int:
    from meshd_mps.gpu.device import device_count

    try:
        n = device_count()
    except (NoDriver, DeviceError) as e:
        skip(str(e))
    if n < 2:
        skip(f"{n} GPU visible; these tests need at least 2")
    return n


@pytest.fixture
def real_mps() -> None:
    found = shutil.which("nvidia-cuda-mps-control")
    if found is None:
        skip("nvidia-cuda-mps-control is not on PATH")
    if "standin" in (found or ""):
        skip("nvidia-cuda-mps-control on PATH is meshd-mps's stand-in, not NVIDIA's")


def renamed(name: str, new: str) -> tuple[dict, bytes]:
    man, ptx = example(name)
    return {**man, "name": new}, ptx


@pytest.mark.mps
async def test_each_gpu_runs_and_a_fault_on_one_leaves_the_others(two_real_gpus, real_mps):
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1) as b:
        assert b.devices == tuple(range(two_real_gpus))
        assert all(len(b.isolations[d].pool) == 1 for d in b.devices)
        progs = Programs(b)
        hbs = {d: await progs.load(*renamed("heartbeat", f"heartbeat-{d}"), device=d) for d in b.devices}
        echo0 = await progs.load(*example("echo"), device=0)
        for p in hbs.values():
            await beats(b, p.slot, 1000)
        clients = await b.mps.clients(b.mps.server)
        assert all(p.kernel.pid in clients for p in [*hbs.values(), echo0])
        ps = await b.daemon.control("ps")
        print(f"mps ps:\n{ps}", file=sys.stderr)
        col = {int(w[0]): w[3] for w in (ln.split() for ln in ps.splitlines()[1:]) if len(w) > 3 and w[0].isdigit()}
        uuid = {d: col.get(p.kernel.pid) for d, p in hbs.items()}
        assert col.get(echo0.kernel.pid) == uuid[0] and len(set(uuid.values())) == len(uuid), uuid  # one device each

        hb0 = hbs[0]
        keep = (hb0.kernel.pid, echo0.kernel.pid, hb0.launch, set(b.isolations[0].pool.pids()))
        gens = {d: p.generation for d, p in hbs.items()}
        idle_gap, _ = await gap_while(b, hb0.slot, lambda: anyio.sleep(0.2))

        async def fault_on_1() -> None:
            await progs.load(*example("fault"), device=1, restart="never")
            with anyio.fail_after(120):
                while not (progs.faults and progs.faults[-1].ms > 0):
                    await anyio.sleep(0.01)

        fault_gap, _ = await gap_while(b, hb0.slot, fault_on_1)
        r = progs.faults[-1]
        print(f"fault report: {r}; GPU 0's heartbeat max gap: idle {idle_gap:.1f} us, during GPU 1's fault and"
              f" recovery {fault_gap:.1f} us", file=sys.stderr)
        assert r.gpu_wide and r.device == 1 and r.faulted == "fault" and "ILLEGAL_ADDRESS" in r.error
        assert r.lost == ["heartbeat-1"] and r.relaunched == ["heartbeat-1"], r.not_relaunched
        # GPU 0 (and any other): the same workers and launches, never torn down or relaunched.
        assert (hb0.kernel.pid, echo0.kernel.pid, hb0.launch, set(b.isolations[0].pool.pids())) == keep
        assert not hb0.launch.finished() and hb0.restarts == 0 and echo0.restarts == 0
        for d, p in hbs.items():
            if d != 1:  # the same launch, not a relaunch (each is a new generation)
                assert p.generation == gens[d] and not p.launch.finished()
        assert fault_gap < 50_000  # a teardown and relaunch would stop it for the whole recovery (0.7 s on the H200)
        assert await progs.call("echo", b"GPU 0 kept running") == b"GPU 0 kept running"
        new1 = progs.by_name["heartbeat-1"]
        assert new1.restarts == 1 and new1.device == 1
        await beats(b, new1.slot, b.mailbox.heartbeat(new1.slot) + 100)
        await progs.unload("fault")
        await progs.close()
    assert mps_processes() == []


async def test_a_blink_on_one_gpu_does_not_halt_the_other(two_real_gpus):
    async with await Backend.open(isolation="blink", gpu="cuda", devices=[0, 1]) as b:
        progs = Programs(b)
        hb0 = await progs.load(*renamed("heartbeat", "heartbeat-0"), device=0)
        hb1 = await progs.load(*renamed("heartbeat", "heartbeat-1"), device=1)
        for p in (hb0, hb1):
            await beats(b, p.slot, 1000)
        idle_gap, _ = await gap_while(b, hb0.slot, lambda: anyio.sleep(0.2))
        load_gap, _ = await gap_while(b, hb0.slot, lambda: progs.load(*example("echo"), device=1))
        print(f"GPU 0's heartbeat max gap: idle {idle_gap:.1f} us, during a blink on GPU 1 {load_gap:.1f} us "
              f"(GPU 1's blink: {b.isolations[1].last_blink_ms:.2f} ms)", file=sys.stderr)
        assert b.isolations[1].blinks == 1 and b.isolations[0].blinks == 0
        assert load_gap < max(10 * idle_gap, 200.0)
        assert await progs.call("echo", b"GPU 1") == b"GPU 1"
        await beats(b, hb1.slot, b.mailbox.heartbeat(hb1.slot) + 100)  # relaunched after its blink
        await progs.close()
