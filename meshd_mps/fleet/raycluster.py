"""The controller loop's cluster on Ray (loop.py ``Cluster``): Ray's view of the fleet (its alive
nodes that advertise ``meshd_slot``, where the fleet's placement groups' bundles are, the resources
free), each node's agent (a detached actor pinned to its node, restarted by Ray), and the
placement groups made and removed.  Every Ray call here blocks, so each runs in a thread.

Ray places, restarts and routes: the controller makes a placement group per replica (or one per
program: desired.py ``units``) and reads where Ray put each bundle; it never picks a node.  A
placement group is detached: it outlives the controller (not the head: after the head's restart
the controller makes them again, pinned where the replicas ran).  Its name in Ray is the unit's
with ``meshd-mps.<fleet id>.`` first: the loop sees only its own fleet's (another fleet in the
cluster, another namespace, has its own), and the ones it finds that no declared program owns
(a program removed while no controller ran) it removes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.fleet.agent import NodeAgent, agent_name
from meshd_mps.fleet.capacity import SLOT
from meshd_mps.fleet.messages import AgentReport, Share
from meshd_mps.fleet.observed import NodeInfo, Placement, RayView


class RayAgent:
    """A node agent's actor, as the loop calls it (links.py ``Agent``)."""

    def __init__(self, handle: Any):
        self.handle = handle

    def watch(self, since: int) -> asyncio.Future[AgentReport]:
        return asyncio.wrap_future(self.handle.watch.remote(since).future())

    def apply(self, share: Share, since: int) -> asyncio.Future[AgentReport]:
        return asyncio.wrap_future(self.handle.apply.remote(share, since).future())


class RayCluster:
    """``fleet``: the fleet's id, in its placement groups' names."""

    def __init__(self, namespace: str, fleet: str, deadlines: Deadlines = DEFAULT):
        self.ns, self.d = namespace, deadlines
        self.prefix = f"meshd-mps.{fleet}."
        self.last: dict[str, Placement] = {}
        self.view: RayView | None = None

    async def look(self, placements: bool = True) -> RayView:
        """Ray's view; with ``placements`` False the placement groups as the last look read them
        (the loop asks for them again while a replica waits on Ray, after it made or removed one,
        when a node came or went, and every ``fleet_tick`` times ten: a group moves only then)."""
        if not placements and self.view is not None:
            nodes = await asyncio.to_thread(ray.nodes)
            alive = self._alive(nodes)
            if alive.keys() == self.view.nodes.keys():
                return RayView(alive, self.view.placements, self.view.available, frozenset())
        nodes, table, available = await asyncio.gather(asyncio.to_thread(ray.nodes),
                                                       asyncio.to_thread(placement_group_table),
                                                       asyncio.to_thread(ray.available_resources))
        alive = self._alive(nodes)
        groups: dict[str, Placement] = {}
        for t in table.values():
            name = t.get("name") or ""
            if not name.startswith(self.prefix) or t.get("state") == "REMOVED":
                continue
            name = name[len(self.prefix):]
            where = t.get("bundles_to_node_id") or {}
            at = tuple(where.get(b) or None for b in range(len(t.get("bundles") or {})))
            old = self.last.get(name)
            same = old is not None and old.nodes == at and old.state == t.get("state")
            groups[name] = old if same and old is not None else Placement(at, str(t.get("state")))
        changed = frozenset(n for n in groups.keys() | self.last.keys() if groups.get(n) is not self.last.get(n))
        self.last = groups
        self.view = RayView(alive, groups, available, changed)
        return self.view

    @staticmethod
    def _alive(nodes: list[dict[str, Any]]) -> dict[str, NodeInfo]:
        return {n["NodeID"]: NodeInfo(n["NodeID"], n.get("Resources") or {}, str(n.get("NodeName") or ""))
                for n in nodes if n.get("Alive") and SLOT in (n.get("Resources") or {})}

    async def agent(self, nid: str) -> RayAgent:
        def start() -> RayAgent:
            return RayAgent(ray.remote(NodeAgent).options(
                name=agent_name(nid), namespace=self.ns, lifetime="detached", get_if_exists=True, max_restarts=-1,
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(deadlines=self.d))

        return await asyncio.to_thread(start)

    async def place(self, create: list[tuple[str, list[dict[str, float]], str]], remove: list[str]) -> None:
        def run() -> None:
            for name in remove:
                with contextlib.suppress(ValueError):  # gone already
                    remove_placement_group(get_placement_group(self.prefix + name))
            for name, bundles, strategy in create:
                placement_group(bundles, strategy=strategy, name=self.prefix + name, lifetime="detached")

        await asyncio.to_thread(run)
