"""A worker's process: its pipes are asyncio streams connected straight to the loop.

``asyncio.create_subprocess_exec`` hands each chunk a child writes to its
protocol one loop iteration late (the subprocess transport forwards pipe data
with ``call_soon``), and every reply then costs one more trip round the loop
before the reader task even sees it.  On the ask path, where the loop is most
of the cost (docs/benchmarks.md, row b), that hop matters.  So a worker is
started with ``subprocess.Popen`` (what asyncio itself calls, in the loop
thread), its stdout and stdin become a ``StreamReader`` (a worker's: a
``wire.FrameReader``, which parses frames in the read callback) and a ``StreamWriter``
through ``connect_read_pipe`` / ``connect_write_pipe``, and its exit is seen
through a pidfd the loop watches, then reaped by pid.  Never ``waitpid(-1)``:
that would take the control daemon's orphans from daemon.py's reaper.

The object answers to what callers used of ``asyncio.subprocess.Process``:
``pid``, ``returncode``, ``stdin``, ``stdout``, ``wait()``, ``kill()``.

A worker in listen mode (live restore) is started without pipes: its frames go
over its socket, its output to a log file, since a worker that writes to a dead
daemon's pipe gets EPIPE.  A worker another meshd-mps started is not our child:
``Adopted`` watches it through a pidfd alone and cannot know its exit status.
Both answer to ``Process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

from meshd_mps.supervision import cpus
from meshd_mps.supervision.wire import FrameReader

#: How often a child's exit is polled where the kernel has no pidfd_open (before Linux 5.3).
POLL_S = 0.05

#: The Popen objects of children handed to another meshd-mps (``Child.detach``), by pid: kept until
#: the child is reaped (``note_reaped``), since a Popen collected while its child runs warns and
#: reaps it behind our back.
_DETACHED: dict[int, subprocess.Popen[bytes]] = {}


def note_reaped(pid: int, returncode: int) -> None:
    """A detached child of ours was reaped by whoever adopted it (an ``Adopted`` in this process,
    a test): its Popen is told, and let go."""
    popen = _DETACHED.pop(pid, None)
    if popen is not None:
        popen.returncode = returncode


class Process(Protocol):
    """What the supervisor needs of a worker's process, ours (Child) or adopted (Adopted)."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """The exit status once known: never for an adopted process that is not our child."""
        ...

    @property
    def exited(self) -> bool: ...

    async def wait(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...

    def detach(self) -> None: ...


class Child:
    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop, framed: bool = False):
        self._popen = popen
        self._framed = framed
        self._loop = loop
        self.pid = popen.pid
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.frames: FrameReader | None = None  # instead of stdout, for a worker (spawn's ``framed``)
        self._read_transport: asyncio.ReadTransport | None = None
        self._exited = asyncio.Event()
        self._pidfd = -1
        self._poll: asyncio.TimerHandle | None = None

    async def _connect(self) -> None:
        loop = self._loop
        if self._popen.stdout is not None and self._framed:
            self._read_transport, self.frames = await loop.connect_read_pipe(FrameReader, self._popen.stdout)
        elif self._popen.stdout is not None:
            reader = self.stdout = asyncio.StreamReader(limit=2**20, loop=loop)
            rt, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                                 self._popen.stdout)
            self._read_transport = rt
        if self._popen.stdin is not None:
            wt, wp = await loop.connect_write_pipe(lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(), loop=loop),
                                                   self._popen.stdin)
            self.stdin = asyncio.StreamWriter(wt, wp, None, loop)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._poll = loop.call_later(POLL_S, self._polled)
        else:
            loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> bool:
        """Reap it if it has exited; True once it has."""
        if self.returncode is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: the status is lost
            pid, status = self.pid, -1
        if pid == 0:
            return False
        self.returncode = os.waitstatus_to_exitcode(status) if status != -1 else 255
        self._popen.returncode = self.returncode  # else Popen.__del__ warns and reaps it again
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self._exited.set()
        return True

    def _polled(self) -> None:
        self._poll = None if self._reap() else self._loop.call_later(POLL_S, self._polled)

    @property
    def exited(self) -> bool:
        return self.returncode is not None

    def detach(self) -> None:
        """Stop watching it, leave it running: another meshd-mps adopts it (``Adopted``).  Its
        exit is no longer ours to reap; the process it runs is not touched."""
        self.close()
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        if self.returncode is None:
            _DETACHED[self.pid] = self._popen

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        self.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Close the pipes' transports (idempotent); the process is not touched."""
        if self.stdin is not None and not self.stdin.is_closing():
            self.stdin.close()
        if self._read_transport is not None and not self._read_transport.is_closing():
            self._read_transport.close()
        if self._poll is not None and self.returncode is not None:
            self._poll.cancel()
            self._poll = None


async def spawn(argv: Sequence[str], env: Mapping[str, str], *, stdin: bool = True, merge_stderr: bool = False,
                output: int | None = None, framed: bool = False) -> Child:
    """Start ``argv`` in a process group of its own, with a pipe on its stdout, and on its stdin
    (else /dev/null); its stderr is ours, or with ``merge_stderr`` its stdout's pipe.  ``framed``:
    its stdout carries worker frames (``Child.frames``, not ``stdout``).  With
    ``output`` (an fd: a log file) no pipe at all: stdin is /dev/null, stdout and stderr go to
    ``output``.  OSError if it cannot start."""
    loop = asyncio.get_running_loop()
    if output is not None:
        with cpus.for_child():  # on the children's CPUs, if the daemon has its own (--daemon-cpus)
            popen = subprocess.Popen(  # noqa: ASYNC220
                list(argv), stdin=subprocess.DEVNULL, stdout=output, stderr=output, env=dict(env), close_fds=True,
                bufsize=0, process_group=0)
        return await _connected(Child(popen, loop))
    # Popen, not create_subprocess_exec, on purpose: see the module's docstring (the pipes join
    # the loop directly).  Its fork is the same one asyncio would make, in this thread.
    # process_group=0: a process group of its own, so that a terminal's signals (Ctrl-C, the
    # shell's kill %1, a hang-up) reach only the daemon, which halts the programs in order.
    with cpus.for_child():
        popen = subprocess.Popen(  # noqa: ASYNC220
            list(argv), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else None, env=dict(env), close_fds=True, bufsize=0,
            process_group=0)
    return await _connected(Child(popen, loop, framed))


async def _connected(child: Child) -> Child:
    popen = child._popen
    try:
        await child._connect()
    except BaseException:
        popen.kill()
        popen.wait()
        child.close()
        raise
    return child


class Adopted:
    """A process that is not our child (a worker another meshd-mps started), watched through a
    pidfd: the loop sees its exit, but no one here can wait for it, so its exit status is unknown
    (``returncode`` stays None; ``exited`` says it is gone) unless it happens to be our child after
    all (a test's, a subreaper's), when it is reaped and its status kept.  Signals go through the
    pidfd, so a pid reused meanwhile is never signalled."""

    def __init__(self, pid: int, pidfd: int, loop: asyncio.AbstractEventLoop):
        self.pid = pid
        self._pidfd = pidfd
        self._loop = loop
        self._status: int | None = None
        self._exited = asyncio.Event()
        loop.add_reader(pidfd, self._gone)

    @classmethod
    def watch(cls, pid: int) -> Adopted:
        """ProcessLookupError if ``pid`` is gone already."""
        return cls(pid, os.pidfd_open(pid), asyncio.get_running_loop())

    @property
    def returncode(self) -> int | None:
        return self._status

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def _gone(self) -> None:
        with contextlib.suppress(ChildProcessError):  # not ours: the status is its parent's
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self._status = os.waitstatus_to_exitcode(status)
                note_reaped(pid, self._status)
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._exited.set()

    async def wait(self) -> int | None:
        await self._exited.wait()
        return self._status

    def send_signal(self, sig: int) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Nothing of its streams is ours (they are WorkerProc's socket); the watch ends at its exit."""

    def detach(self) -> None:
        """Stop watching it (handed on to the next meshd-mps)."""
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
