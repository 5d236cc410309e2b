"""What the controller's loop observed at one look, as ``plan`` reads it: Ray's view (the fleet's
alive nodes, where each placement group's bundles are, the resources still free) and each node's
agent as last heard (its report, whether it answers, the share it holds and the lease it was
granted).  Plain frozen data, made by ``observe`` (loop.py) from Ray (raycluster.py) or from the
simulation (simulate.py), so that ``plan`` is a function of it and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.fleet.capacity import node_name
from meshd_mps.fleet.messages import AgentReport


@dataclass(frozen=True)
class NodeInfo:
    """An alive node of the fleet (it advertises ``meshd_slot``): its Ray id, its name
    (``meshd_node_<name>`` where it gives one, else its id's start) and its resources."""

    id: str
    resources: Mapping[str, float]
    host: str = ""
    named: str | None = field(default=None, init=False)  # its meshd_node_<name>, if any (what pins a replica to it)
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        named = node_name(dict(self.resources))
        object.__setattr__(self, "named", named)
        object.__setattr__(self, "name", named or self.host or self.id[:8])


@dataclass(frozen=True)
class Placement:
    """A placement group as Ray has it: each bundle's node (None: not placed now), and its state
    (``CREATED``, ``PENDING``, ``RESCHEDULING``)."""

    nodes: tuple[str | None, ...]
    state: str = "CREATED"


@dataclass(frozen=True)
class RayView:
    """Ray's view at one look: ``nodes`` (the fleet's alive ones, by id), ``placements`` (the
    fleet's placement groups, by name; one not listed is not there), ``available`` (the cluster's
    free resources), and ``changed``: the placement groups made, moved or gone since the look
    before (None: not known, every one may have)."""

    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    placements: Mapping[str, Placement] = field(default_factory=dict)
    available: Mapping[str, float] = field(default_factory=dict)
    changed: frozenset[str] | None = None


@dataclass(frozen=True)
class AgentState:
    """A node's agent as the controller last heard it: its ``report`` (None: none yet), ``why`` it
    does not answer now (None: it does), the replicas the share it holds orders or keeps (``held``:
    it loads or leaves running those and unloads the others; None: not known), and, per unique
    replica, the end of the last lease the controller granted it there (``grants``, wall-clock
    seconds); ``name``: its node's (kept once the node has left the cluster)."""

    report: AgentReport | None = None
    why: str | None = None
    held: frozenset[str] | None = None
    grants: Mapping[str, float] = field(default_factory=dict)
    name: str | None = None


@dataclass(frozen=True)
class Observed:
    """One look: Ray's view, each node's agent, the replicas each fresh report shows on its daemon
    (``holders``: name -> the nodes), the time (``now``, monotonic; ``wall``), when this controller
    started (``started``, monotonic), and ``fence``: the wall-clock time by which every lease an
    earlier controller may have granted has run out, its copies stopped."""

    ray: RayView
    agents: Mapping[str, AgentState]
    holders: Mapping[str, Set[str]]
    now: float
    wall: float
    started: float
    fence: float
    deadlines: Deadlines = DEFAULT

    def report(self, nid: str | None) -> AgentReport | None:
        a = self.agents.get(nid) if nid is not None else None
        return None if a is None else a.report

    def answers(self, nid: str) -> bool:
        a = self.agents.get(nid)
        return a is not None and a.report is not None and a.why is None

    def stop_within(self, nid: str | None) -> float:
        """How long past a lease a program of node ``nid``'s daemon may run (its report's figure,
        else the default deadlines')."""
        r = self.report(nid)
        if r is not None and r.stop_within is not None:
            return r.stop_within
        d = self.deadlines
        return d.orphan + d.orphan_halt
