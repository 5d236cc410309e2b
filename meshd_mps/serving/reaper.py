"""The forced exit's last resort: kill every descendant process and reap every child.

Used only when a second signal cuts the clean shutdown short (``server.Daemon``): then nothing
else will stop the workers, the MPS daemon or their children, so they are found in /proc
(``procfs``), not in the supervisor's bookkeeping, which may be what hangs.  The daemon is a
subreaper, so the orphans among them are its children and reaped here too.  Synchronous on
purpose: the loop may be the thing that is stuck.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from meshd_mps.supervision.procfs import processes


def _ppids() -> dict[int, int]:
    return {p.pid: p.ppid for p in processes()}


def descendants(root: int) -> set[int]:
    """Every process below ``root`` in the process tree, as /proc shows it now."""
    kids: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def reap_all(within: float) -> None:
    """Kill and reap every child (orphans re-parented to us, a subreaper, included) until none
    is left, or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    me = os.getpid()
    while time.monotonic() < deadline:
        kids = {p for p, pp in _ppids().items() if pp == me}
        if not kids:
            return
        kill_all(kids)
        for p in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p, os.WNOHANG)
        time.sleep(0.01)
