"""Which host CPUs the daemon runs on, and which its children do (``serve --daemon-cpus``).

The event loop is the one thread every ask, DONE and ring call goes through.  Left to the
scheduler, a worker woken on its CPU takes the CPU from it: on an H200 (``scripts/ring_probes.py
ask-cpu``; docs/runs/ring-and-control-path.md), with 32 workers asking at once, p99 2368-3175 us as the
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
import re
from collections.abc import Iterable, Iterator

from meshd_mps.base.errors import ConfigError

#: CPU numbers run below this: Linux's largest CONFIG_NR_CPUS (x86-64's MAXSMP).  A range is
#: refused past it before it is expanded ("0-4000000000" would not fit in memory).
MOST = 8192
_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() takes "²", which int() refuses

#: The CPUs children run on while the daemon is placed (None: unplaced).
_children: frozenset[int] | None = None
#: Before ``place``: the CPUs this process might use (the placing thread's), and each thread's own
#: (by thread id), for ``unplace``.
_allowed: frozenset[int] | None = None
_threads: dict[int, frozenset[int]] = {}


def parse(spec: str | Iterable[int], what: str = "daemon_cpus") -> frozenset[int]:
    """A CPU list as taskset and systemd's CPUAffinity= write it ("3", "2,3", "0-3,8"), or the
    numbers; ConfigError naming the fault.  Whether this process may use them is ``place``'s check."""
    if isinstance(spec, str):
        out: set[int] = set()
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not _NUMBER.fullmatch(lo) or (dash and not _NUMBER.fullmatch(hi)):
                raise ConfigError(f"{what} {spec!r}: CPU numbers and ranges separated by commas (3, 2,3 or 0-3,8)")
            a, b = int(lo), int(hi) if dash else int(lo)
            if b < a:
                raise ConfigError(f"{what} {spec!r}: the range {part.strip()} runs backwards")
            if b >= MOST:
                raise ConfigError(f"{what} {spec!r}: CPU {b} is past any CPU (Linux numbers them below {MOST})")
            out.update(range(a, b + 1))
        return frozenset(out)
    cpus = list(spec)
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ConfigError(f"{what}: {c!r} is not a CPU number (0, 1, ...)")
        if c >= MOST:
            raise ConfigError(f"{what}: CPU {c} is past any CPU (Linux numbers them below {MOST})")
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


def split(daemon: frozenset[int], what: str = "daemon_cpus") -> tuple[frozenset[int], frozenset[int]]:
    """(the CPUs this process may use, those left for its children); ConfigError if it may not use
    one of ``daemon`` or none would be left for the children."""
    allowed = frozenset(os.sched_getaffinity(0)) if _allowed is None else _allowed
    if not daemon or not daemon <= allowed:
        raise ConfigError(f"{what} {text(daemon)}: this process may use CPUs {text(allowed)} only")
    rest = allowed - daemon
    if not rest:
        raise ConfigError(f"{what} {text(daemon)}: that leaves no CPU for the workers (this process may use"
                          f" {text(allowed)})")
    return allowed, rest


def place(daemon: frozenset[int]) -> frozenset[int]:
    """Every thread of this process on ``daemon`` from now on, its children on the CPUs it may use
    less those (``split``, which raises ConfigError); the children's CPUs."""
    global _children, _allowed, _threads
    allowed, rest = split(daemon)
    threads = _every_thread()
    try:
        for tid in threads:
            _set(tid, daemon)
    except BaseException:
        _restore(threads, allowed)  # all or nothing
        raise
    _allowed, _children, _threads = allowed, rest, threads
    return rest


def unplace() -> None:
    """Every thread back on the CPUs it had before ``place``, one started since on those the
    process might use then (the bench's placed phases end so)."""
    global _children, _allowed, _threads
    if _allowed is not None:
        _restore(_threads, _allowed)
    _allowed, _children, _threads = None, None, {}


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


def for_child() -> contextlib.AbstractContextManager[None]:
    """Around a fork: the calling thread on the children's CPUs meanwhile, so that the child
    starts there (a no-op unplaced).  Nothing else may run in this thread meanwhile: a fork only."""
    return thread_on(_children)


@contextlib.contextmanager
def thread_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread alone on ``cpus`` for the block (None: left alone), then back on its own."""
    if cpus is None:
        yield
        return
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def _every_thread() -> dict[int, frozenset[int]]:
    """This process's threads and the CPUs each may use now."""
    out = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            out[tid] = frozenset(os.sched_getaffinity(tid))
    return out


def _set(tid: int, cpus: frozenset[int]) -> None:
    """sched_setaffinity moves one thread; threads started later inherit it from the thread that
    starts them."""
    with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
        os.sched_setaffinity(tid, cpus)


def _restore(before: dict[int, frozenset[int]], allowed: frozenset[int]) -> None:
    """Every thread on its CPUs of ``before``, one not there (started since) on ``allowed``."""
    for tid in map(int, os.listdir("/proc/self/task")):
        _set(tid, before.get(tid, allowed))
