"""The tests' one table of deadlines (tests/conftest.py names TEST_DEADLINES too): short where a
test waits a deadline out, the seed's where a reply must come and a slow machine must not fail it.
Each variant says which tests take it; a test that needs one more change makes it with
``dataclasses.replace`` of one of these."""

from __future__ import annotations

import dataclasses

from meshd_mps.base.deadlines import Deadlines

#: Short retire deadlines keep hang tests quick; replies keep the seed's.
TEST_DEADLINES = Deadlines(retire_quit=1.0, retire_kill=2.0)

#: Quick backoffs: a crash loop is reached in well under a second of backoff (tests/rig/test_restart.py,
#: tests/cases/restart.py).
QUICK_RESTARTS = dataclasses.replace(TEST_DEADLINES, restart_backoff=0.02, restart_backoff_max=0.1)

#: A quick relaunch, and failures 0.5 s apart already two faults (tests/rig/test_lifecycle_races.py).
QUICK_RECOVERY = dataclasses.replace(TEST_DEADLINES, restart_backoff=0.05, fault_window=0.5)

#: Detached workers wait a minute for the next supervisor (tests/rig/test_live_transport.py).
LIVE = Deadlines(retire_quit=1.0, retire_kill=2.0, orphan=60.0)

# tests/rig/test_workers.py's fault table, as Deadlines fields: retirement waits up to 10 s for a worker
# to exit at QUIT or EOF (one that does: its status is its own, never a kill that came early); one
# that hangs gets 0.5 s and is killed.  A reply that never comes is given up on after 1 s: the
# cases wait these deadlines out.
RETIRE = {"retire_quit": 10.0, "retire_kill": 5.0}
HANGS = {"retire_quit": 0.5, "retire_kill": 5.0}
NO_REPLY = 1.0
