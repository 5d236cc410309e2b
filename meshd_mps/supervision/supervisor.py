"""The owner of every worker process and of the tasks that serve them.

One runner task holds an anyio task group for the supervisor's lifetime;
each worker's reader task and each retirement run in it, so no task is
fire-and-forget and close() ends them all.  Retire is the seed's: QUIT, 2 s
to exit, SIGKILL, 2 s more, else "left behind".  Cleanup is the seed's too:
idle workers get EOF, every worker SIGKILL, one shared 500 ms reap deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
import structlog
from anyio.abc import TaskGroup

from meshd_mps.supervision import child
from meshd_mps.errors import MeshError, WorkerError
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision.proc import Deadlines, WorkerProc

log = structlog.get_logger("meshd_mps")

#: After the shared 500 ms deadline, how long close() still waits for the late ones.
CLEANUP_GRACE_S = 5.0


class Supervisor:
    def __init__(self, deadlines: Deadlines = Deadlines()) -> None:
        self.deadlines = deadlines
        self._tg: TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.workers: dict[int, WorkerProc] = {}  # live, not retiring: the seed's `workers`
        self._children: dict[int, WorkerProc] = {}  # every process not yet reaped
        self.closed = False
        self.retired = 0
        self.left_behind: list[int] = []
        # Called (with the retire-QUIT deadline) before a worker whose kernel may still run is
        # told to exit or killed.  Mps sets it: under MPS a client that exits with its kernel
        # running faults every other client of the GPU (H200, docs/reliability.md), one
        # terminated by the server first does not.
        self.before_exit: Callable[[WorkerProc], Awaitable[None]] | None = None
        #: The latest workers (16) that exited on their own with a kernel launched (killed from
        #: outside, crashed): fault recovery names one as the culprit when it was no program's yet.
        self.exited_running: list[WorkerProc] = []

    async def start(self) -> None:
        started = asyncio.Event()

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()

        self._runner = asyncio.create_task(run(), name="meshd-mps supervisor")
        await started.wait()

    def _group(self) -> TaskGroup:
        if self._tg is None or self.closed:
            raise WorkerError("supervisor closed")
        return self._tg

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], program: str | None = None) -> WorkerProc:
        """A new worker process with its reader task; stderr passes through to ours."""
        tg = self._group()
        try:
            process = await child.spawn(argv, env)
        except OSError as e:
            raise WorkerError(f"mps worker: {argv[0]}: {e.strerror or e}") from None
        w = WorkerProc(process, self._unfit, self.deadlines)
        w.program = program
        self.workers[w.pid] = w
        self._children[w.pid] = w
        tg.start_soon(self._read, w, name=f"reader {w.pid}")
        log.debug("worker spawned", pid=w.pid)
        return w

    async def _read(self, w: WorkerProc) -> None:
        """The worker's reader; once its stdout ends (it exited, or closed it) the worker is retired
        at once: a dead worker must not stay live (counted as an MPS client) until its program is
        unloaded.  Its owner's later retire or give-back finds it retiring already."""
        await w.read_frames()
        if w.pid in self.workers and not self.closed:
            if w.running():  # on its own, with a kernel launched: under MPS that faults its GPU
                w.exited_running_at = time.monotonic()
                self.exited_running = [*self.exited_running[-15:], w]
            self.retire(w)

    def start_soon(self, fn, *args, name: str) -> None:  # type: ignore[no-untyped-def]
        """Run a task owned by the supervisor's task group (cancelled at close)."""
        self._group().start_soon(fn, *args, name=name)

    def _unfit(self, w: WorkerProc) -> None:
        """A worker that broke the protocol or hung is retired at once."""
        if w.pid in self.workers and not self.closed:
            self.retire(w)

    def retire(self, w: WorkerProc, before_exit: bool = True) -> None:
        """QUIT, then reaped by a task of ours (killed if it lingers); never blocks the caller.
        ``before_exit=False``: not the ``before_exit`` hook (the GPU's clients are torn down by a
        fault already; on the H200 a terminate_client then hung and the server's teardown never
        ended)."""
        if self.workers.pop(w.pid, None) is None:
            return  # already retiring
        if self.closed:
            return
        self._group().start_soon(self._retire, w, before_exit, name=f"retire {w.pid}")

    async def _retire(self, w: WorkerProc, before_exit: bool = True) -> None:
        with structlog.contextvars.bound_contextvars(pid=w.pid, program=w.program):
            if before_exit and self.before_exit is not None and not w.dead and w.running():
                try:
                    with anyio.move_on_after(self.deadlines.retire_quit):
                        await self.before_exit(w)
                except MeshError as e:
                    log.warning(f"mps: worker {w.pid}: {e}; retiring it anyway")
            if not w.dead and not w.unfit:
                try:
                    with anyio.move_on_after(self.deadlines.retire_quit / 4):
                        await w.send(Op.QUIT)
                except WorkerError:
                    pass
            w.close_stdin()
            d = self.deadlines
            with anyio.move_on_after(d.retire_quit):
                await w.process.wait()
            if w.process.returncode is None:
                log.error(f"mps: worker {w.pid} did not exit in {d.retire_quit:g} s; killing it")
                _kill(w)
                with anyio.move_on_after(d.retire_kill):
                    await w.process.wait()
            if w.process.returncode is None:
                log.error(f"mps: worker {w.pid} not reaped {d.retire_kill:g} s after SIGKILL; left behind")
                self.left_behind.append(w.pid)
            else:
                log.info(f"mps: worker {w.pid} exited", status=w.process.returncode)
                self._children.pop(w.pid, None)
            self.retired += 1

    def live(self) -> list[int]:
        return sorted(self.workers)

    def children(self) -> list[int]:
        return sorted(self._children)

    async def close(self, idle: Sequence[WorkerProc] = ()) -> None:
        """Idle ones see EOF; then every worker is killed and reaped within one shared deadline."""
        if self.closed:
            return
        self.closed = True
        for w in idle:
            w.close_stdin()
        kids = list(self._children.values())
        for w in kids:
            _kill(w)
        t0 = time.monotonic()
        with anyio.move_on_after(self.deadlines.cleanup_reap, shield=True):
            for w in kids:
                await w.process.wait()
        late = [w for w in kids if w.process.returncode is None]
        for w in late:
            log.error(f"mps: worker {w.pid} not reaped {self.deadlines.cleanup_reap * 1e3:.0f} ms after SIGKILL; left behind")
        if late:
            # A process in the middle of a CUDA teardown exits a little later: reap it if it does
            # within a grace period, so that an embedding host is not left with zombies.
            with anyio.move_on_after(CLEANUP_GRACE_S, shield=True):
                for w in late:
                    await w.process.wait()
        for w in kids:
            if w.process.returncode is None:
                self.left_behind.append(w.pid)
            else:
                self._children.pop(w.pid, None)
        if late:
            log.info(f"mps: {sum(w.process.returncode is not None for w in late)} of {len(late)} late workers reaped after all")
        self.workers.clear()
        log.debug("workers reaped", n=len(kids), ms=round((time.monotonic() - t0) * 1e3, 1))
        self._stop.set()
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await self._runner


def _kill(w: WorkerProc) -> None:
    if w.process.returncode is None:
        w.killed = True
        try:
            os.kill(w.pid, 9)
        except ProcessLookupError:
            pass
