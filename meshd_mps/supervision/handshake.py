"""How the supervisor reaches a worker on a socket (live restore), and knows it is the one it
claims to be.

A listen-mode worker serves its frames on ``DIR/<pid>.sock`` so that it can outlive us: its
directory (``listen_dir``), our connection to it (``connect``: retried while it starts), and the
HELLO it sends first, checked against the socket's peer credentials (``check_hello``).  Apart from the
supervisor, which owns the processes, because this is the trust check of a peer: the same for a
worker we just started and for one an earlier meshd-mps left.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
from typing import Any

import anyio

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import (
    ConfigError,
    FrameError,
    NoReply,
    PeerMismatch,
    ProtocolMismatch,
    SpawnFailed,
    WorkerGone,
    WorkerUnfit,
)
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Hello, Op
from meshd_mps.supervision import child
from meshd_mps.supervision.wire import FrameReader, SocketWriter

#: Our end of a worker's socket: its frames as they arrive, and our writes.
Link = tuple[FrameReader, SocketWriter]


async def open_link(path: str) -> Link:
    """A connection to the worker listening on ``path``: its frames read as they arrive."""
    transport, reader = await asyncio.get_running_loop().create_unix_connection(FrameReader, path)
    return reader, SocketWriter(transport, reader)


def listen_dir(dir: str) -> tuple[str, int, str]:
    """The absolute ``dir`` (made 0700 if missing) and a fresh log file in it (0600, fd and path),
    named by the worker's pid once it runs."""
    dir = os.path.abspath(dir)
    if not frames.listen_dir_fits(dir):
        raise ConfigError(f"worker sockets under {dir} would be over the {frames.SUN_PATH_MAX}-byte limit of a"
                          " Unix socket's path; choose a shorter state directory")
    try:
        os.makedirs(dir, mode=0o700, exist_ok=True)
        fd, spawning = tempfile.mkstemp(prefix="spawn.", suffix=".log", dir=dir)
    except OSError as e:
        raise SpawnFailed(f"mps worker: {dir}: {e.strerror or e}") from e
    return dir, fd, spawning


async def connect(path: str, process: child.Child, deadlines: Deadlines) -> Link:
    """Our connection to a worker we just started: retried until its socket is there."""
    within = deadlines.connect
    try:
        with anyio.fail_after(within):
            while True:
                try:
                    return await open_link(path)
                except (FileNotFoundError, ConnectionRefusedError):
                    if process.exited:
                        raise WorkerGone(f"worker {process.pid} exited (status {process.returncode}) before it"
                                         f" listened on {path}", pid=process.pid) from None
                    await anyio.sleep(0.005)  # it is starting: poll for its socket
    except TimeoutError as e:
        raise NoReply(f"worker {process.pid}: no socket at {path} within {within:g}s", pid=process.pid,
                      within=within) from e


async def check_hello(link: Link, pid: int | None, path: str, deadlines: Deadlines) -> Hello:
    """The HELLO a worker sends first on our connection, checked: the peer's credentials
    (SO_PEERCRED: the process that listens) must be ours and name the pid it claims (and
    ``pid``, where we know it), its protocol version ours."""
    reader, writer = link
    sock: Any = writer.get_extra_info("socket")
    peer, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    who = pid if pid is not None else peer
    if uid != os.getuid():
        raise PeerMismatch(f"worker socket {path}: served by uid {uid}, not ours ({os.getuid()}); refusing",
                           pid=peer, claimed=who)
    if pid is not None and peer != pid:
        raise PeerMismatch(f"worker {pid}: its socket {path} is served by process {peer}; refusing",
                           pid=peer, claimed=pid)
    within = deadlines.hello
    try:
        with anyio.fail_after(within):
            op, body = await reader.first()
        if op != Op.HELLO:
            raise FrameError(f"{op.name} where HELLO comes first")
        version, claimed = Hello.head(body)
        if version not in frames.ADOPTS:
            raise ProtocolMismatch(peer, version, frames.PROTOCOL_VERSION)
        hello = Hello.decode(body)
    except TimeoutError as e:
        raise NoReply(f"worker {who}: no HELLO in {within:g}s", pid=who, within=within) from e
    except EOFError as e:
        if isinstance(reader.why, FrameError):
            raise WorkerUnfit(f"worker {who}: bad frame: {reader.why}", pid=who) from e
        raise WorkerGone(f"worker {who} closed its socket before its HELLO", pid=who) from e
    except FrameError as e:
        raise WorkerUnfit(f"worker {who}: bad frame: {e}", pid=who) from e
    if claimed != peer:
        raise PeerMismatch(f"worker socket {path}: HELLO names pid {claimed}, but process {peer} serves it;"
                           " refusing", pid=peer, claimed=claimed)
    return hello
