"""MPS mode below the backend: the host-wide part (the stand-in control daemon, a supervisor, the
mailbox) and one GPU's ``MpsIsolation``; the ``mps_rig`` fixture (tests/conftest.py) builds it."""

from __future__ import annotations

import tempfile

from meshd_mps.isolation.mps import Mps, MpsIsolation
from meshd_mps.mps.control import ControlDaemon
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.supervisor import Supervisor

from .deadlines import TEST_DEADLINES

#: What a load is refused with once the control daemon died under us (the sim's and the GPU's tests).
DAEMON_DIED = (r"^mps: the MPS control daemon \d+ died \(killed by SIGKILL\): no new worker can be verified as a"
               r" client of our server; refusing \(running programs go on; restart meshd-mps to load again\)$")


class MpsRig:
    """MPS mode's host-wide part on a fresh stand-in daemon, and GPU ``devices[0]``'s isolation
    (as ``async with``), its pool empty: each test prewarms what it needs."""

    def __init__(self, deadlines=TEST_DEADLINES, pool_cap=4, max_clients=48, sms=0, devices=(0,)):
        self.mailbox = Mailbox.create()
        # A short path: MPS's sockets live in it and AF_UNIX paths stop at 108 bytes.
        self.daemon = ControlDaemon(tempfile.mkdtemp(prefix="meshd-test-"), temporary=True)
        self.sup = Supervisor(deadlines)
        self.mps = Mps(self.daemon, self.sup, self.mailbox.path, sms, "sim", pool_cap, max_clients)
        self.devices = devices

    async def __aenter__(self) -> MpsIsolation:
        await self.mps.start()
        await self.sup.start()
        for d in self.devices:
            self.mps.add(d)
        return self.mps.gpus[self.devices[0]]

    async def __aexit__(self, *exc) -> None:
        try:
            for g in self.mps.gpus.values():
                await g.close()
            await self.sup.close()
        finally:
            await self.mps.close()
            self.mailbox.close()
