"""Supervisors that detach and adopt workers (live restore's transport): one file mailbox, the
workers' sockets under ``state/workers``, a supervisor at a time (tests/rig/test_live_transport.py)."""

from __future__ import annotations

import os

from meshd_mps.backend import live_paths
from meshd_mps.base.deadlines import Deadlines
from meshd_mps.mps.control import ControlDaemon
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.argv import worker_argv
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor


class LiveRig:
    """A supervisor at a time over one file mailbox and ``state/workers``."""

    def __init__(self, state: str, daemon: ControlDaemon, deadlines: Deadlines):
        self.dir = os.path.join(state, "workers")
        self.mailbox = Mailbox.create(live_paths(state).mailbox)  # shared memory: the GPU registers it
        self.env = {**os.environ, **daemon.env}
        self.deadlines = deadlines
        self.sups: list[Supervisor] = []

    async def sup(self) -> Supervisor:
        s = Supervisor(self.deadlines)
        await s.start()
        self.sups.append(s)
        return s

    async def spawn(self, sup: Supervisor, listen: bool = True) -> WorkerProc:
        return await sup.spawn(worker_argv(self.mailbox.path, 0, "sim"), self.env, listen=self.dir if listen else None)

    async def close(self) -> None:
        for s in self.sups:
            await s.close()
        self.mailbox.close()
        os.unlink(self.mailbox.path)
