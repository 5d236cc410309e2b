"""What the rows run on: ``Bench`` (the options, a backend on GPU 0 per section, the examples
compiled here from CUDA C, the directories it removes), pooled workers whose launches return at once,
``echo`` loaded with its ring's host end, and where the bench's own process runs (``--cpu``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from meshd_mps.backend import Backend
from meshd_mps.bench.measure import until
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.isolation.base import Module
from meshd_mps.isolation.mps import MpsIsolation
from meshd_mps.programs import Programs
from meshd_mps.protocol.ring import Ring
from meshd_mps.supervision import cpus

#: The source tree this bench runs from (a checkout: its examples, and (k)'s next release is a copy of it).
SOURCE = Path(__file__).resolve().parent.parent.parent
EXAMPLES = SOURCE / "examples"


class Bench:
    def __init__(self, gpu: str, quick: bool, mps_dir: str | None, loop: str = "auto", cpu: str = "auto"):
        self.gpu, self.quick, self.loop = gpu, quick, loop
        self.cpu = cpu  # --cpu: where (f)'s host spins (place_ring)
        self.ring_cpu: int | None = None
        self.own_base = mps_dir is None
        self.base = mps_dir or tempfile.mkdtemp(prefix="meshd-bench.")  # short: AF_UNIX paths stop at 108 bytes
        self.dirs: list[str] = []
        self.device = ""
        #: The cubins the bench's backends JIT, shared by them: a figure is never a JIT's (but (e)'s
        #: cold case, which takes a Compiler of its own), and each backend's JIT of the same example
        #: was most of a short section's CPU.
        self.cubins = os.path.join(self.base, "cubins")
        if not self.own_base:
            self.dirs.append(self.cubins)
        self._src: dict[tuple[str, str], tuple[dict[str, Any], bytes]] = {}

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    async def backend(self, isolation: str, pool: int = 0, live: bool = False) -> Backend:
        """A backend on GPU 0; ``live``: with live restore (its workers on sockets), in a state
        directory of its own (removed at cleanup)."""
        d = state = None
        if isolation == "mps":
            d = os.path.join(self.base, str(len(self.dirs)))
            self.dirs.append(d)
        if live:
            state = os.path.join(self.base, f"live{len(self.dirs)}")
            self.dirs.append(state)
        # GPU 0 only: on a several-GPU host every figure stays one GPU's
        b = await Backend.open(isolation=isolation, pool=pool, gpu=self.gpu, mps_dir=d, devices=[0],  # type: ignore[arg-type]
                               live=state, cache_dir=self.cubins)
        if not self.device and b.caps is not None:
            c = b.caps
            self.device = f"{c.name} (sm_{c.cc_major}{c.cc_minor}, {c.sms_total} SMs, {c.blocks_per_sm} blocks/SM)"
        return b

    async def src(self, b: Backend, name: str) -> tuple[dict[str, Any], bytes]:
        """An example's manifest and PTX, compiled here from CUDA C for the device's arch."""
        assert b.info is not None
        arch = b.info.compute
        if (name, arch) not in self._src:
            d = EXAMPLES / name
            cu = (d / f"{name}.cu").read_bytes()
            ptx = await anyio.to_thread.run_sync(lambda: cuda_to_ptx(cu, name, arch=arch, include=[str(EXAMPLES / "include")]))
            self._src[name, arch] = (json.loads((d / "manifest.json").read_text()), ptx)
        return self._src[name, arch]

    def cleanup(self) -> None:
        for d in [self.base] if self.own_base else self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def mps_gpu(b: Backend) -> MpsIsolation:
    """The MPS backend's one GPU (the bench drives GPU 0 only)."""
    g = b.isolations[0]
    assert isinstance(g, MpsIsolation)
    return g


async def returning_worker(bench: Bench, b: Backend, slot: int) -> Module:
    """A pooled worker with ``heartbeat`` loaded and its slot set to HALT: each launch returns at once."""
    img = await b.prepare(*await bench.src(b, "heartbeat"))
    assert img.preloaded is not None
    b.mailbox.reset_slot(slot)
    b.mailbox.halt(slot)
    return img.preloaded


async def retire_idle(b: Backend) -> None:
    """Empty the pool: its workers retired and reaped."""
    idle = mps_gpu(b).pool.drain()
    for w in idle:
        b.sup.retire(w)
    pids = {w.pid for w in idle}
    await until(lambda: not pids & set(b.sup.children()), 15, "retired workers to exit")


@contextlib.asynccontextmanager
async def echo_loaded(bench: Bench, b: Backend) -> AsyncIterator[tuple[Programs, Ring]]:
    """``echo`` loaded on ``b`` and beating, with its ring's host end; unloaded (its Programs
    closed) at the end."""
    progs = Programs(b)
    try:
        p = await progs.load(*await bench.src(b, "echo"))
        slot = p.slot
        await until(lambda: b.mailbox.heartbeat(slot) > 0, 10, "echo's first beat")
        ring = p.ring = p.ring or Ring(b.mailbox, slot, p.name)
        yield progs, ring
    finally:
        await progs.close()


def daemon_cpu(bench: Bench) -> int | None:
    """The CPU (b)'s placed phase gives the bench's event loop (``serve --daemon-cpus`` as the
    bench's process does it): ``--cpu N``, else (auto) the last this process may use; None with
    ``--cpu off`` or a single CPU."""
    every = sorted(os.sched_getaffinity(0))
    if bench.cpu == "off" or len(every) == 1:
        return None
    return every[-1] if bench.cpu == "auto" else int(bench.cpu)


def placement(cpu: int | None) -> contextlib.AbstractContextManager[Any]:
    """The bench's process placed as ``serve --daemon-cpus CPU`` places the daemon (every thread of
    it there, the workers it starts meanwhile elsewhere); None: left alone."""
    return contextlib.nullcontext() if cpu is None else cpus.placed(frozenset({cpu}))
