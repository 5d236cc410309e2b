"""What one GPU can run at once: the limits a load is checked against before it changes anything.

Every figure was measured on the H200 (driver 580, CUDA 13.0; docs/operations.md, "Limits"):

- **Hardware work queues.** A context has ``CUDA_DEVICE_MAX_CONNECTIONS`` of them (8 by default, 32
  at most), and streams share them round-robin.  A kernel on a queue that holds a resident kernel
  never starts: the blink context's 9th program never ran.  So the blink context's worker asks for
  the most, 32 (``BLINK_QUEUES``), gives each module a stream of its own queue, and the context
  takes at most that many programs.  An MPS worker runs one program: ``MPS_QUEUES``.
- **MPS clients.** The server takes 48 (``mps.MAX_CLIENTS``); the pool's idle workers are clients
  too, so the programs of one GPU are at most 48 less the pool (``MpsIsolation.check_room``).
- **Co-residency.** A resident kernel never returns, so every block of it must be on the GPU at
  once: at most its occupancy per SM (``per_sm``, known once the module is loaded) times its
  context's SMs.  Programs that run at once share those blocks, so the *shares*
  (``nodes / (per_sm * sms)``) of a GPU's programs add up to at most 1.  Before the load, the
  device's most blocks per SM gives a lower bound of the share; after it, the real occupancy.
- **The grid.** ``nodes`` is the launch's x dimension: at most ``max_grid_x`` (2^31 - 1).
"""

from __future__ import annotations

from meshd_mps.base.errors import CapacityError, LimitError
from meshd_mps.gpu.device import DeviceInfo
from meshd_mps.supervision.argv import MPS_QUEUES

__all__ = ["BLINK_QUEUES", "MPS_QUEUES", "check_nodes", "check_resident", "share"]

#: Hardware work queues the blink context's worker asks for: the most the driver allows.
BLINK_QUEUES = 32
#: An MPS worker's, ``MPS_QUEUES``: its one program's stream, and one to spare (the worker's command
#: line, supervision/argv.py, asks for it by default).


def share(nodes: int, per_sm: int, sms: int) -> float:
    """The part of its context's resident blocks a kernel of ``nodes`` blocks holds."""
    return nodes / (per_sm * sms) if per_sm > 0 and sms > 0 else float("inf")


def check_nodes(name: str, nodes: int, info: DeviceInfo, sms: int, used: float) -> None:
    """Before anything is loaded: ``nodes`` within the grid, within what the device could ever hold
    at once on ``sms`` SMs (its most blocks per SM), and within what the GPU's other programs
    (their shares add up to ``used``) leave, counted with that most."""
    if nodes < 1:
        raise LimitError(f"{name}: nodes {nodes}: a launch has at least 1 block")
    if nodes > info.max_grid_x:
        raise CapacityError(f"{name}: nodes {nodes} is over the grid limit of {info.max_grid_x} blocks"
                            f" (the launch's x dimension on {info.name})", limit="grid", have=info.max_grid_x,
                            asked=nodes)
    most = info.blocks_per_sm * sms
    if nodes > most:
        raise CapacityError(f"{name}: nodes {nodes} cannot be resident at once: {info.name} holds at most {most} blocks"
                            f" ({info.blocks_per_sm} per SM on {sms} SMs), and a resident kernel needs all of its blocks"
                            " on the GPU together", limit="resident blocks", have=most, asked=nodes)
    _check_share(name, nodes, share(nodes, info.blocks_per_sm, sms), used, most, "at most")


def check_resident(name: str, nodes: int, per_sm: int, sms: int, used: float) -> None:
    """Once the module is loaded: ``nodes`` blocks all resident at once at its real occupancy
    (``per_sm`` blocks on each of ``sms`` SMs), beside the GPU's other programs (``used``)."""
    have = per_sm * sms
    if nodes > have:
        why = ("not one block of it fits an SM (its registers, shared memory or threads)" if per_sm == 0 else
               f"{per_sm} of its blocks fit an SM, on {sms} SMs")
        raise CapacityError(f"{name}: nodes {nodes} cannot be resident at once: the GPU holds {have} of its blocks ({why});"
                            " a resident kernel needs all of its blocks on the GPU together",
                            limit="resident blocks", have=have, asked=nodes)
    _check_share(name, nodes, share(nodes, per_sm, sms), used, have, "")


def _check_share(name: str, nodes: int, mine: float, used: float, whole: int, how: str) -> None:
    if used + mine > 1.0 + 1e-9:
        left = max(0, int((1.0 - used) * whole + 1e-9))
        raise CapacityError(f"{name}: nodes {nodes} do not fit beside the programs already resident on this GPU: they hold"
                            f" {used:.0%} of its blocks, which leaves room for {how + ' ' if how else ''}{left} of this"
                            " program's", limit="co-resident blocks", have=left, asked=nodes)
