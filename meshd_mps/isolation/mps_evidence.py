"""A fault's evidence on one GPU in MPS mode: the culprits the MPS server logged, and the workers
that ended on their own with a kernel launched.  Apart from ``MpsIsolation``, which asks it, as
the evidence is read from the server's log and the supervisor, never from the pool or the programs."""

from __future__ import annotations

from collections.abc import Collection

import anyio

from meshd_mps.base.faults import Stray
from meshd_mps.isolation.base import Evidence
from meshd_mps.mps.clients import Clients
from meshd_mps.supervision.supervisor import Supervisor


class ServerEvidence:
    """One GPU's: ``clients`` (the host's MPS server and its log), ``sup`` (the workers' exits)."""

    def __init__(self, clients: Clients, sup: Supervisor, device: int):
        self.clients, self.sup, self.device = clients, sup, device

    async def evidence(self, ours: Collection[int] = (), wait: float = 0.0) -> Evidence:
        """The server log's culprits, watched for up to ``wait`` seconds until one shows (the server
        writes its line within milliseconds of the fault); whether it was a fault of the GPU is for
        the evidence to say."""
        pids = self.fatal_pids()
        if not pids and wait > 0:
            with anyio.move_on_after(wait):
                while not (pids := self.fatal_pids()):
                    await anyio.sleep(0.02)
        return Evidence(pids, self.strays(set(ours)), gpu_wide=False)

    def fatal_pids(self) -> list[int]:
        """The pids of this GPU that the MPS server logged as having hit a fatal error, taken (a
        later look does not see them again)."""
        return self.clients.fatal.take(self.device, self.clients.device_of)

    def strays(self, ours: set[int]) -> list[Stray]:
        """Workers of this GPU, none of ``ours`` (the programs'), that ended on their own with a
        kernel launched: the culprit where no program is (faults.name_culprit)."""
        return [Stray(w.pid, w.program, w.exited_running_at) for w in self.sup.exited_running
                if w.device == self.device and w.pid not in ours]

    def took(self, stray: Stray) -> None:
        """``stray`` was named a fault's culprit: a later fault does not name it again."""
        self.sup.exited_running = [w for w in self.sup.exited_running if w.pid != stray.pid]
