"""The fleet: many nodes' daemons run as one, on Ray (docs/fleet.md).

Ray places (a placement group per replica, or per program for the strategies that place them
together, against the resources each node advertises from its daemon's limits: ``capacity``),
restarts (detached actors: the ``controller`` and an ``agent`` per node) and routes
(``client.Fleet.call``); the node daemons keep the programs.
Ray is an optional dependency (``pip install 'meshd-mps[fleet]'``): without it, importing this
package raises ``errors.FleetUnavailable``.
"""

from __future__ import annotations

from meshd_mps.base.errors import FleetUnavailable

try:
    import ray  # noqa: F401
except ImportError as e:
    raise FleetUnavailable(f"the fleet needs Ray, which is not installed: {e}",
                           hint="pip install 'meshd-mps[fleet]'") from e

from meshd_mps.fleet.client import Fleet
from meshd_mps.fleet.spec import (
    FleetEvent,
    FleetProgram,
    FleetReply,
    FleetStatus,
    NodeView,
    ProgramSource,
    ProgramSpec,
    ReplicaView,
)

__all__ = ["Fleet", "FleetEvent", "FleetProgram", "FleetReply", "FleetStatus", "NodeView", "ProgramSource",
           "ProgramSpec", "ReplicaView"]
