"""The owner of every worker process and of the tasks that serve them.

The supervisor's anyio task group holds each worker's reader task, each
retirement and every task its owners start (``start_soon``), so no task is
fire-and-forget and close() ends them all.  The group lives in its owner's
scope: ``async with Supervisor() as sup`` enters it in the owner's task, so
that a task's failure reaches the owner.  A host that cannot nest
(``b = await Backend.open()``) calls ``start()`` instead: the group then lives
in one task of the supervisor's that ``close()`` awaits, re-raising what it raised.  Retire is the seed's: QUIT, 2 s
to exit, SIGKILL, 2 s more, else "left behind".  Cleanup is the seed's too:
idle workers get EOF, every worker SIGKILL, one shared 500 ms reap deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from meshd_mps.deadlines import DEFAULT, Deadlines
from meshd_mps.errors import MeshError, SpawnFailed, WorkerError
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision import child, procfs
from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")


class Supervisor:
    def __init__(self, deadlines: Deadlines = DEFAULT) -> None:
        self.deadlines = deadlines
        self._tg: TaskGroup | None = None
        self._group_cm: TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._scopes: set[anyio.CancelScope] = set()  # every task's own: close() cancels them
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
        #: Called with each worker whose stdout ended on its own (not at close): the pool drops a
        #: pooled worker that died while idle at once, so that status and metrics never count it.
        self.exit_hooks: list[Callable[[WorkerProc], None]] = []

    async def __aenter__(self) -> Supervisor:
        """The task group entered in the owner's task: the structured form."""
        self._group_cm = anyio.create_task_group()
        self._tg = await self._group_cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.close()
        assert self._group_cm is not None
        return await self._group_cm.__aexit__(*exc)

    async def start(self) -> None:
        """The task group in a task of the supervisor's own, for a host that cannot nest; close()
        ends it and re-raises what its tasks raised."""
        started = asyncio.Event()

        async def run() -> None:
            async with self:
                started.set()
                await self._stop.wait()

        self._runner = asyncio.create_task(run(), name="meshd-mps supervisor")
        up = asyncio.ensure_future(started.wait())
        done, _ = await asyncio.wait({self._runner, up}, return_when=asyncio.FIRST_COMPLETED)
        up.cancel()  # a runner that failed to enter its group never sets it: no waiter left pending
        if self._runner in done:
            self._runner.result()

    def _group(self) -> TaskGroup:
        if self._tg is None or self.closed:
            raise WorkerError("supervisor closed")
        return self._tg

    def _owned(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> None:
        """``fn(*args)`` as a task of the group, in a cancel scope of its own that close() cancels."""
        scope = anyio.CancelScope()

        async def run() -> None:
            self._scopes.add(scope)
            try:
                with scope:
                    await fn(*args)
            finally:
                self._scopes.discard(scope)

        self._group().start_soon(run, name=name)

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], program: str | None = None) -> WorkerProc:
        """A new worker process with its reader task; stderr passes through to ours."""
        self._group()
        try:
            process = await child.spawn(argv, env)
        except OSError as e:
            raise SpawnFailed(f"mps worker: {argv[0]}: {e.strerror or e}") from e
        w = WorkerProc(process, self._unfit, self.deadlines)
        w.program = program
        self.workers[w.pid] = w
        self._children[w.pid] = w
        self._owned(self._read, w, name=f"reader {w.pid}")
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
            for hook in self.exit_hooks:
                hook(w)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str) -> None:
        """Run a task owned by the supervisor's task group (cancelled at close)."""
        self._owned(fn, *args, name=name)

    def _unfit(self, w: WorkerProc) -> None:
        """A worker that broke the protocol or hung is retired at once."""
        if w.pid in self.workers and not self.closed:
            self.retire(w)

    def retire(self, w: WorkerProc, before_exit: bool = True, at_once: bool = False) -> None:
        """QUIT, then reaped by a task of ours (killed if it lingers); never blocks the caller.
        ``before_exit=False``: not the ``before_exit`` hook (the GPU's clients are torn down by a
        fault already; on the H200 a terminate_client then hung and the server's teardown never
        ended).  ``at_once``: SIGKILL first (a fault's teardown: its context is dead already, and the
        server takes no new client until every torn-down one has exited)."""
        if self.workers.pop(w.pid, None) is None:
            if at_once:
                _kill(w)  # retiring already, by QUIT: not worth the wait
            return
        if self.closed:
            return
        w.retiring()
        if at_once:
            _kill(w)
        self._owned(self._retire, w, before_exit, name=f"retire {w.pid}")

    async def _retire(self, w: WorkerProc, before_exit: bool = True) -> None:
        with structlog.contextvars.bound_contextvars(pid=w.pid, program=w.program):
            if before_exit and self.before_exit is not None and not w.dead and w.running():
                try:
                    with anyio.move_on_after(self.deadlines.retire_quit):
                        await self.before_exit(w)
                except MeshError as e:
                    log.warning(f"mps: worker {w.pid}: {e}; retiring it anyway")
            if w.unfit is None and not w.dead:
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
            with anyio.move_on_after(self.deadlines.cleanup_grace, shield=True):
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
        log.debug("workers reaped", n=len(kids), ms=round((time.monotonic() - t0) * 1e3, 1),
                  statuses={w.pid: w.process.returncode for w in kids})
        for scope in list(self._scopes):
            scope.cancel()
        self._stop.set()
        if self._runner is not None and self._runner is not asyncio.current_task():
            with anyio.CancelScope(shield=True):
                await asyncio.wait({self._runner})
            self._runner.result()  # what a task of the group raised


def _kill(w: WorkerProc) -> None:
    """Our SIGKILL.  One that finds the process exited already (a zombie not yet reaped: killed from
    outside, say) is not ours: ``killed`` stays False, which is the fault evidence (faults.py)."""
    if w.process.returncode is None:
        w.retiring()
        w.killed = procfs.running(w.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, 9)
