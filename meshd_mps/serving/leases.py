"""Program leases: a program loaded with a lease (``lease_until``, wall-clock seconds since the
epoch) is halted and unloaded by this daemon once that time has passed, unless renewed before
(``POST /v1/leases``).

A dead man's switch for whoever placed the program from outside the node: the fleet loads its
``unique`` replicas with one, and its node agent renews it while the fleet's controller grants it
(docs/fleet.md, "Nothing runs twice").  If the agent, its node's Ray or the controller is gone, the
renewals stop and the program stops here by itself, so that the controller may start it elsewhere
once the lease it last granted has run out, without ever hearing from this node again.  The
daemon knows nothing of fleets: a lease is a time, checked against this host's clock (the hosts'
clocks are assumed to agree, as NTP keeps them, to well within the fleet's margin).

The leases are kept in the state directory (``leases.json``, written whole before the load it
belongs to, so that a crash in between leaves a lease without a program, never a program without
its lease): a daemon that restarts with live restore adopts the program and goes on enforcing its
lease; one whose lease ran out meanwhile is unloaded as soon as the daemon serves.  ``stop_within``
is how long after its lease a program may still run at most (the check's period, its halt and its
worker's retirement; with live restore and the daemon gone, its worker's orphan timeout): what the
fleet's controller waits beyond a lease before it starts the program elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable

import anyio
import anyio.abc
import structlog

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import LeaseOver, MeshError, NotLoaded
from meshd_mps.base.strictjson import parse_json
from meshd_mps.programs import Programs
from meshd_mps.state.statedir import atomic_write

log = structlog.get_logger("meshd_mps")

FILE = "leases.json"
#: How often the leases are looked at: a lease's program stops at most this long after it.
CHECK_S = 0.1


class Leases:
    """The programs' leases (name -> until), kept in ``dir`` (None: in memory only)."""

    def __init__(self, dir: str | None, deadlines: Deadlines, live: bool):
        self.dir = dir
        self.until: dict[str, float] = {}
        d = deadlines
        halted = CHECK_S + d.halt + d.retire_quit + d.retire_kill
        #: The longest a leased program may run past its lease (the module's doc).
        self.stop_within = max(halted, d.orphan + d.orphan_halt) if live else max(halted, d.orphan_halt)
        if dir is not None:
            self._read()

    def _read(self) -> None:
        assert self.dir is not None
        path = os.path.join(self.dir, FILE)
        try:
            with open(path, "rb") as f:
                obj = parse_json(f.read())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            # Not trusted, and not dropped silently: every program it named is unloaded at once (a lease
            # that cannot be read has run out, as far as this daemon can tell).
            log.error(f"leases: {path}: unreadable ({e}): the programs it named are treated as out of lease")
            obj = {}
        leases = obj.get("leases") if isinstance(obj, dict) else None
        if isinstance(leases, dict):
            self.until = {str(k): float(v) for k, v in leases.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}

    def _write(self) -> None:
        if self.dir is not None:
            atomic_write(self.dir, FILE, json.dumps({"schema": 1, "leases": self.until}).encode())

    def take(self, name: str, until: float, now: float | None = None) -> None:
        """A program about to be loaded with a lease until ``until``: kept before the load (LeaseOver
        if it has run out already)."""
        now = time.time() if now is None else now
        if until <= now:
            raise LeaseOver(f"program {name!r}: its lease ran out at {until:.3f}, {now - until:.3f}s ago (this"
                            " host's clock): not loaded", program=name, until=until, now=now)
        self.until[name] = until
        self._write()

    def renew(self, names: Iterable[str], until: float, loaded: Iterable[str]) -> tuple[list[str], list[str]]:
        """Each leased program of ``names`` (that is ``loaded``) held until ``until`` (never earlier
        than it was: a renewal that comes late shortens nothing); the names renewed, and those with
        no lease here (not loaded, or loaded without one)."""
        have = set(loaded)
        renewed, missing = [], []
        for name in names:
            if name in self.until and name in have:
                self.until[name] = max(self.until[name], until)
                renewed.append(name)
            else:
                missing.append(name)
        if renewed:
            self._write()
        return renewed, missing

    def drop(self, name: str) -> None:
        if self.until.pop(name, None) is not None:
            self._write()

    def expired(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        return [n for n, t in self.until.items() if t <= now]


async def keep(leases: Leases, programs: Programs, *,
               task_status: anyio.abc.TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED) -> None:
    """Every CHECK_S, each program whose lease has run out halted and unloaded; a lease whose
    program is not loaded (a load that failed, a program unloaded meanwhile) is dropped.  A program
    that does not halt (its kernel ignores HALT: an unload fails on it too) keeps its lease and is
    tried again at the next check."""
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            for name in leases.expired():
                if name in programs.by_name:
                    log.warning(f"program {name}: its lease ran out at {leases.until[name]:.3f}: unloaded", program=name)
                    try:
                        await programs.unload(name)
                    except NotLoaded:
                        pass
                    except MeshError as e:
                        log.error(f"program {name}: not unloaded past its lease: {e}; tried again", program=name)
                        continue
                leases.drop(name)
            await anyio.sleep(CHECK_S)  # the check's period, not a deadline
