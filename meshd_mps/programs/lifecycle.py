"""A program's life as asked for: load, upgrade in place, unload; and the end of them all, a
close (every program halted and unloaded) or a detach (live restore: left running).

An upgrade prepares the new image first (in MPS mode that includes the preload into a pooled
worker, while the old version keeps running), then halts the old one through its slot and starts
the new one on the same slot, as a new generation of the same program."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from meshd_mps.base.errors import AlreadyLoaded, ManifestError, MeshError, Unavailable, UpgradeMismatch
from meshd_mps.base.restart import Policy
from meshd_mps.base.restore import Restore
from meshd_mps.gpu.compiler import Manifest
from meshd_mps.programs.data import Recorded
from meshd_mps.programs.program import Program, ProgramState, Run

if TYPE_CHECKING:
    from meshd_mps.programs.data import DataSource
    from meshd_mps.programs.launching import Launching
    from meshd_mps.programs.recovery import Recovery
    from meshd_mps.programs.registry import Registry

log = structlog.get_logger("meshd_mps")


def manifest_of(manifest: Manifest | bytes | str | Mapping[str, Any]) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else Manifest.parse(manifest)


class Lifecycle:
    def __init__(self, reg: Registry, launching: Launching, recovery: Recovery):
        self.reg = reg
        self.launching = launching
        self.recovery = recovery

    async def load(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, hash: int | None,
                   nodes: int, device: int | None, restart: Policy | str | None, slot: int | None,
                   restore: Restore | str = Restore.RELOAD, data: DataSource | None = None) -> Program:
        """Compile, preload and launch on a free slot (``slot``: that one, a restore's), on GPU
        ``device`` (None: the placement's choice); ``restart``: its restart policy (None: the
        default of these Programs); ``hash``: the image hash it must have (None: any);
        ``restore``: what the daemon's next start does with it (restore.py); ``data``: its data
        (programs/data.py), stored before anything else, checked against the GPU's free memory."""
        reg, b = self.reg, self.reg.b
        m = manifest_of(manifest)
        pol = reg.restart if restart is None else Policy.parse(restart)
        mode = Restore.parse(restore)
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise ManifestError(f"{m.name}: nodes {nodes!r}: a count of blocks expected")
        if m.name in reg.by_name:  # at once, not behind a load that holds the lock (checked again under it)
            raise AlreadyLoaded(m.name)
        ops = self.launching.data
        if not isinstance(data, Recorded) and m.name in reg.data.owners:  # a new program's: none of an earlier one's
            await anyio.to_thread.run_sync(reg.data.forget, m.name)
        pd = await ops.resolve(m, data)  # stored (or found) before the lock: a large file takes a while
        async with reg.lock:
            if reg.closing:
                raise Unavailable(f"{m.name}: meshd-mps is shutting down: no program is loaded now")
            if m.name in reg.by_name:
                raise AlreadyLoaded(m.name)
            slot = reg.free_slot(slot)
            gpu = reg.place(device)
            used = reg.used(gpu)
            b.admit(gpu, m.name, nodes, used)  # every limit, before anything changes
            await ops.check_fits(gpu, m.name, pd)
            t0 = time.perf_counter()
            region = reg.payloads(m)
            try:
                img = await b.prepare(m, ptx, hash, device=gpu, new=True, payloads=region)
                try:
                    k, run = await self.launching.start(img, slot, nodes, used, pd)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await b.drop(img)
                    raise
            except BaseException:
                if region is not None:
                    region.close(forget=True)
                raise
            p = Program(m.name, slot, k, run, img.prepared.hash, nodes, compile_ms=img.prepared.compile_ms,
                        cached=img.prepared.cached, manifest=m, ptx=ptx, restart=pol, restore=mode, data=pd)
            self.recovery.install(p)
            reg.count_load(t0)
            log.info(f"program {m.name} loaded on slot {slot}, GPU {k.device}", program=m.name, pid=k.pid, slot=slot,
                     device=k.device)
            await reg.record(p)
            return p

    async def upgrade(self, name: str, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes,
                      hash: int | None, restart: Policy | str | None, data: DataSource | None = None) -> Program:
        """A new image on the program's slot, a new generation of it; its restart policy kept unless
        ``restart`` is given, and its failures forgotten (a crash-looping program comes back by an
        upgrade); its data and their writes kept unless ``data`` is other data (or the manifest
        asks for more memory)."""
        reg, b = self.reg, self.reg.b
        m = manifest_of(manifest)
        pol = None if restart is None else Policy.parse(restart)
        if m.name != name:
            raise UpgradeMismatch(f"upgrade {name}: the manifest names {m.name!r}", program=name, field="name")
        ops = self.launching.data
        pd = await ops.resolve(m, data, reg.get(name).data)
        async with reg.lock:
            p = reg.get(name)
            used = reg.used(p.device, without=p)
            b.admit(p.device, name, p.nodes, used, new=False)
            await ops.check_fits(p.device, name, pd, placed=pd is p.data and b.isolation == "blink")
            t0 = time.perf_counter()
            # Its payload region kept where the sizes are the same; else a new one beside it, which
            # the new version maps while the old one runs on its own.
            old_region = p.kernel.payloads
            same = (old_region.layout if old_region is not None else None) == (m.layout if m.layout.size else None)
            region = old_region if same else reg.payloads(m)
            try:
                # MPS: loaded in a worker of the program's GPU while the old one runs, its data placed there too.
                img = await b.prepare(m, ptx, hash, device=p.device, payloads=region)
                stopped = False
                try:
                    if img.preloaded is not None:
                        await ops.place(img.preloaded.proc, name, p.slot, pd)
                    await self.launching.halt(p)
                    stopped = True
                    await b.unload(p.kernel)
                    k, run = await self.launching.start(img, p.slot, p.nodes, used, pd)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await b.drop(img)
                        if stopped:
                            await self._roll_back(p)
                    raise
            except BaseException:
                if region is not None and not same:
                    region.close(forget=True)
                raise
            old = p.data
            p.to(ProgramState.RUNNING, run=Run(k, run, img.prepared.hash, img.prepared.compile_ms, img.prepared.cached,
                                               m, ptx), upgraded=True, restart=pol, data=pd)
            if old_region is not None and not same:  # its old kernel is unloaded: nobody maps it any more
                old_region.close(forget=True)
            self.recovery.install(p)
            reg.count_load(t0)
            log.info(f"program {name} upgraded on slot {p.slot}", program=name, pid=k.pid)
            await reg.record(p)
        await ops.dropped(name, old, pd)
        return p

    async def _roll_back(self, old: Program) -> None:
        """A failed upgrade loses nothing: the old version is started again on its slot.  A rollback
        of one upgrade, here and now: not ``state/desired.restore``, which brings a whole desired
        state back at a daemon's start."""
        try:
            await self.recovery.relaunch(old)
            log.info(f"program {old.name}: upgrade failed; the old version runs again", program=old.name)
        except BaseException as e:  # reported, and the upgrade's own error is raised
            self.reg.by_name.pop(old.name, None)
            log.error(f"program {old.name}: upgrade failed and the old version did not restart: {e}", program=old.name)

    async def unload(self, name: str) -> None:
        reg = self.reg
        async with reg.lock:
            p = reg.get(name)
            await self.launching.halt(p)
            del reg.by_name[name]
            await reg.b.unload(p.kernel)
            # Its kernel has ended: the slot keeps no word of it (a kernel may return without writing
            # EXITED), so a next meshd-mps adopting this mailbox (live restore) finds nothing running
            # there to halt and wait 5 s for.
            reg.b.mailbox.reset_slot(p.slot)
            await reg.b.free(p.kernel.proc, p.slot)  # blink: the context keeps a slot's data until now
            if p.kernel.payloads is not None:
                p.kernel.payloads.close(forget=True)
            log.info(f"program {name} unloaded from slot {p.slot}", program=name)
            await reg.forget(name)
        await self.launching.data.forget(name, p.data)

    # ---- the end --------------------------------------------------------------------------------
    async def close(self) -> None:
        """Every program halted (briefly) and unloaded, before the backend closes."""
        reg, b = self.reg, self.reg.b
        async with self._last():
            progs = list(reg.by_name.values())
            for p in progs:  # all halted first: in blink mode the unloads then halt nobody
                b.mailbox.halt(p.slot)
            for p in progs:
                try:
                    await self.launching.halt(p, within=reg.d.close_halt)
                except MeshError as e:
                    log.error(f"program {p.name}: {e}")
            for p in progs:
                try:
                    await b.unload(p.kernel)
                except MeshError as e:
                    log.error(f"program {p.name}: {e}")
                if p.kernel.payloads is not None:  # unmapped here; a worker that still maps it keeps its pages
                    p.kernel.payloads.close(forget=True)
            reg.by_name.clear()

    async def detach(self) -> None:
        """Live restore's stop: the programs are forgotten here, never halted; their workers run on
        for the next meshd-mps (Backend.detach)."""
        async with self._last():
            n = len(self.reg.by_name)
            for p in self.reg.by_name.values():  # unmapped here; the file stays for the next meshd-mps
                if p.kernel.payloads is not None:
                    p.kernel.payloads.close()
            self.reg.by_name.clear()
        log.info(f"{n} programs left running for the next meshd-mps")

    @contextlib.asynccontextmanager
    async def _last(self) -> AsyncIterator[None]:
        """Closing, shielded: nothing starts from now on (``closing``), and the block runs under
        the lock once the load, upgrade or relaunch under way has ended (each bounded by its own
        deadlines, all by ``recover`` here), so that what it installs is closed with the rest."""
        reg = self.reg
        reg.closing = True
        with anyio.CancelScope(shield=True):
            locked = False
            with anyio.move_on_after(reg.d.recover):
                await reg.lock.acquire()
                locked = True
            if not locked:
                log.error(f"programs: a load, upgrade or relaunch still held the lock {reg.d.recover:g}s into the"
                          " close; closing without it")
            try:
                yield
            finally:
                if locked:
                    reg.lock.release()
