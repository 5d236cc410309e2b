"""Nvml.activity over a stand-in pynvml: the power from the energy counter, the SM activity from
GPM, and each reading a GPU lacks as None with the reason.  The GPM structures are pynvml's own
(nvidia-ml-py is a dependency; importing it loads no library), so a wrong field name fails here."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types
import pytest

from meshd_mps.base.errors import DeviceError
from meshd_mps.gpu.nvml import Activity, Nvml

from ..rigs.nvml import NvmlErrors

WINDOW = 0.01


def address(sample) -> int:
    return ctypes.cast(sample, ctypes.c_void_p).value or 0


class FakePynvml(NvmlErrors):
    """What Nvml.activity uses of pynvml, answering from tables; the constants and structures are
    pynvml's."""

    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
    NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(self, energy=(5_000_000, 5_000_700), util=7, gpm=True, metrics=None, fail=None):
        self.energy = list(energy)
        self.util, self.gpm = util, gpm
        self.metrics = metrics or {pynvml.NVML_GPM_METRIC_SM_UTIL: (0, 12.5), pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (0, 3.25)}
        self.fail = fail or {}
        self.calls: list[str] = []
        self.allocated: list[int] = []
        self.taken: list[int] = []
        self.freed: list[int] = []
        self.asked: SimpleNamespace | None = None

    def _call(self, call):
        self.calls.append(call)
        if call in self.fail:
            raise self.fail[call]

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return ("handle", bus)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        assert h == ("handle", "0000:01:00.0")
        self._call("energy")
        return self.energy.pop(0)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._call("util")
        return SimpleNamespace(gpu=self.util, memory=1)

    def nvmlGpmQueryDeviceSupport(self, h):
        self._call("support")
        return SimpleNamespace(version=1, isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        self._call("alloc")
        self.allocated.append(0x1000 * (len(self.allocated) + 1))  # never dereferenced
        return ctypes.cast(ctypes.c_void_p(self.allocated[-1]), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleGet(self, h, sample):
        self._call("sample")
        self.taken.append(address(sample))
        return sample

    def nvmlGpmMetricsGet(self, got):
        self._call("metrics")
        ids = [got.metrics[i].metricId for i in range(got.numMetrics)]
        self.asked = SimpleNamespace(version=got.version, ids=ids, samples=(address(got.sample1), address(got.sample2)))
        for i, metric in enumerate(ids):
            ret, value = self.metrics[metric]
            got.metrics[i].nvmlReturn = ret
            got.metrics[i].value = value
        return got

    def nvmlGpmSampleFree(self, sample):
        self.freed.append(address(sample))


def activity(fake) -> Activity:
    return Nvml(fake, bus_id=lambda d: "0000:01:00.0").activity(0, WINDOW)


def test_watts_from_the_energy_delta_and_the_sm_metrics_from_gpm():
    fake = FakePynvml()
    a = activity(fake)
    assert WINDOW <= a.seconds < 1  # the window as measured: at least the sleep
    assert a.watts == pytest.approx(0.7 / a.seconds)  # 700 mJ over the window
    assert a.watts is not None and 0.7 < a.watts <= 70
    assert (a.gpu_util, a.sm_active, a.sm_occupancy, a.why) == (7, 12.5, 3.25, "")
    # Two samples, the first before the window, the second after; both asked of nvmlGpmMetricsGet
    # in that order, with the two SM metrics, and both freed.
    assert fake.calls == ["support", "alloc", "alloc", "sample", "energy", "energy", "util", "sample", "metrics"]
    assert fake.taken == fake.allocated == [0x1000, 0x2000]
    assert fake.asked == SimpleNamespace(version=1, ids=[pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY],
                                         samples=(0x1000, 0x2000))
    assert sorted(fake.freed) == [0x1000, 0x2000]


def test_no_gpm_on_the_gpu_is_none_with_the_reason_and_the_power_still_read():
    fake = FakePynvml(gpm=False)
    a = activity(fake)
    assert a.watts == pytest.approx(0.7 / a.seconds) and a.gpu_util == 7
    assert a.sm_active is None and a.sm_occupancy is None
    assert a.why == "sm_active, sm_occupancy: no GPM on this GPU (nvmlGpmQueryDeviceSupport; Hopper and later have it)"
    assert "alloc" not in fake.calls and fake.freed == []


def test_gpm_failing_midway_is_none_with_the_call_named_and_the_samples_freed():
    fake = FakePynvml(fail={"metrics": FakePynvml.NVMLError("Unknown Error")})
    a = activity(fake)
    assert (a.sm_active, a.sm_occupancy) == (None, None) and a.watts is not None
    assert a.why == "sm_active, sm_occupancy: nvmlGpmMetricsGet: Unknown Error"
    assert sorted(fake.freed) == [0x1000, 0x2000]
    fake = FakePynvml(fail={"support": FakePynvml.NVMLError_NotSupported("Not Supported")})
    assert activity(fake).why == "sm_active, sm_occupancy: nvmlGpmQueryDeviceSupport: Not Supported"
    # One metric NVML could not give: that one None, the other read.
    fake = FakePynvml(metrics={pynvml.NVML_GPM_METRIC_SM_UTIL: (0, 40.0),
                               pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)})
    a = activity(fake)
    assert (a.sm_active, a.sm_occupancy) == (40.0, None)
    assert a.why == f"sm_occupancy: nvmlGpmMetricsGet: {pynvml.NVML_ERROR_NOT_SUPPORTED}"  # the fake's NVMLError(3)


def test_an_nvidia_ml_py_without_gpm():
    class OldPynvml(FakePynvml):
        def __getattribute__(self, name):
            if name.startswith("nvmlGpm"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    a = activity(OldPynvml())
    assert (a.sm_active, a.sm_occupancy) == (None, None) and a.watts is not None
    assert a.why == "sm_active, sm_occupancy: this nvidia-ml-py has no GPM calls"


def test_energy_not_supported_gives_watts_none():
    fake = FakePynvml(fail={"energy": FakePynvml.NVMLError_NotSupported("Not Supported"),
                            "util": FakePynvml.NVMLError_FunctionNotFound("Function Not Found")})
    a = activity(fake)
    assert a.watts is None and a.gpu_util is None
    assert a.seconds >= WINDOW and (a.sm_active, a.sm_occupancy) == (12.5, 3.25)
    assert a.why == ("watts: nvmlDeviceGetTotalEnergyConsumption: Not Supported; "
                     "gpu_util: nvmlDeviceGetUtilizationRates: Function Not Found")
    assert fake.calls.count("energy") == 1  # not asked again after the window


def test_other_nvml_failures_name_the_gpu_and_the_call():
    fake = FakePynvml(fail={"energy": FakePynvml.NVMLError("GPU is lost")})
    with pytest.raises(DeviceError) as e:
        activity(fake)
    assert str(e.value) == "GPU 0: nvmlDeviceGetTotalEnergyConsumption: GPU is lost"
    assert sorted(fake.freed) == [0x1000, 0x2000]  # the GPM samples freed all the same
    nv = Nvml(FakePynvml(), bus_id=lambda d: "0000:01:00.0")
    with pytest.raises(ValueError, match="more than 0"):
        nv.activity(0, 0)
    nv._open = False
    with pytest.raises(DeviceError, match="GPU 0: NVML is closed"):
        nv.activity(0, WINDOW)


def test_real_pynvml_structure_carries_what_activity_writes():
    """The names activity uses are pynvml's: the fields of c_nvmlGpmMetricsGet_t and its metrics."""
    fields = {f[0] for f in pynvml.c_nvmlGpmMetricsGet_t._fields_}
    assert {"version", "numMetrics", "sample1", "sample2", "metrics"} <= fields
    assert {"metricId", "nvmlReturn", "value"} <= {f[0] for f in pynvml.c_nvmlGpmMetric_t._fields_}
    for name in ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
                 "nvmlGpmSampleFree", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetUtilizationRates"):
        assert callable(getattr(pynvml, name)), name
