"""The worker's frame pipes, moved off fds 0 and 1 before anything else runs in the process.

The daemon hands a worker its frame pipes as stdin and stdout, but those two descriptors belong
to every library in the process too: a stray print would land inside the frame stream, and on
the H200 (tests/gpu/test_faults_real.py) fd 0 was found closed right after the CUDA
driver failed to connect to an MPS server that was shutting down, so the worker's next read
raised EBADF.  So the worker keeps the pipes on descriptors of its own (close-on-exec, above
the standard three) and leaves fd 0 reading /dev/null and fd 1 writing to stderr, the log.
"""

from __future__ import annotations

import fcntl
import os

_taken: tuple[int, int] | None = None


def take() -> tuple[int, int]:
    """The frame pipes' (read, write) descriptors, moved on the first call; once per process."""
    global _taken
    if _taken is None:
        rfd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
        wfd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        _taken = rfd, wfd
    return _taken


def taken() -> tuple[int, int] | None:
    """The pipes' descriptors if ``take`` moved them (a worker started by the CLI), else None."""
    return _taken
