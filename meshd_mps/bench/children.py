"""The bench's own child processes, read from /proc: the orphans of a SIGKILLed ``serve`` reaped
as init would, and any left at the end killed and named (the bench then exits 1)."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return int(s[s.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError):
        return -1


def our_children() -> set[int]:
    """Our children, running or zombie."""
    return {int(d) for d in os.listdir("/proc") if d.isdigit() and _ppid(d) == os.getpid()}


def reap_new_children(before: set[int], within: float) -> None:
    """Children that were not ``before`` (orphans re-parented to us), reaped as they exit, for up to
    ``within`` seconds; any still there then is the leftover check's to report."""
    end = time.monotonic() + within
    while (new := our_children() - before) and time.monotonic() < end:
        for pid in new:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


def leftovers() -> list[int]:
    """Our children still there (running or zombie), killed and reaped; their pids."""
    left = sorted(our_children())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return left
