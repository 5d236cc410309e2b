"""The CUDA backend in either mode, for an asyncio host: ``await Backend.open()``.

Its surface mirrors the seed's backend ops: caps, isolated / resident /
isolation, the mailbox, prepare (compile and, in MPS mode, preload), load,
launch with an awaitable completion, query, unload, module scope, close.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import structlog

from . import abi, frames
from .frames import Op
from .blink import BlinkContext, Module
from .compiler import Compiler, Manifest, Prepared
from .daemon import PIPE_ENV, ControlDaemon
from .device import Caps, DeviceInfo, caps_of, check_sms, query_device, simulated_device
from .errors import ConfigError, MeshError
from .launch import Launch
from .log import setup_logging
from .mailbox import Mailbox
from .mps import MAX_CLIENTS, Mps, Worker
from .mps import launch as mps_launch
from .proc import Deadlines
from .supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

Isolation = Literal["blink", "mps"]
NO_SLOT = 0xFFFFFFFF


@dataclass
class Image:
    """A checked, compiled image (the seed's mesh_prepared); in MPS mode already
    loaded in a worker, so that ``load`` only hands it over."""

    prepared: Prepared
    worker: Worker | None = None

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

    @property
    def pid(self) -> int:
        """The process the kernel runs in."""
        if self.worker is not None:
            return self.worker.proc.pid
        return self.context_pid

    def global_u32(self, name: str) -> int:
        if name == abi.RT_ABI_SYMBOL:
            return self.rt_abi
        raise MeshError(f"global {name}: a worker reports only {abi.RT_ABI_SYMBOL}")


class Backend:
    def __init__(self, isolation: Isolation, sms: int, mps_dir: str | None, pool: int, gpu: str,
                 cache_dir: str | None, deadlines: Deadlines, max_clients: int):
        if isolation not in ("blink", "mps"):
            raise ConfigError(f"--isolation {isolation}: expected blink or mps")
        if gpu not in ("cuda", "sim"):
            raise ConfigError(f"--gpu {gpu}: expected cuda or sim")
        if sms < 0 or pool < 0:
            raise ConfigError("--sms and --pool must not be negative")
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
        self.blink: BlinkContext | None = None
        self.daemon: ControlDaemon | None = None
        self.info: DeviceInfo | None = None
        self.caps: Caps | None = None
        self.compiler: Compiler | None = None
        self._saved_pipe_env: str | None = None
        self._closed = False

    @classmethod
    async def open(cls, *, isolation: Isolation = "blink", sms: int = 0, mps_dir: str | None = None, pool: int = 0,
                   gpu: str = "cuda", cache_dir: str | None = None, deadlines: Deadlines = Deadlines(),
                   max_clients: int = MAX_CLIENTS) -> Backend:
        """Start the backend: in MPS mode the private daemon and the pool first."""
        if not structlog.is_configured():
            setup_logging()  # structlog's default is stdout: a host's output is not ours to fill
        b = cls(isolation, sms, mps_dir, pool, gpu, cache_dir, deadlines, max_clients)
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

    async def _device(self) -> DeviceInfo:
        if self.gpu == "sim":
            return simulated_device()
        return await anyio.to_thread.run_sync(query_device)

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
            self.info = await self._device()
            check_sms(self.info, self.sms)
            self.mps = Mps(self.daemon, self.sup, self.mailbox.path, self.sms, self.gpu, self._pool_n, self._max_clients)
            log.info(f"mps: mailbox {abi.MAILBOX_BYTES} bytes in a memfd ({self.mailbox.path}); workers run --gpu {self.gpu}")
            await self.mps.prewarm(self._pool_n)
        else:
            self.info = await self._device()
            check_sms(self.info, self.sms)
            self.blink = BlinkContext(self.sup, self.mailbox, self.sms, self.gpu)
            await self.blink.open()
        self.caps = caps_of(self.info, self.sms)
        self.compiler = Compiler(self.info, self._cache_dir)

    # ---- the seed's backend ops ------------------------------------------------------------
    @property
    def isolated(self) -> bool:
        return self.isolation == "mps"

    @property
    def resident(self) -> bool:
        return True

    def mailbox_dev(self) -> int:
        """The mailbox's device address in the shared context; 0 in MPS mode (each worker has its own)."""
        return 0 if self.isolated or self.blink is None else self.blink.dev

    def module_scope(self, slot: int | None) -> int | None:
        """MPS mode: modules are scoped per slot (``NO_SLOT`` without one); blink: None (one scope)."""
        if not self.isolated:
            return None
        return NO_SLOT if slot is None else slot

    async def stack_limit(self, set_to: int | None = None) -> int | None:
        """The shared context's stack limit in bytes per thread (set first if asked); None in
        MPS mode, where each worker's context is its own (the seed's SIZE_MAX, set a no-op)."""
        if self.blink is None:
            return None
        blink = self.blink
        p = blink._p()

        async def ask() -> int:
            try:
                payload = await p.ask(Op.LIMIT, frames.limit_body(set_to), Op.LIMIT, self.sup.deadlines.load)
                return frames.limit_value(payload)
            except frames.FrameError as e:
                raise MeshError(f"stack limit: worker {p.pid}: {e}") from None

        if set_to is None:
            return await ask()
        # Setting it waits for every running kernel, as a module load does: a blink.
        return await blink._blink(f"stack limit {set_to}", ask)

    def _compiler(self) -> Compiler:
        if self.compiler is None or self._closed:
            raise MeshError("backend closed")
        return self.compiler

    async def prepare(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, expect: int | None = None) -> Image:
        """Checks, PTX -> cubin (cached), and in MPS mode the preload into a worker."""
        p = await self._compiler().prepare(manifest, ptx, expect)
        img = Image(p)
        if self.mps is not None:
            m = p.manifest
            img.worker = await self.mps.preload(m.name, p.cubin, m.threads, m.smem, m.scratch)
        return img

    async def load(self, img: Image) -> Kernel:
        p, m = img.prepared, img.prepared.manifest
        if self.mps is not None:
            if img.worker is None:
                raise MeshError("internal: an image prepared for the other isolation mode")
            w, img.worker = img.worker, None
            k = Kernel(m.name, m, w.info.regs, w.info.local, w.info.per_sm, w.info.scratch, w.info.rt_abi, worker=w)
        else:
            assert self.blink is not None
            mod = await self.blink.load(m.name, p.cubin, m.threads, m.smem, m.scratch)
            i = mod.info
            k = Kernel(m.name, m, i.regs, i.local, i.per_sm, i.scratch, i.rt_abi, module=mod,
                       context_pid=self.blink.proc.pid if self.blink.proc else 0)
        if k.rt_abi != abi.RT_ABI:
            await self.unload(k)
            raise MeshError(f"{m.name}: {abi.RT_ABI_SYMBOL} is {k.rt_abi}, this meshd-mps runs program ABI {abi.RT_ABI}")
        if self.sms and self.blink is not None and self.blink.sms and k.module and k.module.info.sms != self.sms:
            await self.unload(k)
            raise MeshError(f"load: the context's green context has {k.module.info.sms} SMs, not {self.sms}")
        return k

    async def launch(self, k: Kernel, slot: int, nodes: int = 1) -> Launch:
        """``mesh_main(mailbox_dev, slot)`` on ``nodes`` blocks; await the result for its DONE."""
        if not 0 <= slot < abi.SLOTS:
            raise MeshError(f"{k.name}: slot {slot} out of range 0..{abi.SLOTS - 1}")
        self.mailbox.run(slot)
        if k.worker is not None:
            k.launch = Launch(k.name, slot, nodes, await mps_launch(k.worker, slot, nodes))
        else:
            assert self.blink is not None and k.module is not None
            k.launch = await self.blink.launch(k.module, slot, nodes)
        return k.launch

    def query(self, k: Kernel) -> bool:
        """The last launch finished; WorkerError (naming the program) on a stream error or a death."""
        if k.worker is not None:
            from .mps import query

            return query(k.worker)
        assert self.blink is not None and k.module is not None
        return self.blink.query(k.module)

    async def unload(self, k: Kernel) -> None:
        """MPS: the worker back to the pool (UNLOAD) or retired; blink: the module unloaded (a blink)."""
        if k.worker is not None and self.mps is not None:
            w, k.worker = k.worker, None
            await self.mps.drop(w)
        elif k.module is not None and self.blink is not None:
            mod, k.module = k.module, None
            await self.blink.unload(mod)

    async def drop(self, img: Image) -> None:
        """An image prepared but never loaded: its worker goes back."""
        if img.worker is not None and self.mps is not None:
            w, img.worker = img.worker, None
            await self.mps.drop(w)

    # ---- state ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "isolation": self.isolation,
            "gpu": self.gpu,
            "caps": self.caps.__dict__ if self.caps else None,
            "workers": self.sup.live(),
            "retired": self.sup.retired,
        }
        if self.mps is not None:
            s.update(pool=self.mps.pool.pids(), pool_cap=self.mps.pool.cap, server=self.mps.server,
                     mps_dir=self.mps.daemon.dir, daemon_pid=self.mps.daemon.pid)
        if self.blink is not None:
            s.update(blinks=self.blink.blinks, last_blink_ms=self.blink.last_blink_ms,
                     context_pid=self.blink.proc.pid if self.blink.proc else None)
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

