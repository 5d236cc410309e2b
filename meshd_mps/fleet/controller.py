"""The fleet's controller: a detached, named async Ray actor that keeps the desired state (the
programs declared, checkpointed on its node's disk) and reconciles it, level-triggered, every tick.

Ray places: one placement group per program, a bundle per replica (``capacity.bundle``), with the
spec's strategy; Ray re-places the bundles of a dead node.  The controller only reads where the
bundles landed (``placement_group_table``) and hands each node's agent its share; it never picks a
node.  It starts one agent per node that advertises ``meshd_slot`` (pinned there, detached,
restarted by Ray), and builds the views (``spec.ReplicaView``) from the placements and what each
agent reports of its daemon.  Its fleet's id (kept in the checkpoint) goes to every agent with its
share: the agent claims its node's daemon by it (claim.py), and a daemon another fleet holds shows
here with the reason, on the node and on each replica Ray placed there.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meshd_mps.deadlines import DEFAULT, Deadlines
from meshd_mps.errors import AlreadyDeclared, NoSuchProgram
from meshd_mps.fleet import data as fleet_data
from meshd_mps.fleet.agent import NodeAgent, agent_name
from meshd_mps.fleet.capacity import SLOT, gpu_models, node_name, why_pending
from meshd_mps.fleet.checkpoint import Checkpoint, fleet_state_dir
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.desired import Declared, Image
from meshd_mps.fleet.pace import Watches, settled
from meshd_mps.fleet.spec import (
    FleetEvent,
    FleetProgram,
    FleetStatus,
    NodeView,
    ReplicaView,
    Routes,
    replica_name,
    resource_key,
)

CONTROLLER = "meshd-mps-fleet"
EVENTS = 500
#: Daemon states that count as running (a stalled program runs: its heartbeat is late).
RUNS = ("running", "stalled")
STARTS = ("restarting",)


class FleetController:
    def __init__(self, namespace: str, state_dir: str | None = None, deadlines: Deadlines = DEFAULT):
        self.ns = namespace
        self.d = deadlines
        self.checkpoint = Checkpoint(state_dir or fleet_state_dir(), namespace)
        self.programs: dict[str, Declared] = {k: Declared.from_json(v) for k, v in self.checkpoint.load().items()}
        self.fleet = FleetId(self.checkpoint.fleet, namespace, str(ray.get_runtime_context().gcs_address))
        self.pgs: dict[str, Any] = {}
        self.agents: dict[str, Any] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  # alive fleet nodes, by Ray node id: ray.nodes()' entry
        self.seen: dict[str, dict[str, Any]] = {}  # the last report of each node's agent
        self.answering: dict[str, str | None] = {}  # node -> None (answered this tick) or why not
        self.views: dict[str, FleetProgram] = {}
        self.events: collections.deque[FleetEvent] = collections.deque(maxlen=EVENTS)
        self.ticked = asyncio.Event()
        self.poke = asyncio.Event()  # a change declared (deploy, upgrade, remove): the next look now
        self.watches = Watches(deadlines.fleet_tick)  # the agents' watch calls: a pause ends at their answer
        #: The last look's Ray placement: each program's nodes by replica, the placement groups by
        #: name, the resources available (``_reported`` builds the views on it).
        self.last_look: tuple[dict[str, list[str | None]], dict[str, Any], dict[str, float]] | None = None
        self.nodes_changed = False  # a node joined or left at the last look
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.saving = asyncio.Lock()
        self.started = time.monotonic()
        self.last_tick: float | None = None  # when the last tick ended (monotonic)
        self.moves = 0  # replicas seen on another node than before, since this controller started
        self.node_losses = 0  # fleet nodes that left the cluster, since this controller started
        self.claimed: dict[str, str] = {}  # node -> the other fleet whose claim keeps this one off its daemon
        self.event("controller", f"controller started; {len(self.programs)} programs declared in {self.checkpoint.path}")

    # ---- the API (fleet/client.py) ---------------------------------------------------------------

    async def ready(self) -> bool:
        self._start()
        await self.ticked.wait()
        return True

    async def deploy(self, spec: dict[str, Any], image: dict[str, Any]) -> FleetProgram:
        self._start()
        image = await fleet_data.owned(image)  # its data, if any, the controller's (fleet/data.py)
        async with self.lock:
            name = spec["name"]
            if name in self.programs:
                raise AlreadyDeclared(name)
            p = Declared(name=name, replicas=spec["replicas"], restart=spec["restart"], strategy=spec["strategy"],
                         gpu=spec.get("gpu"), node=spec.get("node"), image=Image.from_json(image))
            self.programs[name] = p
            await self._save()
            self.pgs[name] = await asyncio.to_thread(self._placement, p)
            self.event("declared", f"{name}: declared, {p.replicas} replicas ({p.strategy}), image {p.image.hash}", name)
            self.poke.set()
            return self._view(p)

    async def upgrade(self, name: str, image: dict[str, Any]) -> FleetProgram:
        self._start()
        async with self.lock:
            p = self._get(name)
            p.upgrade_to(Image.from_json(image))
            await self._save()
            self.event("upgrade", f"{name}: upgrade to image {p.image.hash} (generation {p.generation}) declared", name)
            self.poke.set()
            return self._view(p)

    async def remove(self, name: str) -> None:
        self._start()
        async with self.lock:
            p = self._get(name)
            del self.programs[name]
            await self._save()
            pg = self.pgs.pop(name, None) or await asyncio.to_thread(_find_pg, p.pg_name)
            if pg is not None:
                await asyncio.to_thread(remove_placement_group, pg)
            self.views.pop(name, None)
            if self.last_look is not None:
                self.last_look[0].pop(name, None)  # a program declared again under its name is placed anew
            self.event("removed", f"{name}: removed; its replicas are unloaded", name)
            self.poke.set()

    async def program(self, name: str) -> FleetProgram:
        p = self._get(name)
        return self.views.get(name) or self._view(p)

    async def status(self, name: str | None = None) -> FleetStatus:
        self._start()
        progs: tuple[FleetProgram, ...]
        if name is not None:
            progs = (await self.program(name),)
        else:
            progs = tuple(self.views.get(n) or self._view(p) for n, p in sorted(self.programs.items()))
        nodes = tuple(self._node_view(nid) for nid in sorted(set(self.nodes) | set(self.seen)))
        events = tuple(e for e in self.events if name is None or e.program in (None, name))
        age = None if self.last_tick is None else round(time.monotonic() - self.last_tick, 3)
        return FleetStatus(programs=progs, nodes=nodes, events=events, fleet=self.fleet.to_json(), moves=self.moves,
                           node_losses=self.node_losses, tick_age=age)

    async def routes(self, name: str) -> Routes:
        """The replicas a call may go to now (running, not draining), each node's daemon socket,
        agent and call port."""
        p = self._get(name)
        v = self.views.get(name)
        live = [r for r in (v.replicas if v else ()) if r.state == "running" and r.index != p.draining]
        nodes = {r.node for r in live if r.node}
        socks = {n: self.seen[n]["socket"] for n in nodes if n in self.seen}
        agents = {n: self.agents[n] for n in nodes if n in self.agents}
        ports = {n: self.seen[n]["call_port"] for n in nodes if (self.seen.get(n) or {}).get("call_port")}
        return Routes(live, socks, agents, ports)

    # ---- the loop --------------------------------------------------------------------------------

    def _start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                async with self.lock:
                    self._reported()
                    await self._tick()
                self.last_tick = time.monotonic()
            except Exception as e:  # one bad tick (the GCS away a moment) must not end the loop
                self.event("error", f"controller tick failed: {type(e).__name__}: {e}")
            self.ticked.set()
            period = self.d.fleet_tick if self._settled() else min(self.d.fleet_tick, self.d.fleet_busy_tick)
            await self.watches.pause(self.poke, period)

    def _reported(self) -> None:
        """What the agents whose watch answered report (``NodeAgent.watch``: their loads done),
        into the views now, with Ray's placement as the last look read it: the look that follows
        reads Ray and asks every agent again (40-90 ms at 200 replicas), and ``status`` meanwhile
        shows the replicas running."""
        fresh = {nid: r for nid, r in self.watches.answers().items() if nid in self.nodes}
        if not fresh or self.last_look is None:
            return
        self.seen.update(fresh)
        placed, tables, available = self.last_look
        for name, p in self.programs.items():
            if name in placed:
                self._observe(p, placed[name], tables.get(p.pg_name) or {}, available)

    def _settled(self) -> bool:
        return settled(self.programs, self.views, self.nodes_changed,
                       any(why is not None for why in self.answering.values()), self._loading())

    def _loading(self) -> frozenset[tuple[str, int]]:
        """The replicas (program, index) their node's agent is to load or upgrade (starting, not on
        their node's daemon with their image yet, the agent refused neither: ``_replica``'s view)
        while that agent's watch is out."""
        out = self.watches.out()
        return frozenset((name, r.index) for name, v in self.views.items() if name in self.programs
                         for r in v.replicas
                         if r.state == "starting" and r.node in out and r.hash != self.programs[name].assigned[r.index]
                         and self._error_of(r.node, r.name) is None)

    async def _tick(self) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive") and SLOT in (n.get("Resources") or {})}
        for nid in alive.keys() - self.nodes.keys():
            self.event("node-joined", f"node {_name(alive[nid])} ({nid[:8]}) joined the fleet", node=nid)
        for nid in self.nodes.keys() - alive.keys():
            self.event("node-lost", f"node {_name(self.nodes[nid])} ({nid[:8]}) left the cluster", node=nid)
            self.node_losses += 1
            self.claimed.pop(nid, None)
            self.agents.pop(nid, None)
            self.seen.pop(nid, None)
            self.answering.pop(nid, None)
            self.watches.forget(nid)
        self.nodes_changed = alive.keys() != self.nodes.keys()
        self.nodes = alive
        for nid in alive.keys() - self.agents.keys():
            self.agents[nid] = await asyncio.to_thread(self._agent, nid)
        for name, p in self.programs.items():
            if name not in self.pgs:
                self.pgs[name] = await asyncio.to_thread(self._placement, p)
                await self._save()  # its pins
        tables = await asyncio.to_thread(placement_group_table)
        by_name = {t["name"]: t for t in tables.values() if t.get("name") and t.get("state") != "REMOVED"}
        placed: dict[str, list[str | None]] = {}
        shares: dict[str, list[dict[str, Any]]] = {nid: [] for nid in alive}
        keep: list[str] = []  # replicas with no node now: left running wherever they run until Ray places them
        sent: dict[str, set[str]] = {}  # the images in each node's share: each once
        for name, p in self.programs.items():
            t = by_name.get(p.pg_name) or {}
            where = t.get("bundles_to_node_id") or {}
            placed[name] = [where.get(i) or None for i in range(p.replicas)]
            for i, nid in enumerate(placed[name]):
                if nid in shares:
                    shares[nid].append(self._order(p, i, nid, sent.setdefault(nid, set())))
                else:
                    keep.append(replica_name(name, i))
        asked = time.monotonic()
        answers = await asyncio.gather(*(self._ask(nid, orders, keep) for nid, orders in shares.items()))
        waited = time.monotonic() - asked >= self.d.fleet_busy_tick
        for nid, ans in zip(shares, answers, strict=True):
            if isinstance(ans, dict):
                self.seen[nid], self.answering[nid] = ans, None
                self._claim_seen(nid, ans.get("claim"))
            else:
                if self.answering.get(nid, "") is None or waited:
                    # It answered the look before, or its ask hung: an agent that ends (its node lost)
                    # fails its ask at once, or only once Ray knows, and this look's placement was
                    # read before either: look again now.
                    self.poke.set()
                self.answering[nid] = ans
        self.watches.renew([n for n, why in self.answering.items() if why is None], self.agents,
                           {n: (self.seen.get(n) or {}).get("rounds", 0) for n in self.answering})
        available = await asyncio.to_thread(ray.available_resources)
        self.last_look = placed, by_name, available
        for name, p in self.programs.items():
            self._observe(p, placed[name], by_name.get(p.pg_name) or {}, available)
            if any(pin is not None for pin in p.pins):
                await self._unpin(p, placed[name])

    def _claim_seen(self, nid: str, foreign: dict[str, Any] | None) -> None:
        """An event when a node's daemon turns out to be another fleet's, or this fleet's again."""
        other = FleetId.from_json((foreign or {}).get("fleet"))
        was = self.claimed.get(nid)
        name = _name(self.nodes[nid]) if nid in self.nodes else nid[:8]
        if foreign is not None and was is None:
            self.claimed[nid] = other.id if other is not None else ""  # "": its claim file cannot be used
            self.event("node-claimed", f"node {name}: {foreign.get('why')}", node=nid)
        elif foreign is None and was is not None:
            del self.claimed[nid]
            self.event("node-released", f"node {name}: its daemon is this fleet's now (fleet {self.fleet.id})", node=nid)

    def _observe(self, p: Declared, placed: list[str | None], table: dict[str, Any], available: dict[str, float]) -> None:
        before = self.views.get(p.name)
        view = self._view(p, placed, table, available)
        running = [r.state == "running" for r in view.replicas]
        runs = [r.hash if r.state == "running" else None for r in view.replicas]
        for r in view.replicas:
            err = self._error_of(r.node, r.name)
            if err is not None and err[0] == p.image.hash and p.old is not None and err[0] != p.old.hash:
                p.roll_back(err[1])
                self.event("upgrade-failed", f"{p.name}: replica {r.index} refused image {err[0]}: {err[1]};"
                           f" rolling back to {p.image.hash}", p.name, r.index, r.node)
                break
        was = (list(p.assigned), p.draining, p.old, list(p.where))
        for r in view.replicas:
            here = node_name((self.nodes.get(r.node or "") or {}).get("Resources") or {})
            if r.state == "running" and here is not None:
                p.where[r.index] = here
        p.step(running, runs, drain=self.d.fleet_tick * 3)
        if p.draining is not None and was[1] != p.draining:
            self.event("draining", f"{p.name}: replica {p.draining} drained for the upgrade to {p.image.hash}",
                       p.name, p.draining)
        if (list(p.assigned), p.old, p.where) != (was[0], was[2], was[3]):
            asyncio.get_running_loop().create_task(self._save())
        view = self._view(p, placed, table, available)
        self.views[p.name] = view
        old = {r.index: r for r in before.replicas} if before else {}
        for r in view.replicas:
            o = old.get(r.index)
            if o is not None and o.node and r.node and o.node != r.node:
                self.moves += 1
                self.event("moved", f"{p.name}: replica {r.index} moved from node {o.node_name} to {r.node_name}",
                           p.name, r.index, r.node)
            if o is None or o.state != r.state:
                why = f": {r.reason}" if r.reason else ""
                self.event(r.state, f"{p.name}: replica {r.index} {r.state}{why}", p.name, r.index, r.node)

    # ---- views -------------------------------------------------------------------------------------

    def _view(self, p: Declared, placed: list[str | None] | None = None, table: dict[str, Any] | None = None,
              available: dict[str, float] | None = None) -> FleetProgram:
        placed = placed or [None] * p.replicas
        reps = []
        pending_why = None
        for i in range(p.replicas):
            nid = placed[i]
            if nid is None or nid not in self.nodes:
                if pending_why is None:
                    pending_why = self._why_pending(p, placed, table or {}, available)
                reps.append(ReplicaView(p.name, i, "pending", pending_why, generation=p.generation_of(p.assigned[i])))
            else:
                reps.append(self._replica(p, i, nid))
        return FleetProgram(name=p.name, replicas=tuple(reps), wanted=p.replicas, hash=p.image.hash,
                            generation=p.generation, restart=p.restart, strategy=p.strategy, gpu=p.gpu, node=p.node,
                            upgrading=p.upgrading, upgrade_error=p.upgrade_error)

    def _replica(self, p: Declared, i: int, nid: str) -> ReplicaView:
        name = replica_name(p.name, i)
        nname = _name(self.nodes[nid])
        base: dict[str, Any] = {"node": nid, "node_name": nname}
        seen = self.seen.get(nid)
        want = p.assigned[i]
        if seen is None:
            return ReplicaView(p.name, i, "placing", "waiting for the node's agent", **base,
                               generation=p.generation_of(want))
        if seen.get("claim") is not None:  # another fleet's daemon: its programs are not this fleet's replicas
            return ReplicaView(p.name, i, "pending", seen["claim"].get("why"), **base, generation=p.generation_of(want))
        if seen.get("programs") is None:
            return ReplicaView(p.name, i, "placing", f"the node's daemon does not answer: {seen.get('error')}", **base,
                               generation=p.generation_of(want))
        d = next((x for x in seen["programs"] if x.get("name") == name), None)
        err = self._error_of(nid, name)
        if d is None:
            if err is not None and err[0] == want:
                return ReplicaView(p.name, i, "failed", err[1], **base, generation=p.generation_of(want))
            return ReplicaView(p.name, i, "starting", "loading on its node", **base, generation=p.generation_of(want))
        info = {**base, "gpu": d.get("device"), "slot": d.get("slot"), "pid": d.get("pid"), "hash": d.get("hash"),
                "heartbeat_age": d.get("beat_age_s"), "heartbeat": d.get("heartbeat"),
                "generation": p.generation_of(d.get("hash"))}
        if (seen.get("busy") or {}).get(name) == "unloading":
            # An earlier share's (the program removed, then declared again): gone in a moment, then
            # loaded again; no call goes to it meanwhile.
            return ReplicaView(p.name, i, "stopping", "being unloaded on its node (an earlier share's)", **info)
        state, reason = d.get("state"), None
        if i == p.draining:
            return ReplicaView(p.name, i, "stopping", f"drained for the upgrade to {p.image.hash}", **info)
        if d.get("hash") != want:
            return ReplicaView(p.name, i, "starting", f"upgrading to image {want}", **info)
        if state in RUNS:
            return ReplicaView(p.name, i, "running", "stalled: its heartbeat is late" if state == "stalled" else None,
                               **info)
        if state in STARTS:
            return ReplicaView(p.name, i, "starting", f"{state} on its node", **info)
        reason = d.get("error") or f"{state} on its node"
        return ReplicaView(p.name, i, "failed", reason, **info)

    def _why_pending(self, p: Declared, placed: list[str | None], table: dict[str, Any],
                     available: dict[str, float] | None) -> str:
        if not table:
            return "its placement group is being created"
        count = sum(1 for nid in placed if nid is None or nid not in self.nodes)
        nodes = [n.get("Resources") or {} for n in self.nodes.values()]
        return why_pending(p.bundles()[0], nodes, available or {}, count, p.strategy)

    def _node_view(self, nid: str) -> NodeView:
        n = self.nodes.get(nid)
        seen = self.seen.get(nid) or {}
        res = (n or {}).get("Resources") or {}
        count = sum(1 for v in self.views.values() for r in v.replicas if r.node == nid)
        why = self.answering.get(nid)
        agent = "starting" if nid not in self.answering else ("up" if why is None else "not answering")
        return NodeView(node=nid, name=_name(n) if n else nid[:8], alive=n is not None, agent=agent,
                        slots=int(res.get(SLOT, 0)), replicas=count, gpus=gpu_models(res), socket=seen.get("socket"),
                        daemon_pid=seen.get("daemon_pid"), agent_pid=seen.get("pid"),
                        reason=why or (seen.get("claim") or {}).get("why") or seen.get("error"),
                        claimed_by=(self.claimed.get(nid) or None) if n is not None else None,
                        call_port=str(seen["call_port"]) if seen.get("call_port") else None,
                        call_port_error=seen.get("call_port_error"))

    # ---- Ray: agents, placement groups ---------------------------------------------------------------

    def _agent(self, nid: str) -> Any:
        return ray.remote(NodeAgent).options(
            name=agent_name(nid), namespace=self.ns, lifetime="detached", get_if_exists=True, max_restarts=-1,
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(deadlines=self.d)

    def _placement(self, p: Declared) -> Any:
        """The program's placement group: found (it outlives the controller), else made, each bundle
        pinned to the node its replica still runs on, if any (the head restarted: see
        ``Declared.pin_where_running``)."""
        pg = _find_pg(p.pg_name)
        if pg is None:
            p.pin_where_running()
            pg = placement_group(p.bundles(), strategy=p.strategy, name=p.pg_name, lifetime="detached")
        return pg

    async def _unpin(self, p: Declared, placed: list[str | None]) -> None:
        """Bundles pinned to a node that did not rejoin within ``fleet_rejoin`` of this controller's
        start: the placement group made again, those bundles free for Ray to place anywhere, the
        others pinned where their replicas run."""
        names = {node_name(n.get("Resources") or {}) for n in self.nodes.values()}
        lost = [i for i, pin in enumerate(p.pins) if pin is not None and placed[i] is None and pin not in names]
        if not lost or time.monotonic() - self.started < self.d.fleet_rejoin:
            return
        for i in lost:
            self.event("unpinned", f"{p.name}: replica {i}'s node {p.pins[i]} did not rejoin; Ray places it anew",
                       p.name, i)
            p.where[i] = None
        pg = self.pgs.pop(p.name, None)
        if pg is not None:
            await asyncio.to_thread(remove_placement_group, pg)
        self.pgs[p.name] = await asyncio.to_thread(self._placement, p)
        await self._save()

    async def _ask(self, nid: str, orders: list[dict[str, Any]], keep: list[str]) -> dict[str, Any] | str:
        try:
            return await asyncio.wait_for(self.agents[nid].reconcile.remote(orders, keep, self.fleet.to_json()),
                                          self.d.fleet_agent)
        except TimeoutError:
            return f"its agent did not answer in {self.d.fleet_agent:g}s"
        except ray.exceptions.RayError as e:
            return f"its agent is not reachable ({type(e).__name__})"

    def _order(self, p: Declared, i: int, nid: str, sent: set[str]) -> dict[str, Any]:
        """Replica ``i``'s order for node ``nid``: its image with it, unless the node's agent said it
        holds it or this share carries it already (``sent``)."""
        h = p.assigned[i]
        have = (self.seen.get(nid) or {}).get("have") or ()
        im = p.image_of(h)
        image = None if h in have or h in sent or im is None else {"manifest": im.manifest, "ptx": im.ptx, "data": im.data,
                                                                   "data_bytes": im.data_bytes}
        sent.add(h)
        return {"name": replica_name(p.name, i), "hash": h, "restart": p.restart, "image": image,
                "gpu": None if p.gpu is None else resource_key(p.gpu)}

    # ---- small things ----------------------------------------------------------------------------

    def _get(self, name: str) -> Declared:
        p = self.programs.get(name)
        if p is None:
            raise NoSuchProgram(name)
        return p

    def _error_of(self, nid: str | None, name: str) -> tuple[str, str] | None:
        e = ((self.seen.get(nid) or {}).get("errors") or {}).get(name) if nid else None
        return (e[0], e[1]) if e else None

    async def _save(self) -> None:
        """The checkpoint written again: one write at a time, each with the state as it is when its
        turn comes, so that a slower older write never lands after a newer one."""
        async with self.saving:
            snapshot = {n: p.to_json() for n, p in self.programs.items()}
            await asyncio.to_thread(self.checkpoint.save, snapshot)

    def event(self, kind: str, message: str, program: str | None = None, replica: int | None = None,
              node: str | None = None) -> None:
        self.events.append(FleetEvent(time.time(), kind, message, program, replica, node))


def _find_pg(name: str) -> Any:
    try:
        return get_placement_group(name)
    except ValueError:
        return None


def _name(n: dict[str, Any]) -> str:
    return node_name(n.get("Resources") or {}) or str(n.get("NodeName") or n.get("NodeID", "")[:8])
