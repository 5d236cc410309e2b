"""MPS mode: each program in a worker process of its own, an MPS client of the host's private
daemon.  :class:`Mps` is the mode's host-wide part (the daemon and its clients,
:class:`~meshd_mps.mps.clients.Clients`, shared by every GPU); :class:`MpsIsolation` one GPU's.

Creating an MPS client stalls every running client once and takes ~120 ms, a load into an
existing one stalls nobody: so each GPU keeps a pool of idle workers, started before any
program runs (``prewarm``), and ``prepare`` loads an image into one of them (``preload``)
while the programs already there go on running.  No client is created by surprise
(docs/operations.md, "The pool"): a load leaves the pool's reserve to upgrades (``preload``),
a start makes its workers before it launches any (``ahead``), an adopting start makes none.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from meshd_mps.base.errors import (
    CapacityError,
    DeviceError,
    FrameError,
    ImageRefused,
    MeshError,
    NoContext,
    WorkerError,
    WorkerGone,
)
from meshd_mps.base.faults import Stray
from meshd_mps.gpu.compiler import Prepared
from meshd_mps.isolation.base import Admit, Evidence, Image, Isolation, Kernel, Mode, Module
from meshd_mps.isolation.mps_evidence import ServerEvidence
from meshd_mps.isolation.refill import Refill
from meshd_mps.mps.clients import MAX_CLIENTS, Clients, NewClient, pids_debug, stall_estimate_us
from meshd_mps.mps.control import ControlDaemon
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Load, Loaded, Op
from meshd_mps.supervision.pool import Pool, ready
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")


@dataclass(eq=False)
class MpsModule(Module):
    """One image's module in its own MPS client process (its one module, 0)."""

    fresh: bool = False  # spawned for it, not taken from the pool

    @property
    def device(self) -> int:
        """The GPU its context is on."""
        return self.proc.device


class MpsIsolation(Isolation):
    """One GPU's pool of idle workers, and the programs' own workers there."""

    def __init__(self, mps: Mps, device: int):
        super().__init__(mps.sup, device)
        self.mps = mps
        self.pool = Pool(mps.pool_cap, mps.sup.retire)
        self.proof = ServerEvidence(mps, self.sup, device)  # a fault's evidence (the server's log)
        self.paced = Refill(mps.sup, self.pool, device, functools.partial(self.prewarm, 1, hold=True))
        self._closing = False
        self._held: list[WorkerProc] = []  # started during a fault's teardown, no context yet (--hold)
        # Made ahead for programs about to be launched (a fault's lost ones, a start's restored ones, an
        # adopting start's idle ones past the pool): taken before the pool.  Not the pool's reserve.
        self._reserve: list[WorkerProc] = []
        self._warming: list[list[WorkerProc]] = []  # each prewarm's workers, started and not yet pooled or kept
        mps.sup.exit_hooks.append(self._exited)

    async def open(self, adopted: Sequence[WorkerProc] = ()) -> None:
        """The pool prewarmed; with ``adopted`` workers (live restore) it is what they left idle, and
        no client is made: each stalls the running ones once, which the adopted programs' restart
        is not to cost them (bench (k)); one short of its reserve is refilled paced (``settled``)."""
        if adopted:
            await self._adopt(adopted)
        else:
            await self.prewarm(self.pool.cap)

    async def _adopt(self, procs: Sequence[WorkerProc]) -> None:
        """Live restore, creating no MPS client: each adopted worker that is a client of our server
        already is asked READY (else retired: one without a context, held or still starting when
        the last daemon stopped, would create its client at its READY); one that holds no module
        goes to the pool (past its cap: kept for the restore's loads, ``settled``), the others'
        modules are ``found``, for the programs to take or halt."""
        server, clients = await self.mps.client_list()
        ours: list[WorkerProc] = []
        for p in procs:
            if p.pid not in clients:
                log.warning(f"mps: adopted worker {p.pid} is no client of our server {server} (no context yet: held, or"
                            " starting when the last daemon stopped); retiring it unasked, which creates no client",
                            pid=p.pid)
                self.sup.retire(p, before_exit=False)
                continue
            try:
                await ready(p)
                ours.append(p)
            except MeshError as e:
                log.error(f"mps: adopted worker {p.pid}: {e}; retiring it", pid=p.pid)
                self.sup.retire(p, before_exit=False)
        if server is not None:
            self.mps.note_clients(server, clients)
        for p in ours:
            assert p.hello is not None
            self.mps.took(p)
            if p.hello.modules:
                self.found += self.found_in(p, functools.partial(_worker_of, p))
            else:
                self.pool.add(p) if len(self.pool) < self.pool.cap else self._reserve.append(p)
        log.info(f"mps: GPU {self.device}: adopted {len(ours)} workers: {len(self.found)} modules, {len(self.pool)}"
                 f" pooled, {len(self._reserve)} more idle", found=[f.name for f in self.found], pool=self.pool.pids())

    # ---- workers ----------------------------------------------------------------------------
    async def prewarm(self, n: int, into: list[WorkerProc] | None = None, again: bool = False,
                      hold: bool = False) -> None:
        """n workers (the held ones first, then fresh ones), READY all, verified as our clients,
        then pooled (or put ``into`` a list of the caller's); all or none.  ``again``: a READY
        refused (NoContext: the server takes no clients yet) is asked again until the caller's
        deadline.  ``hold``: fresh ones started held too, their clients created at their READY."""
        if n == 0:
            return
        d = self.device
        self.mps.daemon.check_alive()
        t0 = time.monotonic()
        procs: list[WorkerProc] = []
        self._warming.append(procs)  # no image: not counted by load_count while they start
        try:
            while self._held and len(procs) < n:
                procs.append(self._held.pop())
            held = len(procs)
            while len(procs) < n:
                procs.append(await self.mps.spawn(None, d, hold=hold))
            held = held if not hold else n
            first = 0.0

            async def made(p: WorkerProc) -> None:
                nonlocal first
                while True:
                    try:
                        await ready(p)
                        break
                    except NoContext:
                        if not again:
                            raise
                    await anyio.sleep(0.01)
                first = first or time.perf_counter()

            async with anyio.create_task_group() as tg:
                for p in procs:
                    tg.start_soon(made, p)
            self.first_context_at = first
            self.mps.created += held  # their READY made their contexts
            await self.mps.check_clients([p.pid for p in procs])
        except BaseException as e:
            for p in procs:
                self.sup.retire(p)
            if isinstance(e, ExceptionGroup):
                raise e.exceptions[0] from e
            raise
        finally:
            self._warming.remove(procs)
        for p in procs:
            self.pool.add(p) if into is None else into.append(p)
        log.info(f"mps: {'pool of ' if into is None else ''}{n} idle workers {pids_debug([p.pid for p in procs])} on GPU {d}"
                 f" ready in {(time.monotonic() - t0) * 1e3:.0f} ms")

    async def preload(self, name: str, cubin: bytes, threads: int, smem: int, scratch: int, tag: int = 0,
                      new: bool = False) -> MpsModule:
        """The image's module loaded in a pooled worker if one is fit, else in a fresh one: an MPS
        client made now, said in the log and ``new_client``.  ``new`` (a new program's load): never
        the pool's reserve, which an upgrade takes (``keep_reserve`` refills it if need be)."""
        d = self.device
        self.mps.daemon.check_alive()  # a pooled worker would fail its LOAD, a fresh one its check
        t0 = time.monotonic()
        req = Load(0, threads, smem, scratch, name, cubin, tag)
        while True:
            p = self._reserve.pop(0) if self._reserve else self.pool.take(load=new)
            fresh, new_client = p is None, None
            if p is None:
                new_client = NewClient(n := self.mps.count_clients(d) + 1, stall_estimate_us(n))
                p = await self.mps.spawn(name, d)
            p.program = name
            try:
                payload = await p.ask(Op.LOAD, req.encode())
                info = Loaded.decode_ok(payload)
                break
            except ImageRefused as e:
                # The image's fault, not the worker's: a pooled one (verified, still fit) goes back.
                p.program = None
                if fresh or len(self.pool) >= self.pool.cap:
                    self.sup.retire(p)
                else:
                    self.pool.add(p)
                raise e.prefixed(f"load {name}") from e
            except (WorkerError, FrameError) as e:
                self.sup.retire(p)
                if fresh or not isinstance(e, WorkerGone):
                    raise e.prefixed("load") from e
                # A pooled worker that died while idle (not yet seen dead): try the next one.  One
                # that is alive but misbehaved (no reply, garbage) is not retried: a hang would
                # cost the caller a second load deadline.
                log.info(f"mps: pooled worker {p.pid} was gone ({e}); taking another", pid=p.pid)
            except BaseException:
                # Cancelled (a caller's timeout, the API's drain): its LOAD is written and loads all
                # the same, so it is no pooled worker any more; neither pooled nor kept, it would
                # hold a client of the server for ever.
                self.sup.retire(p)
                raise
        w = MpsModule(name, p, 0, info, fresh, new_client=new_client)
        try:
            if self.mps.sms and self.mps.sms != info.sms:
                raise DeviceError(f"load: the worker's green context has {info.sms} SMs, not {self.mps.sms}")
            if fresh:
                await self.mps.check_clients([p.pid])
        except BaseException:
            # Not verified as our client, or not the context asked for: retired, never pooled, so
            # that no later load takes it unchecked.
            self.sup.retire(p)
            raise
        if new_client is not None:
            log.warning(f"mps: program {name}: a new MPS client (worker {p.pid}) made at its load, the pool of GPU {d}"
                        f" being down to {len(self.pool)} idle (its reserve {self.pool.reserve}): it stalls each running"
                        f" program there once, ~{new_client.stall_us:.0f} us at {new_client.clients} clients (an"
                        " estimate)", pid=p.pid, program=name, device=d, new_client=new_client.as_dict())
        log.info(
            f"mps: worker {p.pid} ({'new' if fresh else 'pooled'}) on GPU {d} for {name}: module loaded, mailbox at device"
            f" 0x{info.dev:x}, {info.sms} SMs, in {(time.monotonic() - t0) * 1e3:.1f} ms",
            pid=p.pid,
            program=name,
        )
        return w

    async def give_back(self, w: Module) -> bool:
        """Back to the pool with UNLOAD, unless unfit or the pool is full (then retired); True if kept."""
        return await self.pool.give_back(w.proc, w.module)

    # ---- the isolation ----------------------------------------------------------------------
    def capacity(self) -> int:
        """The server's clients less the pool's (kept for the next loads and upgrades) and the
        native clients'."""
        return self.mps.max_clients - self.pool.cap - len(self.mps.native)

    def check_room(self, name: str) -> None:
        """CapacityError unless this GPU takes one more program (``capacity``)."""
        m, d = self.mps, self.device
        busy = self.load_count()
        have = self.capacity()
        if busy >= have:
            gpu = "" if len(m.gpus) <= 1 else f" of GPU {d}"
            raise CapacityError(
                f"{name}: the MPS server{gpu} takes {m.max_clients} clients (CUDA 13.0); {busy} programs,"
                f" {len(m.native)} native clients and a pool of {self.pool.cap} leave no room for another",
                limit="MPS clients", have=have, asked=busy + 1)

    async def prepare(self, prepared: Prepared, new: bool = False) -> Image:
        m = prepared.manifest
        return Image(prepared, self.device,
                     await self.preload(m.name, prepared.cubin, m.threads, m.smem, m.scratch, prepared.hash, new))

    async def ahead(self, loads: int) -> int:
        """Before a start launches any program: workers for its ``loads``, taken by them first.  With
        programs running (adopted) the pool's are taken, its reserve too (refilled paced, ``settled``),
        so that none is made unless it must; else those beyond the pool's (its reserve left) are made
        now, in one batch, before anyone runs.  How many were made."""
        while self.load_count() and len(self._reserve) < loads and (w := self.pool.take()) is not None:
            self._reserve.append(w)
        make = max(0, loads - len(self._reserve) - self.pool.for_loads())
        if make:
            await self.prewarm(make, into=self._reserve)
            log.info(f"mps: GPU {self.device}: {make} workers made before any program is launched, for {loads}"
                     " loads", device=self.device)
        return make

    def settled(self) -> None:
        """The start's restore is done: the workers made or adopted for it and not taken go to the
        pool (past its cap: retired, which creates no client); a pool short of its reserve (adopted
        so) is refilled now, paced."""
        while self._reserve:
            w = self._reserve.pop()
            self.pool.add(w) if len(self.pool) < self.pool.cap else self.sup.retire(w)
        self.keep_reserve()

    async def load(self, img: Image, admit: Admit | None = None) -> Kernel:
        """The preloaded worker handed over."""
        w, img.preloaded = img.preloaded, None
        if w is None:
            raise MeshError("internal: an image prepared for the other isolation mode")
        k = Kernel(img.name, img.prepared.manifest, w, self, payloads=img.payloads)
        try:
            if admit is not None:
                admit(w.info)
            if img.payloads is not None:  # its own worker: no kernel of its context runs
                await self._map_payloads(img.name, w.proc, w.module, img.payloads)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.unload(k)
            raise
        await self._check_abi(k)
        return k

    async def _unload(self, k: Kernel) -> None:
        await self.give_back(k.module)

    async def _abandon(self, k: Kernel, slot: int) -> None:
        """A worker whose kernel does not return is retired (the server ends its context first)."""
        run = k.launch
        if run is not None and not run.finished():
            with anyio.move_on_after(self.sup.deadlines.launch):
                with contextlib.suppress(WorkerError):
                    await run.wait()
            if not run.finished():
                self.sup.retire(k.proc)
        await self._unload(k)

    async def drop(self, img: Image) -> None:
        w, img.preloaded = img.preloaded, None
        if w is not None:
            await self.give_back(w)

    def retire_stuck(self, k: Kernel) -> bool:
        if k.unloaded:
            return False
        self.sup.retire(k.proc)
        return True

    def not_started_why(self) -> str:
        return (f"its blocks wait for SMs that the other resident programs of GPU {self.device} hold, or the program"
                " does not set STATE = RUNNING when it starts (docs/program-abi.md)")

    def pooled(self) -> tuple[int, int]:
        return len(self.pool), self.pool.cap

    def reserve(self) -> tuple[int, int]:
        return self.pool.reserve_idle(), self.pool.reserve

    def keep_reserve(self) -> None:
        if len(self.pool) < self.pool.reserve and not self._closing:
            self.paced.ask(self.pool.reserve)

    def load_count(self) -> int:
        """Its workers that are not idle in the pool, kept for a fault's lost programs, or starting
        for either (a pooled worker's replacement is no image)."""
        idle = {w.pid for w in (*self._reserve, *self._held, *(w for b in self._warming for w in b))}
        idle.update(self.pool.pids())
        return sum(1 for p in self.mps.workers_on(self.device) if p not in idle)

    def status(self) -> dict[str, Any]:
        return {"workers": self.mps.workers_on(self.device), "pool": self.pool.pids(), "pool_cap": self.pool.cap,
                "pool_reserve": self.pool.reserve_idle(), "pool_reserve_cap": self.pool.reserve}

    # ---- a fault of the GPU -----------------------------------------------------------------
    async def teardown(self, ahead: int = 0) -> list[WorkerProc]:
        """MPS tore every client of this GPU down: every worker of it killed and reaped, the pool's
        too, without terminate_client (they are torn down already: on the H200 a terminate_client then
        hung and the server's teardown never ended), within ``recover``: the server takes no new
        client until they have exited, and a dead context has nothing to close.  Meanwhile
        ``ahead`` new workers start, held (imported, no context: the server takes no client until
        the torn-down ones have exited), for ``refill``, which waits for them: the teardown waits
        only for the old workers' exit (``hold_ahead`` says why)."""
        d = self.device
        self.first_context_at = 0.0
        torn = self.pool.drain() + self._reserve
        self._reserve = []
        torn += [w for w in self.mps.spawned_on(d) if w not in torn and w not in self._held]
        log.info(f"mps: GPU {d}: retiring its {len(torn)} workers after a fault", device=d)
        for w in torn:
            self.sup.retire(w, before_exit=False, at_once=True)
        self.hold_ahead(ahead - len(self._held), functools.partial(self.mps.spawn, None, d, hold=True),
                        self._keep_held)
        with anyio.move_on_after(self.sup.deadlines.recover):
            for w in torn:
                await w.process.wait()
        return torn

    def _keep_held(self, w: WorkerProc) -> None:
        """A worker started ahead of the refill, held for it; retired if the GPU is closing meanwhile."""
        if self._closing:
            self.sup.retire(w)
        else:
            self._held.append(w)

    async def refill(self, extra: int = 0) -> bool:
        """``extra`` workers (the lost programs' next ones, the held ones first) in one batch, once
        the server takes clients on this GPU again, retried within ``recover``; the pool is refilled
        after the lost programs are back (``recovered``).  False if the server took none in time
        (logged)."""
        d, within = self.device, self.sup.deadlines.recover
        want = max(0, min(extra, self.mps.max_clients - self.pool.cap))
        try:
            with anyio.fail_after(within):
                await self.held_started()
                while True:
                    try:
                        await self.prewarm(want, into=self._reserve, again=True)
                        break
                    except MeshError as e:
                        log.info(f"mps: after the fault, GPU {d} takes no new clients yet: {e}")
                        await anyio.sleep(0.05)
        except TimeoutError:
            log.error(f"mps: the server took no new clients on GPU {d} within {within:g}s of the fault")
            return False
        self.paced.last_client = time.monotonic()
        return True

    async def evidence(self, ours: Collection[int] = (), wait: float = 0.0) -> Evidence:
        return await self.proof.evidence(ours, wait)

    def took(self, stray: Stray) -> None:
        self.proof.took(stray)

    def died_on_its_own(self, k: Kernel) -> bool:
        return not k.unloaded and k.proc.died_on_its_own()

    def own_error(self, k: Kernel) -> str:
        return "" if k.unloaded else k.proc.err or ""

    def recovered(self) -> None:
        """The lost programs are back: the workers kept for them and not taken go to the pool (or
        are retired past its cap), and the pool refills in the background, paced."""
        while self._reserve:
            w = self._reserve.pop()
            self.pool.add(w) if len(self.pool) < self.pool.cap else self.sup.retire(w)
        self.paced.ask(self.pool.cap)

    # ---- a pooled worker's death --------------------------------------------------------------
    def _exited(self, w: WorkerProc) -> None:
        """A worker's stdout ended on its own: a pooled one is dropped from the pool at once (it
        is no longer counted in status, ps or the metrics) and replaced, paced."""
        if self._closing or not self.pool.remove(w):
            return
        log.warning(f"mps: pooled worker {w.pid} on GPU {self.device} died while idle; replacing it", pid=w.pid,
                    device=self.device)
        self.paced.ask(self.pool.cap)

    def detach(self) -> None:
        """The pool is not refilled any more; its workers, like every other, are left running, but
        the held ones (a recovery's, no context yet), whose READY at the next start would be a new client."""
        self._closing = self.paced.closing = True
        self.pool.drain()
        for w in self._held:
            self.sup.retire(w)
        self._reserve, self._held = [], []

    async def close(self) -> None:
        """The idle workers see EOF first (then the supervisor kills every worker)."""
        self._closing = self.paced.closing = True
        for w in self.pool.drain() + self._reserve + self._held:
            w.close_stdin()
        self._reserve, self._held = [], []


class Mps(Clients, Mode):
    """MPS mode's host-wide part: the daemon and our workers as its clients (:class:`Clients`, whose
    ``start``, ``close``, ``detach`` and ``keeps_workers`` are the mode's), and each GPU's
    :class:`MpsIsolation` (``gpus``), with ``pool_cap`` idle workers kept."""

    gpus: dict[int, MpsIsolation]  # type: ignore[assignment]

    def __init__(self, daemon: ControlDaemon, sup: Supervisor, mailbox: str, sms: int, gpu: str, pool_cap: int,
                 max_clients: int = MAX_CLIENTS, listen: str | None = None):
        Mode.__init__(self, sup)
        Clients.__init__(self, daemon, sup, mailbox, sms, gpu, max_clients, listen)
        self.pool_cap = pool_cap

    @classmethod
    def under(cls, mps_dir: str | None, sup: Supervisor, mailbox: str, sms: int, gpu: str, pool_cap: int,
              max_clients: int = MAX_CLIENTS, listen: str | None = None) -> Mps:
        """With a daemon of its own under ``mps_dir`` (None: a temporary directory, removed at close)."""
        d = mps_dir or tempfile.mkdtemp(prefix=f"meshd-mps.{os.getpid()}.")
        return cls(ControlDaemon(d, temporary=mps_dir is None, gpu=gpu), sup, mailbox, sms, gpu, pool_cap, max_clients, listen)

    def gpu_count(self) -> int:
        return len(self.gpus)

    def _make(self, device: int) -> MpsIsolation:
        return MpsIsolation(self, device)

    def status(self) -> dict[str, Any]:
        """Every GPU's pool together, the server and the daemon."""
        pools = [g.pool for g in self.gpus.values()]
        return {"pool": sorted(p for pool in pools for p in pool.pids()), "pool_cap": sum(pool.cap for pool in pools),
                "pool_reserve": sum(pool.reserve_idle() for pool in pools),
                "pool_reserve_cap": sum(pool.reserve for pool in pools), **self.daemon_status()}


def _worker_of(p: WorkerProc, hm: frames.HelloModule) -> MpsModule:
    return MpsModule(hm.name, p, hm.id, hm.info)
