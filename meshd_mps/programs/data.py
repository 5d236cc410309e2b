"""A program's data as ``Programs`` handles it (docs/program-abi.md, "Data"): what a load or an
upgrade asks for, checked against the GPU's free memory before anything runs; placed in the
worker that runs the program before its launch (a relaunch or an upgrade in a worker that holds
it already copies nothing); written while the kernel runs, never halting it or anything else.

A write goes to the program's own file first (datastore.py), then to its worker's region (WRITE,
on the worker's own stream), and once that copy is complete the slot's DATA_SEQ is increased: the
program reads DATA_SEQ (an acquire) before the data it covers.  A write to a program whose worker
does not hold its data now (it is being relaunched, say) is kept in its file and placed with the
rest at its next launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import anyio
import structlog

from meshd_mps.base.errors import DataTooLarge, NoData, WorkerError, WriteOutOfRange
from meshd_mps.programs.datastore import DataSpec, ProgramData
from meshd_mps.protocol import abi

if TYPE_CHECKING:
    from meshd_mps.gpu.compiler import Manifest
    from meshd_mps.programs.registry import Registry
    from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")


@dataclass(frozen=True)
class DataRef:
    """Data this daemon holds already, by its SHA-256 (an upload's, ``POST /v1/data``)."""

    key: str


@dataclass(frozen=True)
class Recorded:
    """A program's data as its record says (a restore's): the spec, and whether it was written
    (then its own file holds it, and a restore without that file fails)."""

    spec: DataSpec
    written: bool = False

    @classmethod
    def from_dict(cls, d: Any) -> Recorded:
        return cls(DataSpec.from_dict(d), bool(d.get("written", False)))


#: What a load or an upgrade may be given as its data: a path (read as the caller), bytes, a
#: binary file, data held already (``DataRef``), or a record's (a restore's).
DataSource = str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes] | DataRef | Recorded


@dataclass(frozen=True)
class Written:
    """A write's outcome: ``seq`` the slot's DATA_SEQ after it (None: not on the device yet: the
    program's worker does not hold its data now, and gets it with the write at its next launch)."""

    name: str
    offset: int
    bytes: int
    seq: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"program": self.name, "offset": self.offset, "bytes": self.bytes, "seq": self.seq}


class Data:
    def __init__(self, reg: Registry):
        self.reg = reg

    # ---- what a load or an upgrade asks for -------------------------------------------------------
    async def resolve(self, m: Manifest, given: DataSource | None, old: ProgramData | None = None) -> ProgramData | None:
        """The data a load (``old`` None) or an upgrade of a program holding ``old`` runs with:
        ``given`` stored (off the loop) or looked up, at least the manifest's ``data_bytes``; an
        upgrade given nothing keeps ``old`` unless its manifest asks for more memory; given the same
        data, it keeps ``old`` and its writes."""
        store = self.reg.data
        if given is None:
            if old is not None:
                if m.data_bytes <= old.spec.alloc:
                    return old
                return ProgramData(DataSpec(old.spec.key, old.spec.size, m.data_bytes))
            return ProgramData(DataSpec(None, 0, m.data_bytes)) if m.data_bytes else None
        if isinstance(given, Recorded):  # a record's: once written, its own file holds its writes
            return ProgramData(given.spec, written=given.written)
        if isinstance(given, DataRef):
            spec = await anyio.to_thread.run_sync(store.spec, given.key)
        else:
            spec = await anyio.to_thread.run_sync(store.ingest, given)
        alloc = max(spec.size, m.data_bytes)
        if not alloc:
            return None
        if old is not None and old.spec.key == spec.key and old.spec.alloc == alloc:
            return old
        return ProgramData(DataSpec(spec.key, spec.size, alloc))

    async def check_fits(self, device: int, name: str, d: ProgramData | None, placed: bool = False) -> None:
        """DataTooLarge unless ``d`` fits GPU ``device``'s free memory (``placed``: it is there
        already, in the worker that keeps it: nothing more is needed)."""
        if d is None or placed:
            return
        mem = await self.reg.b.free_memory(device)
        if mem is None:
            return
        total, free = mem
        if d.spec.alloc > free:
            raise DataTooLarge(f"{name}: its data needs {d.spec.alloc} bytes of GPU {device}'s memory, which has {free} of"
                               f" {total} bytes free: it does not fit (nothing was loaded)", have=free, asked=d.spec.alloc,
                               device=device, program=name)

    # ---- in a worker --------------------------------------------------------------------------------
    async def place(self, proc: WorkerProc, name: str, slot: int, d: ProgramData | None) -> None:
        """Before a launch in ``proc`` on ``slot``: the program's data there (copied in unless it
        holds it already); without data, a region the slot had there freed."""
        b = self.reg.b
        if d is None:
            await b.free(proc, slot)
            return
        async with d.lock:
            if b.holds(proc, slot, d.token):
                return
            path, n = await anyio.to_thread.run_sync(self.reg.data.source, name, d)
            await b.place(proc, slot, d.token, d.spec.alloc, n, path)

    async def write(self, name: str, offset: int, data: bytes) -> Written:
        """``data`` into the running program's data at ``offset`` (Programs.write)."""
        reg = self.reg
        p = reg.get(name)
        d = p.data
        if d is None:
            raise NoData(name)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + len(data) > d.spec.alloc:
            raise WriteOutOfRange(f"program {name}: a write of {len(data)} bytes at offset {offset} is past the end of its"
                                  f" {d.spec.alloc} bytes of data", program=name, offset=offset, bytes=len(data),
                                  size=d.spec.alloc)
        async with d.lock:
            p = reg.get(name)
            if p.data is not d:  # upgraded to other data meanwhile: the write was for the old
                raise NoData(name) if p.data is None else WriteOutOfRange(
                    f"program {name}: its data changed (an upgrade) while the write waited", program=name, offset=offset,
                    bytes=len(data), size=p.data.spec.alloc)
            before, first = d.token, not d.written
            await anyio.to_thread.run_sync(reg.data.write, name, d, offset, data)
            d.writes += 1
            if first:  # its data is its own file from now on: recorded, so that a restore looks for it there
                await reg.record(p)
            proc = p.kernel.proc
            if not reg.b.holds(proc, p.slot, before) or proc.dead:
                return Written(name, offset, len(data), None)
            try:
                await reg.b.write(proc, p.slot, offset, data, d.token)
            except WorkerError as e:  # its worker died under it: kept in its file, placed at its relaunch
                log.warning(f"program {name}: a write not copied to its worker ({e}); it is kept and placed at the"
                            " program's next launch", program=name)
                return Written(name, offset, len(data), None)
            mb = reg.b.mailbox
            seq = (mb.u32(p.slot, abi.DATA_SEQ) + 1) & 0xFFFFFFFF
            mb.set_u32(p.slot, abi.DATA_SEQ, seq)  # after the copy: the program reads it before the data
            return Written(name, offset, len(data), seq)

    # ---- gone ---------------------------------------------------------------------------------------
    async def forget(self, name: str, d: ProgramData | None) -> None:
        """An unloaded (or upgraded) program's own file removed, and what no program or record holds
        collected; nothing to do for a program without data."""
        if d is None:
            return
        await anyio.to_thread.run_sync(self.reg.data.forget, name)
        await self.collect()

    async def dropped(self, name: str, old: ProgramData | None, new: ProgramData | None) -> None:
        """After an upgrade to other data: the old data's own file removed, unless the new data
        has written its own there since (a write takes the new data's lock: held here meanwhile)."""
        if old is None or old is new:
            return
        async with old.lock:
            if new is None:
                await self.forget(name, old)
                return
            async with new.lock:
                if not new.written:
                    await anyio.to_thread.run_sync(self.reg.data.forget, name)
        await self.collect()

    async def collect(self) -> None:
        reg = self.reg
        keep: set[str] = {p.data.spec.key for p in reg.by_name.values() if p.data is not None and p.data.spec.key}
        names: set[str] = {p.name for p in reg.by_name.values() if p.data is not None and p.data.written}
        if reg.recorder is not None:
            kept = reg.recorder.data_kept()
            keep |= set(kept.keys)
            names |= set(kept.names)
        gone = await anyio.to_thread.run_sync(reg.data.gc, keep, names)
        if gone:
            log.debug(f"data: removed {len(gone)} files no program holds", files=gone)

