"""The fleet's controller: a detached, named async Ray actor (``meshd-mps-fleet``, on the head,
restarted by Ray) that keeps the programs declared (checkpointed on its node's disk: checkpoint.py)
and runs the loop that makes the cluster run them (loop.py: observe, plan, act, on Ray:
raycluster.py).

Its methods are the fleet's API (fleet/client.py calls them): ``deploy``, ``upgrade`` and ``remove``
change what is declared (and write the checkpoint) and wake the loop; ``program``, ``status`` and
``routes`` answer from the views the loop's last tick made.  None of them waits on the loop, on
Ray or on a node's agent: with one node's agent hung, each answers at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any

import ray

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.fleet import data as fleet_data
from meshd_mps.fleet.capacity import SLOT, gpu_models
from meshd_mps.fleet.checkpoint import Checkpoint, fleet_state_dir
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.loop import Reconciler
from meshd_mps.fleet.raycluster import RayCluster
from meshd_mps.fleet.spec import FleetProgram, FleetStatus, NodeView, Routes

CONTROLLER = "meshd-mps-fleet"


class FleetController:
    def __init__(self, namespace: str, state_dir: str | None = None, deadlines: Deadlines = DEFAULT):
        self.ns = namespace
        self.checkpoint = Checkpoint(state_dir or fleet_state_dir(), namespace)
        declared = self.checkpoint.load()
        fleet = FleetId(self.checkpoint.fleet, namespace, str(ray.get_runtime_context().gcs_address))
        self.loop = Reconciler(RayCluster(namespace, fleet.id, deadlines), fleet, deadlines, self.checkpoint, declared)
        self.task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.loop.run())

    # ---- the API (fleet/client.py) ---------------------------------------------------------------

    async def ready(self) -> bool:
        self._start()
        await self.loop.ticked.wait()
        return True

    async def deploy(self, spec: Spec, data_node: str | None = None) -> FleetProgram:
        """``spec`` declared; its data (if any: a ref the deploying client owns, put on its node
        ``data_node``) made the controller's first (fleet/data.py)."""
        self._start()
        if spec.image.data is not None:
            got = await fleet_data.owned({"data": spec.image.data, "data_node": data_node})
            spec = dataclasses.replace(spec, image=dataclasses.replace(spec.image, data=got["data"]))
        return await self.loop.declare(spec)

    async def upgrade(self, name: str, image: Image) -> FleetProgram:
        self._start()
        return await self.loop.upgrade(name, image)

    async def remove(self, name: str) -> None:
        self._start()
        await self.loop.remove(name)

    async def program(self, name: str) -> FleetProgram:
        return self.loop.view(name)

    async def status(self, name: str | None = None) -> FleetStatus:
        self._start()
        return status(self.loop, name)

    async def routes(self, name: str) -> Routes:
        return routes(self.loop, name)


def status(lp: Reconciler, name: str | None = None) -> FleetStatus:
    """The fleet as the loop's last tick saw it (``name``: one program's, and the events of it and
    of no program)."""
    names = [name] if name is not None else sorted(lp.specs)
    progs = tuple(lp.view(n) for n in names)
    placed = collections.Counter(r.node for n in lp.specs for r in lp.view(n).replicas if r.node)
    nodes = tuple(node_view(lp, nid, placed[nid]) for nid in sorted(set(lp.nodes) | set(lp.links.links)))
    events = tuple(e for e in lp.events if name is None or e.program in (None, name))
    age = None if lp.last_tick is None else round(time.monotonic() - lp.last_tick, 3)
    return FleetStatus(programs=progs, nodes=nodes, events=events, fleet=lp.fleet.to_json(), moves=lp.moves,
                       node_losses=lp.node_losses, tick_age=age)


def routes(lp: Reconciler, name: str) -> Routes:
    """The replicas a call may go to now (running, not draining), each node's daemon socket,
    agent and call port."""
    v = lp.view(name)
    got = lp.plans.get(name)
    draining = got.rollout.draining if got is not None else None
    live = [r for r in v.replicas if r.state == "running" and r.index != draining]
    socks: dict[str, str] = {}
    agents: dict[str, Any] = {}
    ports = {}
    for nid in {r.node for r in live if r.node}:
        lk = lp.links.links.get(nid)
        if lk is None:
            continue
        agents[nid] = lk.agent.handle
        if lk.report is not None:
            socks[nid] = lk.report.socket
            if lk.report.call_port is not None:
                ports[nid] = lk.report.call_port
    return Routes(live, socks, agents, ports)


def node_view(lp: Reconciler, nid: str, count: int) -> NodeView:
    """Node ``nid`` as the loop sees it; ``count``: the replicas Ray placed there."""
    n = lp.nodes.get(nid)
    lk = lp.links.links.get(nid)
    rep = lk.report if lk is not None else None
    res = dict(n.resources) if n is not None else {}
    why = lk.why if lk is not None else None
    agent = "starting" if rep is None and why is None else ("up" if why is None else "not answering")
    return NodeView(node=nid, name=n.name if n is not None else nid[:8], alive=n is not None, agent=agent,
                    slots=int(res.get(SLOT, 0)), replicas=count, gpus=gpu_models(res),
                    socket=rep.socket if rep else None, daemon_pid=rep.daemon_pid if rep else None,
                    agent_pid=rep.pid if rep else None,
                    reason=why or (rep.claim.why if rep and rep.claim else None) or (rep.error if rep else None),
                    claimed_by=(lp.links.claimed.get(nid) or None) if n is not None else None,
                    call_port=str(rep.call_port) if rep and rep.call_port else None,
                    call_port_error=rep.call_port_error if rep else None)
