"""Blink mode: every program is a kernel of one CUDA context.

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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import structlog

from meshd_mps.protocol import frames
from meshd_mps.errors import CapacityError, FrameError, HaltTimeout, StillRunning, Unavailable, WorkerError
from meshd_mps.protocol.frames import Launch as LaunchReq, Load, Loaded, Op
from meshd_mps.isolation.launch import Launch
from meshd_mps.isolation.limits import BLINK_QUEUES
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")


@dataclass
class Module:
    name: str
    module: int
    info: Loaded
    runs: list[Launch] = field(default_factory=list)

    def running(self) -> list[Launch]:
        self.runs = [r for r in self.runs if not r.finished()]
        return self.runs


class BlinkContext:
    def __init__(self, sup: Supervisor, mailbox: Mailbox, sms: int, gpu: str, device: int = 0):
        self.sup = sup
        self.device = device
        self.mailbox = mailbox
        self.sms = sms
        self.gpu = gpu
        #: How long a resident program may take to see HALT and return (tests shorten it).
        self.halt_s = sup.deadlines.halt
        self.proc: WorkerProc | None = None
        self.modules: dict[int, Module] = {}
        self._next = 1
        self._lock = anyio.Lock()  # one blink at a time
        self.dev = 0
        self.last_blink_ms: float | None = None
        self.last_blink_at = 0.0  # its monotonic end, to find the latest across GPUs
        self.blinks = 0
        #: Hardware work queues the context's worker asks for; a module gets a stream of its own queue.
        self.queues = BLINK_QUEUES

    async def open(self) -> None:
        from meshd_mps.mps.clients import worker_argv

        argv = worker_argv(self.mailbox.path, self.sms, self.gpu, self.device, queues=self.queues)
        self.proc = await self.sup.spawn(argv, dict(os.environ), f"blink context (GPU {self.device})")
        await self.proc.ask(Op.READY)

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
                r.relaunched(await self._start(m, r.slot, r.nodes))
            except WorkerError as e:
                r.relaunch_failed(e)

    async def _blink(self, what: str, work, drop: Module | None = None):  # type: ignore[no-untyped-def]
        """Every running program halted, ``work`` done, the halted ones relaunched (``drop``'s not)."""
        async with self._lock:
            t0 = time.perf_counter()
            halted = await self._halt_all()
            try:
                return await work()
            finally:
                dropped = [r for r in halted if drop is not None and r in drop.runs]
                for r in dropped:
                    r.relaunched(r.inner)  # it ends here, with the DONE of its HALT
                await self._relaunch([r for r in halted if r not in dropped])
                ms = (time.perf_counter() - t0) * 1e3
                if halted:
                    self.blinks += 1
                    self.last_blink_ms = ms
                    self.last_blink_at = time.monotonic()
                    log.info(f"blink: {what}: {len(halted)} programs on GPU {self.device} halted for {ms:.2f} ms")

    # ---- modules ----------------------------------------------------------------------------
    def room(self) -> int:
        """Programs the context still takes: one module, one stream, one hardware queue each."""
        return self.queues - len(self.modules)

    def check_room(self, name: str) -> None:
        if self.room() <= 0:
            raise CapacityError(
                f"{name}: the blink context of GPU {self.device} runs {len(self.modules)} programs, one per hardware work"
                f" queue, and has {self.queues}: a kernel on a shared queue would wait behind a resident one forever"
                " (use --isolation mps for more programs)", limit="hardware queues", have=self.queues,
                asked=len(self.modules) + 1)

    async def load(self, name: str, cubin: bytes, threads: int, smem: int, scratch: int,
                   admit: Callable[[Loaded], None] | None = None) -> Module:
        """The module loaded, in one blink; ``admit`` (raising to refuse it) sees what the worker
        reported before anything is relaunched, and a refused module is unloaded in the same blink."""
        self.check_room(name)
        module = self._next
        self._next += 1
        req = Load(module, threads, smem, scratch, name, cubin)

        async def work() -> Module:
            try:
                payload = await self._p().ask(Op.LOAD, req.encode())
                info = Loaded.decode_ok(payload)
            except (FrameError, WorkerError) as e:
                raise e.prefixed("load") from e
            self.dev = info.dev
            if admit is not None:
                try:
                    admit(info)
                except BaseException:
                    await self._p().send(Op.UNLOAD, frames.unload_body(module))
                    raise
            m = self.modules[module] = Module(name, module, info)
            return m

        return await self._blink(f"load {name}", work)

    async def discard(self, m: Module) -> None:
        """A module whose launch is given up (it never started): in one blink every program is
        halted, so that a kernel queued behind one of them runs, sees HALT and returns; the
        module is unloaded and the others relaunched."""

        async def work() -> None:  # every launch of m returned: _halt_all refuses otherwise
            self.modules.pop(m.module, None)
            await self._p().send(Op.UNLOAD, frames.unload_body(m.module))

        await self._blink(f"discard {m.name}", work, drop=m)

    async def unload(self, m: Module) -> None:
        if m.running():
            raise StillRunning(f"blink: {m.name} still runs; halt it before unloading", program=m.name)

        async def work() -> None:
            self.modules.pop(m.module, None)
            await self._p().send(Op.UNLOAD, frames.unload_body(m.module))

        await self._blink(f"unload {m.name}", work)

    async def _start(self, m: Module, slot: int, nodes: int):  # type: ignore[no-untyped-def]
        p = self._p()
        gen, done = p.next_gen(m.module)
        try:
            await p.ask(Op.LAUNCH, LaunchReq(m.module, gen, slot, nodes).encode())
        except WorkerError as e:
            done.cancel()
            raise e.prefixed(m.name, "{what} ({message})") from e
        return done

    async def launch(self, m: Module, slot: int, nodes: int) -> Launch:
        r = Launch(m.name, slot, nodes, await self._start(m, slot, nodes))
        m.runs.append(r)
        return r

    def query(self, m: Module) -> bool:
        try:
            return self._p().query(m.module)
        except WorkerError as e:
            raise e.prefixed(m.name) from e



def _halted_cleanly(r: Launch) -> bool:
    f = r.inner
    return f.done() and not f.cancelled() and f.exception() is None and f.result().ok
