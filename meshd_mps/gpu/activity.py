"""What a GPU did over a window, from NVML: the bench's gauge of what an idle resident program
costs.  Its average power (the energy counter, read before and after the window) and its SM
activity (GPM, Hopper and later), each None, with the reason, where the GPU or driver cannot say.
``Nvml.activity`` (gpu/nvml.py) calls :func:`measure` with its pynvml module and the GPU's handle."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from meshd_mps.base.errors import DeviceError


@dataclass(frozen=True)
class Activity:
    """What a GPU did over a window of ``seconds`` (as measured, not as asked): ``watts``, its
    average power (the energy counter's difference over the window); ``gpu_util``, percent of the
    driver's own trailing period (1/6 s to 1 s) in which a kernel ran, read at the end; and, over
    the window, ``sm_active``, percent of SMs busy, and ``sm_occupancy``, percent of the warps an SM
    can hold that were resident (GPM).  Each is None where NVML cannot say; ``why`` names those,
    '' where every one was read."""

    seconds: float
    watts: float | None
    gpu_util: int | None
    sm_active: float | None
    sm_occupancy: float | None
    why: str = ""


def measure(n: Any, h: Any, device: int, seconds: float) -> Activity:
    """GPU ``device``'s (handle ``h``, pynvml ``n``) power and SM activity over the next ``seconds``,
    slept here (a thread's call, as every NVML one).  The energy counter moves in the driver's own
    steps: a window of a second or more reads it well.  A reading the GPU, driver or nvidia-ml-py
    lacks, or a GPM call that fails, is None and named in ``why``; DeviceError naming the call for
    any other NVML failure (the GPU lost, say)."""
    energy = "nvmlDeviceGetTotalEnergyConsumption"
    samples: list[Any] = []
    try:
        gpm_why = _gpm_begin(n, h, samples)  # the first sample, taken before the window opens
        before, energy_why = _optional(n, energy, h, device)
        t0 = time.monotonic()
        time.sleep(seconds)
        after, _ = _optional(n, energy, h, device) if before is not None else (None, "")
        elapsed = time.monotonic() - t0
        util, util_why = _optional(n, "nvmlDeviceGetUtilizationRates", h, device)
        sm: tuple[float | None, float | None] = (None, None)
        if not gpm_why:
            sm, gpm_why = _gpm_end(n, h, samples)
    finally:
        for sample in samples:
            with contextlib.suppress(n.NVMLError):  # one NVML will not take back: the reading stands
                n.nvmlGpmSampleFree(sample)
    watts = None
    if before is not None and after is not None:
        watts = (int(after) - int(before)) / 1000 / elapsed  # millijoules
    why = [w for w in (f"watts: {energy_why}" if energy_why else "",
                       f"gpu_util: {util_why}" if util_why else "", gpm_why) if w]
    return Activity(elapsed, watts, None if util is None else int(util.gpu), sm[0], sm[1], "; ".join(why))


def _optional(n: Any, call: str, h: Any, device: int) -> tuple[Any, str]:
    """``call(h)`` and ''; (None, why) where the GPU or driver does not support it."""
    try:
        return getattr(n, call)(h), ""
    except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound) as e:
        return None, f"{call}: {e}"
    except n.NVMLError as e:
        raise DeviceError(f"GPU {device}: {call}: {e}") from e


def _gpm_begin(n: Any, h: Any, samples: list[Any]) -> str:
    """Two GPM samples into ``samples`` (the caller frees them), the first taken now; '' where
    it was, else why not.  GPM is Hopper's and later's: nvmlGpmQueryDeviceSupport says."""
    if not hasattr(n, "nvmlGpmMetricsGet"):
        return "sm_active, sm_occupancy: this nvidia-ml-py has no GPM calls"
    call = "nvmlGpmQueryDeviceSupport"
    try:
        if not n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
            return "sm_active, sm_occupancy: no GPM on this GPU (nvmlGpmQueryDeviceSupport; Hopper and later have it)"
        call = "nvmlGpmSampleAlloc"
        samples.append(n.nvmlGpmSampleAlloc())
        samples.append(n.nvmlGpmSampleAlloc())
        call = "nvmlGpmSampleGet"
        n.nvmlGpmSampleGet(h, samples[0])
    except n.NVMLError as e:
        return f"sm_active, sm_occupancy: {call}: {e}"
    return ""


def _gpm_end(n: Any, h: Any, samples: list[Any]) -> tuple[tuple[float | None, float | None], str]:
    """The second sample, and the SM metrics between the two: (SM_UTIL, SM_OCCUPANCY) and why
    one or both are None."""
    call = "nvmlGpmSampleGet"
    try:
        n.nvmlGpmSampleGet(h, samples[1])
        call = "nvmlGpmMetricsGet"
        got = n.c_nvmlGpmMetricsGet_t()
        got.version = n.NVML_GPM_METRICS_GET_VERSION
        got.numMetrics = 2
        got.sample1, got.sample2 = samples[0], samples[1]
        got.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
        got.metrics[1].metricId = n.NVML_GPM_METRIC_SM_OCCUPANCY
        n.nvmlGpmMetricsGet(got)
    except n.NVMLError as e:
        return (None, None), f"sm_active, sm_occupancy: {call}: {e}"
    values: list[float | None] = []
    why: list[str] = []
    for field, m in (("sm_active", got.metrics[0]), ("sm_occupancy", got.metrics[1])):
        ok = m.nvmlReturn == n.NVML_SUCCESS  # each metric has its own answer
        values.append(float(m.value) if ok else None)
        if not ok:
            why.append(f"{field}: nvmlGpmMetricsGet: {n.NVMLError(m.nvmlReturn)}")
    return (values[0], values[1]), "; ".join(why)
