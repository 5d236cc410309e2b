"""Process bookkeeping for tests, read from /proc (no psutil)."""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> tuple[str, str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = s[s.index("(") + 1 : s.rindex(")")]
    fields = s[s.rindex(")") + 2 :].split()
    return comm, fields[0], int(fields[1])


def children(of: int | None = None) -> set[int]:
    """Direct children of ``of`` (default: us), zombies included."""
    me = os.getpid() if of is None else of
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[2] == me:
                out.add(int(d))
    return out


def describe(pids) -> str:
    parts = []
    for p in sorted(pids):
        st = _stat(p)
        parts.append(f"{p} ({st[0]}, state {st[1]})" if st else f"{p} (gone)")
    return ", ".join(parts)


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] != "Z"


def wait_gone(pids, within: float) -> set[int]:
    """Reap what is ours; the pids still there (running or zombie) after ``within`` s."""
    left = set(pids)
    deadline = time.monotonic() + within
    while left and time.monotonic() < deadline:
        for p in list(left):
            if _stat(p) is None:
                left.discard(p)
        if left:
            time.sleep(0.01)
    return left
