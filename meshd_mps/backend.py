"""The CUDA backend in either mode, for an asyncio host: ``await Backend.open()``.

Its surface mirrors the seed's backend ops: caps, isolated / resident /
isolation, the mailbox, prepare (compile and, in MPS mode, preload), load,
launch with an awaitable completion, query, unload, module scope, close.

Several GPUs (``devices``, default every visible one): in MPS mode one control
daemon for the host and a pool per GPU; in blink mode one context per GPU.
Every image and kernel carries its ``device``; ``prepare`` puts an image on
the GPU named, else on the least loaded one.  ``info``, ``caps`` and
``compiler`` are the first GPU's (what a one-GPU caller has always used);
``infos``, ``device_caps`` and ``compilers`` hold every GPU's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import structlog

from meshd_mps.protocol import abi, frames
from meshd_mps.isolation import limits
from meshd_mps.protocol.frames import Done, Loaded, Op
from meshd_mps.isolation.blink import BlinkContext, Module
from meshd_mps.gpu.compiler import Compiler, Manifest, Prepared
from meshd_mps.mps.control import PIPE_ENV, ControlDaemon
from meshd_mps.gpu.device import (Caps, DeviceInfo, caps_of, check_sms, check_unique, choose_devices, device_count, ordinals_text,
                     query_device, simulated_count, simulated_device)
from meshd_mps.errors import (AbiMismatch, ConfigError, DeviceError, MailboxError, MeshError, NotServedHere, Unavailable,
                              WorkerError)
from meshd_mps.isolation.launch import Launch
from meshd_mps.log import setup_logging
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.mps.clients import MAX_CLIENTS, Mps, Worker
from meshd_mps.mps.clients import launch as mps_launch
from meshd_mps.mps.clients import query as mps_query
from meshd_mps.deadlines import Deadlines
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

Isolation = Literal["blink", "mps"]


@dataclass
class Image:
    """A checked, compiled image (the seed's mesh_prepared); in MPS mode already
    loaded in a worker, so that ``load`` only hands it over."""

    prepared: Prepared
    worker: Worker | None = None
    device: int | None = None  # the GPU it is for (None: the backend's first)

    @property
    def name(self) -> str:
        return self.prepared.manifest.name


@dataclass
class Kernel:
    """A loaded program: its worker (MPS) or its module in the blink context."""

    name: str
    manifest: Manifest
    regs: int
    local: int
    per_sm: int
    scratch: int
    rt_abi: int
    worker: Worker | None = None
    module: Module | None = None
    launch: Launch | None = None
    context_pid: int = 0  # blink mode: the one context's worker
    device: int = 0  # the GPU it runs on
    sms: int = 0  # the SMs of its context (a green context's, else the device's)

    @property
    def pid(self) -> int:
        """The process the kernel runs in."""
        if self.worker is not None:
            return self.worker.proc.pid
        return self.context_pid


class Backend:
    def __init__(self, isolation: Isolation, sms: int, mps_dir: str | None, pool: int, gpu: str,
                 cache_dir: str | None, deadlines: Deadlines, max_clients: int, devices: Sequence[int] | None = None):
        if isolation not in ("blink", "mps"):
            raise ConfigError(f"--isolation {isolation}: expected blink or mps")
        if gpu not in ("cuda", "sim"):
            raise ConfigError(f"--gpu {gpu}: expected cuda or sim")
        if sms < 0 or pool < 0:
            raise ConfigError("--sms and --pool must not be negative")
        self._asked = None if devices is None else check_unique(devices)  # that they exist: at open
        self.isolation: Isolation = isolation
        self.sms = sms
        self.gpu = gpu
        self._mps_dir = mps_dir
        self._pool_n = pool
        self._cache_dir = cache_dir
        self._max_clients = max_clients
        self.sup = Supervisor(deadlines)
        self.mailbox = Mailbox.create()
        self.mps: Mps | None = None
        self.blinks: dict[int, BlinkContext] = {}  # blink mode: the context of each GPU
        self.daemon: ControlDaemon | None = None
        self.devices: tuple[int, ...] = ()  # the GPUs driven, ascending (known once open)
        self.infos: dict[int, DeviceInfo] = {}
        self.device_caps: dict[int, Caps] = {}
        self.compilers: dict[int, Compiler] = {}
        self._saved_pipe_env: str | None = None
        self._closed = False

    @classmethod
    async def open(cls, *, isolation: Isolation = "blink", sms: int = 0, mps_dir: str | None = None, pool: int = 0,
                   gpu: str = "cuda", cache_dir: str | None = None, deadlines: Deadlines = Deadlines(),
                   max_clients: int = MAX_CLIENTS, devices: Sequence[int] | None = None) -> Backend:
        """Start the backend: in MPS mode the private daemon and the pools first.  ``devices``: the
        GPUs to drive (CUDA ordinals; None: every visible one); ``pool`` idle workers per GPU."""
        if not structlog.is_configured():
            setup_logging()  # structlog's default is stdout: a host's output is not ours to fill
        b = cls(isolation, sms, mps_dir, pool, gpu, cache_dir, deadlines, max_clients, devices)
        try:
            await b._open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await b.close()
            raise
        return b

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

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

    async def _open(self) -> None:
        await self.sup.start()
        if self.isolation == "mps":
            temporary = self._mps_dir is None
            d = self._mps_dir or tempfile.mkdtemp(prefix=f"meshd-mps.{os.getpid()}.")
            self.daemon = ControlDaemon(d, temporary)
            await self.daemon.start()
            # meshd-mps's own cuInit (device attributes, no context) must join no daemon.
            self._saved_pipe_env = os.environ.get(PIPE_ENV)
            os.environ[PIPE_ENV] = os.path.join(self.daemon.dir, "none")
            await self._devices()
            self.mps = Mps(self.daemon, self.sup, self.mailbox.path, self.sms, self.gpu, self._pool_n, self._max_clients,
                           self.devices)
            log.info(f"mps: mailbox {abi.MAILBOX_BYTES} bytes in a memfd ({self.mailbox.path}); workers run --gpu {self.gpu}")
            mps = self.mps
            try:  # every GPU's pool at once: contexts on different GPUs do not wait for each other
                async with anyio.create_task_group() as tg:
                    for g in self.devices:
                        tg.start_soon(mps.prewarm, self._pool_n, g)
            except ExceptionGroup as e:
                raise e.exceptions[0] from e
        else:
            await self._devices()
            for g in self.devices:
                self.blinks[g] = BlinkContext(self.sup, self.mailbox, self.sms, self.gpu, device=g)
                await self.blinks[g].open()

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

    @property
    def blink(self) -> BlinkContext | None:
        """Blink mode: the first GPU's context."""
        return self.blinks.get(self.devices[0]) if self.devices else None

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
        if self.mps is not None:
            return len(self.mps.workers_on(device)) - len(self.mps.pools[device])
        ctx = self.blinks.get(device)
        return len(ctx.modules) if ctx is not None else 0

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
        if self.isolated or not self.blinks:
            return 0
        return self.blinks[self.device_or_first(device)].dev

    async def stack_limit(self, set_to: int | None = None, device: int | None = None) -> int | None:
        """GPU ``device``'s shared context's stack limit in bytes per thread (set first if asked;
        default: the first GPU); None in MPS mode, where each worker's context is its own (the
        seed's SIZE_MAX, set a no-op)."""
        if not self.blinks:
            return None
        blink = self.blinks[self.device_or_first(device)]
        p = blink._p()

        async def ask() -> int:
            try:
                payload = await p.ask(Op.LIMIT, frames.limit_body(set_to))
                return frames.limit_value(payload)
            except frames.FrameError as e:
                raise e.prefixed(f"stack limit: worker {p.pid}") from e

        if set_to is None:
            return await ask()
        # Setting it waits for every running kernel, as a module load does: a blink.
        return await blink._blink(f"stack limit {set_to}", ask)

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
        img = Image(p, device=d)
        if self.mps is not None:
            m = p.manifest
            img.worker = await self.mps.preload(m.name, p.cubin, m.threads, m.smem, m.scratch, d)
        return img

    def admit(self, device: int, name: str, nodes: int, used: float, new: bool = True) -> None:
        """Before anything changes: CapacityError if GPU ``device`` cannot take a program of
        ``nodes`` blocks beside its programs (whose shares of its blocks add up to ``used``);
        ``new``: one more program (an upgrade or relaunch takes its predecessor's place)."""
        d = self.device_or_first(device)
        if new:
            if self.mps is not None:
                self.mps.check_room(name, d)
            else:
                self.blinks[d].check_room(name)
        info = self.infos[d]
        limits.check_nodes(name, nodes, info, info.sms_total, used)

    def not_started_why(self, device: int) -> str:
        """The likely reasons a launched kernel does not start, in this mode, in words."""
        if self.mps is not None:
            return (f"its blocks wait for SMs that the other resident programs of GPU {device} hold, or the program"
                    " does not set STATE = RUNNING when it starts (docs/program-abi.md)")
        ctx = self.blinks[device]
        return (f"its stream shares a hardware work queue with a resident kernel ({len(ctx.modules)} programs in a context"
                f" of {ctx.queues} queues), its blocks wait for SMs that resident programs hold, or the program does not"
                " set STATE = RUNNING when it starts (docs/program-abi.md)")

    async def load(self, img: Image, admit: Callable[[Loaded], None] | None = None) -> Kernel:
        """The image's module, ready to launch.  ``admit`` sees what the worker reported (its
        occupancy, its context's SMs) and raises to refuse it; a refused module is unloaded (in
        blink mode within the load's own blink)."""
        p, m = img.prepared, img.prepared.manifest
        if self.mps is not None:
            if img.worker is None:
                raise MeshError("internal: an image prepared for the other isolation mode")
            w, img.worker = img.worker, None
            i = w.info
            k = Kernel(m.name, m, i.regs, i.local, i.per_sm, i.scratch, i.rt_abi, worker=w, device=w.device, sms=i.sms)
            if admit is not None:
                try:
                    admit(i)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self.unload(k)
                    raise
        else:
            d = self.device_or_first(img.device)
            ctx = self.blinks[d]
            mod = await ctx.load(m.name, p.cubin, m.threads, m.smem, m.scratch, admit)
            i = mod.info
            k = Kernel(m.name, m, i.regs, i.local, i.per_sm, i.scratch, i.rt_abi, module=mod,
                       context_pid=ctx.proc.pid if ctx.proc else 0, device=d, sms=i.sms)
        if k.rt_abi != abi.RT_ABI:
            await self.unload(k)
            raise AbiMismatch(f"{m.name}: {abi.RT_ABI_SYMBOL} is {k.rt_abi}, this meshd-mps runs program ABI {abi.RT_ABI}",
                              program=m.name, abi=k.rt_abi, expected=abi.RT_ABI)
        if self.sms and self.blinks and k.module and k.module.info.sms != self.sms:
            await self.unload(k)
            raise DeviceError(f"load: the context's green context has {k.module.info.sms} SMs, not {self.sms}")
        return k

    async def launch(self, k: Kernel, slot: int, nodes: int = 1) -> Launch:
        """``mesh_main(mailbox_dev, slot)`` on ``nodes`` blocks; await the result for its DONE."""
        if not 0 <= slot < abi.SLOTS:
            raise MailboxError(f"{k.name}: slot {slot} out of range 0..{abi.SLOTS - 1}")
        self.mailbox.run(slot)
        if k.worker is not None:
            k.launch = Launch(k.name, slot, nodes, await mps_launch(k.worker, slot, nodes))
        else:
            assert k.module is not None
            k.launch = await self.blinks[k.device].launch(k.module, slot, nodes)
        return k.launch

    def query(self, k: Kernel) -> bool:
        """The last launch finished; WorkerError (naming the program) on a stream error or a death."""
        if k.worker is not None:
            return mps_query(k.worker)
        assert k.module is not None
        return self.blinks[k.device].query(k.module)

    async def unload(self, k: Kernel) -> None:
        """MPS: the worker back to the pool (UNLOAD) or retired; blink: the module unloaded (a blink)."""
        if k.worker is not None and self.mps is not None:
            w, k.worker = k.worker, None
            await self.mps.drop(w)
        elif k.module is not None and self.blinks:
            mod, k.module = k.module, None
            await self.blinks[k.device].unload(mod)

    async def abandon(self, k: Kernel, slot: int) -> None:
        """A launch given up before its kernel started: HALT on its slot, so that it returns at
        once should it start; its module unloaded.  MPS: a worker whose kernel does not return
        is retired (the server ends its context first); blink: in one blink, which halts the
        kernels it may be queued behind."""
        self.mailbox.halt(slot)
        if k.worker is not None and self.mps is not None:
            run = k.launch
            if run is not None and not run.finished():
                with anyio.move_on_after(self.sup.deadlines.launch):
                    try:
                        await run.wait()
                    except WorkerError:
                        pass
                if not run.finished():
                    self.sup.retire(k.worker.proc)
            await self.unload(k)
        elif k.module is not None and self.blinks:
            mod, k.module = k.module, None
            await self.blinks[k.device].discard(mod)

    async def drop(self, img: Image) -> None:
        """An image prepared but never loaded: its worker goes back."""
        if img.worker is not None and self.mps is not None:
            w, img.worker = img.worker, None
            await self.mps.drop(w)

    # ---- state ----------------------------------------------------------------------------
    def device_status(self, d: int) -> dict[str, Any]:
        """One GPU's part of ``status()``: its caps, workers, pool (MPS) or context and blinks (blink)."""
        caps = self.device_caps.get(d)
        s: dict[str, Any] = {"device": d, "name": caps.name if caps else None,
                             "caps": caps.__dict__ if caps else None, "images": self.load_of(d)}
        if self.mps is not None:
            pool = self.mps.pools[d]
            s.update(workers=self.mps.workers_on(d), pool=pool.pids(), pool_cap=pool.cap)
        ctx = self.blinks.get(d)
        if ctx is not None:
            pid = ctx.proc.pid if ctx.proc else None
            s.update(workers=[pid] if pid else [], blinks=ctx.blinks, last_blink_ms=ctx.last_blink_ms, context_pid=pid)
        return s

    def last_blink_ms(self) -> float | None:
        """Blink mode: the length of the latest blink on any GPU (None before the first)."""
        done = [c for c in self.blinks.values() if c.last_blink_ms is not None]
        return max(done, key=lambda c: c.last_blink_at).last_blink_ms if done else None

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
        if self.mps is not None:
            s.update(pool=sorted(p for pool in self.mps.pools.values() for p in pool.pids()),
                     pool_cap=sum(pool.cap for pool in self.mps.pools.values()), server=self.mps.server,
                     mps_dir=self.mps.daemon.dir, daemon_died=self.mps.daemon.lost(),  # first: a status poll notices a death
                     daemon_pid=self.mps.daemon.pid)
        blink = self.blink
        if blink is not None:
            s.update(blinks=sum(c.blinks for c in self.blinks.values()), last_blink_ms=self.last_blink_ms(),
                     context_pid=blink.proc.pid if blink.proc else None)
        return s

    async def close(self) -> None:
        """Every worker killed and reaped, then the daemon quit; nothing is left behind."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self.mps is not None:
                await self.mps.close()
            else:
                await self.sup.close()
                if self.daemon is not None:
                    await self.daemon.quit()
            if self.daemon is not None:
                if self._saved_pipe_env is None:
                    os.environ.pop(PIPE_ENV, None)
                else:
                    os.environ[PIPE_ENV] = self._saved_pipe_env
        self.mailbox.close()


