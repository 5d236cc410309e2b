"""One worker process as the supervisor sees it (the seed's ``proc``).

Its frames come in through a :class:`~meshd_mps.supervision.wire.FrameReader` on its stdout
(or, for a worker in listen mode, its socket), which hands each to ``_frame`` in the loop's read
callback; they go out through its stdin's ``StreamWriter`` (or the socket's ``SocketWriter``).
A task of the :class:`~meshd_mps.supervision.supervisor.Supervisor` (``read_frames``) awaits
only the end.  A request and its reply meet in a future; DONE frames arrive
on their own and resolve the launch's completion future.  A worker answers its
requests one at a time, in the order it reads them, so asks are matched to
replies in order (``_asked``): an ask waits for no other, and its deadline runs
from when the worker is done with the ones before it.  A frame that breaks the
protocol, a reply unasked, or one past its deadline makes the worker *unfit*: it
is never asked again and its owner retires it.

Its lifecycle is :class:`WorkerState`, changed only by :meth:`WorkerProc.to`, which refuses
the moves the table does not allow (supervisord's ``ProcessStates``).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable

import structlog

from meshd_mps.base import faults
from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import (
    FrameError,
    ImageRefused,
    NoContext,
    NoReply,
    StateError,
    WorkerError,
    WorkerGone,
    WorkerUnfit,
)
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Done, Hello, Op
from meshd_mps.supervision.child import Process
from meshd_mps.supervision.wire import FrameReader, SocketWriter

log = structlog.get_logger("meshd_mps")


class WorkerState(enum.Enum):
    STARTING = "starting"  # spawned; no request answered yet
    READY = "ready"  # answered: fit for requests (idle or running a kernel: see WorkerProc.running)
    FAULTED = "faulted"  # a launch failed on its stream: the context is not fit for another image
    UNFIT = "unfit"  # broke the protocol or missed a deadline: never asked again
    RETIRING = "retiring"  # told to exit (QUIT, EOF) or killed by us
    EXITED = "exited"  # its stdout closed: the process exited (or closed it)
    DETACHED = "detached"  # its socket closed by us (Supervisor.detach): it runs on, for the next daemon


#: The moves WorkerProc.to allows; EXITED is reached from every state (a process can die any time).
#: DETACHED (Supervisor.detach) from every state but the ends.
MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.FAULTED, WorkerState.UNFIT, WorkerState.RETIRING,
                                     WorkerState.DETACHED}),
    WorkerState.READY: frozenset({WorkerState.FAULTED, WorkerState.UNFIT, WorkerState.RETIRING, WorkerState.DETACHED}),
    WorkerState.FAULTED: frozenset({WorkerState.UNFIT, WorkerState.RETIRING, WorkerState.DETACHED}),
    WorkerState.UNFIT: frozenset({WorkerState.RETIRING, WorkerState.DETACHED}),
    WorkerState.RETIRING: frozenset(),
    WorkerState.EXITED: frozenset(),
    WorkerState.DETACHED: frozenset(),
}
#: Where a worker can be detached from.
DETACHABLE = frozenset(s for s, to in MOVES.items() if WorkerState.DETACHED in to)
#: Where a worker that may be asked can be.
ASKABLE = frozenset({WorkerState.STARTING, WorkerState.READY, WorkerState.FAULTED})


def _secs(s: float) -> str:
    """Rust's Duration Debug for whole seconds, as the seed prints it: "30s", "2s"."""
    return f"{s:g}s"


class _NoReply(Exception):
    """The ask's deadline passed before its reply came."""


class WorkerProc:
    def __init__(self, process: Process, on_unfit: Callable[[WorkerProc], None], deadlines: Deadlines = DEFAULT,
                 link: tuple[FrameReader, SocketWriter] | None = None):
        """``link``: the worker's frames, read and written, when they are not the process's
        stdout and stdin (a worker in listen mode: its socket)."""
        reader: FrameReader | None
        writer: asyncio.StreamWriter | SocketWriter | None
        if link is None:
            reader, writer = getattr(process, "frames", None), getattr(process, "stdin", None)
        else:
            reader, writer = link
        assert reader is not None and writer is not None
        self.process = process
        self.pid = process.pid
        self.program: str | None = None  # for log lines: the image it runs, if any
        self._reader, self._stdin = reader, writer
        self.socket: str | None = None  # the socket it listens on (listen mode), for adoption
        self.log_file: str | None = None  # where its output goes (listen mode)
        self.hello: Hello | None = None  # what it said when we connected (listen mode)
        #: Its launches whose DONE we had not had when we adopted it, by (module, gen): each future
        #: resolves with that DONE (ended while no daemon was connected: right after HELLO).
        self.outstanding: dict[tuple[int, int], asyncio.Future[Done]] = {}
        self._on_unfit = on_unfit
        self.deadlines = deadlines
        self._transport: asyncio.WriteTransport = writer.transport
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it is asked on (set at the first ask)
        #: The asks sent and not answered, in order: each one's reply future and its deadline's length.
        self._asked: deque[tuple[asyncio.Future[tuple[Op, bytes]], float]] = deque()
        self._deadline = 0.0  # the oldest ask's (monotonic); its watchdog (_watch) re-arms itself
        self._watchdog: asyncio.TimerHandle | None = None
        self._watching_until = 0.0  # when the armed watchdog fires
        self.gen: dict[int, int] = {}  # module -> last launch's generation
        self.done: dict[int, int] = {}  # module -> last generation whose stream finished
        self._waiters: dict[tuple[int, int], asyncio.Future[Done]] = {}
        self.state = WorkerState.STARTING
        self.err: str | None = None  # the first stream error, "worker N: ..."
        self.unfit: str | None = None  # why it must not be used again (it broke the protocol or hung)
        self.exited_from: WorkerState | None = None  # the state it was in when its stdout closed
        self.exited = asyncio.Event()
        self.device = 0  # the GPU its context is on (Mps sets it)
        self.exited_running_at = 0.0  # monotonic time it exited on its own with a kernel launched
        #: SIGKILLed by us (a retire's or the cleanup's kill): evidence, not a state.  A worker
        #: retired after it was killed from outside is RETIRING too, but its -9 is not ours.
        self.killed = False

    def to(self, state: WorkerState, why: str = "") -> bool:
        """The one way the state changes; False if it is there already, StateError if the table
        (MOVES) does not allow the move.  EXITED is reached from anywhere."""
        if state == self.state:
            return False
        if state != WorkerState.EXITED and state not in MOVES[self.state]:
            raise StateError(f"worker {self.pid}: {self.state.value} -> {state.value} is not a move a worker makes",
                             what=f"worker {self.pid}", frm=self.state.value, to=state.value)
        if state == WorkerState.EXITED:
            self.exited_from = self.state
        log.debug("worker state", pid=self.pid, frm=self.state.value, to=state.value, why=why)
        self.state = state
        return True

    @property
    def dead(self) -> bool:
        """Its stdout closed: the process exited (or closed it)."""
        return self.state == WorkerState.EXITED

    def __repr__(self) -> str:
        return f"<worker {self.pid}{' ' + self.program if self.program else ''}>"

    # ---- reading ----------------------------------------------------------------------------
    async def read_frames(self) -> None:
        """Until the worker's stdout (or socket) ends or a frame breaks the protocol: the frames
        themselves are taken as they arrive (``_frame``, from the FrameReader's read callback);
        the end is dealt with here, in this task, so that its owner's reaction to the exit
        (Supervisor._read) follows in the same step, before any waiter of its futures runs."""
        self._reader.attach(self._frame)
        try:
            await self._reader.ended.wait()
            why = self._reader.why
            if isinstance(why, FrameError):
                self.mark_unfit(f"worker {self.pid}: bad frame: {why}")
            elif why is not None:
                self.mark_unfit(f"worker {self.pid}: stdout: {why}")
        finally:
            self._closed()

    def _frame(self, op: Op, body: bytes) -> None:
        if op == Op.DONE:
            d = Done.decode(body)
            if not d.ok and self.err is None:
                self.err = f"worker {self.pid}: {d.message}"
                if self.state in (WorkerState.STARTING, WorkerState.READY):
                    self.to(WorkerState.FAULTED, self.err)
            if d.gen > self.gen.get(d.module, 0):
                raise FrameError(f"DONE for generation {d.gen} of module {d.module}, never launched")
            self.done[d.module] = d.gen
            waiter = self._waiters.pop((d.module, d.gen), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(d)
            return
        if op not in frames.REPLIES:
            raise FrameError(f"op {op.name} is not a worker's frame")
        asked = self._asked
        if not asked:
            raise FrameError(f"unsolicited reply {op.name}")
        fut, _ = asked.popleft()
        if asked:  # the next ask's deadline runs from now: the worker starts on it
            self._watch_until(time.monotonic() + asked[0][1])
        if not fut.done():  # done: its caller gave up (a cancel), and its reply is dropped
            fut.set_result((op, body))

    def _closed(self) -> None:
        if not self._stdin.is_closing():  # a socket's other direction (a pipe's is closed at the reap)
            self._stdin.close()
        if self.state == WorkerState.DETACHED:
            # Closed by us, quietly: the process and its launches go on, their DONEs go to the next
            # daemon; an ask in flight cannot be answered here any more.
            self.exited.set()
            self._fail_asks(lambda: WorkerGone(f"worker {self.pid}: detached", pid=self.pid))
            return
        unfit = self.unfit
        self.to(WorkerState.EXITED, unfit or "stdout closed")
        self.exited.set()
        self._fail_asks(lambda: WorkerUnfit(unfit, pid=self.pid) if unfit
                        else WorkerGone(f"worker {self.pid} exited", pid=self.pid))
        for (_module, _gen), fut in self._waiters.items():
            if not fut.done():
                fut.set_exception(WorkerGone(self.err or f"worker {self.pid} exited while its kernel ran", pid=self.pid))
        self._waiters.clear()

    def mark_unfit(self, why: str) -> None:
        if self.unfit is not None:
            return
        self.unfit = why
        log.error("worker unfit", pid=self.pid, program=self.program, why=why)
        if self.state in ASKABLE:
            self.to(WorkerState.UNFIT, why)
        self._fail_asks(lambda: WorkerUnfit(why, pid=self.pid))
        self._on_unfit(self)

    def _fail_asks(self, error: Callable[[], BaseException]) -> None:
        """Every ask not answered fails with ``error()``; no reply is matched to them any more."""
        for fut, _ in self._asked:
            if not fut.done():
                fut.set_exception(error())
        self._asked.clear()

    @property
    def asking(self) -> bool:
        """An ask is waiting for its reply."""
        return bool(self._asked)

    def detach(self) -> None:
        """Close its connection without a word (its socket: a worker in listen mode waits for the
        next daemon); its launches' futures stay unresolved.  The reader ends at the EOF."""
        if self.state in DETACHABLE:
            self.to(WorkerState.DETACHED, "detached")
        if not self._stdin.is_closing():
            self._stdin.close()

    def adopted(self, hello: Hello) -> None:
        """Take over what the worker said it runs: each module's generation, a future for each
        launch whose DONE we have not had (``outstanding``), its GPU."""
        self.hello = hello
        self.device = hello.device
        for m in hello.modules:
            self.gen[m.id] = m.gen
            self.done[m.id] = m.gen
        loop = self._on_loop()
        for la in hello.launches:
            self.gen[la.module] = max(self.gen.get(la.module, 0), la.gen)
            self.done[la.module] = min(self.done.get(la.module, la.gen), la.gen - 1)
            fut: asyncio.Future[Done] = loop.create_future()
            self._waiters[(la.module, la.gen)] = fut
            self.outstanding[(la.module, la.gen)] = fut

    def retiring(self) -> None:
        """Told to exit, or killed, by its owner: whatever it does next is not on its own."""
        if self.state not in (WorkerState.RETIRING, WorkerState.EXITED):
            self.to(WorkerState.RETIRING)

    def died_on_its_own(self) -> bool:
        """Its process ended on its own (faults.died_on_its_own): evidence that it faulted the GPU."""
        return faults.died_on_its_own(self.process.returncode, self.exited_running_at > 0, self.killed)

    # ---- writing ----------------------------------------------------------------------------
    def _write(self, frame: bytes) -> bool:
        """``frame`` handed to the transport (which writes it at once if the pipe has room);
        True if the caller must wait for it to drain (a full pipe: a cubin), or see it fail."""
        t = self._transport
        if t.is_closing():
            raise WorkerGone(f"worker {self.pid}: stdin closed", pid=self.pid)
        t.write(frame)
        return bool(t.get_write_buffer_size()) or t.is_closing()

    async def _drain(self) -> None:
        try:
            await self._stdin.drain()
        except (ConnectionError, OSError) as e:
            raise WorkerGone(f"worker {self.pid}: {e.strerror or e}", pid=self.pid) from e

    async def send(self, op: Op, body: bytes = b"") -> None:
        """A frame that is not answered (UNLOAD, QUIT)."""
        if self._write(frames.encode(op, body)):
            await self._drain()

    def close_stdin(self) -> None:
        """EOF on the worker's stdin: an idle worker exits on it."""
        if not self._stdin.is_closing():
            self._stdin.close()

    async def ask(self, op: Op, body: bytes = b"") -> bytes:
        """Send request ``op``, wait for its reply (``frames.REPLY``) within its deadline
        (``Deadlines.reply``), which runs from when the worker has answered the asks before it;
        the reply's payload.  WorkerGone if the worker is gone, WorkerUnfit (NoReply) if it broke
        the protocol or missed the deadline, ImageRefused if the driver refused an image,
        WorkerError for a request it refused.  This is every LAUNCH's path (docs/benchmarks.md,
        row b): no lock (the order of the replies matches them), no task, one timer per worker."""
        want = frames.REPLY[op]
        within = self.deadlines.reply(op)
        if self.unfit:
            raise WorkerUnfit(self.unfit, pid=self.pid)
        if self.state not in ASKABLE:
            raise WorkerGone(f"worker {self.pid} exited" if self.dead else f"worker {self.pid} is retiring", pid=self.pid)
        fut: asyncio.Future[tuple[Op, bytes]] = self._on_loop().create_future()
        asked = self._asked
        asked.append((fut, within))
        if len(asked) == 1:
            self._watch_until(time.monotonic() + within)
        try:
            drain = self._write(frames.encode(op, body))
        except BaseException:
            asked.pop()  # ours (nothing ran since the append), and not written: no reply will come
            raise
        if drain:
            try:
                await self._drain()
            except BaseException:
                fut.cancel()  # written: its reply, if one comes, keeps its place and is dropped
                raise
        try:
            got, reply = await fut
        except _NoReply as e:  # the watchdog has marked the worker unfit: a late reply would be taken for the next one's
            raise NoReply(f"worker {self.pid}: no reply in {_secs(within)}", pid=self.pid, within=within) from e
        if got != want:
            why = f"worker {self.pid}: reply {got.name}, expected {want.name}"
            self.mark_unfit(why)
            raise WorkerUnfit(why, pid=self.pid)
        try:
            ok, payload = frames.split_reply(got, reply)
        except FrameError as e:
            why = f"worker {self.pid}: bad frame: {e}"
            self.mark_unfit(why)
            raise WorkerUnfit(why, pid=self.pid) from e
        if self.state == WorkerState.STARTING:
            self.to(WorkerState.READY)
        if ok == frames.OK:
            return payload
        if ok == frames.NO_ENTRY:
            raise frames.NoEntry(driver=frames.reply_text(payload))
        if ok == frames.REFUSED:
            text = frames.reply_text(payload)
            raise ImageRefused(f"worker {self.pid}: {text}", driver=text)
        kind = NoContext if op == Op.READY else WorkerError
        raise kind(f"worker {self.pid}: {frames.reply_text(payload)}", pid=self.pid)

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the worker is asked on (its transport's), looked up once: get_running_loop()
        costs a getpid(2) a call on CPython 3.11 (its fork check), a syscall a launch on row b's
        hot path (as strace showed)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _watch_until(self, deadline: float) -> None:
        """The oldest ask's deadline.  Its watchdog is one timer per worker that re-arms itself
        for the ask pending when it fires, and stays unarmed while nothing is: not a timer per ask,
        nor an anyio scope (~2 us and ~5-10 us of the loop each, on the hot path of row b)."""
        self._deadline = deadline
        if self._watchdog is None or deadline < self._watching_until:
            if self._watchdog is not None:
                self._watchdog.cancel()
            self._watching_until = deadline
            loop = self._on_loop()
            self._watchdog = loop.call_at(loop.time() + (deadline - time.monotonic()), self._watch)

    def _watch(self) -> None:
        self._watchdog = None
        if not self._asked:
            return
        fut, within = self._asked[0]
        if (left := self._deadline - time.monotonic()) <= 0:
            if not fut.done():
                fut.set_exception(_NoReply())  # its ask raises NoReply
            # Unfit here, not in the asking task: that task may be cancelled before it runs again
            # (its caller's own timeout, in the same turn of the loop), and the late ask would
            # then stay at the head of ``_asked`` with no watchdog left for the asks behind it.
            self.mark_unfit(f"worker {self.pid}: no reply in {_secs(within)}")
        else:
            self._watching_until = self._deadline
            self._watchdog = self._on_loop().call_later(left, self._watch)

    # ---- launches ---------------------------------------------------------------------------
    def next_gen(self, module: int) -> tuple[int, asyncio.Future[Done]]:
        """A new launch generation of ``module`` and the future its DONE resolves."""
        gen = self.gen.get(module, 0) + 1
        self.gen[module] = gen
        fut: asyncio.Future[Done] = self._on_loop().create_future()
        self._waiters[(module, gen)] = fut
        return gen, fut

    def query(self, module: int = 0) -> bool:
        """The last launch's stream finished; WorkerError on a stream error or a death."""
        if self.err:
            raise WorkerError(self.err, pid=self.pid)
        d = self.done.get(module, 0) == self.gen.get(module, 0)
        if not d and self.dead:
            raise WorkerGone(f"worker {self.pid} exited while its kernel ran", pid=self.pid)
        return d

    def running(self) -> bool:
        """A launch asked for whose DONE has not come: its kernel may still run."""
        return any(self.done.get(m, 0) != g for m, g in self.gen.items())

    def idle(self) -> bool:
        """Alive, fit, no stream error, nothing running: fit for another image."""
        if self.state not in (WorkerState.STARTING, WorkerState.READY):
            return False
        return all(self.done.get(m, 0) == g for m, g in self.gen.items())
