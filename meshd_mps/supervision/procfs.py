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
