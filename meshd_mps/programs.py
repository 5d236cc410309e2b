"""Named resident programs on mailbox slots: load, upgrade in place, unload, call.

The layer ``meshd-mps serve`` exposes.  An upgrade prepares the new image
first (in MPS mode that includes the preload into a pooled worker, while the
old version keeps running), then halts the old one through its slot and
starts the new one on the same slot.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from . import abi
from .backend import Backend, Image, Kernel
from .compiler import Manifest
from .errors import MeshError, WorkerError
from .frames import Done
from .launch import Launch

log = structlog.get_logger("meshd_mps")

HALT_S = 5.0
CALL_S = 5.0
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class ProgramError(MeshError):
    """A request about programs that cannot be carried out (unknown name, no free slot, ...)."""


@dataclass
class Program:
    name: str
    slot: int
    kernel: Kernel
    launch: Launch
    hash: int
    nodes: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    upgrades: int = 0
    compile_ms: float = 0.0
    cached: bool = False

    def state(self) -> tuple[str, str]:
        """(running | exited | failed, the error text if failed)."""
        if not self.launch.finished():
            return "running", ""
        f = self.launch.inner
        if f.cancelled():
            return "failed", "cancelled"
        e = f.exception()
        if e is not None:
            return "failed", str(e)
        d: Done = f.result()
        return ("exited", "") if d.ok else ("failed", d.message)


class Programs:
    def __init__(self, backend: Backend):
        self.b = backend
        self.by_name: dict[str, Program] = {}
        self._lock = anyio.Lock()  # one load/upgrade/unload at a time
        self.loads = 0
        self.load_ms: list[float] = []

    def _free_slot(self) -> int:
        used = {p.slot for p in self.by_name.values()}
        for s in range(abi.SLOTS):
            if s not in used:
                return s
        raise ProgramError(f"no free mailbox slot: all {abi.SLOTS} are in use")

    def get(self, name: str) -> Program:
        p = self.by_name.get(name)
        if p is None:
            raise ProgramError(f"program {name!r} is not loaded")
        return p

    @staticmethod
    def _manifest(manifest: Manifest | bytes | str | Mapping[str, Any]) -> Manifest:
        return manifest if isinstance(manifest, Manifest) else Manifest.parse(manifest)

    async def _start(self, img: Image, slot: int, nodes: int) -> tuple[Kernel, Launch]:
        k = await self.b.load(img)
        try:
            self.b.mailbox.reset_slot(slot)
            return k, await self.b.launch(k, slot, nodes)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.b.unload(k)
            raise

    async def load(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, expect: int | None = None,
                   nodes: int = 1) -> Program:
        m = self._manifest(manifest)
        if nodes < 1:
            raise ProgramError(f"{m.name}: nodes must be at least 1")
        async with self._lock:
            if m.name in self.by_name:
                raise ProgramError(f"program {m.name!r} is already loaded (upgrade it instead)")
            slot = self._free_slot()
            t0 = time.perf_counter()
            img = await self.b.prepare(m, ptx, expect)
            try:
                k, run = await self._start(img, slot, nodes)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.b.drop(img)
                raise
            p = Program(m.name, slot, k, run, img.prepared.hash, nodes, compile_ms=img.prepared.compile_ms, cached=img.prepared.cached)
            self.by_name[m.name] = p
            self._count(t0)
            log.info(f"program {m.name} loaded on slot {slot}", program=m.name, pid=k.pid, slot=slot)
            return p

    def _count(self, t0: float) -> None:
        self.loads += 1
        self.load_ms.append((time.perf_counter() - t0) * 1e3)
        del self.load_ms[:-1000]

    async def _halt(self, p: Program, within: float = HALT_S) -> None:
        """HALT through the slot and wait for the program's DONE; an MPS worker that
        does not stop is killed, since it would never be fit again."""
        if p.launch.finished():
            return
        self.b.mailbox.halt(p.slot)
        with anyio.move_on_after(within):
            try:
                await p.launch.wait()
            except WorkerError:
                pass
            return
        if p.kernel.worker is not None:
            log.error(f"program {p.name} did not halt in {within:g}s; retiring its worker", pid=p.kernel.pid)
            self.b.sup.retire(p.kernel.worker.proc)
            return
        raise ProgramError(f"program {p.name} did not halt within {within:g}s")

    async def upgrade(self, name: str, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes,
                      expect: int | None = None) -> Program:
        m = self._manifest(manifest)
        if m.name != name:
            raise ProgramError(f"upgrade {name}: the manifest names {m.name!r}")
        async with self._lock:
            old = self.get(name)
            t0 = time.perf_counter()
            img = await self.b.prepare(m, ptx, expect)  # MPS: loaded in a worker while the old one runs
            try:
                await self._halt(old)
                await self.b.unload(old.kernel)
                k, run = await self._start(img, old.slot, old.nodes)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.b.drop(img)
                    self.by_name.pop(name, None)
                raise
            p = Program(name, old.slot, k, run, img.prepared.hash, old.nodes, upgrades=old.upgrades + 1,
                        compile_ms=img.prepared.compile_ms, cached=img.prepared.cached)
            self.by_name[name] = p
            self._count(t0)
            log.info(f"program {name} upgraded on slot {p.slot}", program=name, pid=k.pid)
            return p

    async def unload(self, name: str) -> None:
        async with self._lock:
            p = self.get(name)
            await self._halt(p)
            del self.by_name[name]
            await self.b.unload(p.kernel)
            log.info(f"program {name} unloaded from slot {p.slot}", program=name)

    async def call(self, name: str, payload: bytes, within: float = CALL_S) -> bytes:
        """A request through the program's ring, and its response."""
        p = self.get(name)
        if p.launch.finished():
            raise ProgramError(f"program {name} is not running ({p.state()[0]})")
        seq = self.b.mailbox.post(p.slot, payload)
        delay = 20e-6
        with anyio.move_on_after(within):
            while True:
                got = self.b.mailbox.response(p.slot, seq)
                if got is not None:
                    return got
                if p.launch.finished():
                    raise ProgramError(f"program {name} ended before answering ({p.state()[1] or p.state()[0]})")
                await anyio.sleep(delay)  # the kernel answers in host memory: nothing to wait on but the word
                delay = min(delay * 2, 1e-3)
        raise ProgramError(f"program {name}: no response in {within:g}s")

    def describe(self, p: Program) -> dict[str, Any]:
        state, error = p.state()
        mb = self.b.mailbox
        return {
            "name": p.name,
            "slot": p.slot,
            "state": state,
            "error": error,
            "pid": p.kernel.pid or (self.b.blink.proc.pid if self.b.blink and self.b.blink.proc else 0),
            "heartbeat": mb.heartbeat(p.slot),
            "uptime_s": round(time.monotonic() - p.started, 3),
            "hash": f"{p.hash:016x}",
            "upgrades": p.upgrades,
            "regs": p.kernel.regs,
            "nodes": p.nodes,
        }

    def list(self) -> list[dict[str, Any]]:
        return [self.describe(p) for p in sorted(self.by_name.values(), key=lambda p: p.slot)]

    async def close(self) -> None:
        """Every program halted (briefly) and unloaded, before the backend closes."""
        with anyio.CancelScope(shield=True):
            for p in list(self.by_name.values()):
                try:
                    await self._halt(p, within=1.0)
                    await self.b.unload(p.kernel)
                except MeshError as e:
                    log.error(f"program {p.name}: {e}")
            self.by_name.clear()
