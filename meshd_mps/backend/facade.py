"""The CUDA backend in either mode, for an asyncio host: ``await Backend.open()``, or
``async with Backend.open() as b``.

Its surface mirrors the seed's backend ops: caps, isolation, the
mailbox, prepare (compile and, in MPS mode, preload), load, launch with an
awaitable completion, query, unload, close.  Each op is that of its GPU's
:class:`~meshd_mps.isolation.base.Isolation` (blink or MPS, chosen once at
open): the backend finds the GPU and delegates.

Several GPUs (``devices``, default every visible one): in MPS mode one control
daemon for the host and a pool per GPU; in blink mode one context per GPU.
Every image and kernel carries its ``device``; ``prepare`` puts an image on
the GPU named, else on the least loaded one.  ``info``, ``caps`` and
``compiler`` are the first GPU's (what a one-GPU caller has always used);
``infos``, ``device_caps`` and ``compilers`` hold every GPU's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import anyio
import structlog

from meshd_mps.backend import leftovers
from meshd_mps.backend.data import DataRegions
from meshd_mps.backend.inventory import inventory
from meshd_mps.backend.leftovers import live_mailbox, live_paths
from meshd_mps.backend.native import NativeClients
from meshd_mps.backend.opening import Opening
from meshd_mps.base import defaults
from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import ConfigError, MailboxError, NotServedHere, Unavailable
from meshd_mps.base.faults import Stray
from meshd_mps.base.log import setup_logging
from meshd_mps.gpu.compiler import Compiler, Manifest
from meshd_mps.gpu.device import Caps, DeviceInfo, check_driver, check_unique, ordinals_text
from meshd_mps.isolation import limits
from meshd_mps.isolation.base import Admit, BlinkStats, Evidence, Found, Image, Isolation, Kernel, Mode
from meshd_mps.isolation.blink import Blink, last_blink_ms
from meshd_mps.isolation.launch import Launch
from meshd_mps.isolation.mps import Mps
from meshd_mps.isolation.preflight import preflight
from meshd_mps.mps.clients import MAX_CLIENTS
from meshd_mps.mps.control import ControlDaemon
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.payloads import Region
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

IsolationName = Literal["blink", "mps"]


class Backend(NativeClients, DataRegions):
    def __init__(self, isolation: IsolationName, sms: int, mps_dir: str | None, pool: int, gpu: str,
                 cache_dir: str | None, deadlines: Deadlines, max_clients: int, devices: Sequence[int] | None = None,
                 live: str | None = None, clear: str | None = None):
        if isolation not in ("blink", "mps"):
            raise ConfigError(f"isolation {isolation!r}: expected blink or mps")
        if gpu not in ("cuda", "sim"):
            raise ConfigError(f"gpu {gpu!r}: expected cuda or sim")
        if sms < 0 or pool < 0:
            raise ConfigError("sms and pool must not be negative")
        self._asked = None if devices is None else check_unique(devices)  # that they exist: at open
        self.isolation: IsolationName = isolation
        self.sms = sms
        self.gpu = gpu
        self._mps_dir = mps_dir
        self._pool_n = pool
        self._cache_dir = cache_dir
        self._max_clients = max_clients
        self.sup = Supervisor(deadlines)
        #: Live restore: the directory (the state dir's) that holds what outlives us: the mailbox
        #: file, the MPS directory and the workers' sockets (``live_paths``); None: nothing does.
        self.live = live
        self._clear = clear
        self.mailbox = live_mailbox(live_paths(live).mailbox) if live is not None else Mailbox.create()
        #: The simulated GPU's idle kernels wait on their slots' doorbells (protocol/doorbell.py);
        #: a GPU's poll, and nothing rings.
        self.mailbox.doorbell = gpu == "sim"
        #: Live restore: the modules the adopted workers hold, for the programs to take or halt.
        self.found: list[Found] = []
        #: Live restore: what adoption did with each worker left, for status and the log.
        self.adoption: dict[str, list[int]] = {}
        #: The mode's host-wide part, which holds each GPU's isolation (made at open).
        self.mode: Mode | None = None
        self._mps: Mps | None = None  # the same, in MPS mode
        self.devices: tuple[int, ...] = ()  # the GPUs driven, ascending (known once open)
        self.infos: dict[int, DeviceInfo] = {}
        self.device_caps: dict[int, Caps] = {}
        self.compilers: dict[int, Compiler] = {}
        self._closed = False

    @classmethod
    def open(cls, *, isolation: IsolationName = defaults.ISOLATION, sms: int = defaults.SMS, mps_dir: str | None = None,
             pool: int = 0, gpu: str = defaults.GPU, cache_dir: str | None = None, deadlines: Deadlines = Deadlines(),
             max_clients: int = MAX_CLIENTS, devices: Sequence[int] | None = None, live: str | None = None,
             clear: str | None = None) -> Opening[Backend]:
        """Start the backend: in MPS mode the private daemon and the pools first.  ``devices``: the
        GPUs to drive (CUDA ordinals; None: every visible one); ``pool`` idle workers per GPU.
        ``live``: a directory of ours (the state dir) where the workers, the mailbox and the MPS
        daemon outlive the backend (``detach``), and where the next open adopts them (``found``).
        ``clear``: such a directory, whose leftovers are halted and ended at open (a start without
        live restore after one with it).  ``await`` it, or enter it with ``async with`` (:class:`Opening`)."""

        def make() -> Backend:
            if not structlog.is_configured():
                setup_logging()  # structlog's default is stdout: a host's output is not ours to fill
            return cls(isolation, sms, mps_dir, pool, gpu, cache_dir, deadlines, max_clients, devices, live, clear)

        return Opening(make)

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _choose(self) -> Mode:
        """The one place the mode is chosen: its host-wide part, which makes every GPU's isolation."""
        paths = live_paths(self.live) if self.live is not None else None
        listen = paths.workers if paths is not None else None
        if self.isolation == "mps":
            mps_dir = self._mps_dir or (paths.mps if paths is not None else None)
            self._mps = Mps.under(mps_dir, self.sup, self.mailbox.path, self.sms, self.gpu, self._pool_n,
                                  self._max_clients, listen)
            return self._mps
        return Blink(self.sup, self.mailbox, self.sms, self.gpu, listen)

    async def _open(self) -> None:
        if self.gpu == "cuda":  # first, whatever the isolation: no MPS daemon started for a machine without one
            check_driver()
        if self._clear is not None:
            await leftovers.clear_left(self.sup, self._clear)
        self.mode = self._choose()
        await self.mode.start()
        inv = await inventory(self.gpu, self._asked, self.sms, self._cache_dir)
        self.devices, self.infos, self.device_caps, self.compilers = inv.devices, inv.infos, inv.caps, inv.compilers
        adopted: dict[int, list[WorkerProc]] = {}
        if self.live is not None:
            adoption = await leftovers.adopt(self.sup, self.mailbox, self.live, self.devices, self.mode.keeps_workers)
            self.adoption, adopted = adoption.report, adoption.kept
        await self.mode.open(self.devices, adopted)
        self.found = [f for g in self.isolations.values() for f in g.found]

    # ---- each GPU's isolation -------------------------------------------------------------
    @property
    def isolations(self) -> dict[int, Isolation]:
        """Each GPU's isolation, by ordinal (none before open)."""
        return self.mode.gpus if self.mode is not None else {}

    def _on(self, device: int | None) -> Isolation:
        return self.isolations[self.device_or_first(device)]

    @property
    def mps(self) -> Mps | None:
        """MPS mode's host-wide part (the daemon, client checks, each GPU's pool); None in blink mode."""
        return self._mps

    @property
    def daemon(self) -> ControlDaemon | None:
        """MPS mode: the private control daemon."""
        mps = self.mps
        return None if mps is None else mps.daemon

    # ---- the first GPU's, for one-GPU callers ----------------------------------------------
    @property
    def info(self) -> DeviceInfo | None:
        return self.infos.get(self.devices[0]) if self.devices else None

    @property
    def caps(self) -> Caps | None:
        return self.device_caps.get(self.devices[0]) if self.devices else None

    @property
    def compiler(self) -> Compiler | None:
        return self.compilers.get(self.devices[0]) if self.devices else None

    @compiler.setter
    def compiler(self, c: Compiler) -> None:
        """Replaces the first GPU's compiler, and every GPU's that shared it (the bench's cold cache)."""
        old = self.compiler
        for d in self.devices:
            if self.compilers[d] is old:
                self.compilers[d] = c

    # ---- placement ------------------------------------------------------------------------
    def device_or_first(self, device: int | None) -> int:
        """``device`` checked to be one of ours; None: the first."""
        if device is None:
            if not self.devices:
                raise Unavailable("backend not open")
            return self.devices[0]
        if isinstance(device, bool) or not isinstance(device, int) or device not in self.devices:
            raise NotServedHere(f"GPU {device!r} is not served here (devices {ordinals_text(self.devices)})",
                                device=device, devices=self.devices)
        return device

    def load_of(self, device: int) -> int:
        """Images on ``device``: MPS, its workers that are not idle in the pool; blink, its context's modules."""
        g = self.isolations.get(device)
        return g.load_count() if g is not None else 0

    def least_loaded(self, load: Mapping[int, int] | None = None) -> int:
        """The GPU with the least ``load`` (default: ``load_of``); ties go to the lowest ordinal."""
        if not self.devices:
            raise Unavailable("backend not open")
        count = (lambda d: load.get(d, 0)) if load is not None else self.load_of
        return min(self.devices, key=lambda d: (count(d), d))

    # ---- the seed's backend ops ------------------------------------------------------------
    def mailbox_dev(self, device: int | None = None) -> int:
        """The mailbox's device address in GPU ``device``'s shared context (default: the first);
        0 in MPS mode (each worker has its own)."""
        return self._on(device).mailbox_dev() if self.isolations else 0

    async def stack_limit(self, set_to: int | None = None, device: int | None = None) -> int | None:
        """GPU ``device``'s shared context's stack limit in bytes per thread (set first if asked;
        default: the first GPU; setting it is a blink); None in MPS mode, where each worker's
        context is its own (the seed's SIZE_MAX, set a no-op)."""
        return await self._on(device).stack_limit(set_to)

    def _compiler(self, device: int) -> Compiler:
        c = self.compilers.get(device)
        if c is None or self._closed:
            raise Unavailable("backend closed")
        return c

    async def prepare(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, hash: int | None = None,
                      device: int | None = None, new: bool = False, payloads: Region | None = None) -> Image:
        """Checks, PTX -> cubin (cached), and in MPS mode the preload into a worker; on GPU
        ``device``, else on the least loaded one (``least_loaded``).  ``hash``: the image hash the
        caller requires (HashMismatch otherwise).  ``new``: a new program's (MPS: not into the
        pool's reserve, which upgrades and relaunches take).  ``payloads``: the program's payload
        region (backend/payloads.py), which ``load`` has its worker map."""
        if self._closed or not self.devices:
            raise Unavailable("backend closed")
        d = self.least_loaded() if device is None else self.device_or_first(device)
        p = await self._compiler(d).prepare(manifest, ptx, hash)
        preflight(p, self.gpu, self.infos[d])  # before any worker sees it: in blink mode a load halts them all
        img = await self.isolations[d].prepare(p, new)
        img.payloads = payloads
        return img

    def admit(self, device: int, name: str, nodes: int, used: float, new: bool = True) -> None:
        """Before anything changes: CapacityError if GPU ``device`` cannot take a program of
        ``nodes`` blocks beside its programs (whose shares of its blocks add up to ``used``);
        ``new``: one more program (an upgrade or relaunch takes its predecessor's place)."""
        d = self.device_or_first(device)
        if new:
            self.isolations[d].check_room(name)
        info = self.infos[d]
        limits.check_nodes(name, nodes, info, info.sms_total, used)

    def not_started_why(self, device: int) -> str:
        """The likely reasons a launched kernel does not start, in this mode, in words."""
        return self._on(device).not_started_why()

    async def load(self, img: Image, admit: Admit | None = None) -> Kernel:
        """The image's module, ready to launch.  ``admit`` sees what the worker reported (its
        occupancy, its context's SMs) and raises to refuse it; a refused module is unloaded (in
        blink mode within the load's own blink)."""
        return await self._on(img.device).load(img, admit)

    async def launch(self, k: Kernel, slot: int, nodes: int = 1) -> Launch:
        """``mesh_main(mailbox_dev, slot)`` on ``nodes`` blocks; await the result for its DONE."""
        if not 0 <= slot < abi.SLOTS:
            raise MailboxError(f"{k.name}: slot {slot} out of range 0..{abi.SLOTS - 1}")
        self.mailbox.run(slot)
        return await k.isolation.launch(k, slot, nodes)

    def query(self, k: Kernel) -> bool:
        """The last launch finished; WorkerError (naming the program) on a stream error or a death."""
        return k.isolation.query(k)

    async def unload(self, k: Kernel) -> None:
        """MPS: the worker back to the pool (UNLOAD, its program data freed) or retired; blink: the
        module unloaded (a blink; the slot's data stays: backend/data.py)."""
        if self._mps is not None and not k.unloaded:
            await self.free(k.proc)
        await k.isolation.unload(k)

    async def abandon(self, k: Kernel, slot: int) -> None:
        """A launch given up before its kernel started: HALT on its slot, so that it returns at
        once should it start; its module unloaded.  MPS: a worker whose kernel does not return
        is retired (the server ends its context first); blink: in one blink, which halts the
        kernels it may be queued behind."""
        self.mailbox.halt(slot)
        if self._mps is not None and not k.unloaded:
            await self.free(k.proc)
        await k.isolation.abandon(k, slot)

    async def drop(self, img: Image) -> None:
        """An image prepared but never loaded: its worker goes back (its program data freed first)."""
        if img.preloaded is not None:
            await self.free(img.preloaded.proc)
        await self._on(img.device).drop(img)

    def retire_stuck(self, k: Kernel) -> bool:
        """A kernel that did not halt: True if its worker was retired for it (MPS), False if it
        cannot be (blink: the context is every program's)."""
        return k.isolation.retire_stuck(k)

    # ---- a fault of one GPU ---------------------------------------------------------------
    async def teardown(self, device: int, ahead: int = 0) -> list[WorkerProc]:
        """After a fault of GPU ``device``: every worker of it retired (MPS: its programs' and its
        pool's; blink: its context), awaited within ``recover``, while the workers for ``ahead``
        lost programs start (held: no context yet); the workers retired."""
        return await self._on(device).teardown(ahead)

    async def refill(self, device: int, extra: int = 0) -> bool:
        """After ``teardown``, once GPU ``device`` takes workers again: what ``extra`` lost programs
        need (MPS: a worker each, the pool refilled once they are back; blink: the new context),
        within ``recover``; False if not (logged)."""
        return await self._on(device).refill(extra)

    # ---- a fault's evidence, in one call --------------------------------------------------
    async def evidence(self, device: int, ours: Collection[int] = (), wait: float = 0.0) -> Evidence:
        """GPU ``device``'s evidence about a failure: the server log's culprits (watched for up to
        ``wait`` seconds until one shows: the server writes its line within milliseconds of the
        fault), the strays that are none of ``ours`` (pids), and whether every failure is the GPU's."""
        return await self._on(device).evidence(ours, wait)

    def took(self, device: int, stray: Stray) -> None:
        """``stray`` was named a fault's culprit: a later fault does not name it again."""
        self._on(device).took(stray)

    async def ahead(self, loads: Mapping[int, int]) -> None:
        """Before a start launches any program: what ``loads`` (new programs by GPU) need, made on
        every GPU at once (MPS: their workers), so that none is made once programs run."""
        try:
            async with anyio.create_task_group() as tg:
                for d, n in loads.items():
                    if n and d in self.isolations:
                        tg.start_soon(self.isolations[d].ahead, n)
        except ExceptionGroup as e:
            raise e.exceptions[0] from e

    def keep_reserve(self, device: int) -> None:
        """After a launch on GPU ``device``: its pool's reserve refilled, paced, if it is short."""
        self._on(device).keep_reserve()

    def settled(self) -> None:
        """The start's restore is done: what ``ahead`` or an adoption kept for it and no load took
        goes to each GPU's pool."""
        for g in self.isolations.values():
            g.settled()

    def recovered(self, device: int) -> None:
        """GPU ``device``'s lost programs are back (MPS: its pool refills now, paced)."""
        self._on(device).recovered()

    def first_context_at(self, device: int) -> float:
        """When GPU ``device`` last took a new context after a fault (perf_counter; 0: not since)."""
        return self._on(device).first_context_at

    def take(self, f: Found, manifest: Manifest | None) -> Kernel:
        """An adopted module (live restore) taken as a kernel: ``manifest`` None, to be unloaded."""
        return f.isolation.take(f, manifest)

    # ---- what the layers above use of the supervisor ----------------------------------------
    @property
    def deadlines(self) -> Deadlines:
        """The one deadline table, as handed to ``open``."""
        return self.sup.deadlines

    @property
    def closed(self) -> bool:
        """Closing or closed (detached too): its workers end, by no fault of anyone's."""
        return self._closed or self.sup.closed

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> None:
        """A task in the backend's task group (the supervisor's), ended with it."""
        self.sup.start_soon(fn, *args, name=name)

    # ---- state ----------------------------------------------------------------------------
    def device_status(self, d: int) -> dict[str, Any]:
        """One GPU's part of ``status()``: its caps, workers, pool (MPS) or context and blinks (blink)."""
        caps = self.device_caps.get(d)
        s: dict[str, Any] = {"device": d, "name": caps.name if caps else None,
                             "caps": caps.__dict__ if caps else None, "images": self.load_of(d)}
        g = self.isolations.get(d)
        if g is not None:
            s.update(g.status(), capacity=g.capacity())
        return s

    def last_blink_ms(self) -> float | None:
        """Blink mode: the length of the latest blink on any GPU (None before the first)."""
        return last_blink_ms(self.isolations.values())

    def blink_stats(self) -> dict[int, BlinkStats]:
        """Each GPU's blinks, of those whose module changes halt their programs (blink mode; none in MPS mode)."""
        return {d: s for d, g in sorted(self.isolations.items()) if (s := g.blink_stats()) is not None}

    def status(self) -> dict[str, Any]:
        """The first GPU's caps and context at the top (as on a one-GPU host), every GPU's under ``devices``;
        ``pool`` and ``pool_cap`` count every GPU's."""
        s: dict[str, Any] = {
            "isolation": self.isolation,
            "gpu": self.gpu,
            "caps": self.caps.__dict__ if self.caps else None,
            "workers": self.sup.live(),
            "retired": self.sup.retired,
            "devices": [self.device_status(d) for d in self.devices],
        }
        if self.mode is not None:
            s.update(self.mode.status())
        return s

    async def _give_up(self) -> None:
        """A failed open: closed, or (live restore, with programs adopted) detached, so that they run on."""
        if self.live is not None and any(g.found for g in self.isolations.values()):
            await self.detach()
        else:
            await self.close()

    async def detach(self) -> list[int]:
        """Live restore's stop: nothing halted or killed; every worker on its socket (pooled ones
        too), the MPS daemon and the mailbox file are left running for the next ``open(live=...)``
        to adopt.  The detached workers' pids."""
        if self._closed:
            return []
        if self.live is None:
            raise ConfigError("detach: this backend was opened without live=DIR; nothing of it can outlive it")
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                for g in self.isolations.values():
                    g.detach()
                pids = await self.sup.detach()  # re-raises what a task of its group raised
                if self.mode is not None:
                    await self.mode.detach()
        finally:
            self.mailbox.close()
        return pids

    async def close(self) -> None:
        """Every worker killed and reaped, then the daemon quit; nothing is left behind."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                for g in self.isolations.values():
                    await g.close()
                try:
                    await self.sup.close()  # re-raises what a task of its group raised
                finally:
                    if self.mode is not None:
                        await self.mode.close()
        finally:
            self.mailbox.close()
            if self.live is not None:  # nothing runs on it any more: not left in shared memory
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.mailbox.path)
