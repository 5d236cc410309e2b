"""What a worker keeps so that it can outlive its daemon (live restore).

A worker in listen mode (``--listen DIR``) serves its frames on a Unix socket it creates at
``DIR/<pid>.sock`` instead of stdin/stdout, one daemon connection at a time.  Its kernels do not
depend on the connection: when it closes (the daemon died, or stopped for a live restore) the
worker keeps them running and waits ``--orphan-timeout`` seconds for the next daemon.  Each
daemon that connects first gets a HELLO (``frames.Hello``: who the worker is, its modules, its
launches not yet reported), then the DONEs that came while none was connected.  If none comes in
time, the worker halts its own kernels (CONTROL = HALT in each running slot, their ends awaited
for ``--halt-within`` seconds) before it exits 0: under MPS a client that exits with its kernel
running faults the GPU's other clients (docs/reliability.md).  At stdin EOF (today's pipes) it
halts them the same way before it exits.  QUIT exits at once, as ever: the daemon halts first (a
daemon that cannot adopt a worker of another protocol version halts its slots through the mailbox,
then tells it to QUIT, the op every version understands).

``Book`` is the worker's account of its modules and launches; ``Link`` is the channel to
whichever daemon is connected now, and the one place a DONE is either written or queued, so that
HELLO and the queue always agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Done, Hello, HelloLaunch, HelloModule, Loaded, Op
from meshd_mps.protocol.mailbox import Mailbox

from . import pipes, wlog

log = wlog.log


@dataclass
class _Launch:
    slot: int
    nodes: int
    running: bool = True


class Link:
    """The worker's modules and launches, and the channel to the daemon connected now (None while
    none is).  One lock covers both: a DONE is written to the channel or queued, never lost
    between a HELLO and the queue that follows it."""

    def __init__(self, device: int, mailbox: str):
        self.device = device
        self.mailbox = mailbox
        self._cv = threading.Condition()
        self._ch: _Writer | None = None
        self._modules: dict[int, HelloModule] = {}  # id -> name, last launch's gen, tag, LOADED report
        self._launches: dict[tuple[int, int], _Launch] = {}  # whose DONE no daemon has had yet
        self._queue: list[Done] = []  # DONEs of launches that ended while no daemon was connected

    # ---- the book -------------------------------------------------------------------------
    def loaded(self, module: int, name: str, tag: int, info: Loaded) -> None:
        with self._cv:
            self._modules[module] = HelloModule(module, 0, name, tag, info)

    def unloaded(self, module: int) -> None:
        with self._cv:
            self._modules.pop(module, None)

    def launching(self, module: int, gen: int, slot: int, nodes: int) -> None:
        """Before the launch itself: its DONE can come before the launch call returns."""
        with self._cv:
            m = self._modules.get(module)
            if m is not None:
                self._modules[module] = dataclasses.replace(m, gen=gen)
            self._launches[(module, gen)] = _Launch(slot, nodes)

    def not_launched(self, module: int, gen: int) -> None:
        with self._cv:
            self._launches.pop((module, gen), None)

    def running(self) -> list[tuple[int, int, int]]:
        """(module, gen, slot) of each launch still running."""
        with self._cv:
            return [(m, g, la.slot) for (m, g), la in self._launches.items() if la.running]

    def hello(self) -> Hello:
        with self._cv:
            return self._hello()

    def _hello(self) -> Hello:
        return Hello(
            frames.PROTOCOL_VERSION, os.getpid(), self.device,
            tuple(m for _, m in sorted(self._modules.items())),
            tuple(HelloLaunch(m, g, la.slot, la.nodes, la.running) for (m, g), la in sorted(self._launches.items())),
            self.mailbox)

    # ---- the channel ----------------------------------------------------------------------
    def done(self, d: Done) -> None:
        """A launch ended (a completion thread): its DONE to the daemon, or queued for the next."""
        with self._cv:
            la = self._launches.get((d.module, d.gen))
            if la is not None:
                la.running = False
            self._cv.notify_all()
            if self._ch is not None:
                try:
                    self._ch.write(Op.DONE, d.encode())
                except OSError:
                    self._ch = None  # the daemon is gone: its reader sees EOF, the next one gets it
                else:
                    self._launches.pop((d.module, d.gen), None)
                    return
            self._queue.append(d)

    def attach(self, ch: _Writer, hello: bool) -> None:
        """A daemon connected: HELLO (in listen mode), the queued DONEs, then it gets every frame.
        OSError if it is gone already."""
        with self._cv:
            if hello:
                ch.write(Op.HELLO, self._hello().encode())
            while self._queue:
                d = self._queue[0]
                ch.write(Op.DONE, d.encode())
                self._queue.pop(0)
                self._launches.pop((d.module, d.gen), None)
            self._ch = ch

    def detach(self) -> None:
        with self._cv:
            self._ch = None

    def halt_all(self, mailbox: Mailbox | None, within: float, why: str) -> bool:
        """CONTROL = HALT in every running launch's slot, then their ends awaited for ``within``
        seconds; True if none runs any more."""
        with self._cv:
            slots = sorted({la.slot for la in self._launches.values() if la.running})
            if not slots:
                return True
            t0 = time.monotonic()
            log.warning(f"{why}: halting the kernels still running", slots=slots)
            if mailbox is not None:
                for s in slots:
                    mailbox.halt(s)
            ended = self._cv.wait_for(lambda: not any(la.running for la in self._launches.values()), within)
            ms = round((time.monotonic() - t0) * 1e3, 1)
        if ended:
            log.info(f"{why}: every kernel halted", slots=slots, ms=ms)
        else:
            with self._cv:
                left = sorted(la.slot for la in self._launches.values() if la.running)
            log.error(f"{why}: kernels still running {within:g} s after HALT; exiting anyway", slots=left)
        return ended


class _Writer(Protocol):
    """What Link writes to: main.Channel (not imported here: main imports this module)."""

    def write(self, op: Op, body: bytes = b"") -> None: ...


class Listener:
    """The worker's listening socket, ``DIR/<pid>.sock``, mode 0600, made before the GPU opens (a
    daemon connects at once; its HELLO waits until the worker accepts)."""

    def __init__(self, dir: str):
        self.path = frames.listen_path(dir, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # named by our own pid: whatever is there is a dead process's
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.sock.listen(4)

    def accept(self, within: float) -> socket.socket | None:
        """The next daemon's connection, or None if none came within ``within`` seconds."""
        self.sock.settimeout(within)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return None
        conn.setblocking(True)
        return conn

    def close(self) -> None:
        """No daemon can connect any more: the socket file is removed first (a connect is then
        ENOENT, not a connection that no one serves)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.sock.close()


#: serve() on one channel, the daemon attached to it (``Link.attach``): the exit status at QUIT
#: (or a protocol error), None at EOF or when the daemon is gone.
Serve = Callable[[int, int, bool], "int | None"]


def run_piped(serve: Serve, link: Link, mailbox: Mailbox | None, halt_within: float) -> int:
    """Today's mode: frames on the pipes the daemon gave as stdin and stdout (workers/pipes.py).
    At EOF (the daemon closed them, or died) the kernels still running are halted before the
    worker exits, never left running at its exit."""
    status = serve(*pipes.take(), False)
    if status is not None:
        return status
    link.halt_all(mailbox, halt_within, "stdin closed")  # their DONEs still go to stdout, if it is read
    return 0


def run_listening(serve: Serve, link: Link, listener: Listener, mailbox: Mailbox | None, orphan: float,
                  halt_within: float) -> int:
    """Listen mode: one daemon connection at a time, each greeted with HELLO; between two, the
    kernels run on for up to ``orphan`` seconds; then they are halted and the worker exits 0."""
    try:
        while True:
            conn = listener.accept(orphan)
            if conn is None:
                log.warning(f"no daemon connected within {orphan:g} s; exiting", socket=listener.path)
                listener.close()
                link.halt_all(mailbox, halt_within, "orphan timeout")
                return 0
            with conn:
                log.info("daemon connected", socket=listener.path)
                status = serve(conn.fileno(), conn.fileno(), True)
                link.detach()
            if status is not None:
                return status
            log.warning(f"the daemon's connection closed; kernels go on, waiting {orphan:g} s for the next one",
                        running=len(link.running()))
    finally:
        listener.close()
