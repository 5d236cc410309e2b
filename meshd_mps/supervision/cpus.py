"""Which host CPUs the daemon runs on, and which its children do (``serve --daemon-cpus``).

The event loop is the one thread every ask, DONE and ring call goes through.  Left to the
scheduler, a worker woken on its CPU takes the CPU from it: on the lent H200 (2026-12-05,
``scripts/issue18_probes.py ask-cpu``), with 32 workers asking at once, p99 2368-3175 us as the
scheduler placed the threads, and 954-1593 us with the loop's CPU its own and every worker kept
off it.  A host spin on a program's ring (``Ring.spin``) is as fast as the CPU it spins on, and
on that VM the CPUs differed by up to 0.9 us of a 4-5 us round trip (docs/benchmarks.md).

So ``place`` puts every thread of the daemon on the CPUs given and leaves the others to its
children: every child is started through ``for_child`` (``child.spawn``: the workers, the MPS
control daemon and so its server), which a child inherits from the thread that forks it.
Unplaced (the default), nothing here touches an affinity.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from meshd_mps.errors import ConfigError

#: The CPUs children run on while the daemon is placed (None: unplaced).
_children: frozenset[int] | None = None
#: Every thread's CPUs before ``place``, for ``unplace``.
_before: frozenset[int] | None = None


def parse(spec: str | Iterable[int], what: str = "--daemon-cpus") -> frozenset[int]:
    """A CPU list as taskset and systemd's CPUAffinity= write it ("3", "2,3", "0-3,8"), or the
    numbers; ConfigError naming the fault.  Whether this process may use them is ``place``'s check."""
    if isinstance(spec, str):
        out: set[int] = set()
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ConfigError(f"{what} {spec!r}: CPU numbers and ranges separated by commas (3, 2,3 or 0-3,8)")
            a, b = int(lo), int(hi) if dash else int(lo)
            if b < a:
                raise ConfigError(f"{what} {spec!r}: the range {part.strip()} runs backwards")
            out.update(range(a, b + 1))
        return frozenset(out)
    cpus = list(spec)
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ConfigError(f"{what}: {c!r} is not a CPU number (0, 1, ...)")
    if not cpus:
        raise ConfigError(f"{what}: no CPU given")
    return frozenset(cpus)


def text(cpus: Iterable[int]) -> str:
    """``0-3,8``: as ``parse`` reads it."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split(daemon: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
    """(the CPUs this process may use, those left for its children); ConfigError if it may not use
    one of ``daemon`` or none would be left for the children."""
    allowed = frozenset(os.sched_getaffinity(0)) if _before is None else _before
    if not daemon or not daemon <= allowed:
        raise ConfigError(f"--daemon-cpus {text(daemon)}: this process may use CPUs {text(allowed)} only")
    rest = allowed - daemon
    if not rest:
        raise ConfigError(f"--daemon-cpus {text(daemon)}: that leaves no CPU for the workers (this process may use"
                          f" {text(allowed)})")
    return allowed, rest


def place(daemon: frozenset[int]) -> frozenset[int]:
    """Every thread of this process on ``daemon`` from now on, its children on the CPUs it may use
    less those (``split``, which raises ConfigError); the children's CPUs."""
    global _children, _before
    allowed, rest = split(daemon)
    _set_every_thread(daemon)
    _before, _children = allowed, rest
    return rest


def unplace() -> None:
    """Every thread back on the CPUs it had before ``place`` (the bench's placed phases end so)."""
    global _children, _before
    if _before is not None:
        _set_every_thread(_before)
    _before = _children = None


@contextlib.contextmanager
def placed(daemon: frozenset[int]) -> Iterator[frozenset[int]]:
    """``place`` for the block, then ``unplace``."""
    rest = place(daemon)
    try:
        yield rest
    finally:
        unplace()


def children() -> frozenset[int] | None:
    """Where children run while the daemon is placed (None: unplaced)."""
    return _children


def status() -> dict[str, str] | None:
    """For ``GET /v1/status``: {"daemon": its CPUs, "children": theirs}, None unplaced."""
    if _children is None:
        return None
    return {"daemon": text(os.sched_getaffinity(0)), "children": text(_children)}


@contextlib.contextmanager
def for_child() -> Iterator[None]:
    """Around a fork: the calling thread on the children's CPUs meanwhile, so that the child
    starts there (a no-op unplaced).  Nothing else may run in this thread meanwhile: a fork only."""
    if _children is None:
        yield
        return
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _children)
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def _set_every_thread(cpus: frozenset[int]) -> None:
    """sched_setaffinity moves one thread: each of this process's, and threads started later
    inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
