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

Live restore: a worker spawned with ``listen=DIR`` serves its frames on
``DIR/<pid>.sock`` and outlives us; ``detach()`` stops the supervisor without retiring such
workers (their connections closed, nothing killed), and the next meshd-mps's supervisor
``adopt()``s each one by its socket: the same process, its HELLO (docs/protocol.md) saying what it
runs.  Reaching such a worker and checking its HELLO is handshake.py's.
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

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import MeshError, ProtocolMismatch, SpawnFailed, WorkerError, WorkerGone
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision import child, handshake, procfs
from meshd_mps.supervision.proc import DETACHABLE, WorkerProc, WorkerState

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
        self._dismissing: list[WorkerProc] = []  # refused by adopt for their protocol version (dismiss)

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

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], program: str | None = None, *,
                    listen: str | None = None) -> WorkerProc:
        """A new worker process with its reader task; stderr passes through to ours.

        ``listen``: a directory (made 0700 if missing) where the worker serves its frames on
        ``<pid>.sock`` and writes its output to ``<pid>.log``, so that it outlives us (live
        restore): it is started with ``--listen`` and its orphan and halt deadlines, we connect
        (within ``Deadlines.connect``) and read its HELLO (``Deadlines.hello``) into ``w.hello``."""
        self._group()
        if listen is not None:
            return await self._spawn_listening(argv, env, program, listen)
        try:
            process = await child.spawn(argv, env, framed=True)
        except OSError as e:
            raise SpawnFailed(f"mps worker: {argv[0]}: {e.strerror or e}") from e
        await self._closed_meanwhile(process)
        w = WorkerProc(process, self._unfit, self.deadlines)
        w.program = program
        self._own(w)
        log.debug("worker spawned", pid=w.pid)
        return w

    async def _closed_meanwhile(self, process: child.Child) -> None:
        """A process whose start ``close`` came during (it kills only the workers it knows): ended
        here, and the spawn refused, so that nothing is left behind."""
        if not self.closed:
            return
        process.kill()
        with anyio.move_on_after(self.deadlines.retire_kill, shield=True):
            await process.wait()
        if process.returncode is None:
            self.left_behind.append(process.pid)
        raise WorkerError("supervisor closed")

    def _own(self, w: WorkerProc) -> None:
        self.workers[w.pid] = w
        self._children[w.pid] = w
        self._owned(self._read, w, name=f"reader {w.pid}")

    async def _spawn_listening(self, argv: Sequence[str], env: Mapping[str, str], program: str | None,
                               dir: str) -> WorkerProc:
        dir, fd, spawning = handshake.listen_dir(dir)
        d = self.deadlines
        argv = [*argv, "--listen", dir, "--orphan-timeout", f"{d.orphan:g}", "--halt-within", f"{d.orphan_halt:g}"]
        try:
            process = await child.spawn(argv, env, output=fd)
        except OSError as e:
            os.unlink(spawning)
            raise SpawnFailed(f"mps worker: {argv[0]}: {e.strerror or e}") from e
        finally:
            os.close(fd)
        log_file = os.path.join(dir, f"{process.pid}.log")
        os.replace(spawning, log_file)
        path = frames.listen_path(dir, process.pid)
        try:
            link = await handshake.connect(path, process, self.deadlines)
            try:
                hello = await handshake.check_hello(link, process.pid, path, self.deadlines)
            except BaseException:
                link[1].close()
                raise
        except BaseException:
            process.kill()
            with anyio.move_on_after(self.deadlines.retire_kill, shield=True):
                await process.wait()
            if process.returncode is None:
                self.left_behind.append(process.pid)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        if self.closed:
            link[1].close()
            for left in (path, log_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(left)
            await self._closed_meanwhile(process)
        w = WorkerProc(process, self._unfit, self.deadlines, link=link)
        w.program, w.socket, w.log_file, w.hello = program, path, log_file, hello
        self._own(w)
        log.debug("worker spawned", pid=w.pid, socket=path)
        return w

    async def adopt(self, path: str, *, to_end: bool = False) -> WorkerProc:
        """The worker that listens on ``path`` (started by an earlier meshd-mps with ``listen``),
        taken over: connected, its HELLO checked (``PeerMismatch``: left as it runs; ``ProtocolMismatch``: kept for
        ``dismiss``, or left as
        it runs) and taken in (``w.hello``; ``w.outstanding``: a future per launch not yet
        reported, resolved by its DONE; ``w.gen``, ``w.device``).  Its exit is watched through a
        pidfd; it is not our child, so its exit status stays unknown.  ``WorkerGone`` if no
        process listens there any more; a socket file left by a dead worker is removed.  The
        worker is in state STARTING, as a spawned one: the caller asks READY.  ``to_end``: taken over
        only to be halted and ended (a start without live restore), and logged so, not as adopted."""
        self._group()
        named = os.path.basename(path).removesuffix(".sock")
        pid_of_name = int(named) if named.isdigit() else 0
        try:
            link = await handshake.open_link(path)
        except FileNotFoundError as e:
            raise WorkerGone(f"worker {pid_of_name}: no socket at {path}", pid=pid_of_name) from e
        except ConnectionRefusedError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise WorkerGone(f"worker {pid_of_name} is gone (nothing listens on {path}); its socket removed",
                             pid=pid_of_name) from e
        except OSError as e:
            raise WorkerGone(f"worker {pid_of_name}: {path}: {e.strerror or e}", pid=pid_of_name) from e
        try:
            hello = await handshake.check_hello(link, None, path, self.deadlines)
        except ProtocolMismatch as e:
            self._unadopted(e.pid, path, link)  # its connection kept: dismiss tells it to QUIT
            raise
        except BaseException:
            link[1].close()
            raise
        try:
            process = child.Adopted.watch(hello.pid)
        except ProcessLookupError as e:
            link[1].close()
            raise WorkerGone(f"worker {hello.pid} exited as it was adopted", pid=hello.pid) from e
        w = WorkerProc(process, self._unfit, self.deadlines, link=link)
        w.socket = path
        w.log_file = os.path.join(os.path.dirname(path), f"{hello.pid}.log")  # if it has one: removed with it
        w.adopted(hello)
        self._own(w)
        what = "found, left running by an earlier meshd-mps: to be halted and ended" if to_end else "adopted"
        log.info(f"mps: worker {w.pid} {what}", pid=w.pid, device=hello.device,
                 modules=[m.name for m in hello.modules], launches=len(hello.launches))
        return w

    def _unadopted(self, pid: int, path: str, link: handshake.Link) -> None:
        """A worker of another protocol version: kept (its connection, a pidfd) for ``dismiss``."""
        try:
            process = child.Adopted.watch(pid)
        except ProcessLookupError:
            return
        w = WorkerProc(process, self._unfit, self.deadlines, link=link)
        w.socket = path
        self._dismissing.append(w)

    async def dismiss(self) -> list[int]:
        """The workers ``adopt`` refused for their protocol version, told to QUIT (the op every
        version has) and awaited (``retire_quit``), killed past it (``retire_kill``).  The caller
        halts their kernels first, through the mailbox: a worker exits at QUIT at once, and under
        MPS an exit with a kernel running faults the GPU.  Returns their pids."""
        ws, self._dismissing = self._dismissing, []
        for w in ws:
            with contextlib.suppress(WorkerError):
                await w.send(Op.QUIT)
            w.close_stdin()
        d = self.deadlines
        with anyio.move_on_after(d.retire_quit):
            for w in ws:
                await w.process.wait()
        for w in ws:
            if not w.process.exited:
                log.error(f"mps: worker {w.pid} (another protocol version) did not QUIT in {d.retire_quit:g} s; killing it")
                w.process.kill()
        with anyio.move_on_after(d.retire_kill):
            for w in ws:
                await w.process.wait()
        for w in ws:
            if not w.process.exited:
                self.left_behind.append(w.pid)
            elif w.socket is not None:
                _forget_files(w)
        return [w.pid for w in ws]

    def leave_unadopted(self) -> None:
        """The workers ``adopt`` refused for their protocol version, not dismissed: their
        connections closed, left as they run (each waits for its orphan timeout)."""
        for w in self._dismissing:
            w.close_stdin()
            w.process.detach()
        self._dismissing = []

    async def detach(self) -> list[int]:
        """Stop without retiring the workers on sockets (live restore): their connections closed,
        nothing killed; each waits for its orphan timeout, for the next meshd-mps to adopt it.
        Their reader tasks end quietly, their launches' futures stay unresolved.  Workers on pipes
        cannot outlive us and are closed as ``close()`` closes them.  Returns the detached pids."""
        if self.closed:
            return []
        kept = [w for w in self._children.values()
                if w.socket is not None and w.state in DETACHABLE and not w.process.exited]
        for w in kept:
            w.detach()
            w.process.detach()
            self._children.pop(w.pid, None)
            self.workers.pop(w.pid, None)
        if kept:
            log.info(f"mps: {len(kept)} workers detached; they run on for the next meshd-mps",
                     pids=sorted(w.pid for w in kept))
        await self.close()
        return sorted(w.pid for w in kept)

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
            if not w.process.exited:
                log.error(f"mps: worker {w.pid} did not exit in {d.retire_quit:g} s; killing it")
                _kill(w)
                with anyio.move_on_after(d.retire_kill):
                    await w.process.wait()
            if not w.process.exited:
                log.error(f"mps: worker {w.pid} not reaped {d.retire_kill:g} s after SIGKILL; left behind")
                self.left_behind.append(w.pid)
            else:
                log.info(f"mps: worker {w.pid} exited", status=w.process.returncode)
                self._children.pop(w.pid, None)
                _forget_files(w)
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
        self.leave_unadopted()
        for w in idle:
            w.close_stdin()
        kids = list(self._children.values())
        for w in kids:
            _kill(w)
        t0 = time.monotonic()
        with anyio.move_on_after(self.deadlines.cleanup_reap, shield=True):
            for w in kids:
                await w.process.wait()
        late = [w for w in kids if not w.process.exited]
        d = self.deadlines
        for w in late:
            log.warning(f"mps: worker {w.pid} not reaped {d.cleanup_reap * 1e3:.0f} ms after SIGKILL; waiting up to"
                        f" {d.cleanup_grace:g} s more")
        if late:
            # A process in the middle of a CUDA teardown exits a little later: reap it if it does
            # within a grace period, so that an embedding host is not left with zombies; only what
            # outlives that is left behind, and said so.
            with anyio.move_on_after(d.cleanup_grace, shield=True):
                for w in late:
                    await w.process.wait()
        for w in kids:
            if not w.process.exited:
                log.error(f"mps: worker {w.pid} not reaped {d.cleanup_reap + d.cleanup_grace:g} s after SIGKILL;"
                          " left behind")
                self.left_behind.append(w.pid)
            else:
                self._children.pop(w.pid, None)
                _forget_files(w)
        if late:
            log.info(f"mps: {sum(w.process.exited for w in late)} of {len(late)} late workers reaped after all")
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
    """Our SIGKILL.  One that finds the process exiting or exited already (killed from outside, say:
    a zombie not yet reaped, or a CUDA client still in its exit) is not ours: ``killed`` stays False,
    which is the fault evidence (faults.py).  A second one that finds our first one's exit under way
    (a retire's kill after the teardown's, ~0.2 s for a CUDA client) leaves it ours."""
    if not w.process.exited:
        w.retiring()
        w.killed = w.killed or not procfs.ending(w.pid)
        w.process.kill()


def _forget_files(w: WorkerProc) -> None:
    """A listen-mode worker reaped: its socket removed (a SIGKILL leaves it), and its log too
    unless it exited on its own (then it is the evidence)."""
    if w.socket is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(w.socket)
    on_its_own = w.exited_from not in (None, WorkerState.RETIRING)
    if w.log_file is not None and not on_its_own:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(w.log_file)
