"""The desired state kept as the programs change, and brought back at start (issue 17).

``Recorder`` writes every successful load, upgrade and unload into the :class:`Store` before the
request is answered (off the event loop: each write is fsynced).  ``restore`` runs at ``serve``'s
start, before it reports ready: every recorded program is loaded again on its slot and GPU, with
its restart policy, then every program the config file declares and the state lacks; a program
that no longer loads is reported and skipped, never blocking the others.  A record wins over a
declared program of the same name: it is the latest an operator did (an upgrade through the API,
say), the declaration only says that the program is wanted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from meshd_mps.errors import MeshError
from meshd_mps.serving.client import ClientError
from meshd_mps.state.config import DeclaredProgram
from meshd_mps.state.store import ProgramRecord, Store

if TYPE_CHECKING:
    from meshd_mps.programs import Program, Programs

log = structlog.get_logger("meshd_mps")


class Recorder:
    """Programs' successful changes, into ``store``."""

    def __init__(self, store: Store):
        self.store = store

    async def loaded(self, p: Program) -> None:
        """A load or an upgrade: the program as it runs now."""
        assert p.manifest is not None
        rec = ProgramRecord.of(p.name, dataclasses.asdict(p.manifest), p.ptx, slot=p.slot, nodes=p.nodes,
                               device=p.device, hash=p.hash, restart=p.policy.value)
        await anyio.to_thread.run_sync(self.store.record, rec, p.ptx)

    async def unloaded(self, name: str) -> None:
        await anyio.to_thread.run_sync(self.store.forget, name)


@dataclass
class Restored:
    """What ``restore`` did, for the log and ``status``."""

    restored: list[str] = field(default_factory=list)  # recorded programs running again
    declared: list[str] = field(default_factory=list)  # declared in the config file, loaded anew
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it is not running

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: A declared program's load body (``serving.client.program_body``), its CUDA C compiled for the GPU.
Body = Callable[[DeclaredProgram], dict[str, Any]]


async def restore(programs: Programs, store: Store, declared: Sequence[DeclaredProgram], body: Body) -> Restored:
    """Every recorded program loaded again on its slot, then the declared ones the state lacks."""
    out = Restored()
    for name, why in store.skipped.items():  # records the store could not use (logged by it)
        out.skipped[name] = why
    for rec in sorted(store.programs().values(), key=lambda r: r.slot):
        try:
            ptx = await anyio.to_thread.run_sync(store.ptx, rec)
            await programs.load(rec.manifest, ptx, int(rec.hash, 16), rec.nodes, rec.device, rec.restart, slot=rec.slot)
            out.restored.append(rec.name)
        except MeshError as e:
            out.skipped[rec.name] = str(e)
            log.error(f"restore: program {rec.name} (slot {rec.slot}, GPU {rec.device}) not restored: {e}",
                      program=rec.name)
    for d in declared:
        if d.name in programs.by_name or d.name in out.skipped:
            continue
        try:
            b = await anyio.to_thread.run_sync(body, d)  # its files read, CUDA C compiled: ClientError
            expect = None if d.hash is None else int(d.hash, 16)
            await programs.load(b["manifest"], b["ptx"].encode(), expect, d.nodes or 1, d.device, d.restart)
            out.declared.append(d.name)
        except (MeshError, ClientError) as e:
            out.skipped[d.name] = str(e)
            log.error(f"restore: declared program {d.name} (config line {d.line}) not loaded: {e}", program=d.name)
    log.info(f"restore: {len(out.restored)} recorded and {len(out.declared)} declared programs running,"
             f" {len(out.skipped)} skipped", restored=out.restored, declared=out.declared, skipped=out.skipped)
    return out
