"""Process, fd and temporary-file bookkeeping for tests, read from /proc (no psutil)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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


# ---- fds and temporary files: what a test must give back -----------------------------------

#: Names of the temporary entries meshd-mps and the tests make (MPS dirs, the stand-in's default pipe dir).
TEMP_PREFIXES = ("meshd", "nvidia-mps")


def open_fds() -> dict[int, str]:
    """This process's open fds and what each one is (``readlink /proc/self/fd/N``)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def temp_entries() -> set[str]:
    """The entries of ``tempfile.gettempdir()`` named like meshd-mps's (``meshd*``, ``nvidia-mps*``)."""
    d = tempfile.gettempdir()
    return {os.path.join(d, n) for n in os.listdir(d) if n.startswith(TEMP_PREFIXES)}


@dataclass(frozen=True)
class Resources:
    fds: dict[int, str]
    temps: frozenset[str]

    @classmethod
    def now(cls) -> Resources:
        gc.collect()  # what only the collector would close counts as closed (it warns, and warnings are errors)
        return cls(open_fds(), frozenset(temp_entries()))

    def leaks_since(self, before: Resources) -> str:
        """What this snapshot holds that ``before`` did not (and what it lost), in words; "" if equal."""
        parts = []
        new = {fd: t for fd, t in self.fds.items() if before.fds.get(fd) != t}
        gone = {fd: t for fd, t in before.fds.items() if self.fds.get(fd) != t}
        if new:
            parts.append(f"{len(new)} fd(s) left open: " + ", ".join(f"{fd} -> {t}" for fd, t in sorted(new.items())))
        if gone:
            parts.append(f"{len(gone)} fd(s) of before closed or replaced: "
                         + ", ".join(f"{fd} -> {t}" for fd, t in sorted(gone.items())))
        if self.temps - before.temps:
            parts.append("temporary entries left: " + ", ".join(sorted(self.temps - before.temps)))
        if before.temps - self.temps:
            parts.append("temporary entries of before removed: " + ", ".join(sorted(before.temps - self.temps)))
        return "; ".join(parts)


@contextmanager
def fd_limit(more: int) -> Iterator[int]:
    """Inside: this process can open at most ``more`` new fds (the soft RLIMIT_NOFILE lowered to
    the lowest free fd + ``more``; fds already open above it stay usable).  Restored on the way out,
    whatever happens; yields the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.dup(0)
    os.close(probe)  # the lowest free fd: every fd below it is taken
    limit = probe + more
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def fds_exhausted(free: int = 0, room: int = 64) -> Iterator[None]:
    """Inside: exactly ``free`` more fds can be opened.  The soft RLIMIT_NOFILE is lowered
    (``fd_limit(room)``) and every fd below it but ``free`` taken by a /dev/null filler, holes
    included, so that the point where EMFILE comes does not depend on which fds happen to be open.
    The fillers are closed and the limit restored on the way out, whatever happens."""
    fillers: list[int] = []
    with fd_limit(room):
        try:
            while True:
                try:
                    fillers.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
                except OSError as e:
                    if e.errno != errno.EMFILE:
                        raise
                    break
            if len(fillers) < free:
                raise RuntimeError(f"fds_exhausted({free}): only {len(fillers)} fds under the limit were free")
            for _ in range(free):
                os.close(fillers.pop())
            yield
        finally:
            for fd in fillers:
                os.close(fd)
