"""Neighbours on our GPUs: NVML's view (a stand-in pynvml, the simulation, and this machine's
missing driver), sorted into ours and foreign, and logged once per change."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from meshd_mps.base.errors import ConfigError, DeviceError, NvmlUnavailable, Timeout
from meshd_mps.gpu.device import SIM_GPUS_ENV
from meshd_mps.gpu.nvml import SIM_MEMORY, SIM_NVML_ENV, ComputeMode, DeviceView, GpuProcess, Nvml, SimNvml
from meshd_mps.neighbours import NeighbourWatch, classify, look, mode_advice

from ..rigs.nvml import NvmlErrors


def proc(pid: int, name: str = "python", used: int | None = 1 << 20, mps: bool = False) -> GpuProcess:
    return GpuProcess(pid, name, used, "compute", mps)


def view(*procs: GpuProcess, device: int = 0, mode: ComputeMode = ComputeMode.EXCLUSIVE_PROCESS) -> DeviceView:
    return DeviceView(device, mode, procs)


# ---- classify -------------------------------------------------------------------------------------


def test_classify_splits_ours_the_server_native_and_foreign():
    v = view(proc(10, mps=True), proc(11, mps=True), proc(20, "nvidia-cuda-mps-server"), proc(30, mps=True), proc(40))
    n = classify(v, ours={10, 11}, server={20}, native={30})
    assert [p.pid for p in n.ours] == [10, 11]
    assert [p.pid for p in n.server] == [20]
    assert [p.pid for p in n.native] == [30]
    assert [p.pid for p in n.foreign] == [40]
    assert (n.role(40), n.role(20), n.role(99)) == ("foreign", "server", None)
    d = n.as_dict()
    assert d["compute_mode"] == "exclusive_process" and d["ours"] == [10, 11] and d["server"] == [20]
    assert d["foreign"] == [{"pid": 40, "name": "python", "used_bytes": 1 << 20, "kind": "compute", "mps": False}]


def test_classify_an_empty_view_and_unknown_pids():
    n = classify(view(), ours={1}, server={2}, native={3})
    assert n.ours == n.server == n.native == n.foreign == ()
    # Nothing known (no server yet, no worker): every process on the GPU is foreign, an MPS
    # client of another server too.
    n = classify(view(proc(5, mps=True), proc(6)), ours=set(), server=set(), native=set())
    assert [p.pid for p in n.foreign] == [5, 6]


def test_classify_a_pid_in_two_sets_counts_once():
    n = classify(view(proc(7)), ours={7}, server={7}, native={7})
    assert [p.pid for p in n.ours] == [7] and n.server == n.native == n.foreign == ()


# ---- NeighbourWatch ---------------------------------------------------------------------------------


def warnings(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


def test_a_foreign_process_is_logged_once_when_it_comes_and_once_when_it_goes():
    w = NeighbourWatch("mps")
    ours = {"ours": {10}, "server": {20}, "native": set()}
    with capture_logs() as logs:
        w.observe(classify(view(proc(10), proc(20)), **ours))
        w.observe(classify(view(proc(10), proc(20), proc(1234, used=5 << 20)), **ours))
        w.observe(classify(view(proc(10), proc(20), proc(1234, used=6 << 20)), **ours))  # still there: nothing new
        assert w.foreign() == [(0, proc(1234, used=5 << 20))]
        w.observe(classify(view(proc(10), proc(20)), **ours))
        w.observe(classify(view(proc(10), proc(20)), **ours))
    [came] = warnings(logs)
    assert came["event"] == ("GPU 0: process 1234 (python) has a context outside our MPS server: "
                             "it time-slices with our programs (docs/operations.md)")
    assert (came["device"], came["pid"], came["name"], came["used_bytes"]) == (0, 1234, "python", 5 << 20)
    [went] = [e for e in logs if e["log_level"] == "info"]
    assert went["event"] == "GPU 0: process 1234 (python), which had a context outside our MPS server, is gone"
    assert (went["device"], went["pid"], went["name"]) == (0, 1234, "python")
    assert w.foreign() == []


def test_each_gpu_and_each_pid_is_its_own():
    w = NeighbourWatch("blink")
    none: dict[str, set[int]] = {"ours": set(), "server": set(), "native": set()}
    with capture_logs() as logs:
        w.observe(classify(view(proc(1), proc(2, "torch", mps=True), device=0), **none))
        w.observe(classify(view(proc(1), device=1), **none))  # the same pid on another GPU: news there too
        w.observe(classify(view(proc(2, "torch", mps=True), device=0), **none))  # 1 left GPU 0 only
    came = warnings(logs)
    assert [(e["device"], e["pid"]) for e in came] == [(0, 1), (0, 2), (1, 1)]
    assert "beside our CUDA context" in came[0]["event"]
    assert "(an MPS client, not of our server)" in came[1]["event"] and came[1]["mps"] is True
    gone = [e for e in logs if e["log_level"] == "info"]
    assert [(e["device"], e["pid"]) for e in gone] == [(0, 1)]
    assert [(d, p.pid) for d, p in w.foreign()] == [(0, 2), (1, 1)]
    assert set(w.latest) == {0, 1} and [p.pid for p in w.latest[0].foreign] == [2]


def test_a_foreign_process_that_joins_our_server_is_said_to_be_ours_now():
    w = NeighbourWatch("mps")
    with capture_logs() as logs:
        w.observe(classify(view(proc(20), proc(50)), ours=set(), server={20}, native=set()))
        w.observe(classify(view(proc(20), proc(50)), ours=set(), server={20}, native={50}))
    [late] = [e for e in logs if e["log_level"] == "info"]
    assert late["event"] == "GPU 0: process 50 (python) is no longer outside our MPS server: it is native now"
    assert w.foreign() == []


# ---- the compute mode ---------------------------------------------------------------------------------


def test_mode_advice():
    for iso in ("mps", "blink"):
        assert mode_advice(iso, ComputeMode.EXCLUSIVE_PROCESS) is None  # MPS's wish; blink's one context
        assert mode_advice(iso, ComputeMode.UNKNOWN) is None
        prohibited = mode_advice(iso, ComputeMode.PROHIBITED)
        assert prohibited is not None and prohibited.level == "warning" and "none of our programs can run" in prohibited.text
        default = mode_advice(iso, ComputeMode.DEFAULT)
        assert default is not None and default.level == "info" and "EXCLUSIVE_PROCESS" in default.text
    assert "our MPS server" in mode_advice("mps", ComputeMode.DEFAULT).text  # type: ignore[union-attr]


def test_the_compute_mode_is_said_once_per_change():
    w = NeighbourWatch("mps")
    nobody: dict[str, set[int]] = {"ours": set(), "server": set(), "native": set()}
    with capture_logs() as logs:
        for mode in (ComputeMode.PROHIBITED, ComputeMode.PROHIBITED, ComputeMode.EXCLUSIVE_PROCESS,
                     ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.DEFAULT, ComputeMode.DEFAULT, ComputeMode.PROHIBITED):
            w.observe(classify(view(mode=mode), **nobody))
        w.observe(classify(view(mode=ComputeMode.PROHIBITED, device=1), **nobody))
    said = [(e["log_level"], e["device"], e["compute_mode"]) for e in logs]
    assert said == [("warning", 0, "prohibited"), ("info", 0, "default"), ("warning", 0, "prohibited"),
                    ("warning", 1, "prohibited")]
    assert logs[0]["event"].startswith("GPU 0: compute mode PROHIBITED: no process may create a CUDA context")


# ---- the simulated NVML --------------------------------------------------------------------------------


def test_the_simulation_with_no_file_shows_only_its_residents(monkeypatch):
    monkeypatch.delenv(SIM_NVML_ENV, raising=False)
    monkeypatch.setenv(SIM_GPUS_ENV, "2")
    with SimNvml.open() as sim:
        assert sim.view(1) == DeviceView(1, ComputeMode.DEFAULT, (), (0, SIM_MEMORY))
        with pytest.raises(DeviceError, match="GPU 2: the simulation has 2 GPUs"):
            sim.view(2)
    with SimNvml.open(residents=lambda d: [proc(100 + d, mps=True)]) as sim:
        v = sim.view(1)
        assert [p.pid for p in v.processes] == [101]
        assert classify(v, ours={101}, server=set(), native=set()).foreign == ()
    with pytest.raises(DeviceError, match="closed"):
        sim.view(0)


def test_the_simulation_reads_its_file_at_every_view(tmp_path, monkeypatch):
    f = tmp_path / "nvml.json"
    f.write_text(json.dumps({"0": {"compute_mode": "default",
                                   "processes": [{"pid": 123, "name": "python", "used_bytes": 1048576}]}}))
    monkeypatch.setenv(SIM_NVML_ENV, str(f))
    monkeypatch.delenv(SIM_GPUS_ENV, raising=False)
    sim = SimNvml.open(residents=lambda d: [proc(7, "worker", mps=True)])
    v = sim.view(0)
    assert v.compute_mode is ComputeMode.DEFAULT
    assert v.processes == (proc(7, "worker", mps=True), GpuProcess(123, "python", 1048576, "compute", False))
    assert [p.pid for p in classify(v, ours={7}, server=set(), native=set()).foreign] == [123]
    # its memory: an H200's, what its processes hold used (nvidia-smi's figures, as NVML's)
    assert v.memory == ((1 << 20) + 1048576, SIM_MEMORY)
    n = classify(v, ours={7}, server=set(), native=set()).as_dict()
    assert (n["memory_used"], n["memory_total"]) == (2 << 20, 143771 << 20)
    f.write_text(json.dumps({"0": {"compute_mode": "exclusive_process", "processes": [
        {"pid": 124, "kind": "graphics", "mps": True}]}}))
    v = sim.view(0)
    assert v.compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    got = [(p.pid, p.kind, p.mps, p.used_bytes) for p in v.processes]
    assert got == [(7, "compute", True, 1 << 20), (124, "graphics", True, None)]
    assert v.processes[1].name  # /proc's name where pid 124 exists here, else "?"
    f.write_text("{}")
    assert sim.view(0).processes == (proc(7, "worker", mps=True),)


@pytest.mark.parametrize(("text", "says"), [
    ("not json", "not JSON"),
    ("[]", "an object by GPU ordinal"),
    ('{"gpu0": {}}', "'gpu0' is not a GPU ordinal"),
    ('{"0": {"mode": "default"}}', "GPU 0: an object with compute_mode and processes"),
    ('{"0": {"compute_mode": "exclusive"}}', "GPU 0: compute_mode 'exclusive': one of default, exclusive_process"),
    ('{"0": {"processes": {"pid": 1}}}', "GPU 0: processes: a list"),
    ('{"0": {"processes": [{"pid": -1}]}}', "GPU 0, process 0: pid -1 is not a process id"),
    ('{"0": {"processes": [{"pid": true}]}}', "GPU 0, process 0: pid True is not a process id"),
    ('{"0": {"processes": [{"pid": 1, "user": "x"}]}}', "GPU 0, process 0: unknown key 'user'"),
    ('{"0": {"processes": [{"pid": 1, "used_bytes": "1M"}]}}', "used_bytes '1M' is not a count of bytes"),
    ('{"0": {"processes": [{"pid": 1, "kind": "mps"}]}}', "kind 'mps': compute or graphics"),
    ('{"0": {"processes": [{"pid": 1, "mps": 1}]}}', "mps 1: true or false"),
    ('{"0": {"processes": [{"pid": 1, "name": ""}]}}', "name '' is not a process name"),
])
def test_a_malformed_simulation_file_is_refused_at_open(tmp_path, monkeypatch, text, says):
    f = tmp_path / "nvml.json"
    f.write_text(text)
    monkeypatch.setenv(SIM_NVML_ENV, str(f))
    with pytest.raises(ConfigError) as e:
        SimNvml.open()
    assert str(e.value).startswith(f"{SIM_NVML_ENV}={f}: ") and says in str(e.value)


def test_a_missing_simulation_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SIM_NVML_ENV, str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="No such file"):
        SimNvml.open()


# ---- Nvml over a stand-in pynvml ----------------------------------------------------------------------


class FakePynvml(NvmlErrors):
    """What Nvml uses of pynvml, answering from tables."""

    def __init__(self, mode=0, compute=(), graphics=(), mps=(), names=None, fail=None, memory=(1 << 30, 80 << 30)):
        self.mode, self.compute, self.graphics, self.mps, self.memory = mode, compute, graphics, mps, memory
        self.names = names or {}
        self.fail = fail or {}
        self.asked: list[str] = []
        self.shut = 0

    def _answer(self, call, value):
        if call in self.fail:
            raise self.fail[call]
        return value

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.asked.append(bus)
        return self._answer("handle", ("handle", bus))

    def nvmlDeviceGetComputeMode(self, h):
        return self._answer("mode", self.mode)

    @staticmethod
    def _procs(rows):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in rows]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._answer("compute", self._procs(self.compute))

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return self._answer("graphics", self._procs(self.graphics))

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        return self._answer("mps", self._procs(self.mps))

    def nvmlDeviceGetMemoryInfo(self, h):
        used, total = self.memory
        return self._answer("memory", SimpleNamespace(used=used, total=total, free=total - used))

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise self.NVMLError("Not Found")
        return self.names[pid]

    def nvmlShutdown(self):
        self.shut += 1


def test_nvml_view_as_seen_on_the_h200_under_mps():
    """The lists NVML gave on the H200: a plain context, the server, two clients."""
    fake = FakePynvml(mode=0, compute=[(495, 545259520), (521, 69206016), (516, 543162368), (531, 543162368)],
                      mps=[(516, 543162368), (531, 543162368)], names={521: b"nvidia-cuda-mps-server", 600: "/usr/bin/Xorg"},
                      graphics=[(600, None), (495, 1)])
    comm = {495: "python3", 516: "python3", 531: "python3", 521: "nvidia-cuda-mps"}
    nv = Nvml(fake, bus_id=lambda d: f"0000:0{d}:00.0", name=comm.get)
    v = nv.view(3)
    assert v.device == 3 and v.compute_mode is ComputeMode.DEFAULT
    assert v.processes == (
        GpuProcess(495, "python3", 545259520, "compute", False),  # in both lists: once, as compute
        GpuProcess(516, "python3", 543162368, "compute", True),
        GpuProcess(521, "nvidia-cuda-mps-server", 69206016, "compute", False),  # comm cut at 15: NVML's name
        GpuProcess(531, "python3", 543162368, "compute", True),
        GpuProcess(600, "Xorg", None, "graphics", False),  # not visible here: NVML's name
    )
    assert v.memory == (1 << 30, 80 << 30)  # nvmlDeviceGetMemoryInfo's used and total
    n = classify(v, ours={516, 531}, server={521}, native=set())
    assert [p.pid for p in n.foreign] == [495, 600] and n.memory == v.memory
    nv.view(3)
    assert fake.asked == ["0000:03:00.0"]  # the handle is kept
    nv.close()
    nv.close()
    assert fake.shut == 1
    with pytest.raises(DeviceError, match="GPU 3: NVML is closed"):
        nv.view(3)


def test_nvml_modes_names_and_optional_lists():
    f = FakePynvml
    fake = f(mode=3, compute=[(1, 10)], fail={"graphics": f.NVMLError_NotSupported("Not Supported"),
                                             "mps": f.NVMLError_FunctionNotFound("Function Not Found")})
    v = Nvml(fake, bus_id=lambda d: "b", name=lambda pid: None).view(0)
    assert v.compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    assert v.processes == (GpuProcess(1, "?", 10, "compute", False),)  # no name anywhere: "?"
    for raw, mode in ((2, ComputeMode.PROHIBITED), (1, ComputeMode.UNKNOWN), (9, ComputeMode.UNKNOWN)):
        assert Nvml(f(mode=raw), bus_id=lambda d: "b").view(0).compute_mode is mode
    unsupported = f(fail={"mode": f.NVMLError_NotSupported("Not Supported"), "memory": f.NVMLError_NotSupported("no")})
    assert Nvml(unsupported, bus_id=lambda d: "b").view(0).compute_mode is ComputeMode.UNKNOWN
    assert Nvml(unsupported, bus_id=lambda d: "b").view(0).memory is None  # a board that does not say
    # A name NVML gives differently for a pid /proc shows: /proc's (the process we can see).
    other = f(compute=[(8, 1)], names={8: "nvidia-cuda-mps-server"})
    assert Nvml(other, bus_id=lambda d: "b", name=lambda pid: "a-long-comm-nam").view(0).processes[0].name == "a-long-comm-nam"


@pytest.mark.parametrize(("call", "says"), [
    ("handle", "GPU 0: nvmlDeviceGetHandleByPciBusId(0000:00:06.0): GPU is lost"),
    ("mode", "GPU 0: nvmlDeviceGetComputeMode: GPU is lost"),
    ("compute", "GPU 0: nvmlDeviceGetComputeRunningProcesses: GPU is lost"),
    ("graphics", "GPU 0: nvmlDeviceGetGraphicsRunningProcesses: GPU is lost"),
    ("memory", "GPU 0: nvmlDeviceGetMemoryInfo: GPU is lost"),
])
def test_nvml_failures_name_the_gpu_and_the_call(call, says):
    fake = FakePynvml(fail={call: FakePynvml.NVMLError("GPU is lost")})
    with pytest.raises(DeviceError) as e:
        Nvml(fake, bus_id=lambda d: "0000:00:06.0").view(0)
    assert str(e.value) == says and isinstance(e.value.__cause__, FakePynvml.NVMLError)
    fake = FakePynvml(fail={"compute": FakePynvml.NVMLError_NotSupported("Not Supported")})
    with pytest.raises(DeviceError, match="ComputeRunningProcesses: Not Supported"):  # the compute list is not optional
        Nvml(fake, bus_id=lambda d: "b").view(0)


def test_nvml_open_without_a_driver():
    try:
        nv = Nvml.open()
    except NvmlUnavailable as e:
        assert e.why == "libnvidia-ml.so.1 is not found: no NVIDIA driver on this machine"
        assert str(e) == f"NVML unavailable: {e.why}" and e.fields() == {"why": e.why}
        assert type(e.__cause__).__name__ == "NVMLError_LibraryNotFound"
        return
    nv.close()
    pytest.skip("an NVIDIA driver is present here: tests/gpu/test_nvml_real.py covers it")


def test_importing_meshd_mps_and_its_cli_loads_no_pynvml():
    code = ("import sys, meshd_mps, meshd_mps.serving.cli, meshd_mps.neighbours, meshd_mps.gpu.nvml; "
            "print('pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# ---- look: in a thread, under a deadline -----------------------------------------------------------------


async def test_look_reads_every_gpu_in_a_thread(monkeypatch):
    monkeypatch.delenv(SIM_NVML_ENV, raising=False)
    monkeypatch.setenv(SIM_GPUS_ENV, "2")
    seen: set[str] = set()

    def residents(d: int) -> list[GpuProcess]:
        seen.add(threading.current_thread().name)
        return [proc(10 + d)]

    views = await look(SimNvml.open(residents), [0, 1], within=30)
    assert [(v.device, [p.pid for p in v.processes]) for v in views] == [(0, [10]), (1, [11])]
    assert threading.current_thread().name not in seen


async def test_look_past_its_deadline_is_a_timeout():
    release = threading.Event()

    class Hung:
        def view(self, device: int) -> DeviceView:
            release.wait(60)  # an NVML call stuck in the driver
            return view(device=device)

        def close(self) -> None:
            pass

    try:
        with pytest.raises(Timeout, match=r"NVML: no view of GPU 0,1 in 0.05s"):
            await look(Hung(), [0, 1], within=0.05)
    finally:
        release.set()
