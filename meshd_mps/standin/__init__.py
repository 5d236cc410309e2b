"""The meshd-mps stand-in for ``nvidia-cuda-mps-control`` (CI machines without a GPU).

``BIN_DIR`` holds an executable ``nvidia-cuda-mps-control`` that speaks the real
binary's command language; put it first on ``PATH``.  Simulated GPU programs call
:func:`connect_client` where a real one would create its CUDA context: with a
stand-in daemon listening they become its MPS clients, without one they run as
plain (non-MPS) contexts, as the real driver silently does.

Client-socket protocol (``PIPE_DIR/standin-clients``, a Unix stream socket):
the client sends ``HELLO <pid> <device>\\n`` (the device's ordinal; ``HELLO <pid>``
alone means device 0); the daemon answers ``OK\\n`` and counts the connection as
a client of that device until it closes, or ``ERR <text>\\n`` and closes it.  The
client limit and a fault's teardown are per device.
After ``OK`` the client may say ``RUNNING\\n`` (a kernel of it is on the GPU),
``IDLE\\n`` (none any more), ``FAULT\\n`` (it hit a fatal GPU error) and ``PING\\n`` (a
module load's round trip: the daemon answers ``PONG\\n``, after anything it said before); the daemon
says ``FAULT\\n`` to every client of a device it tears down: at a client's fault,
and when a client's connection closes while it said RUNNING (on the H200 a client
that exited with a kernel running faulted the device's other clients).  While a torn-down
client of a device lives, a new one is refused (``ERR``); once the last has exited, the server
recreates its contexts and a ``HELLO`` waits for its ``OK`` meanwhile, as a context creation
blocks on the GPU (``MESHD_MPS_STANDIN_RECOVER_MS`` per torn client).
``terminate_client`` sends ``TERMINATED\\n`` to a connected client, then EOF (a
terminated client faults nobody); ``quit`` closes it (EOF).

Standard library only.
"""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["BIN_DIR", "CLIENT_SOCKET", "StandinRefused", "connect_client"]

BIN_DIR: str = os.path.dirname(os.path.abspath(__file__))
CLIENT_SOCKET = "standin-clients"


class StandinRefused(Exception):
    """The stand-in daemon refused a client (e.g. the client limit is reached)."""


def _readline(sock: socket.socket) -> bytes:
    """One line, read a byte at a time so nothing after it is consumed."""
    line = b""
    while not line.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            break
        line += b
    return line


def connect_client(pipe_dir: str, pid: int, timeout: float = 5.0, device: int = 0) -> socket.socket | None:
    """Become an MPS client of the stand-in daemon of ``pipe_dir`` on GPU ``device`` ("context creation").

    Returns the connected socket (keep it open for the client's whole life), or
    None when no stand-in daemon listens there.  Raises :class:`StandinRefused`
    when the daemon says ``ERR`` or closes the connection without an answer, and
    :class:`TimeoutError` when it does not answer within ``timeout`` seconds.
    """
    path = os.path.join(pipe_dir, CLIENT_SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED):
                sock.close()
                return None
            raise
        sock.sendall(b"HELLO %d %d\n" % (pid, device))
        line = _readline(sock).decode("utf-8", "replace").rstrip("\n")
    except BaseException:
        sock.close()
        raise
    if line == "OK":
        sock.settimeout(None)
        return sock
    sock.close()
    if line.startswith("ERR "):
        raise StandinRefused(line[4:])
    raise StandinRefused(f"unexpected answer from the stand-in daemon: {line!r}" if line
                         else "the stand-in daemon closed the connection without an answer")
