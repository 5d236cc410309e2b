"""Blink mode: every program of a GPU is a kernel of its one CUDA context.

The context lives in one worker process (so the event loop never blocks on
CUDA).  In one context a module load or unload waits for every running
kernel, so each one is a *blink*: every resident program is halted through
its mailbox slot, the module work is done, and the halted programs are
relaunched on the same slots.  The blink's length is measured and logged.

Several GPUs: one context (one worker, ``--device N``) per GPU, each with its
own modules and its own lock, so a blink on one GPU halts only that GPU's
programs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import structlog

from meshd_mps.base.errors import (
    CapacityError,
    DeviceError,
    FrameError,
    HaltTimeout,
    ImageRefused,
    MeshError,
    StillRunning,
    Unavailable,
    WorkerError,
)
from meshd_mps.base.faults import Stray
from meshd_mps.gpu.compiler import Prepared
from meshd_mps.isolation.base import Admit, BlinkStats, Evidence, Image, Isolation, Kernel, Mode, Module
from meshd_mps.isolation.launch import Launch
from meshd_mps.isolation.limits import BLINK_QUEUES
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Load, Loaded, Op
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.argv import worker_argv
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

T = TypeVar("T")


@dataclass(eq=False)
class BlinkModule(Module):
    """A module of the context, with its launches (a blink halts and relaunches the running ones)."""

    runs: list[Launch] = field(default_factory=list)

    def running(self) -> list[Launch]:
        self.runs = [r for r in self.runs if not r.finished()]
        return self.runs


class BlinkIsolation(Isolation):
    """One GPU's context, in one worker process: every program of the GPU a module of it."""

    def __init__(self, sup: Supervisor, mailbox: Mailbox, sms: int, gpu: str, device: int = 0,
                 listen: str | None = None):
        super().__init__(sup, device)
        self.mailbox = mailbox
        self.listen = listen  # live restore: the context's worker serves on a socket there and outlives us
        self.sms = sms
        self.gpu = gpu
        #: How long a resident program may take to see HALT and return (tests shorten it).
        self.halt_s = sup.deadlines.halt
        self.proc: WorkerProc | None = None
        self.modules: dict[int, BlinkModule] = {}
        self._next = 1
        self._lock = anyio.Lock()  # one blink at a time
        self.dev = 0
        #: Hardware work queues the context's worker asks for; a module gets a stream of its own queue.
        self.queues = BLINK_QUEUES
        self._held: WorkerProc | None = None  # the next context's worker, standing by (``_stand_by``)
        self._opened = False
        self._torn: WorkerProc | None = None  # the context the last teardown retired
        #: Blinks: module changes that halted and relaunched every running program of the GPU, the
        #: last one's length (ms) and its monotonic end.
        self.blinks = 0
        self.last_blink_ms: float | None = None
        self.last_blink_at = 0.0

    async def open(self, adopted: Sequence[WorkerProc] = ()) -> None:
        """The context: the adopted one that holds modules (live restore), else a new one: the
        standby's (``_stand_by``), whose context is made already, else a fresh worker's.  Then the
        next standby is started."""
        first, self._opened = not self._opened, True
        ctx = next((p for p in adopted if p.hello is not None and p.hello.modules), None)
        for p in adopted:
            if p is not ctx:  # no module of ours in it, or a second context of this GPU
                self.sup.retire(p, before_exit=False)
        held, self._held = self._held, None
        if held is not None and (ctx is not None or not held.idle()):
            self.sup.retire(held)  # not needed, or it died while it stood by
            held = None
        self.proc = ctx or held or await self._spawn()
        if first and ctx is None:
            self._stand_by(context=True)  # its context made beside this one's, before any program runs
        await self.proc.ask(Op.READY)
        self.first_context_at = time.perf_counter()
        if ctx is not None:
            # Adopted programs run: a context made now would stall them once (as a new MPS client
            # does); the standby waits without one, and a recovery then makes it.
            self._stand_by(context=False)
            self.found = self.found_in(ctx, self._adopted_module)
            self._next = max(self.modules) + 1
            log.info(f"blink: GPU {self.device}: context {ctx.pid} adopted with {len(self.found)} modules",
                     device=self.device, pid=ctx.pid, found=[f.name for f in self.found])
        elif first:
            await self.held_started()  # the start's two contexts made before anything runs
        else:
            # After a fault's recovery, beside the relaunched programs: its context stalls them once,
            # as the MPS pool's refill after a recovery does.
            self._stand_by(context=True)

    def _adopted_module(self, hm: frames.HelloModule) -> BlinkModule:
        assert self.proc is not None
        m = self.modules[hm.id] = BlinkModule(hm.name, self.proc, hm.id, hm.info)
        self.dev = hm.info.dev
        return m

    def _stand_by(self, context: bool) -> None:
        """The next context's worker, started now for a fault's recovery.  With ``context`` its CUDA
        context is made now too: a blink context (32 hardware queues) takes ~0.6 s to make on an
        H100, cuInit included, most of a recovery, and another process's idle context costs the
        running ones nothing (plain contexts are isolated from each other's faults).  Without, it is
        held (imported only: nothing of the GPU touched), and saves the recovery the imports."""
        if self._held is None:
            self.hold_ahead(1, functools.partial(self._standby_worker, context), self._keep_held)

    async def _standby_worker(self, context: bool) -> WorkerProc:
        p = await self._spawn(hold=not context)
        if context:
            try:
                await p.ask(Op.READY)
            except MeshError as e:
                # A GPU that takes one context at a time (compute mode EXCLUSIVE_PROCESS): held, then.
                self.sup.retire(p)
                log.info(f"blink: GPU {self.device}: no second context for the standby ({e}); it waits held",
                         device=self.device)
                return await self._spawn(hold=True)
            except BaseException:
                self.sup.retire(p)
                raise
        return p

    async def _spawn(self, hold: bool = False) -> WorkerProc:
        """The context's worker (``hold``: imported, its context created at READY)."""
        argv = worker_argv(self.mailbox.path, self.sms, self.gpu, self.device, queues=self.queues, hold=hold)
        p = await self.sup.spawn(argv, dict(os.environ), f"blink context (GPU {self.device})", listen=self.listen)
        p.device = self.device
        return p

    def _p(self) -> WorkerProc:
        if self.proc is None:
            raise Unavailable("blink: the context is not open")
        return self.proc

    # ---- the blink --------------------------------------------------------------------------
    async def _halt_all(self) -> list[Launch]:
        running = [r for m in self.modules.values() for r in m.running()]
        for r in running:
            r.blinking()
            self.mailbox.halt(r.slot)
        if running:
            await asyncio.wait([r.inner for r in running], timeout=self.halt_s)  # waits, never cancels them
        stuck = [r for r in running if not r.inner.done()]
        if stuck:
            for r in running:
                self.mailbox.run(r.slot)
            await self._relaunch([r for r in running if r not in stuck])
            for r in stuck:
                r.relaunched(r.inner)
            names = ", ".join(f"{r.name} (slot {r.slot})" for r in stuck)
            raise HaltTimeout(f"blink: {names} did not halt within {self.halt_s:g}s: refusing the module change, which would"
                              " wait for it", programs=tuple(r.name for r in stuck), within=self.halt_s)
        return running

    async def _relaunch(self, halted: list[Launch]) -> None:
        for r in halted:
            m = next(m for m in self.modules.values() if r in m.runs)
            if not _halted_cleanly(r):
                r.relaunched(r.inner)  # it failed rather than halted: it is not restarted
                continue
            self.mailbox.run(r.slot)
            try:
                r.relaunched(await m.start(r.slot, r.nodes))
            except WorkerError as e:
                r.relaunch_failed(e)

    async def _blink(self, what: str, work: Callable[[], Awaitable[T]], drop: BlinkModule | None = None) -> T:
        """Every running program halted, ``work`` done, the halted ones relaunched (``drop``'s not).
        A cancel (a caller's timeout, the API's drain) ends ``work`` only: the halt and the relaunch
        are shielded (each bounded by its own deadline), so that no program is left halted, or
        relaunched behind its ``Launch``'s back."""
        async with self._lock:
            t0 = time.perf_counter()
            with anyio.CancelScope(shield=True):
                halted = await self._halt_all()
            try:
                return await work()
            finally:
                dropped = [r for r in halted if drop is not None and r in drop.runs]
                for r in dropped:
                    r.relaunched(r.inner)  # it ends here, with the DONE of its HALT
                with anyio.CancelScope(shield=True):
                    await self._relaunch([r for r in halted if r not in dropped])
                ms = (time.perf_counter() - t0) * 1e3
                if halted:
                    self.blinks += 1
                    self.last_blink_ms = ms
                    self.last_blink_at = time.monotonic()
                    log.info(f"blink: {what}: {len(halted)} programs on GPU {self.device} halted for {ms:.2f} ms")

    # ---- modules ----------------------------------------------------------------------------
    def capacity(self) -> int:
        """One module, one stream, one hardware queue each."""
        return self.queues

    def room(self) -> int:
        """Programs the context still takes."""
        return self.capacity() - len(self.modules)

    def check_room(self, name: str) -> None:
        if self.room() <= 0:
            raise CapacityError(
                f"{name}: the blink context of GPU {self.device} runs {len(self.modules)} programs, one per hardware work"
                f" queue, and has {self.queues}: a kernel on a shared queue would wait behind a resident one forever"
                " (MPS isolation takes more programs: isolation \"mps\")", limit="hardware queues", have=self.queues,
                asked=len(self.modules) + 1)

    async def prepare(self, prepared: Prepared, new: bool = False) -> Image:
        return Image(prepared, self.device)

    async def load(self, img: Image, admit: Admit | None = None) -> Kernel:
        """The module loaded, in one blink; ``admit`` (raising to refuse it) sees what the worker
        reported before anything is relaunched, and a refused module is unloaded in the same blink."""
        m = img.prepared.manifest
        self.check_room(m.name)
        module = self._next
        self._next += 1
        req = Load(module, m.threads, m.smem, m.scratch, m.name, img.prepared.cubin, img.prepared.hash)

        async def work() -> BlinkModule:
            p = self._p()
            try:
                payload = await p.ask(Op.LOAD, req.encode())
                info = Loaded.decode_ok(payload)
            except (FrameError, WorkerError) as e:
                raise e.prefixed("load") from e
            except ImageRefused as e:  # answered: the worker loaded nothing, so there is nothing to unload
                raise e.prefixed(f"load {m.name}") from e
            except BaseException:  # cancelled: the LOAD was written (ask's first wait is after it), so it loads
                # and leaves its hardware queue; bounded: behind a large LOAD still draining to a
                # worker that reads nothing, the UNLOAD would wait for ever.
                with anyio.move_on_after(p.deadlines.reply(Op.LOAD), shield=True), contextlib.suppress(WorkerError):
                    await p.send(Op.UNLOAD, frames.unload_body(module))
                raise
            self.dev = info.dev
            try:
                if admit is not None:
                    admit(info)
                if img.payloads is not None:  # registered here, with every kernel of the context halted
                    await self._map_payloads(m.name, p, module, img.payloads)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await p.send(Op.UNLOAD, frames.unload_body(module))
                raise
            mod = self.modules[module] = BlinkModule(m.name, p, module, info)
            return mod

        mod = await self._blink(f"load {m.name}", work)
        k = Kernel(m.name, m, mod, self, payloads=img.payloads)
        await self._check_abi(k)
        if self.sms and mod.info.sms != self.sms:
            await self.unload(k)
            raise DeviceError(f"load: the context's green context has {mod.info.sms} SMs, not {self.sms}")
        return k

    def _launched(self, k: Kernel, run: Launch) -> None:
        assert isinstance(k.module, BlinkModule)
        k.module.runs.append(run)

    def _gone(self, m: Module) -> bool:
        """A module of a context torn down since (``teardown``): it went with it."""
        return m.proc is not self.proc

    async def _unload(self, k: Kernel) -> None:
        m = k.module
        assert isinstance(m, BlinkModule)
        if self._gone(m):
            return
        if m.running():
            raise StillRunning(f"blink: {m.name} still runs; halt it before unloading", program=m.name)

        async def work() -> None:
            self.modules.pop(m.module, None)
            await self._p().send(Op.UNLOAD, frames.unload_body(m.module))

        await self._blink(f"unload {m.name}", work)

    async def _abandon(self, k: Kernel, slot: int) -> None:
        """In one blink every program is halted, so that a kernel queued behind one of them runs,
        sees HALT and returns; the module is unloaded and the others relaunched."""
        m = k.module
        assert isinstance(m, BlinkModule)
        if self._gone(m):
            return

        async def work() -> None:  # every launch of m returned: _halt_all refuses otherwise
            self.modules.pop(m.module, None)
            await self._p().send(Op.UNLOAD, frames.unload_body(m.module))

        await self._blink(f"discard {m.name}", work, drop=m)

    def retire_stuck(self, k: Kernel) -> bool:
        return False

    def not_started_why(self) -> str:
        return (f"its stream shares a hardware work queue with a resident kernel ({len(self.modules)} programs in a context"
                f" of {self.queues} queues), its blocks wait for SMs that resident programs hold, or the program does not"
                " set STATE = RUNNING when it starts (docs/program-abi.md)")

    async def stack_limit(self, set_to: int | None = None) -> int | None:
        """Setting it waits for every running kernel, as a module load does: a blink."""
        p = self._p()

        async def ask() -> int:
            try:
                payload = await p.ask(Op.LIMIT, frames.limit_body(set_to))
                return frames.u64_value(Op.LIMIT, payload)
            except frames.FrameError as e:
                raise e.prefixed(f"stack limit: worker {p.pid}") from e

        if set_to is None:
            return await ask()
        return await self._blink(f"stack limit {set_to}", ask)

    def mailbox_dev(self) -> int:
        return self.dev

    def load_count(self) -> int:
        return len(self.modules)

    def status(self) -> dict[str, Any]:
        pid = self.proc.pid if self.proc else None
        return {"workers": [pid] if pid else [], "blinks": self.blinks, "last_blink_ms": self.last_blink_ms,
                "context_pid": pid, "standby_pid": self._held.pid if self._held is not None else None}

    # ---- a fault of the context -------------------------------------------------------------
    async def teardown(self, ahead: int = 0) -> list[WorkerProc]:
        """The context's worker retired, and every module with it: an error in one context is sticky,
        every program's of the GPU.  The next context's worker starts meanwhile, held (imported, no
        context until ``refill``, which waits for it: ``hold_ahead``)."""
        p, self.proc = self.proc, None
        self._torn = p
        self.first_context_at = 0.0
        self.modules.clear()
        if p is None:
            return []
        log.info(f"blink: GPU {self.device}: retiring its context after a fault", device=self.device, pid=p.pid)
        self.sup.retire(p, before_exit=False, at_once=True)
        if self._held is not None and not self._held.idle():  # the standby died meanwhile
            self.sup.retire(self._held)
            self._held = None
        self.hold_ahead(0 if self._held else 1, functools.partial(self._spawn, hold=True), self._keep_held)
        with anyio.move_on_after(self.sup.deadlines.recover):
            await p.process.wait()
        return [p]

    @property
    def standby(self) -> WorkerProc | None:
        """The next context's worker (``_stand_by``), if it is up."""
        return self._held

    def detach(self) -> None:
        """Live restore's stop: the standby is retired, not left for the next daemon (which would
        retire it: it holds no module)."""
        held, self._held = self._held, None
        if held is not None:
            self.sup.retire(held)

    def _keep_held(self, p: WorkerProc) -> None:
        """The next context's worker, started ahead of the refill; retired if one came meanwhile."""
        if self._held is None:
            self._held = p
        else:
            self.sup.retire(p)

    async def refill(self, extra: int = 0) -> bool:
        """A new context (``extra`` is moot: one context takes every program); False if none came
        up within ``recover`` (logged)."""
        if self.proc is not None:
            return True
        within = self.sup.deadlines.recover
        try:
            with anyio.fail_after(within):
                await self.held_started()
                await self.open()
            return True
        except TimeoutError:
            why = f"not within {within:g}s"
        except MeshError as e:
            why = str(e)
        log.error(f"blink: GPU {self.device}: no new context after the fault: {why}", device=self.device)
        if self.proc is not None:
            self.sup.retire(self.proc)
            self.proc = None
        return False

    async def evidence(self, ours: Collection[int] = (), wait: float = 0.0) -> Evidence:
        """One context: a launch's error is sticky, every program of it fails with it (``gpu_wide``);
        no server logs a culprit."""
        return Evidence([], self.strays(set(ours)), gpu_wide=True)

    def blink_stats(self) -> BlinkStats:
        return BlinkStats(self.blinks, self.last_blink_ms, self.last_blink_at)

    def strays(self, ours: set[int]) -> list[Stray]:
        """The torn context's worker, if it died on its own (killed from outside, a crash): then it,
        not any one program, took the GPU's programs down."""
        p = self._torn
        if p is None or not p.died_on_its_own():
            return []
        return [Stray(p.pid, None, p.exited_running_at or time.monotonic())]

    def took(self, stray: Stray) -> None:
        if self._torn is not None and self._torn.pid == stray.pid:
            self._torn = None


class Blink(Mode):
    """Blink mode's host-wide part: nothing but every GPU's context, and their blinks added up."""

    gpus: dict[int, BlinkIsolation]  # type: ignore[assignment]

    def __init__(self, sup: Supervisor, mailbox: Mailbox, sms: int, gpu: str, listen: str | None = None):
        super().__init__(sup)
        self.mailbox = mailbox
        self.sms = sms
        self.gpu = gpu
        self.listen = listen

    def _make(self, device: int) -> BlinkIsolation:
        return BlinkIsolation(self.sup, self.mailbox, self.sms, self.gpu, device, self.listen)

    def status(self) -> dict[str, Any]:
        """Every GPU's blinks, the latest one's length, and the first GPU's context (as on a one-GPU host)."""
        if not self.gpus:
            return {}
        first = self.gpus[min(self.gpus)]
        return {"blinks": sum(c.blinks for c in self.gpus.values()), "last_blink_ms": last_blink_ms(self.gpus.values()),
                "context_pid": first.proc.pid if first.proc else None,
                "standby_pid": first.standby.pid if first.standby is not None else None}


def last_blink_ms(contexts: Iterable[Isolation]) -> float | None:
    """The length of the latest blink of any of ``contexts`` (None before the first)."""
    done = [s for c in contexts if (s := c.blink_stats()) is not None and s.last_ms is not None]
    return max(done, key=lambda s: s.last_at).last_ms if done else None


def _halted_cleanly(r: Launch) -> bool:
    f = r.inner
    return f.done() and not f.cancelled() and f.exception() is None and f.result().ok
