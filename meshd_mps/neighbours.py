"""The processes on our GPUs sorted into ours and theirs, and the log lines that name theirs.

A process with a context of its own on one of our GPUs is *foreign*: the GPU time-slices
between its context and our MPS server's (or, in blink mode, our one context's), and our
resident programs stall while it runs (2.45 ms measured on an H200 beside a PyTorch matmul loop;
as a client of our server the same loop cost one 0.44 ms stall: docs/operations.md).  NVML lists
every process with a context (``gpu/nvml.py``); under Volta-and-later MPS our workers are listed
under their own pids, as MPS clients, beside our server.  So what is not ours, not our server
and not a native client that joined our server is foreign, whatever NVML's ``mps`` flag says (a
client of another MPS server is outside ours).

:func:`classify` is pure; :class:`NeighbourWatch` remembers what it has said, so that each
foreign process is logged once when it comes and once when it goes, and a compute mode that
cannot work once; :func:`look` reads the views in a thread, under a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

import anyio
import structlog

from meshd_mps.base.errors import Timeout
from meshd_mps.gpu.nvml import ComputeMode, DeviceView, GpuProcess, NvmlLike

log = structlog.get_logger("meshd_mps")

Isolation = Literal["mps", "blink"]


@dataclass(frozen=True)
class Neighbours:
    """One GPU's processes by whose they are: ``ours`` (our workers; in blink mode the context
    worker), ``server`` (our MPS server), ``native`` (native clients registered with our server)
    and ``foreign`` (a context outside our server)."""

    device: int
    compute_mode: ComputeMode
    ours: tuple[GpuProcess, ...] = ()
    server: tuple[GpuProcess, ...] = ()
    native: tuple[GpuProcess, ...] = ()
    foreign: tuple[GpuProcess, ...] = ()
    memory: tuple[int, int] | None = None  # the GPU's memory used and in all (bytes), where NVML says

    def role(self, pid: int) -> str | None:
        """Which of the four ``pid`` is in (None: not on this GPU)."""
        for role in ("ours", "server", "native", "foreign"):
            if any(p.pid == pid for p in getattr(self, role)):
                return role
        return None

    def as_dict(self) -> dict[str, Any]:
        """For ``status``: pids of ours, the foreign processes in full."""
        return {
            "device": self.device,
            "compute_mode": self.compute_mode.value,
            "ours": [p.pid for p in self.ours],
            "server": [p.pid for p in self.server],
            "native": [p.pid for p in self.native],
            "foreign": [asdict(p) for p in self.foreign],
            "memory_used": None if self.memory is None else self.memory[0],
            "memory_total": None if self.memory is None else self.memory[1],
        }


def classify(view: DeviceView, ours: set[int], server: set[int], native: set[int]) -> Neighbours:
    """``view``'s processes split by the pids we know: our workers, our MPS server's, the native
    clients registered with it; every other process is foreign.  A pid in two sets counts as
    the first of ours, server, native."""
    split: dict[str, list[GpuProcess]] = {"ours": [], "server": [], "native": [], "foreign": []}
    for p in view.processes:
        role = "ours" if p.pid in ours else "server" if p.pid in server else "native" if p.pid in native else "foreign"
        split[role].append(p)
    return Neighbours(view.device, view.compute_mode, ours=tuple(split["ours"]), server=tuple(split["server"]),
                      native=tuple(split["native"]), foreign=tuple(split["foreign"]), memory=view.memory)


class Advice(NamedTuple):
    level: Literal["warning", "info"]
    text: str


def mode_advice(isolation: Isolation, mode: ComputeMode) -> Advice | None:
    """What GPU compute mode ``mode`` means for ``isolation``, where it says something.

    PROHIBITED: no context can be created, so nothing of ours can run.  EXCLUSIVE_PROCESS: what
    MPS wants (the server is the one process; every other CUDA process must join it as a
    client) and fine for blink mode's one context.  DEFAULT works, but lets any process make a
    context of its own beside ours: said once, at info.
    """
    if mode is ComputeMode.PROHIBITED:
        return Advice("warning", "compute mode PROHIBITED: no process may create a CUDA context on it, so none of our "
                                 "programs can run there (nvidia-smi -c DEFAULT, or EXCLUSIVE_PROCESS: docs/operations.md)")
    if mode is ComputeMode.DEFAULT:
        ours = "our MPS server" if isolation == "mps" else "our context"
        return Advice("info", f"compute mode DEFAULT: any process may create a context beside {ours} and time-slice "
                              "with our programs; EXCLUSIVE_PROCESS keeps them out (docs/operations.md)")
    return None


class NeighbourWatch:
    """Logs what changes among the foreign processes of our GPUs, once per change: a warning
    when one comes, info when it goes; the compute mode's advice when it is first seen or
    changes.  ``latest`` is the last view of each GPU, for ``status`` and the metrics."""

    def __init__(self, isolation: Isolation):
        self.isolation: Isolation = isolation
        self._foreign: dict[tuple[int, int], GpuProcess] = {}
        self._modes: dict[int, ComputeMode] = {}
        self.latest: dict[int, Neighbours] = {}

    def _outside(self) -> str:
        return "outside our MPS server" if self.isolation == "mps" else "beside our CUDA context"

    def observe(self, n: Neighbours) -> None:
        d = n.device
        self.latest[d] = n
        if self._modes.get(d) is not n.compute_mode:
            self._modes[d] = n.compute_mode
            advice = mode_advice(self.isolation, n.compute_mode)
            if advice is not None:
                getattr(log, advice.level)(f"GPU {d}: {advice.text}", device=d, compute_mode=n.compute_mode.value)
        now = {p.pid: p for p in n.foreign}
        for p in now.values():
            if (d, p.pid) not in self._foreign:
                self._foreign[d, p.pid] = p
                whose = " (an MPS client, not of our server)" if p.mps else ""
                log.warning(f"GPU {d}: process {p.pid} ({p.name}){whose} has a context {self._outside()}: "
                            "it time-slices with our programs (docs/operations.md)",
                            device=d, pid=p.pid, name=p.name, used_bytes=p.used_bytes, mps=p.mps)
        for (dev, pid), p in list(self._foreign.items()):
            if dev != d or pid in now:
                continue
            del self._foreign[dev, pid]
            role = n.role(pid)
            if role is None:
                log.info(f"GPU {d}: process {pid} ({p.name}), which had a context {self._outside()}, is gone",
                         device=d, pid=pid, name=p.name)
            else:
                log.info(f"GPU {d}: process {pid} ({p.name}) is no longer {self._outside()}: it is {role} now",
                         device=d, pid=pid, name=p.name, role=role)

    def foreign(self) -> list[tuple[int, GpuProcess]]:
        """Every foreign process now known, as (GPU, process), by GPU and pid."""
        return sorted(((d, p) for (d, _), p in self._foreign.items()), key=lambda x: (x[0], x[1].pid))


def _views(nvml: NvmlLike, devices: Sequence[int]) -> list[DeviceView]:
    return [nvml.view(d) for d in devices]


async def look(nvml: NvmlLike, devices: Sequence[int], within: float) -> list[DeviceView]:
    """Each of ``devices``' views, read in a worker thread (NVML blocks in the driver); Timeout
    past ``within`` seconds, the thread then left to finish on its own (a lost GPU can hang an
    NVML call)."""
    try:
        with anyio.fail_after(within):
            return await anyio.to_thread.run_sync(_views, nvml, devices, abandon_on_cancel=True)
    except TimeoutError as e:
        gpus = ",".join(str(d) for d in devices)
        raise Timeout(f"NVML: no view of GPU {gpus} in {within:g}s") from e
