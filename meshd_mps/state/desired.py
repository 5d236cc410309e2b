"""The desired state kept as the programs change, and brought back at start.

``Recorder`` writes every successful load, upgrade and unload into the :class:`Store` before the
request is answered (off the event loop: each write is fsynced).  ``restore`` runs at ``serve``'s
start, before it reports ready: with live restore the modules the adopted workers hold are
reconciled with the records first (``unwanted``: adopted as they run, or halted and unloaded);
a recorded program loaded with restore ``adopt`` (restore.py: the fleet's replicas, which Ray may
have placed elsewhere meanwhile) that was not adopted is left, its record dropped (``left``); every
other recorded program not adopted is loaded again on its slot and GPU, with its restart policy,
then every program the config file declares and the state lacks (or holds a record of that could
not be brought back); a program that no longer loads is reported and skipped, never blocking the others.  A record wins over a
declared program of the same name: it is the latest an operator did (an upgrade through the API,
say), the declaration only says that the program is wanted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from meshd_mps.base.errors import MeshError
from meshd_mps.base.restore import LEFT, Restore
from meshd_mps.gpu.compiler import Manifest
from meshd_mps.isolation.base import Found
from meshd_mps.programs import FaultReport, Program, Programs
from meshd_mps.programs.data import Recorded
from meshd_mps.programs.datastore import Kept
from meshd_mps.protocol import abi
from meshd_mps.state.config import DeclaredProgram
from meshd_mps.state.history import History, Launched
from meshd_mps.state.store import ProgramRecord, Store

log = structlog.get_logger("meshd_mps")


class Recorder:
    """Programs' successful changes, into ``store`` (``programs.Recorder``, the Protocol that
    Programs calls)."""

    def __init__(self, store: Store):
        self.store = store

    async def loaded(self, p: Program) -> None:
        """A load or an upgrade: the program as it runs now."""
        assert p.manifest is not None
        rec = ProgramRecord.of(p.name, p.manifest.as_dict(), p.ptx, slot=p.slot, nodes=p.nodes,
                               device=p.device, hash=p.hash, restart=p.restart.value, restore=p.restore.value,
                               data={**p.data.spec.as_dict(), "written": p.data.written} if p.data else None)
        await anyio.to_thread.run_sync(self.store.record, rec, p.ptx)

    async def unloaded(self, name: str) -> None:
        await anyio.to_thread.run_sync(self.store.forget, name)

    def data_kept(self) -> Kept:
        """The data every record names (one not loaded now too: the next start loads it)."""
        recs = [r for r in self.store.programs().values() if r.data is not None]
        return Kept([k for r in recs if (k := (r.data or {}).get("key"))], [r.name for r in recs])

    async def history(self, programs: Sequence[Program], faults: Sequence[FaultReport]) -> None:
        """Each program's launch (its wall time, worker, restarts) and the recent fault reports, for
        the next daemon's live restore (state/history.py)."""
        h = History({p.name: Launched(p.started_wall, p.kernel.pid, p.restarts) for p in programs},
                    [f.as_dict() for f in faults])
        await anyio.to_thread.run_sync(self.store.keep_history, h)


@dataclass
class Restored:
    """What ``restore`` did, for the log and ``status``."""

    adopted: list[str] = field(default_factory=list)  # live restore: recorded programs taken over as they ran
    restored: list[str] = field(default_factory=list)  # recorded programs loaded and launched again
    declared: list[str] = field(default_factory=list)  # declared in the config file, loaded anew
    halted: list[dict[str, Any]] = field(default_factory=list)  # live restore: modules found and not wanted
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it is not running
    left: dict[str, str] = field(default_factory=dict)  # restore adopt, not running: name -> why, its record dropped

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: A declared program's load body (``state.program_files.program_body``), its CUDA C compiled for
#: the GPU; a MeshError (ProgramFilesError) says why there is none.
Body = Callable[[DeclaredProgram], dict[str, Any]]


def unwanted(f: Found, rec: ProgramRecord | None, taken: set[str]) -> str:
    """Why the adopted module ``f`` is not the recorded program ``rec`` as it should run ("": it
    is, and is adopted).  A record is written before a load or upgrade is answered, so a module
    that differs from it is a change that was never answered: rolled back."""
    if rec is None:
        return "no record names it (unloaded, or a load that was never answered)"
    if f.name in taken:
        return "a second copy of an adopted program"
    if f.tag != int(rec.hash, 16):
        return f"image {f.tag:016x}, the record's is {rec.hash} (an upgrade that was never answered)"
    if f.launch is None or not f.launch.running:
        return "loaded, not running (a load that was never answered, or a kernel that ended meanwhile): reloaded"
    if (f.launch.slot, f.launch.nodes, f.device) != (rec.slot, rec.nodes, rec.device):
        return (f"slot {f.launch.slot}, {f.launch.nodes} nodes on GPU {f.device}; the record's: slot {rec.slot},"
                f" {rec.nodes} nodes on GPU {rec.device}")
    if f.module.info.rt_abi != abi.RT_ABI:
        return f"program ABI {f.module.info.rt_abi}, this meshd-mps runs {abi.RT_ABI}"
    return ""


async def restore(programs: Programs, store: Store, declared: Sequence[DeclaredProgram], body: Body,
                  found: Sequence[Found] = ()) -> Restored:
    """Reconcile: the adopted modules (live restore, ``found``) that match their records taken over
    as they run, those that do not halted and unloaded; then every recorded program not adopted
    loaded again on its slot, then the declared ones the state lacks.  An adopted program keeps its
    launch time and restart count, and the daemon the fault reports, as the last daemon kept them
    (``Store.history``)."""
    out = Restored()
    kept = await anyio.to_thread.run_sync(store.history) if found else History()
    if found:
        programs.carry_over(_reports(kept))
    for name, why in store.skipped.items():  # records the store could not use (logged by it)
        out.skipped[name] = why
    records = store.programs()
    keep: list[tuple[Found, ProgramRecord]] = []
    drop: list[tuple[Found, str]] = []
    taken: set[str] = set()
    for f in found:
        rec = records.get(f.name)
        why = unwanted(f, rec, taken)
        if why:
            drop.append((f, why))
        else:
            assert rec is not None
            keep.append((f, rec))
            taken.add(f.name)
    for f, rec in keep:  # first: in blink mode each unload below is a blink, which must halt them too
        try:
            ptx = await anyio.to_thread.run_sync(store.ptx, rec)
            seen = kept.programs.get(f.name)
            if seen is not None and seen.pid != f.module.proc.pid:
                seen = None  # another launch's (a relaunch the last daemon did not live to keep)
            await programs.adopt(f, Manifest.parse(rec.manifest), ptx, int(rec.hash, 16), rec.nodes, rec.restart,
                                 started_wall=seen.started_at if seen else None, restarts=seen.restarts if seen else 0,
                                 restore=rec.restore, data=_data(rec))
            out.adopted.append(rec.name)
        except MeshError as e:
            drop.append((f, f"not adopted: {e}"))
    for f, why in drop:  # before any load: a slot they run on may be a record's
        entry = {"program": f.name, "pid": f.module.proc.pid, "slot": f.launch.slot if f.launch else None, "why": why}
        try:
            await programs.discard(f, why)
        except MeshError as e:
            entry["error"] = str(e)
            log.error(f"restore: {f.name} on worker {f.module.proc.pid} not discarded: {e}", program=f.name)
        out.halted.append(entry)
    records = await _leave(programs, store, records, out)
    # Every worker the loads below need made first, at once: no MPS client is made once they run.
    wanted: list[int | None] = [r.device for r in records.values() if r.name not in programs.by_name]
    wanted += [d.device for d in declared if d.name not in programs.by_name and d.name not in records]
    try:
        await programs.ahead(wanted)
    except MeshError as e:  # each load then makes its own, or is refused, as it would be
        log.error(f"restore: the workers for {len(wanted)} loads not made ahead: {e}")
    try:
        await _load_all(programs, store, declared, body, records, out)
    finally:
        programs.settled()
    log.info(f"restore: {len(out.adopted)} adopted, {len(out.restored)} recorded and {len(out.declared)} declared"
             f" programs loaded, {len(out.halted)} halted, {len(out.skipped)} skipped, {len(out.left)} left",
             adopted=out.adopted, restored=out.restored, declared=out.declared, halted=out.halted, skipped=out.skipped,
             left=out.left)
    return out


async def _leave(programs: Programs, store: Store, records: dict[str, ProgramRecord],
                 out: Restored) -> dict[str, ProgramRecord]:
    """The records of restore ``adopt`` programs that were not adopted dropped (whoever loaded
    them places them again, maybe elsewhere by now: loaded here too, they would run twice); the
    records left to load.  A record that cannot be dropped is not loaded either (logged)."""
    keep: dict[str, ProgramRecord] = {}
    for name, rec in records.items():
        if name in programs.by_name or rec.restore != Restore.ADOPT.value:
            keep[name] = rec
            continue
        out.left[name] = LEFT
        try:
            await anyio.to_thread.run_sync(store.forget, name)
        except MeshError as e:  # StateIOError: the next start leaves it again
            log.error(f"restore: program {name}: its record not dropped: {e}", program=name)
        log.info(f"restore: program {name} not loaded again: {LEFT}", program=name)
    return keep


async def _load_all(programs: Programs, store: Store, declared: Sequence[DeclaredProgram], body: Body,
                    records: dict[str, ProgramRecord], out: Restored) -> None:
    """Every recorded program not adopted loaded again on its slot, then the declared ones the
    state lacks."""
    for rec in sorted(records.values(), key=lambda r: r.slot):
        if rec.name in programs.by_name:
            continue
        try:
            ptx = await anyio.to_thread.run_sync(store.ptx, rec)
            await programs.load(rec.manifest, ptx, int(rec.hash, 16), rec.nodes, rec.device, rec.restart, slot=rec.slot,
                                data=_data(rec))
            out.restored.append(rec.name)
        except MeshError as e:
            out.skipped[rec.name] = str(e)
            log.error(f"restore: program {rec.name} (slot {rec.slot}, GPU {rec.device}) not restored: {e}",
                      program=rec.name)
    for d in declared:
        if d.name in programs.by_name:
            continue
        # A record that could not be brought back (its PTX damaged, say) leaves the declaration: the
        # program is still wanted, and its own files may load where the record's copy did not.
        unused = out.skipped.pop(d.name, None)
        try:
            b = await anyio.to_thread.run_sync(body, d)  # its files read, CUDA C compiled: ProgramFilesError
            want = None if d.hash is None else int(d.hash, 16)
            await programs.load(b["manifest"], b["ptx"].encode(), want, d.nodes or 1, d.device, d.restart,
                                data=b.get("data_file"))
            out.declared.append(d.name)
            if unused is not None:
                log.warning(f"restore: program {d.name} loaded from its declaration (config line {d.line}), not from its"
                            f" record: {unused}", program=d.name)
        except MeshError as e:
            out.skipped[d.name] = str(e) if unused is None else f"{unused}; from its declaration: {e}"
            # A refusal of the user's program (as a refused load is), not a failure of the daemon's.
            log.warning(f"restore: declared program {d.name} (config line {d.line}) not loaded: {e}", program=d.name)


def _data(rec: ProgramRecord) -> Recorded | None:
    return None if rec.data is None else Recorded.from_dict(rec.data)


def _reports(h: History) -> list[FaultReport]:
    """The fault reports kept, those that can be read (a damaged one is logged and left out)."""
    out: list[FaultReport] = []
    for d in h.faults:
        try:
            out.append(FaultReport.from_dict(d))
        except (TypeError, ValueError) as e:
            log.warning(f"restore: a fault report kept by the last daemon not carried over: {e}")
    return out
