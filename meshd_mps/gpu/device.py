"""What the GPU is, asked of the driver WITHOUT creating a context (the seed's device_info).

``query_device`` only calls cuInit, cuDeviceGet, cuDeviceGetName and
cuDeviceGetAttribute: no context, so no MPS client and no GPU memory.  Under
``--isolation mps`` the caller points CUDA_MPS_PIPE_DIRECTORY somewhere with no
daemon first, as the seed does, so that even cuInit joins no server.

``simulated_device`` is the explicit CPU simulation (``--gpu sim``): an H200's
figures, so that limits and register caps are computed as on the real thing.
The simulation has ``$MESHD_MPS_SIM_GPUS`` such devices (default 1), so that
several GPUs can be tested on a machine with none.

``device_count`` (cuDeviceGetCount) and ``parse_devices`` / ``choose_devices``
(``--devices``) say which GPUs a backend drives; ordinals are CUDA's, as the
daemon's environment (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``) numbers
them, and its workers and MPS control daemon inherit that environment.

cuda.bindings is imported lazily: this module (and the simulation) works on a
machine without cuda-python.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, SupportsInt

from meshd_mps.base.errors import ConfigError, DeviceError, NoDriver

#: How many GPUs the CPU simulation has (``--gpu sim``); the workers inherit it.
SIM_GPUS_ENV = "MESHD_MPS_SIM_GPUS"


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    cc_major: int
    cc_minor: int
    sms_total: int
    blocks_per_sm: int
    host_atomics: bool
    max_threads: int  # per block
    max_shared: int  # bytes of shared memory per block, opt-in
    regs_per_block: int
    ordinal: int = 0  # which GPU: CUDA's device ordinal
    max_grid_x: int = (1 << 31) - 1  # blocks in a launch's x dimension (CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)

    @property
    def arch(self) -> str:
        """The real architecture, for nvJitLink: ``sm_90``."""
        return f"sm_{self.cc_major}{self.cc_minor}"

    @property
    def compute(self) -> str:
        """The virtual architecture, for NVRTC: ``compute_90``."""
        return f"compute_{self.cc_major}{self.cc_minor}"


@dataclass(frozen=True)
class Caps:
    """The backend's capabilities as meshd reports them (the seed's mesh_caps)."""

    backend: str
    name: str
    cc_major: int
    cc_minor: int
    sms_total: int
    sms: int  # SMs a program may use: the green context's request, else sms_total
    green: bool
    blocks_per_sm: int
    max_threads: int
    max_shared: int
    arch: str


def simulated_count() -> int:
    """The simulation's GPU count: ``$MESHD_MPS_SIM_GPUS``, default 1; ConfigError if it is not a count."""
    raw = os.environ.get(SIM_GPUS_ENV, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{SIM_GPUS_ENV}={raw}: a count of simulated GPUs (1 or more) expected")
    return int(raw)


#: The simulated GPU's memory in bytes (an H200's 143771 MiB unless set): what a program's data is
#: allocated from, so that data that does not fit fails there as it fails on the GPU.
SIM_MEMORY_ENV = "MESHD_MPS_SIM_GPU_MEMORY"
SIM_MEMORY = 143771 << 20


def simulated_memory() -> int:
    """The simulated GPU's memory in bytes (``$MESHD_MPS_SIM_GPU_MEMORY``); ConfigError if it is not a size."""
    raw = os.environ.get(SIM_MEMORY_ENV, "").strip()
    if not raw:
        return SIM_MEMORY
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{SIM_MEMORY_ENV}={raw}: the simulated GPU's memory in bytes (1 or more) expected")
    return int(raw)


def simulated_device(ordinal: int = 0) -> DeviceInfo:
    """The CPU simulation's device ``ordinal``: an NVIDIA H200's figures (probe/RESULTS.md)."""
    return DeviceInfo(
        name="simulated NVIDIA H200 (meshd-mps --gpu sim)",
        cc_major=9,
        cc_minor=0,
        sms_total=132,
        blocks_per_sm=32,
        host_atomics=False,
        max_threads=1024,
        max_shared=232448,
        regs_per_block=65536,
        ordinal=ordinal,
        max_grid_x=(1 << 31) - 1,
    )


def is_no_driver(e: BaseException) -> bool:
    """True for cuda.pathfinder's "driver library not found" errors (raised by the first call)."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError

        if isinstance(e, DynamicLibNotFoundError):
            return True
    except ImportError:  # an older cuda-python without cuda.pathfinder
        pass
    return type(e).__name__ in ("DynamicLibNotFoundError", "DynamicLibNotAvailableError")


def error_name(err: SupportsInt) -> tuple[str, str]:
    """A CUresult's (name, description), e.g. ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid").

    Asks the driver (cuGetErrorName / cuGetErrorString) and falls back on the
    enum's name where the driver cannot say.
    """
    from cuda.bindings import driver as cu

    code = int(err)
    try:
        enum = cu.CUresult(code)
    except ValueError:
        return f"CUDA error {code}", ""
    name, text = enum.name, ""
    try:
        r, s = cu.cuGetErrorName(enum)
        if int(r) == 0 and s:
            name = s.decode(errors="replace")
        r, s = cu.cuGetErrorString(enum)
        if int(r) == 0 and s:
            text = s.decode(errors="replace")
    except Exception:  # no driver to ask
        pass
    return name, text


def describe_error(err: SupportsInt) -> str:
    """``NAME (description)`` for a CUresult."""
    name, text = error_name(err)
    return f"{name} ({text})" if text else name


def _driver() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise DeviceError(f"cuda-python is not installed: {e}") from e
    return cu


def _ck(call: str, r: Any) -> Any:
    """A driver call's (err, *values): the value(s), or DeviceError naming the call and the error."""
    err, *vals = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        raise DeviceError(f"{call}: {describe_error(err)}")
    return vals[0] if len(vals) == 1 else tuple(vals)


@contextmanager
def _driver_errors(what: str) -> Iterator[None]:
    """A failure of the driver's calls inside as meshd-mps says it: NoDriver where there is no
    driver library, else DeviceError prefixed with ``what`` (DeviceErrors from ``_ck`` pass)."""
    try:
        yield
    except DeviceError:
        raise
    except Exception as e:
        if is_no_driver(e):
            raise NoDriver(str(e)) from e
        raise DeviceError(f"{what}: {type(e).__name__}: {e}") from e


#: The CUDA driver's library, as cuda.bindings loads it.
DRIVER_LIBRARY = "libcuda.so.1"


def check_driver() -> None:
    """NoDriver where the CUDA driver's library cannot be loaded.  It initialises nothing (no cuInit:
    in MPS mode that waits until the daemon's own pipe directory is set), so a start checks it before
    it makes anything (a socket, a state directory, the MPS daemon), whatever the isolation."""
    import ctypes

    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError as e:
        raise NoDriver(str(e)) from e


def device_count() -> int:
    """GPUs the driver shows this process (cuInit, cuDeviceGetCount), without a context.

    NoDriver where the driver library is not found, DeviceError for a failing call
    (``cuInit: CUDA_ERROR_NO_DEVICE (...)`` on a machine whose GPUs are all hidden).
    """
    cu = _driver()
    with _driver_errors("cuDeviceGetCount"):
        _ck("cuInit", cu.cuInit(0))
        return int(_ck("cuDeviceGetCount", cu.cuDeviceGetCount()))


def query_device(ordinal: int = 0) -> DeviceInfo:
    """Device ``ordinal``'s figures, without creating a context.

    Raises NoDriver("no NVIDIA driver: ...") where the driver library is not
    found, DeviceError for a driver call that fails (naming the call and error).
    """
    cu = _driver()
    ck = _ck
    with _driver_errors(f"device {ordinal}"):
        ck("cuInit", cu.cuInit(0))
        dev = ck("cuDeviceGet", cu.cuDeviceGet(ordinal))
        raw = ck("cuDeviceGetName", cu.cuDeviceGetName(256, dev))
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
        A = cu.CUdevice_attribute

        def attr(a: str) -> int:
            got = cu.cuDeviceGetAttribute(getattr(A, "CU_DEVICE_ATTRIBUTE_" + a), dev)
            return int(ck(f"cuDeviceGetAttribute({a})", got))

        return DeviceInfo(
            name=name,
            cc_major=attr("COMPUTE_CAPABILITY_MAJOR"),
            cc_minor=attr("COMPUTE_CAPABILITY_MINOR"),
            sms_total=attr("MULTIPROCESSOR_COUNT"),
            blocks_per_sm=attr("MAX_BLOCKS_PER_MULTIPROCESSOR"),
            host_atomics=attr("HOST_NATIVE_ATOMIC_SUPPORTED") != 0,
            max_threads=attr("MAX_THREADS_PER_BLOCK"),
            max_shared=attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            regs_per_block=attr("MAX_REGISTERS_PER_BLOCK"),
            ordinal=ordinal,
            max_grid_x=attr("MAX_GRID_DIM_X"),
        )


def check_sms(info: DeviceInfo, sms: int, what: str = "the device") -> None:
    """Refuse an ``--sms`` the device cannot give (0 means the whole device); ``what`` names
    the device in the error (``GPU 1`` where there are several)."""
    if sms < 0:
        raise ConfigError(f"sms {sms}: must be 0 (the whole device) or a count of SMs")
    if sms > info.sms_total:
        raise ConfigError(f"sms {sms}: {what} has {info.sms_total}")


def ordinals_text(devices: Iterable[int]) -> str:
    """``0,1,3``: the form ``--devices`` takes."""
    return ",".join(str(d) for d in devices)


def parse_devices(text: str) -> tuple[int, ...] | None:
    """``--devices``: ``all`` (None: every visible GPU) or ordinals ``0,1``; ConfigError naming the
    fault.  Whether the GPUs exist is checked when the backend opens (``choose_devices``)."""
    t = text.strip()
    if t == "all":
        return None
    items = [i.strip() for i in t.split(",")]
    if not t or any(not i for i in items):
        raise ConfigError(f"devices {text!r}: GPU ordinals separated by commas (0,1) or all")
    bad = [i for i in items if not i.isdigit()]
    if bad:
        raise ConfigError(f"devices {text}: {bad[0]!r} is not a GPU ordinal (0, 1, ...)")
    return check_unique([int(i) for i in items])


def check_unique(devices: Iterable[int]) -> tuple[int, ...]:
    """The ordinals as given, ConfigError for a negative one or one named twice."""
    out: list[int] = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, int):
            raise ConfigError(f"devices: {d!r} is not a GPU ordinal (0, 1, ...)")
        if d < 0:
            raise ConfigError(f"devices {d}: a GPU ordinal is 0 or more")
        if d in out:
            raise ConfigError(f"devices {ordinals_text([*out, d])}: GPU {d} is named twice")
        out.append(d)
    if not out:
        raise ConfigError("devices: no GPU named (give ordinals such as 0,1, or leave it out for all)")
    return tuple(out)


def choose_devices(asked: Iterable[int] | None, visible: int) -> tuple[int, ...]:
    """The GPUs to drive, ascending: ``asked`` (None: all ``visible``), each one checked to exist."""
    if visible < 1:
        raise ConfigError("no GPU visible to this process (check CUDA_VISIBLE_DEVICES)")
    if asked is None:
        return tuple(range(visible))
    devices = check_unique(asked)
    for d in devices:
        if d >= visible:
            seen = "0" if visible == 1 else f"0-{visible - 1}"
            raise ConfigError(f"devices {d}: only {visible} GPU{'s' if visible > 1 else ''} visible ({seen})")
    return tuple(sorted(devices))


def caps_of(info: DeviceInfo, sms: int) -> Caps:
    """The capabilities for ``--sms sms`` (0: the whole device, no green context).

    ``sms`` is the request as given; the driver rounds a green context up to
    its partition granularity (multiples of 8 on an H200) and each worker's
    LOADED reports the count it really got.
    """
    check_sms(info, sms)
    return Caps(
        backend="cuda",
        name=info.name,
        cc_major=info.cc_major,
        cc_minor=info.cc_minor,
        sms_total=info.sms_total,
        sms=sms or info.sms_total,
        green=sms != 0,
        blocks_per_sm=info.blocks_per_sm,
        max_threads=info.max_threads,
        max_shared=info.max_shared,
        arch=info.arch,
    )
