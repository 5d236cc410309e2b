"""The simulated GPU's doorbell: a futex wake on a slot's REQ_HEAD word once the host has written
its ring or its HALT, and a wait on such words.

A GPU's resident kernel polls its slot without pause and sees a request within microseconds.  The
simulated kernel cannot: a thread per kernel spinning takes the CPU, so an idle one parks and its
process's poller looks at it every POLL_S (2 ms, workers/sim_kernels.py ``Poller``).  A request to
an idle simulated replica waited for that look, and the daemon's wait then backed off to its 1 ms
sleeps: ~2.5 ms more per call than the GPU's ring, which the fleet's calls to replicas taken in
turn paid at every call (docs/benchmarks.md, "the simulated GPU's doorbell").  So, with the
simulated GPU only (``Mailbox.doorbell``, set by the backend for ``--gpu sim``), the host rings the
slot after it publishes or halts: FUTEX_WAKE on the slot's REQ_HEAD word in the shared mapping,
which wakes any process waiting on the same word of the same file.  A parked kernel waits on its
slot's REQ_HEAD and CONTROL words (futex_waitv, Linux 5.16), each with the value its last poll
read, so that a request or HALT written before the wait began ends it at once.

Only a hint: a kernel learns its work from the ring's words at its poll, and its process's poller
still looks at every parked kernel each POLL_S, so a bell lost, or none (another kernel than
Linux's, another CPU), costs that look's wait, never a request.  On the GPU nothing rings: its
kernel polls, and a syscall per call would be spent for nobody.  ctypes, not a library: no package
on PyPI offers futex_waitv, and the two calls are two syscalls of the C library already loaded.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Sequence

#: (futex, futex_waitv) syscall numbers where the doorbell is known to work; elsewhere none rings.
_CALLS = {"x86_64": (202, 449), "aarch64": (98, 449)}
_FUTEX_WAKE = 1
_FUTEX_PRIVATE_FLAG = 128
_FUTEX2_SIZE_U32 = 0x02
_FUTEX2_PRIVATE = 128
_CLOCK_MONOTONIC = 1
_ALL = 2**31 - 1
#: futex_waitv's most words in one wait (FUTEX_WAITV_MAX); a wait on more sleeps instead.
MOST = 128


class _Waiter(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_FUTEX, _WAITV = _CALLS.get(os.uname().machine, (0, 0))  # not platform's: 2 ms more of a worker's start


def _probe() -> bool:
    """futex_waitv is there: with no words it answers EINVAL; a kernel without it, ENOSYS."""
    if not _WAITV:
        return False
    if _syscall(ctypes.c_long(_WAITV), None, ctypes.c_uint(0), ctypes.c_uint(0), None, ctypes.c_int(0)) == 0:
        return True
    return ctypes.get_errno() != errno.ENOSYS


#: The doorbell works here (Linux 5.16 or later, x86_64 or aarch64).
SUPPORTED = _probe()


def address(buffer: ctypes._CData | bytearray | memoryview | object) -> int:
    """The address of a writable buffer's first byte (an mmap's, which never moves while it is
    mapped).  The buffer is exported only for this call, so that it can still be closed."""
    view = ctypes.c_char.from_buffer(buffer)  # type: ignore[arg-type]
    try:
        return ctypes.addressof(view)
    finally:
        del view


def wake(word: int, private: bool = False) -> None:
    """Every waiter on the u32 at address ``word`` woken (``private``: this process's own word)."""
    if SUPPORTED:
        op = _FUTEX_WAKE | (_FUTEX_PRIVATE_FLAG if private else 0)
        _syscall(ctypes.c_long(_FUTEX), ctypes.c_void_p(word), ctypes.c_int(op), ctypes.c_int(_ALL), None, None,
                 ctypes.c_int(0))


def wait(words: Sequence[tuple[int, int, bool]], timeout: float) -> None:
    """Until one of ``words`` ((address, expected u32, private)) is rung, or holds another value
    than expected (at once), or ``timeout`` seconds pass; the caller then looks at every word.  A
    sleep of ``timeout`` where the doorbell does not work or ``words`` are more than MOST."""
    if not SUPPORTED or not words or len(words) > MOST:
        time.sleep(timeout)
        return
    ws = (_Waiter * len(words))()
    for w, (at, expected, private) in zip(ws, words, strict=True):
        w.val, w.uaddr, w.flags = expected, at, _FUTEX2_SIZE_U32 | (_FUTEX2_PRIVATE if private else 0)
    end = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(timeout * 1e9)
    ts = _Timespec(end // 1_000_000_000, end % 1_000_000_000)
    # Its answer is not read: rung, timed out, a word changed already (EAGAIN) or a signal (EINTR)
    # all send the caller to its look.
    _syscall(ctypes.c_long(_WAITV), ws, ctypes.c_uint(len(words)), ctypes.c_uint(0), ctypes.byref(ts),
             ctypes.c_int(_CLOCK_MONOTONIC))
