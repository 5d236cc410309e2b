"""A program's restore mode: what the daemon's next start does with it.

A node daemon keeps its programs across its own restart (state/desired.py), which is right for
a program that only that node runs.  A program that something above the node places (the fleet:
Ray re-places a lost node's replicas elsewhere) must not come back by itself on a node that
returns, or it runs twice: loaded with ``adopt``, it is taken over at the next start only if it
still runs there (live restore), and otherwise left to whoever loaded it, its record dropped.
"""

from __future__ import annotations

import enum

from meshd_mps.base.errors import BadRestoreMode


class Restore(enum.Enum):
    RELOAD = "reload"  # loaded again from its record at the next start if it no longer runs (the default)
    ADOPT = "adopt"  # adopted at the next start if it still runs; otherwise not loaded again, its record dropped

    @classmethod
    def parse(cls, value: object) -> Restore:
        """The mode named ``value`` (a Restore, or its name); BadRestoreMode otherwise."""
        if isinstance(value, Restore):
            return value
        for r in cls:
            if value == r.value:
                return r
        raise BadRestoreMode(f"restore mode {value!r}: one of {', '.join(r.value for r in cls)}", value=str(value)[:80])


#: The default, as a program loaded without one gets it (the node keeps it).
DEFAULT = Restore.RELOAD

#: Why an ``adopt`` program that no longer runs is not loaded again at a start (status's
#: ``state.restore.left``).
LEFT = "restore adopt: not running, left to whoever loaded it (the fleet)"
