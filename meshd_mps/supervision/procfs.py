"""Processes as /proc shows them: one scan, shared by the daemon's reaper and serve's forced exit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    ppid: int
    comm: str  # the name; a zombie keeps it, but not its command line
    state: str
    argv: list[str]


def processes() -> Iterator[Proc]:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                s = f.read().decode(errors="replace")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue  # gone meanwhile
        fields = s[s.rindex(")") + 2 :].split()
        yield Proc(int(d), int(fields[1]), s[s.index("(") + 1 : s.rindex(")")], fields[0], argv)


def starttime(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22); None if it is
    gone.  With the pid, it names one process for the life of the boot: a pid can be reused, a
    (pid, start time) pair cannot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(s[s.rindex(")") + 2 :].split()[19])


def boot_id() -> str:
    """This boot's id: a start time read before a reboot means nothing after it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def alive(pid: int, start: int) -> bool:
    """The process (``pid``, ``start``) still runs (and is not a zombie)."""
    if starttime(pid) != start:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return False
    return s[s.rindex(")") + 2 :].split()[0] != "Z"


def running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie, exited but not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read().decode(errors="replace")
    except OSError:
        return False
    return s[s.rindex(")") + 2 :].split()[0] not in ("Z", "X")


#: The kernel's task flag for a process that has begun to exit (include/linux/sched.h).
PF_EXITING = 0x4


def exiting(stat: str) -> bool:
    """A /proc/PID/stat line's process has begun to exit or has exited: a zombie, or a task
    with PF_EXITING (a fatal signal taken: a SIGKILLed CUDA client stays so for ~0.2 s on the
    H200 while the driver tears its context down, its pipes still open)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


def ending(pid: int) -> bool:
    """``pid`` is gone, or ``exiting``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return exiting(f.read().decode(errors="replace"))
    except OSError:
        return True
