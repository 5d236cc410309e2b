"""Who else is on our GPUs: every process NVML sees with a context there, and the compute mode.

A process with a CUDA context of its own on one of our GPUs time-slices with our MPS server (or
our one blink context) and stalls our resident programs (docs/operations.md); NVML is how to see
it, and ``meshd_mps/neighbours.py`` sorts what this module reads into ours and theirs.

What NVML lists (nvidia-ml-py 13.615, ``pynvml.py``; the NVML reference, ``nvml.h``):

- ``nvmlDeviceGetComputeRunningProcesses``: every process "with a compute context on a device"
  (a CUDA application with an active context), its pid and the GPU memory it uses.
- ``nvmlDeviceGetGraphicsRunningProcesses``: the same for graphics contexts (OpenGL, Vulkan);
  read as none where a board does not support it.
- ``nvmlDeviceGetMPSComputeRunningProcesses`` ("For Volta or newer fully supported devices.
  This function returns information only about compute running processes (e.g. CUDA
  application which have active context) utilizing MPS", nvml.h): the MPS clients.

nvidia-smi's Type column is made from these lists: C, G, and "M+C" for a Volta-MPS client,
which is in both the MPS list and the compute list.  Before Volta, "all MPS client behavior
will be attributed to the MPS server process by system monitoring and accounting tools (for
example, nvidia-smi, NVML API)" (NVIDIA's MPS documentation, docs.nvidia.com/deploy/mps,
"Limitations"): only the server was listed.  Seen on an NVIDIA H200 (driver 580.159.04,
nvidia-ml-py 13; docs/gpu-runs.md), a plain context and two clients of a private MPS
server on GPU 0:

- compute list: the plain context (520 MiB), the server ``nvidia-cuda-mps-server`` (66 MiB)
  and both clients (518 MiB each), each under its own pid; MPS list: the two clients only;
  graphics list: empty (supported, not an error); nvidia-smi: C, C, M+C, M+C;
- ``get_client_list`` of the server named the same two pids NVML listed as MPS clients;
- ``/proc/PID/comm`` of the server reads ``nvidia-cuda-mps`` (the kernel keeps 15 characters),
  NVML's name ``nvidia-cuda-mps-server``.

So under MPS our workers are listed under their own pids (as MPS clients) beside our server's
pid, and a process in none of our sets has a context outside our server (it may be a client of
another MPS server: the ``mps`` flag says so; that server is a context of its own).

Which NVML device is CUDA's ordinal N: by PCI bus id.  NVML numbers every GPU of the machine in
PCI order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers the visible ones, fastest first
unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; so the indexes agree only by luck.  ``cuDeviceGetPCIBusId``
needs no context (cuInit only, which the daemon does already in ``gpu/device.py``), and
``nvmlDeviceGetHandleByPciBusId`` takes its answer as it is; a UUID would do as well, but CUDA
gives it as 16 bytes to be formatted.  Under MIG the bus id names the whole GPU: the view is of
every instance (NVML lists them only to a privileged caller).

Every call here is a blocking C call into the driver: the daemon makes them in a thread
(``anyio.to_thread.run_sync``, ``neighbours.look``), never on the event loop.  pynvml is imported
by :meth:`Nvml.open` alone, never when meshd-mps is imported: the CLI and the workers never load it.

:class:`SimNvml` is NVML for ``--gpu sim``, chosen explicitly, never as a fallback: the processes
of ``$MESHD_MPS_SIM_NVML`` (a JSON file, read at every view so that a test can change it) beside
the ones its caller says are its own.

:meth:`Nvml.activity` is the bench's gauge of what an idle resident program costs (gpu/activity.py).
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Self

from meshd_mps.base.errors import ConfigError, DeviceError, NoDriver, NvmlUnavailable
from meshd_mps.gpu.activity import Activity, measure

#: The JSON file of processes that the simulated NVML shows (``--gpu sim``); unset: none.
SIM_NVML_ENV = "MESHD_MPS_SIM_NVML"
#: The simulated GPU's memory (bytes): an H200's, as its NVML reports it (143771 MiB).
SIM_MEMORY = 143771 * 1024 * 1024

Kind = Literal["compute", "graphics"]


class ComputeMode(enum.StrEnum):
    """A GPU's compute mode (``nvidia-smi -c``), as NVML reports it."""

    DEFAULT = "default"  # any number of processes may hold a context
    EXCLUSIVE_PROCESS = "exclusive_process"  # one process at a time (with MPS: the MPS server)
    PROHIBITED = "prohibited"  # no context at all
    UNKNOWN = "unknown"  # NVML could not say, or a mode it has removed (EXCLUSIVE_THREAD)


#: NVML_COMPUTEMODE_* (nvml.h); 1, EXCLUSIVE_THREAD, is no longer supported and reads as unknown.
_MODES = {0: ComputeMode.DEFAULT, 2: ComputeMode.PROHIBITED, 3: ComputeMode.EXCLUSIVE_PROCESS}


@dataclass(frozen=True)
class GpuProcess:
    """One process with a context on a GPU.  ``used_bytes`` is None where NVML cannot say;
    ``kind`` is "compute" if it has a compute context (a process with both is listed once);
    ``mps`` is True for a process NVML lists as an MPS client (of whichever server)."""

    pid: int
    name: str  # /proc/PID/comm, else NVML's; "?" for a pid we cannot see (another pid namespace)
    used_bytes: int | None
    kind: Kind = "compute"
    mps: bool = False


@dataclass(frozen=True)
class DeviceView:
    """What NVML shows of GPU ``device`` (CUDA's ordinal) at one moment; ``memory``: its memory
    used and in all, bytes (None where NVML cannot say)."""

    device: int
    compute_mode: ComputeMode
    processes: tuple[GpuProcess, ...]
    memory: tuple[int, int] | None = None


class NvmlLike(Protocol):
    """What the daemon needs of NVML, real or simulated."""

    def view(self, device: int) -> DeviceView: ...

    def close(self) -> None: ...


#: /proc/PID/comm keeps 15 characters (TASK_COMM_LEN - 1): a name this long may be cut short.
COMM_LEN = 15


def proc_name(pid: int) -> str | None:
    """``/proc/PID/comm``; None where it is not visible (gone, or in another pid namespace)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip() or None
    except OSError:
        return None


def cuda_pci_bus_id(ordinal: int) -> str:
    """The PCI bus id (``0000:3B:00.0``) of CUDA's device ``ordinal``, without a context."""
    from meshd_mps.gpu.device import _ck, _driver, _driver_errors

    cu = _driver()
    with _driver_errors(f"device {ordinal}"):
        _ck("cuInit", cu.cuInit(0))
        dev = _ck("cuDeviceGet", cu.cuDeviceGet(ordinal))
        raw = _ck("cuDeviceGetPCIBusId", cu.cuDeviceGetPCIBusId(32, dev))
    text = bytes(raw).split(b"\0", 1)[0].decode() if isinstance(raw, bytes | bytearray) else str(raw)
    return text.strip()


def merge(compute: Iterable[Any], graphics: Iterable[Any], mps: Iterable[Any],
          name: Callable[[int], str]) -> tuple[GpuProcess, ...]:
    """NVML's three lists (objects with ``pid`` and ``usedGpuMemory``) as one process each, by pid."""
    mps_pids = {int(p.pid) for p in mps}
    out: dict[int, GpuProcess] = {}
    lists: tuple[tuple[Kind, Iterable[Any]], ...] = (("compute", compute), ("graphics", graphics))
    for kind, procs in lists:
        for p in procs:
            pid = int(p.pid)
            if pid in out:
                continue  # a process with a compute and a graphics context: once, as compute
            used = p.usedGpuMemory
            out[pid] = GpuProcess(pid, name(pid), None if used is None else int(used), kind, pid in mps_pids)
    for pid in mps_pids - out.keys():  # an MPS client missing from the compute list (not seen, but cheap to keep)
        out[pid] = GpuProcess(pid, name(pid), None, "compute", True)
    return tuple(sorted(out.values(), key=lambda p: p.pid))


_WHY = {  # NVML_ERROR_* at nvmlInit, in words
    "NVMLError_LibraryNotFound": "libnvidia-ml.so.1 is not found: no NVIDIA driver on this machine",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to talk to the NVIDIA driver (/dev/nvidiactl)",
}


class Nvml:
    """NVML opened: :meth:`view` of one GPU after another, then :meth:`close`.

    Every method blocks in the driver: call them in a thread (``anyio.to_thread.run_sync``).
    ``bus_id`` maps CUDA's ordinal to its PCI bus id (default: ask the CUDA driver); the handle
    found for an ordinal is kept.
    """

    def __init__(self, nvml: Any, bus_id: Callable[[int], str] = cuda_pci_bus_id,
                 name: Callable[[int], str | None] = proc_name):
        self._n = nvml
        self._bus_id = bus_id
        self._name = name
        self._handles: dict[int, Any] = {}
        self._open = True

    @classmethod
    def open(cls, bus_id: Callable[[int], str] = cuda_pci_bus_id) -> Self:
        """nvmlInit; NvmlUnavailable (``why``: the package, the library, the driver, the
        permission) where NVML cannot be had."""
        try:
            import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types
        except ImportError as e:
            raise NvmlUnavailable(f"NVML unavailable: nvidia-ml-py is not installed ({e})",
                                  why="nvidia-ml-py (pynvml) is not installed") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            why = _WHY.get(type(e).__name__, f"nvmlInit: {e}")
            raise NvmlUnavailable(f"NVML unavailable: {why}", why=why) from e
        return cls(pynvml, bus_id)

    def _handle(self, device: int) -> Any:
        h = self._handles.get(device)
        if h is None:
            try:
                bus = self._bus_id(device)
            except NoDriver as e:
                raise NvmlUnavailable(f"GPU {device}: {e}", why=str(e)) from e
            try:
                h = self._n.nvmlDeviceGetHandleByPciBusId(bus)
            except self._n.NVMLError as e:
                raise DeviceError(f"GPU {device}: nvmlDeviceGetHandleByPciBusId({bus}): {e}") from e
            self._handles[device] = h
        return h

    def _list(self, call: str, h: Any, device: int, optional: bool) -> Sequence[Any]:
        """One of NVML's process lists; an optional one that the device or driver lacks is empty."""
        n = self._n
        try:
            return list(getattr(n, call)(h))
        except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound) as e:
            if optional:
                return []
            raise DeviceError(f"GPU {device}: {call}: {e}") from e
        except n.NVMLError as e:
            raise DeviceError(f"GPU {device}: {call}: {e}") from e

    def view(self, device: int) -> DeviceView:
        """GPU ``device``'s compute mode and processes; DeviceError naming the call that failed."""
        if not self._open:
            raise DeviceError(f"GPU {device}: NVML is closed")
        n = self._n
        h = self._handle(device)
        try:
            mode = _MODES.get(int(n.nvmlDeviceGetComputeMode(h)), ComputeMode.UNKNOWN)
        except n.NVMLError_NotSupported:
            mode = ComputeMode.UNKNOWN
        except n.NVMLError as e:
            raise DeviceError(f"GPU {device}: nvmlDeviceGetComputeMode: {e}") from e
        compute = self._list("nvmlDeviceGetComputeRunningProcesses", h, device, optional=False)
        graphics = self._list("nvmlDeviceGetGraphicsRunningProcesses", h, device, optional=True)
        mps = self._list("nvmlDeviceGetMPSComputeRunningProcesses", h, device, optional=True)
        return DeviceView(device, mode, merge(compute, graphics, mps, self._process_name), self._memory(h, device))

    def _memory(self, h: Any, device: int) -> tuple[int, int] | None:
        """nvmlDeviceGetMemoryInfo's used and total bytes; None where the board does not say."""
        n = self._n
        try:
            m = n.nvmlDeviceGetMemoryInfo(h)
        except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound):
            return None
        except n.NVMLError as e:
            raise DeviceError(f"GPU {device}: nvmlDeviceGetMemoryInfo: {e}") from e
        return int(m.used), int(m.total)

    def memory(self, device: int) -> tuple[int, int]:
        """GPU ``device``'s memory, (total, free) bytes, every process's use counted; DeviceError."""
        try:
            m = self._n.nvmlDeviceGetMemoryInfo(self._handle(device))
        except self._n.NVMLError as e:
            raise DeviceError(f"GPU {device}: nvmlDeviceGetMemoryInfo: {e}") from e
        return int(m.total), int(m.free)

    def activity(self, device: int, seconds: float) -> Activity:
        """GPU ``device``'s power and SM activity over the next ``seconds`` (gpu/activity.py)."""
        if not self._open:
            raise DeviceError(f"GPU {device}: NVML is closed")
        if not seconds > 0:
            raise ValueError(f"a window of {seconds!r} s: more than 0 expected")
        return measure(self._n, self._handle(device), device, seconds)

    def _process_name(self, pid: int) -> str:
        """/proc's name where we see the pid, else NVML's (nvmlSystemGetProcessName), else "?".
        A 15-character comm is cut short (``nvidia-cuda-mps``): NVML's name completes it."""
        local = self._name(pid)
        if local and len(local) < COMM_LEN:
            return local
        try:
            got = self._n.nvmlSystemGetProcessName(pid)
        except self._n.NVMLError:
            return local or "?"
        text = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
        full = os.path.basename(text.strip())
        if local and not full.startswith(local):
            return local  # a pid of another namespace that NVML names differently: ours is the one we see
        return full or local or "?"

    def close(self) -> None:
        """nvmlShutdown, once."""
        if self._open:
            self._open = False
            self._handles.clear()
            try:
                self._n.nvmlShutdown()
            except self._n.NVMLError as e:
                raise DeviceError(f"nvmlShutdown: {e}") from e

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the simulation (--gpu sim) ---------------------------------------------------------------

_PROCESS_KEYS = {"pid", "name", "used_bytes", "kind", "mps"}


def _sim_process(raw: object, where: str) -> GpuProcess:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an object with pid (and name, used_bytes, kind, mps) expected")
    extra = set(raw) - _PROCESS_KEYS
    if extra:
        raise ValueError(f"{where}: unknown key {sorted(extra)[0]!r} (known: {', '.join(sorted(_PROCESS_KEYS))})")
    pid = raw.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        raise ValueError(f"{where}: pid {pid!r} is not a process id")
    name = raw.get("name", proc_name(pid) or "?")
    used = raw.get("used_bytes", None)
    kind = raw.get("kind", "compute")
    mps = raw.get("mps", False)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name {name!r} is not a process name")
    if used is not None and (isinstance(used, bool) or not isinstance(used, int) or used < 0):
        raise ValueError(f"{where}: used_bytes {used!r} is not a count of bytes")
    if kind not in ("compute", "graphics"):
        raise ValueError(f"{where}: kind {kind!r}: compute or graphics")
    if not isinstance(mps, bool):
        raise ValueError(f"{where}: mps {mps!r}: true or false")
    return GpuProcess(pid, name, used, kind, mps)


def parse_sim(text: str) -> dict[int, tuple[ComputeMode, tuple[GpuProcess, ...]]]:
    """The simulated NVML's file: ``{"0": {"compute_mode": "default", "processes": [{"pid": 123,
    "name": "python", "used_bytes": 1048576}]}}`` (per process also ``kind``, "compute" or
    "graphics", and ``mps``); ValueError naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError('an object by GPU ordinal expected: {"0": {"compute_mode": ..., "processes": [...]}}')
    out: dict[int, tuple[ComputeMode, tuple[GpuProcess, ...]]] = {}
    for key, dev in raw.items():
        if not key.isdigit():
            raise ValueError(f"{key!r} is not a GPU ordinal")
        if not isinstance(dev, dict) or set(dev) - {"compute_mode", "processes"}:
            raise ValueError(f"GPU {key}: an object with compute_mode and processes expected")
        mode = dev.get("compute_mode", "default")
        if mode not in {m.value for m in ComputeMode}:
            raise ValueError(f"GPU {key}: compute_mode {mode!r}: one of {', '.join(m.value for m in ComputeMode)}")
        procs = dev.get("processes", [])
        if not isinstance(procs, list):
            raise ValueError(f"GPU {key}: processes: a list expected")
        parsed = tuple(_sim_process(p, f"GPU {key}, process {i}") for i, p in enumerate(procs))
        out[int(key)] = (ComputeMode(mode), parsed)
    return out


class SimNvml:
    """NVML as ``--gpu sim`` shows it: the processes of ``path`` (``$MESHD_MPS_SIM_NVML``; None:
    none) beside ``residents(device)``, the ones its caller says are its own (our workers and the
    stand-in's server, as a real NVML would list them).  With neither, nothing is on the GPUs:
    nothing foreign.  ``path`` is read at every view, so that a test can bring a process and take
    it away; a malformed one is ConfigError, at open as at every view.
    """

    def __init__(self, path: str | None, devices: int, residents: Callable[[int], Iterable[GpuProcess]] | None = None):
        self.path = path
        self.devices = devices
        self._residents = residents
        self._open = True

    @classmethod
    def open(cls, residents: Callable[[int], Iterable[GpuProcess]] | None = None) -> Self:
        from meshd_mps.gpu.device import simulated_count

        sim = cls(os.environ.get(SIM_NVML_ENV) or None, simulated_count(), residents)
        sim._read()  # a malformed file is refused now, not at the first view
        return sim

    def _read(self) -> dict[int, tuple[ComputeMode, tuple[GpuProcess, ...]]]:
        if self.path is None:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{SIM_NVML_ENV}={self.path}: {e.strerror}") from e
        try:
            return parse_sim(text)
        except ValueError as e:
            raise ConfigError(f"{SIM_NVML_ENV}={self.path}: {e}") from e

    def view(self, device: int) -> DeviceView:
        if not self._open:
            raise DeviceError(f"GPU {device}: NVML is closed")
        if not 0 <= device < self.devices:
            raise DeviceError(f"GPU {device}: the simulation has {self.devices} GPU{'s' if self.devices > 1 else ''}")
        mode, listed = self._read().get(device, (ComputeMode.DEFAULT, ()))
        own = tuple(self._residents(device)) if self._residents else ()
        seen = {p.pid for p in own}
        procs = own + tuple(p for p in listed if p.pid not in seen)
        used = sum(p.used_bytes or 0 for p in procs)  # the simulated GPU's memory: what its processes hold
        return DeviceView(device, mode, tuple(sorted(procs, key=lambda p: p.pid)), (used, SIM_MEMORY))

    def close(self) -> None:
        self._open = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
