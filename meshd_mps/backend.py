"""The CUDA backend in either mode, for an asyncio host: ``await Backend.open()``, or
``async with Backend.open() as b``.

Its surface mirrors the seed's backend ops: caps, isolated / isolation, the
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
import dataclasses
import hashlib
import os
from collections.abc import Awaitable, Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import structlog

from meshd_mps.deadlines import Deadlines
from meshd_mps.errors import (
    ConfigError,
    MailboxError,
    MpsError,
    NotOurClient,
    NotServedHere,
    ProtocolMismatch,
    Unavailable,
    WorkerError,
    WorkerGone,
    WrongMode,
)
from meshd_mps.faults import Stray
from meshd_mps.gpu.compiler import Compiler, Manifest
from meshd_mps.gpu.device import (
    Caps,
    DeviceInfo,
    caps_of,
    check_sms,
    check_unique,
    choose_devices,
    device_count,
    ordinals_text,
    query_device,
    simulated_count,
    simulated_device,
)
from meshd_mps.isolation import limits
from meshd_mps.isolation.base import Admit, Found, Image, Isolation, Kernel, Mode
from meshd_mps.isolation.blink import Blink, last_blink_ms
from meshd_mps.isolation.launch import Launch
from meshd_mps.log import setup_logging
from meshd_mps.mps.clients import MAX_CLIENTS, Mps
from meshd_mps.mps.control import ControlDaemon, Owner
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

__all__ = ["Backend", "Evidence", "Found", "Image", "Kernel", "LivePaths", "Opening", "live_paths"]

log = structlog.get_logger("meshd_mps")

IsolationName = Literal["blink", "mps"]


#: Where the live-restore mailbox lives: shared memory (tmpfs).  The GPU maps the mailbox as host
#: memory (cuMemHostRegister), which the H200's driver refused for a regular file's pages
#: (CUDA_ERROR_INVALID_VALUE, 2026-12-03) and takes for shmem, as for today's memfd.
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Evidence:
    """What one GPU holds about a failure, read in one call (``Backend.evidence``) for faults.py to
    weigh: the mode's differences stay in its isolation."""

    #: The pids the MPS server logged as having hit a fatal error on that GPU, taken (a later look
    #: does not see them again); none where there is no server (blink).
    fatal_pids: list[int]
    #: Workers of that GPU, none of the caller's, that ended on their own with a kernel launched:
    #: the culprit where no program is (faults.name_culprit); ``Backend.took`` once one is named.
    strays: list[Stray]
    #: Every failure of a program's launch is its GPU's (blink: one context, whose error is
    #: sticky); False: whether it was a fault of the GPU is for the rest of the evidence to say.
    gpu_wide: bool


@dataclass(frozen=True)
class LivePaths:
    """What outlives the daemon for a live-restore directory (the state dir)."""

    mailbox: str  # the mailbox every worker maps: a file in SHM_DIR named after the state dir, this user's
    mps: str  # the MPS control daemon's directory (pipes, logs, its marker)
    workers: str  # each worker's <pid>.sock and <pid>.log


def live_paths(dir: str) -> LivePaths:
    d = os.path.abspath(dir)  # the workers compare the mailbox path they were given with ours
    tag = hashlib.sha256(os.fsencode(d)).hexdigest()[:16]
    return LivePaths(os.path.join(SHM_DIR, f"meshd-mps.{os.getuid()}.{tag}.mailbox"), os.path.join(d, "mps"),
                     os.path.join(d, "workers"))


def _live_mailbox(path: str) -> Mailbox:
    """The mailbox an earlier meshd-mps left (its kernels may run on it: its contents kept), else a
    new one."""
    if os.path.exists(path):
        try:
            return Mailbox.open(path)
        except MailboxError as e:
            log.warning(f"live restore: {e}; making a new one")
    return Mailbox.create(path)


class Opening:
    """What ``Backend.open`` returns.  Awaited: the open backend, its supervisor's task group in a
    task of its own (for a host that cannot nest; ``close`` ends it).  ``async with``: the group
    entered in the caller's task, so that a failure of one of its tasks reaches the caller, and the
    backend closed at the block's end.  Either way a failed open leaves nothing behind."""

    def __init__(self, make: Callable[[], Backend]):
        self._make = make
        self._b: Backend | None = None

    def __await__(self) -> Generator[Any, None, Backend]:
        return self._detached().__await__()

    async def _detached(self) -> Backend:
        b = self._make()
        try:
            await b.sup.start()
            await b._open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await b._give_up()
            raise
        return b

    async def __aenter__(self) -> Backend:
        b = self._b = self._make()
        await b.sup.__aenter__()
        try:
            await b._open()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await b._give_up()
            await self.__aexit__(type(e), e, e.__traceback__)
            raise
        return b

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        assert self._b is not None
        with anyio.CancelScope(shield=True):
            await self._b.close()
        if isinstance(exc, Exception):
            # The block's own error (or the open's) is raised as it is, not inside the group's
            # ExceptionGroup; a failure of the group's tasks still is (with it as the context).
            await self._b.sup.__aexit__(None, None, None)
            return False
        return await self._b.sup.__aexit__(typ, exc, tb)


class Backend:
    def __init__(self, isolation: IsolationName, sms: int, mps_dir: str | None, pool: int, gpu: str,
                 cache_dir: str | None, deadlines: Deadlines, max_clients: int, devices: Sequence[int] | None = None,
                 live: str | None = None, clear: str | None = None):
        if isolation not in ("blink", "mps"):
            raise ConfigError(f"--isolation {isolation}: expected blink or mps")
        if gpu not in ("cuda", "sim"):
            raise ConfigError(f"--gpu {gpu}: expected cuda or sim")
        if sms < 0 or pool < 0:
            raise ConfigError("--sms and --pool must not be negative")
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
        self.mailbox = _live_mailbox(live_paths(live).mailbox) if live is not None else Mailbox.create()
        #: Live restore: the modules the adopted workers hold, for the programs to take or halt.
        self.found: list[Found] = []
        #: Live restore: what adoption did with each worker left, for status and the log.
        self.adoption: dict[str, list[int]] = {}
        #: The mode's host-wide part, which holds each GPU's isolation (made at open).
        self.mode: Mode | None = None
        self.devices: tuple[int, ...] = ()  # the GPUs driven, ascending (known once open)
        self.infos: dict[int, DeviceInfo] = {}
        self.device_caps: dict[int, Caps] = {}
        self.compilers: dict[int, Compiler] = {}
        self._closed = False

    @classmethod
    def open(cls, *, isolation: IsolationName = "blink", sms: int = 0, mps_dir: str | None = None, pool: int = 0,
             gpu: str = "cuda", cache_dir: str | None = None, deadlines: Deadlines = Deadlines(),
             max_clients: int = MAX_CLIENTS, devices: Sequence[int] | None = None, live: str | None = None,
             clear: str | None = None) -> Opening:
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
            return Mps.under(mps_dir, self.sup, self.mailbox.path, self.sms, self.gpu, self._pool_n, self._max_clients,
                             listen)
        return Blink(self.sup, self.mailbox, self.sms, self.gpu, listen)

    async def _open(self) -> None:
        if self._clear is not None:
            await self._clear_left(self._clear)
        self.mode = self._choose()
        await self.mode.start()
        await self._devices()
        adopted = await self._adopt() if self.live is not None else {}
        await self.mode.open(self.devices, adopted)
        self.found = [f for g in self.isolations.values() for f in g.found]

    async def _adopt(self) -> dict[int, list[WorkerProc]]:
        """Live restore: every worker an earlier meshd-mps left on its socket, adopted (its HELLO:
        what it runs).  Those this backend cannot keep (another protocol version, another mailbox,
        a GPU not served here, clients of an MPS server that is gone) have their kernels halted
        through the mailbox and are told to QUIT; every slot that no kept worker runs on is zeroed.
        Each GPU's kept workers, for its isolation to take in."""
        assert self.mode is not None and self.live is not None
        d = live_paths(self.live).workers
        try:
            paths = sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".sock"))
        except FileNotFoundError:
            paths = []
        kept: list[WorkerProc] = []
        unwanted: list[WorkerProc] = []
        out: dict[str, list[int]] = {"adopted": [], "dismissed": [], "gone": []}
        for path in paths:
            try:
                w = await self.sup.adopt(path)
            except ProtocolMismatch as e:
                log.warning(f"live restore: {e}: its programs are reloaded", pid=e.pid, theirs=e.theirs, ours=e.ours)
                continue
            except WorkerError as e:  # gone, not ours (PeerMismatch), or no HELLO
                log.warning(f"live restore: {path}: {e}", pid=e.pid)
                if isinstance(e, WorkerGone):
                    out["gone"].append(e.pid or 0)
                continue
            if why := self._not_kept(w):
                log.warning(f"live restore: worker {w.pid} not kept: {why}", pid=w.pid)
                unwanted.append(w)
            else:
                kept.append(w)
        keep = {la.slot for w in kept for la in (w.hello.launches if w.hello else ()) if la.running}
        stale = [s for s in range(abi.SLOTS) if s not in keep and self.mailbox.u32(s, abi.STATE) == abi.RUNNING]
        if stale:
            await self._halt_slots(stale)
        for w in unwanted:
            self.sup.retire(w, before_exit=False)
        out["dismissed"] = [w.pid for w in unwanted] + await self.sup.dismiss()
        for s in range(abi.SLOTS):
            if s not in keep:
                self.mailbox.reset_slot(s)
        out["adopted"] = sorted(w.pid for w in kept)
        self.adoption = out
        by: dict[int, list[WorkerProc]] = {}
        for w in kept:
            by.setdefault(w.device, []).append(w)
        return by

    def _not_kept(self, w: WorkerProc) -> str:
        """Why an adopted worker cannot be kept ("": it can)."""
        assert self.mode is not None and w.hello is not None
        if not self.mode.keeps_workers:
            return "its MPS server is gone"
        if w.hello.mailbox != self.mailbox.path:
            return f"it maps mailbox {w.hello.mailbox}, not ours"
        if w.device not in self.devices:
            return f"its GPU {w.device} is not served here"
        return ""

    async def _halt_slots(self, slots: list[int], mailbox: Mailbox | None = None) -> None:
        """HALT on ``slots`` of ``mailbox`` (ours), whose kernels no worker of ours runs (left by
        workers we cannot keep), and their STATE awaited off RUNNING within ``halt``: they must not
        exit with a kernel running (under MPS that faults the GPU), nor share a slot with a new one."""
        mb = mailbox or self.mailbox
        for s in slots:
            mb.halt(s)
        within = self.sup.deadlines.halt
        with anyio.move_on_after(within):
            while any(mb.u32(s, abi.STATE) == abi.RUNNING for s in slots):
                await anyio.sleep(0.005)  # the kernels answer in host memory: nothing to await but the words
        left = [s for s in slots if mb.u32(s, abi.STATE) == abi.RUNNING]
        log.info(f"live restore: halted the kernels on slots {slots} that no adopted worker runs",
                 still_running=left)
        if left:
            log.error(f"live restore: slots {left} still RUNNING {within:g}s after HALT (no kernel answers there, or"
                      " one that ignores HALT); they are zeroed and reused", slots=left)

    async def _clear_left(self, dir: str) -> None:
        """Without live restore: what an earlier meshd-mps with live restore left under ``dir``
        (workers on sockets, their kernels, the MPS daemon, the mailbox file) halted and ended, so
        that nothing of it runs on unseen: kernels halted through that mailbox, workers told to
        QUIT (killed past ``retire_quit``), the daemon adopted and quit."""
        paths = live_paths(dir)
        try:
            socks = sorted(os.path.join(paths.workers, n) for n in os.listdir(paths.workers) if n.endswith(".sock"))
        except FileNotFoundError:
            socks = []
        mb = None
        if socks:
            try:
                mb = Mailbox.open(paths.mailbox)
            except MailboxError as e:
                log.error(f"left by live restore: {e}: its kernels cannot be halted")
        try:
            ws: list[WorkerProc] = []
            for path in socks:
                try:
                    ws.append(await self.sup.adopt(path))
                except WorkerError as e:  # ProtocolMismatch too: kept by the supervisor for dismiss
                    log.warning(f"left by live restore: {path}: {e}", pid=e.pid)
            if mb is not None:
                running = [s for s in range(abi.SLOTS) if mb.u32(s, abi.STATE) == abi.RUNNING]
                if running:
                    await self._halt_slots(running, mb)
            for w in ws:
                self.sup.retire(w, before_exit=False)
            dismissed = await self.sup.dismiss()
            d = self.sup.deadlines
            with anyio.move_on_after(d.retire_quit + d.retire_kill):
                for w in ws:
                    await w.process.wait()
            if ws or dismissed:
                log.warning(f"without --live-restore: {len(ws) + len(dismissed)} workers an earlier meshd-mps left"
                            f" running in {paths.workers} halted and ended", pids=[w.pid for w in ws] + dismissed)
        finally:
            if mb is not None:
                mb.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.mailbox)
        if Owner.read(paths.mps) is not None:  # a marker: a daemon of ours may run there
            left = ControlDaemon(paths.mps, temporary=False, deadlines=self.sup.deadlines)
            try:
                await left.adopt()
            except MpsError:
                return  # none runs there (or not ours to quit: its meshd-mps is alive)
            log.warning(f"without --live-restore: the MPS control daemon {left.pid} left in {paths.mps} quit")
            await left.quit()

    async def _devices(self) -> None:
        """Which GPUs (checked against those visible), their figures, caps and compilers."""
        if self.gpu == "sim":
            visible = simulated_count()
        else:
            visible = await anyio.to_thread.run_sync(device_count)
        self.devices = choose_devices(self._asked, visible)
        several = len(self.devices) > 1
        for d in self.devices:
            info = simulated_device(d) if self.gpu == "sim" else await anyio.to_thread.run_sync(query_device, d)
            check_sms(info, self.sms, f"GPU {d}" if several else "the device")
            self.infos[d] = info
            self.device_caps[d] = caps_of(info, self.sms)
            # GPUs of the same kind share one compiler, so one cubin cache: a JIT once per kind.
            same = next((c for c in self.compilers.values() if dataclasses.replace(c.info, ordinal=0)
                         == dataclasses.replace(info, ordinal=0)), None)
            self.compilers[d] = same or Compiler(info, self._cache_dir)
        log.info(f"GPUs {ordinals_text(self.devices)} of {visible} visible: "
                 + ", ".join(f"{d}: {self.infos[d].name} ({self.infos[d].arch}, {self.infos[d].sms_total} SMs)"
                             for d in self.devices))

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
        return self.mode.as_mps() if self.mode is not None else None

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
            raise NotServedHere(f"GPU {device!r} is not served here (--devices {ordinals_text(self.devices)})",
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
    @property
    def isolated(self) -> bool:
        return self.isolation == "mps"

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

    async def prepare(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, expect: int | None = None,
                      device: int | None = None) -> Image:
        """Checks, PTX -> cubin (cached), and in MPS mode the preload into a worker; on GPU
        ``device``, else on the least loaded one (``least_loaded``)."""
        if self._closed or not self.devices:
            raise Unavailable("backend closed")
        d = self.least_loaded() if device is None else self.device_or_first(device)
        p = await self._compiler(d).prepare(manifest, ptx, expect)
        return await self.isolations[d].prepare(p)

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
        """MPS: the worker back to the pool (UNLOAD) or retired; blink: the module unloaded (a blink)."""
        await k.isolation.unload(k)

    async def abandon(self, k: Kernel, slot: int) -> None:
        """A launch given up before its kernel started: HALT on its slot, so that it returns at
        once should it start; its module unloaded.  MPS: a worker whose kernel does not return
        is retired (the server ends its context first); blink: in one blink, which halts the
        kernels it may be queued behind."""
        self.mailbox.halt(slot)
        await k.isolation.abandon(k, slot)

    async def drop(self, img: Image) -> None:
        """An image prepared but never loaded: its worker goes back."""
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
        g = self._on(device)
        pids = g.fatal_pids()
        if not pids and wait > 0 and not g.shared_fate:
            with anyio.move_on_after(wait):
                while not (pids := g.fatal_pids()):
                    await anyio.sleep(0.02)
        return Evidence(pids, g.strays(set(ours)), g.shared_fate)

    def took(self, device: int, stray: Stray) -> None:
        """``stray`` was named a fault's culprit: a later fault does not name it again."""
        self._on(device).took(stray)

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

    # ---- native clients ---------------------------------------------------------------------
    def _mps_mode(self, what: str) -> Mps:
        mps = self.mps
        if mps is None:
            raise WrongMode(f"{what}: native clients join our MPS server; this backend runs --isolation {self.isolation}",
                            isolation=self.isolation)
        return mps

    def native_env(self) -> dict[str, str]:
        """The environment a CUDA process that is not one of our workers needs to join our MPS
        server as a native client (then register its pid: ``add_native``)."""
        return self._mps_mode("native env").native_env()

    async def add_native(self, pid: int) -> None:
        """Register ``pid`` as a native client: checked to be a client of our server (MpsError
        otherwise), then counted against the server's clients and not logged as foreign; dropped
        when it exits."""
        mps = self._mps_mode(f"native client {pid}")
        mps.daemon.check_alive()  # a dead daemon is ours to report (500), not the caller's pid
        try:
            await mps.check_native(pid)
        except MpsError as e:
            raise NotOurClient(f"native client {pid} not registered: {e} (start it with the environment of"
                               " `meshd-mps native`, and register it once its CUDA context exists)", pid=pid) from e

    def drop_native(self, pid: int) -> bool:
        """``pid`` no longer a native client of ours; False if it was not one."""
        return self._mps_mode(f"native client {pid}").drop_native(pid)

    def natives(self) -> list[int]:
        """The native clients that still run (none in blink mode)."""
        return sorted(self.mps.native) if self.mps is not None else []

    # ---- state ----------------------------------------------------------------------------
    def device_status(self, d: int) -> dict[str, Any]:
        """One GPU's part of ``status()``: its caps, workers, pool (MPS) or context and blinks (blink)."""
        caps = self.device_caps.get(d)
        s: dict[str, Any] = {"device": d, "name": caps.name if caps else None,
                             "caps": caps.__dict__ if caps else None, "images": self.load_of(d)}
        g = self.isolations.get(d)
        if g is not None:
            s.update(g.status())
        return s

    def last_blink_ms(self) -> float | None:
        """Blink mode: the length of the latest blink on any GPU (None before the first)."""
        return last_blink_ms(self.isolations.values())

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
