"""Several GPUs in one host (``--devices``), on the simulated GPU with two devices
(``MESHD_MPS_SIM_GPUS=2``) and the stand-in MPS daemon, which counts clients and
tears them down per device as MPS does: placement, per-GPU pools, caps and
status, a fault on one GPU leaving the other's programs running, a blink on one
GPU leaving the other's alone, the option's errors, and ``serve --devices``."""

from __future__ import annotations

import json
import os
import re

import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import ClientLimit, ConfigError, NotServedHere, WorkerError
from meshd_mps.gpu.device import SIM_GPUS_ENV, choose_devices, parse_devices, simulated_count
from meshd_mps.isolation.limits import MPS_QUEUES
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi
from meshd_mps.protocol.frames import Op
from meshd_mps.serving.client import ClientError, program_body
from meshd_mps.supervision.argv import worker_argv
from workers import warm
from workers.main import parse_args

from ..rigs.backend import beats, example, open_sim
from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.mps import MpsRig
from ..rigs.serve import EXAMPLES, cli, parse_metrics
from ..rigs.sim import sim
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two_gpus(monkeypatch, standin_on_path):
    """The simulation has two GPUs (the workers inherit the variable); the stand-in on PATH."""
    monkeypatch.setenv(SIM_GPUS_ENV, "2")


def renamed(name: str, new: str) -> tuple[dict, bytes]:
    """An example under another name (the simulation runs it by its name's prefix)."""
    man, ptx = example(name)
    return {**man, "name": new}, ptx


async def gpu_of_clients(b: Backend) -> dict[int, str]:
    """pid -> the device the stand-in daemon counts that client on (its ``ps``)."""
    out = await b.daemon.control("ps")
    return {int(w[0]): w[3] for w in (ln.split() for ln in out.splitlines()[1:]) if w}


# ---- the option ------------------------------------------------------------------------------


def test_devices_option_parses_and_refuses():
    assert parse_devices("all") is None
    assert parse_devices("0,1") == (0, 1) and parse_devices(" 1, 0 ") == (1, 0)
    for text, msg in [("", "GPU ordinals separated by commas"), ("0,,1", "GPU ordinals separated by commas"),
                      ("x", "'x' is not a GPU ordinal"), ("0,-1", "'-1' is not a GPU ordinal"),
                      ("0,1,0", "^devices 0,1,0: GPU 0 is named twice$")]:
        with pytest.raises(ConfigError, match=msg):
            parse_devices(text)
    assert choose_devices(None, 2) == (0, 1) and choose_devices([1, 0], 2) == (0, 1)
    with pytest.raises(ConfigError, match=r"^devices 3: only 2 GPUs visible \(0-1\)$"):
        choose_devices([0, 3], 2)
    with pytest.raises(ConfigError, match=r"^devices 1: only 1 GPU visible \(0\)$"):
        choose_devices([1], 1)
    with pytest.raises(ConfigError, match="no GPU named"):
        choose_devices([], 2)


def test_simulated_gpu_count(monkeypatch):
    monkeypatch.delenv(SIM_GPUS_ENV, raising=False)
    assert simulated_count() == 1
    monkeypatch.setenv(SIM_GPUS_ENV, "3")
    assert simulated_count() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(SIM_GPUS_ENV, bad)
        with pytest.raises(ConfigError, match=f"^{SIM_GPUS_ENV}={bad}: a count of simulated GPUs"):
            simulated_count()


def test_worker_argv_and_warm_read_the_same_options():
    """warm.py reads argv before the worker's argparse does; both must see the same GPU."""
    argvs = [worker_argv("/proc/1/fd/3", sms, gpu, dev)[3:] for sms in (0, 16) for gpu in ("cuda", "sim") for dev in (0, 1, 7)]
    argvs += [["--mailbox", "m", "--device=2", "--gpu=sim"], ["--mailbox", "m", "--device", "1", "--device", "3"],
              ["--mailbox", "m"]]
    for argv in argvs:
        ns = parse_args(argv)
        assert warm.options(argv) == (ns.gpu, ns.sms, ns.device), argv
        assert warm.queues(argv) == ns.queues, argv
    argv = worker_argv("m", 0, "sim", 1)
    assert argv[argv.index("--device") + 1] == "1" and argv[argv.index("--queues") + 1] == str(MPS_QUEUES)
    with pytest.raises(SystemExit):  # no abbreviations, which warm.py would not read
        parse_args(["--mailbox", "m", "--dev", "1"])


@pytest.mark.usefixtures("no_leaks")
async def test_backend_refuses_bad_devices_and_leaves_nothing(two_gpus):
    for iso in ("blink", "mps"):
        with pytest.raises(ConfigError, match=r"^devices 2: only 2 GPUs visible \(0-1\)$"):
            await Backend.open(isolation=iso, gpu="sim", devices=[0, 2])
        with pytest.raises(ConfigError, match=r"^devices 1,1: GPU 1 is named twice$"):
            await Backend.open(isolation=iso, gpu="sim", devices=[1, 1])
        with pytest.raises(ConfigError, match="no GPU named"):
            await Backend.open(isolation=iso, gpu="sim", devices=[])
        with pytest.raises(ConfigError, match=r"^sms 200: GPU 0 has 132$"):  # checked against each GPU
            await Backend.open(isolation=iso, gpu="sim", sms=200)


async def test_one_gpu_by_default(standin_on_path, monkeypatch):
    monkeypatch.delenv(SIM_GPUS_ENV, raising=False)
    async with await open_sim(deadlines=TEST_DEADLINES) as b:
        assert b.devices == (0,) and b.info is b.infos[0] and b.caps is b.device_caps[0]
        s = b.status()
        assert [d["device"] for d in s["devices"]] == [0] and s["context_pid"] == s["devices"][0]["context_pid"]


# ---- MPS: pools, placement, limits -------------------------------------------------------------


@pytest.mark.usefixtures("no_leaks")
async def test_a_pool_per_gpu_each_worker_a_client_of_its_gpu(two_gpus):
    async with await open_sim("mps", pool=2, deadlines=TEST_DEADLINES) as b:
        assert b.devices == (0, 1) and set(b.isolations) == {0, 1}
        assert all(len(g.pool) == 2 for g in b.isolations.values())
        on = await gpu_of_clients(b)
        for d in (0, 1):
            assert {on[p] for p in b.isolations[d].pool.pids()} == {f"GPU-standin-{d}"}
        # Caps and status per GPU; the first GPU's at the top, as on a one-GPU host.
        assert b.infos[1].ordinal == 1 and b.info.ordinal == 0 and b.device_caps[1].sms_total == 132
        assert b.compilers[0] is b.compilers[1]  # GPUs of one kind share the compiler and its cache
        s = b.status()
        assert [d["device"] for d in s["devices"]] == [0, 1]
        assert all(len(d["pool"]) == 2 and d["pool_cap"] == 2 and d["caps"]["sms_total"] == 132 for d in s["devices"])
        assert len(s["pool"]) == 4 and s["pool_cap"] == 4 and s["caps"] == b.caps.__dict__


@pytest.mark.usefixtures("no_leaks")
async def test_placement_named_and_least_loaded(two_gpus):
    async with await open_sim("mps", pool=2, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        pool0, pool1 = set(b.isolations[0].pool.pids()), set(b.isolations[1].pool.pids())
        hb = await progs.load(*example("heartbeat"))  # 0 and 0: the tie goes to GPU 0
        echo = await progs.load(*example("echo"))  # 1 and 0: GPU 1
        spin = await progs.load(*example("spin"), device=1)  # named
        hb2 = await progs.load(*renamed("heartbeat", "heartbeat-2"))  # 1 and 2: GPU 0
        assert (hb.device, echo.device, spin.device, hb2.device) == (0, 1, 1, 0)
        assert hb.kernel.pid in pool0 and echo.kernel.pid in pool1  # each from its own GPU's pool
        on = await gpu_of_clients(b)
        assert on[hb.kernel.pid] == "GPU-standin-0" and on[echo.kernel.pid] == "GPU-standin-1"
        rows = {r["name"]: r for r in progs.list()}
        assert {n: r["device"] for n, r in rows.items()} == {"heartbeat": 0, "echo": 1, "spin": 1, "heartbeat-2": 0}
        with pytest.raises(NotServedHere, match=r"GPU 5 is not served here \(devices 0,1\)"):
            await progs.load(*renamed("spin", "spin-5"), device=5)
        assert "spin-5" not in progs.by_name
        await beats(b, hb.slot, 10)
        await beats(b, hb2.slot, 10)
        assert await progs.call("echo", b"on GPU 1") == b"on GPU 1"
        up = await progs.upgrade("echo", *example("echo"))
        assert up.device == 1  # an upgrade stays on its GPU
        assert on.get(up.kernel.pid, "GPU-standin-1") == "GPU-standin-1"
        assert (await gpu_of_clients(b))[up.kernel.pid] == "GPU-standin-1"
        assert await progs.call("echo", b"again") == b"again"
        s = b.status()
        assert [d["images"] for d in s["devices"]] == [2, 2]
        await progs.close()


async def test_client_limit_is_per_gpu(standin_on_path, monkeypatch):
    monkeypatch.setenv(SIM_GPUS_ENV, "2")
    r = MpsRig(pool_cap=0, max_clients=2, devices=(0, 1))
    async with r as gpu0:
        m, gpu1 = r.mps, r.mps.gpus[1]
        a = await gpu0.preload("a", sim(), 32, 0, 0)
        b = await gpu0.preload("b", sim(), 32, 0, 0)
        with pytest.raises(ClientLimit, match=r"^mps: 2 clients already: the MPS server takes at most 2 \(CUDA 13.0\) per GPU,"
                                             r" and GPU 0 has them all; refusing another worker for c$"):
            await gpu0.preload("c", sim(), 32, 0, 0)
        c = await gpu1.preload("c", sim(), 32, 0, 0)  # GPU 1 has room
        d = await gpu1.preload("d", sim(), 32, 0, 0)
        assert (a.device, b.device, c.device, d.device) == (0, 0, 1, 1)
        assert m.workers_on(1) == sorted([c.proc.pid, d.proc.pid]) and m.device_of(a.proc.pid) == 0
        assert set(m.gpus) == {0, 1}  # a GPU not served has no isolation (Backend.device_or_first refuses it)
        for w, g in ((a, gpu0), (b, gpu0), (c, gpu1), (d, gpu1)):
            await g.give_back(w)
        # A worker told a GPU the simulation does not have is refused as cuDeviceGet refuses it.
        p = await m.sup.spawn(worker_argv(m.mailbox, 0, "sim", 5), {**os.environ, **m.worker_env}, "nowhere")
        with pytest.raises(WorkerError, match=r"cuDeviceGet: CUDA_ERROR_INVALID_DEVICE \(simulated: device 5; 2 GPUs"):
            await p.ask(Op.READY)
        m.sup.retire(p)


# ---- faults and blinks stay on their GPU -------------------------------------------------------


@pytest.mark.usefixtures("no_leaks")
async def test_a_fault_on_gpu_1_leaves_gpu_0_running(two_gpus):
    async with await open_sim("mps", pool=1, deadlines=TEST_DEADLINES) as b:
        progs = Programs(b)
        hb0 = await progs.load(*example("heartbeat"), device=0)
        echo0 = await progs.load(*example("echo"), device=0)
        hb1 = await progs.load(*renamed("heartbeat", "heartbeat-1"), device=1)
        for p in (hb0, hb1):
            await beats(b, p.slot, 10)
        run0, pids0, gens0 = hb0.launch, (hb0.kernel.pid, echo0.kernel.pid), (hb0.generation, echo0.generation)
        pool0, pool1 = set(b.isolations[0].pool.pids()), set(b.isolations[1].pool.pids())
        old1 = hb1.kernel.pid
        before = b.mailbox.heartbeat(hb0.slot)
        await progs.load(*example("fault"), device=1, restart="never")
        await until(lambda: progs.faults and progs.faults[-1].ms > 0)
        r = progs.faults[-1]
        assert r.gpu_wide and r.device == 1 and r.faulted == "fault" and "ILLEGAL_ADDRESS" in r.error
        assert r.lost == ["heartbeat-1"] and r.relaunched == ["heartbeat-1"] and r.not_relaunched == {}
        # GPU 0: the same programs, launches and workers, never stopped nor relaunched.
        assert progs.by_name["heartbeat"] is hb0 and progs.by_name["echo"] is echo0
        assert (hb0.generation, echo0.generation) == gens0  # not relaunched: a relaunch is a new generation
        assert hb0.launch is run0 and not run0.finished() and hb0.restarts == 0 and echo0.restarts == 0
        assert (hb0.kernel.pid, echo0.kernel.pid) == pids0 and hb0.kernel.proc.gen[0] == 1
        assert set(b.isolations[0].pool.pids()) == pool0
        assert b.mailbox.u32(hb0.slot, abi.STATE) == abi.RUNNING
        assert set(pids0) <= set(await b.mps.clients(b.mps.server))
        await beats(b, hb0.slot, max(before, b.mailbox.heartbeat(hb0.slot)))  # still beating after it all
        assert await progs.call("echo", b"GPU 0 never noticed") == b"GPU 0 never noticed"
        # GPU 1: torn down and recovered on fresh workers, its pool refilled.
        states = {row["name"]: row for row in progs.list()}
        assert states["fault"]["state"] == "faulted" and states["fault"]["device"] == 1
        new1 = progs.by_name["heartbeat-1"]
        assert new1.device == 1 and new1.restarts == 1 and new1.kernel.pid != old1
        await until(lambda: len(b.isolations[1].pool) == 1)  # refilled, paced, after the relaunch
        assert not set(b.isolations[1].pool.pids()) & pool1
        await beats(b, new1.slot, b.mailbox.heartbeat(new1.slot))
        on = await gpu_of_clients(b)
        assert on[new1.kernel.pid] == "GPU-standin-1" and on[hb0.kernel.pid] == "GPU-standin-0"
        await progs.unload("fault")
        await progs.close()


@pytest.mark.usefixtures("no_leaks")
async def test_a_blink_on_one_gpu_does_not_blink_the_other(two_gpus):
    async with await open_sim(deadlines=TEST_DEADLINES) as b:  # blink mode
        ctx = b.isolations
        assert set(ctx) == {0, 1} and ctx[0].proc.pid != ctx[1].proc.pid  # a context per GPU
        progs = Programs(b)
        hb0 = await progs.load(*example("heartbeat"))
        hb1 = await progs.load(*renamed("heartbeat", "heartbeat-1"))
        assert (hb0.device, hb1.device) == (0, 1)
        assert (hb0.kernel.pid, hb1.kernel.pid) == (ctx[0].proc.pid, ctx[1].proc.pid)
        assert b.mailbox_dev(0) != b.mailbox_dev(1)  # the mailbox is registered in each GPU's context
        for p in (hb0, hb1):
            await beats(b, p.slot, 10)
        gen0 = ctx[0].proc.gen[hb0.kernel.module.module]
        gen1 = ctx[1].proc.gen[hb1.kernel.module.module]
        assert ctx[0].blinks == ctx[1].blinks == 0  # each load found its GPU idle
        await progs.load(*example("spin"), device=1)  # halts GPU 1's programs, not GPU 0's
        assert ctx[1].blinks == 1 and ctx[0].blinks == 0
        assert ctx[1].proc.gen[hb1.kernel.module.module] == gen1 + 1  # relaunched
        assert ctx[0].proc.gen[hb0.kernel.module.module] == gen0  # untouched
        assert not hb0.launch.finished() and not hb1.launch.finished()
        s = b.status()
        assert [d["blinks"] for d in s["devices"]] == [0, 1] and s["blinks"] == 1
        assert s["last_blink_ms"] == ctx[1].last_blink_ms
        for p in (hb0, hb1):
            await beats(b, p.slot, b.mailbox.heartbeat(p.slot))
        await progs.close()


# ---- serve --devices, end to end ---------------------------------------------------------------


def test_serve_devices_end_to_end(serve, tmp, monkeypatch):
    monkeypatch.setenv(SIM_GPUS_ENV, "2")
    sock = os.path.join(tmp, "s.sock")
    # pool 2: a load takes one, never the last (each GPU's pool's reserve, kept for upgrades)
    s = serve("mps", "--devices", "0,1", "--pool", "2", sock=sock)
    st = s.wait_ready()
    assert [d["device"] for d in st["devices"]] == [0, 1] and all(len(d["pool"]) == 2 for d in st["devices"])
    assert st["pool"]["capacity"] == 4 and sorted(st["clients"]) == sorted(st["pool"]["idle"])
    assert "devices 0: simulated NVIDIA H200" in s.log()

    r = cli("load", str(EXAMPLES / "heartbeat"), "--device", "1", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert re.match(r"heartbeat loaded on slot 0 \(pid \d+, hash [0-9a-f]{16}, GPU 1, ", r.stdout), r.stdout
    r = cli("load", str(EXAMPLES / "echo"), "--socket", sock)  # GPU 0 has fewer programs
    assert r.returncode == 0 and ", GPU 0, " in r.stdout, (r.stdout, r.stderr)

    lines = cli("ps", "--socket", sock).stdout.splitlines()
    assert lines[0].split()[:5] == ["NAME", "SLOT", "STATE", "PID", "GPU"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert rows["heartbeat"][4] == "1" and rows["echo"][4] == "0"
    listed = {p["name"]: p for p in json.loads(cli("ps", "--json", "--socket", sock).stdout)["programs"]}
    assert listed["heartbeat"]["device"] == 1 and listed["echo"]["device"] == 0

    table = dict(re.split(r"\s{2,}", ln, maxsplit=1) for ln in cli("status", "--socket", sock).stdout.splitlines())
    for d in (0, 1):  # each GPU's pool gave a worker to the load and kept its reserve
        assert re.fullmatch(r"simulated NVIDIA H200 \(meshd-mps --gpu sim\) \(sm_90, 132 SMs\), 1 program, pool 1 idle of 2"
                            r" \[\d+\], reserve 1 of 1", table[f"gpu {d}"]), table[f"gpu {d}"]
    assert "device" not in table  # the GPUs' rows instead
    st = s.client.status()
    assert [d["programs"] for d in st["devices"]] == [1, 1]

    r = cli("load", str(EXAMPLES / "spin"), "--device", "2", "--socket", sock)
    assert r.returncode == 1 and "field 'device' 2: this daemon serves GPU 0, 1 (--devices)" in r.stderr
    with pytest.raises(ClientError) as ei:
        s.client.upgrade("echo", program_body(str(EXAMPLES / "echo"), device=1))
    assert ei.value.status == 400 and "an upgrade keeps the program on its GPU 0" in str(ei.value)
    assert s.client.call("echo", "through GPU 0")["data"] == "through GPU 0"
    m = parse_metrics(s.client.metrics())
    assert m['meshd_mps_device_programs{device="0"}'] == 1 and m['meshd_mps_device_programs{device="1"}'] == 1
    assert m["meshd_mps_pool_capacity"] == 4 and m["meshd_mps_pool_reserve"] == 2
    assert m['meshd_mps_device_info{device="1",name="simulated NVIDIA H200 (meshd-mps --gpu sim)"}'] == 1
    assert s.stop() == 0, s.log()


def test_serve_refuses_bad_devices(tmp, monkeypatch):
    monkeypatch.setenv(SIM_GPUS_ENV, "2")
    sock = os.path.join(tmp, "x.sock")
    state = ("--state-dir", os.path.join(tmp, "state"))  # never root's default (/var/lib/meshd-mps-sim)
    r = cli("serve", "--gpu", "sim", "--devices", "0,2", "--socket", sock, *state)
    assert r.returncode == 1 and r.stderr.strip().endswith("meshd-mps: devices 2: only 2 GPUs visible (0-1)"), r.stderr
    r = cli("serve", "--gpu", "sim", "--devices", "0,x", "--socket", sock, *state)
    assert r.returncode == 2 and r.stderr.strip() == "meshd-mps: devices 0,x: 'x' is not a GPU ordinal (0, 1, ...)"
    assert "Traceback" not in r.stderr and not os.path.exists(sock)
