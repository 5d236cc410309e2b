"""What a live restore carries over besides the desired state: each program's launch time and
restarts, and the recent fault reports (docker keeps a container's start time and restart count
across a live restore; so does meshd-mps).

One file in the state directory, ``history.json``, written whole (``atomic_write``) at each change
(a load, an upgrade, a relaunch, a fault's report).  It is what the daemon saw, never what it runs:
a file that cannot be read is logged and an empty history taken in its place.  A program's entry
names the worker its launch ran in, so that an adoption takes it only for that very launch."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import structlog

from meshd_mps.state.statedir import atomic_write

log = structlog.get_logger("meshd_mps")

HISTORY = "history.json"
#: The history file's schema; a file of another one is not read (an empty history instead).
SCHEMA = 1


@dataclass(frozen=True)
class Launched:
    """A program's launch as the daemon saw it: its wall time, its worker's pid, and how many
    relaunches came before it (its restart count)."""

    started_at: float
    pid: int
    restarts: int

    @classmethod
    def from_json(cls, obj: Any) -> Launched:
        """ValueError if ``obj`` is not one."""
        if not isinstance(obj, dict) or set(obj) != {"started_at", "pid", "restarts"}:
            raise ValueError(f"a launch's started_at, pid and restarts expected, got {obj!r:.200}")
        t, pid, n = obj["started_at"], obj["pid"], obj["restarts"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"started_at {t!r}: a time in seconds expected")
        for k, v in (("pid", pid), ("restarts", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k} {v!r}: an integer, 0 or more, expected")
        return cls(float(t), pid, n)


@dataclass
class History:
    """Each program's launch by name, and the recent fault reports (as ``FaultReport.as_dict``)."""

    programs: dict[str, Launched] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "programs": {n: vars(x) for n, x in sorted(self.programs.items())},
                "faults": self.faults}


def read_history(dir: str) -> History:
    """The history kept in ``dir``; an empty one if there is none, or none that can be read (logged)."""
    path = os.path.join(dir, HISTORY)
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
        if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
            raise ValueError(f"schema {obj.get('schema') if isinstance(obj, dict) else None!r}, this meshd-mps reads {SCHEMA}")
        programs, faults = obj.get("programs"), obj.get("faults")
        if not isinstance(programs, dict) or not isinstance(faults, list):
            raise ValueError("a programs object and a faults list expected")
        return History({str(n): Launched.from_json(x) for n, x in programs.items()},
                       [x for x in faults if isinstance(x, dict)])
    except FileNotFoundError:
        return History()
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning(f"state: {path}: not read ({e}); the programs' launch times, restarts and fault reports start"
                    " again", file=path)
        return History()


def write_history(dir: str, h: History) -> None:
    """``h`` kept in ``dir``, whole; StateIOError if the disk refuses."""
    atomic_write(dir, HISTORY, json.dumps(h.to_json(), indent=1, sort_keys=True).encode() + b"\n")
