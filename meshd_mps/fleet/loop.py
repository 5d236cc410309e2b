"""The fleet controller's loop: each tick ``observe()`` (Ray's view, and every node agent's report,
asked concurrently, each within its deadline: links.py), then ``plan`` (fleet/plan.py, a pure
function, for each program whose inputs changed, and of it for the replicas whose inputs changed),
then ``act()`` (placement groups made or given up, each node sent its share where it changed, the
leases renewed), and the checkpoint written once if the tick changed what it keeps.

Who writes what: the ``specs`` only the API (``declare``, ``upgrade``, ``remove``: each a change of
the dict and a checkpoint, never a wait on Ray or an agent); the ``rollouts``, the views and the
events only the loop.  The API never waits on the loop either: it answers from the views the last
tick made (``Reconciler.view``), and wakes the loop with a reason (links.py ``Wakeup``), which is
the one way the loop is woken (an agent's answer, a failed call, a time the plan asked for).

The loop runs over a ``Cluster`` (Ray: raycluster.py; the simulation of 1,000 nodes: simulate.py):
the same code in both.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import secrets
import time
from typing import Any, Protocol

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import AlreadyDeclared, NoSuchProgram
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.links import Agent, Links, Saver, Wakeup, Why, wall
from meshd_mps.fleet.messages import Order, Share
from meshd_mps.fleet.observed import AgentState, NodeInfo, Observed, RayView
from meshd_mps.fleet.plan import ProgramPlan, plan
from meshd_mps.fleet.rollout import Rollout
from meshd_mps.fleet.spec import FleetEvent, FleetProgram, parse_replica_name
from meshd_mps.fleet.views import view_of

EVENTS = 500
NodeShare = tuple[tuple[Order, ...], frozenset[str], frozenset[str]]  # orders, keep, leased
NONE: NodeShare = ((), frozenset(), frozenset())


class Cluster(Protocol):
    """What the loop asks of the cluster: Ray's view, an agent per node, placement groups."""

    async def look(self, placements: bool = True) -> RayView: ...

    async def agent(self, nid: str) -> Agent: ...

    async def place(self, create: list[tuple[str, list[dict[str, float]], str]], remove: list[str]) -> None: ...


class Reconciler:
    def __init__(self, cluster: Cluster, fleet: FleetId, deadlines: Deadlines = DEFAULT,
                 checkpoint: Checkpoint | None = None, declared: dict[str, Any] | None = None):
        self.cluster, self.fleet, self.d = cluster, fleet, deadlines
        self.specs: dict[str, Spec] = {}
        self.rollouts: dict[str, Rollout] = {}
        for name, entry in (declared or {}).items():
            self.specs[name] = spec = Spec.from_json(entry["spec"])
            if entry.get("rollout") is not None:
                self.rollouts[name] = Rollout.from_json(entry["rollout"], spec)
        self.plans: dict[str, ProgramPlan] = {}
        #: What the API shows of each program: its plan's view, once the tick that made it has written
        #: what it keeps (a replica seen running here has its node in the checkpoint: a head that
        #: restarts then finds it there).
        self.views: dict[str, tuple[str, FleetProgram]] = {}
        self.events: collections.deque[FleetEvent] = collections.deque(maxlen=EVENTS)
        self.wakeup = Wakeup()
        self.links = Links(deadlines, self.wakeup, self.event, fleet)
        self.nodes: dict[str, NodeInfo] = {}
        self.ray = RayView()
        self.seen: dict[str, AgentState] = {}  # each node's agent as the last plan saw it
        self.seen_nodes: set[str] = set()
        self.by_pg: dict[str, str] = {}  # a placement group's name (or its prefix) -> its program
        self.on_node: dict[str, set[str]] = collections.defaultdict(set)  # node -> the programs its news changes
        self.shares: dict[str, tuple[int, NodeShare]] = {}  # node -> its share's count and content
        self.parts: dict[str, dict[str, NodeShare]] = collections.defaultdict(dict)  # node -> program -> its part
        self.waiting: set[str] = set()  # programs with a replica that waits on Ray or on an agent
        self.saver = Saver(checkpoint, self.snapshot)
        self.epoch = secrets.token_hex(4)
        self.count = 0
        self.started = time.monotonic()
        self.started_wall = wall()
        self.last_tick: float | None = None
        self.ticks = 0
        self.moves = self.node_losses = 0
        self.owned: set[str] = set()  # the placement groups of the programs planned
        self.looked = -math.inf  # when the placement groups were last read whole (monotonic)
        self.placed = False  # groups made or removed since
        self.ray_at = -math.inf  # when Ray was last read (monotonic)
        self.ticked = asyncio.Event()
        self.event("controller", f"controller started; {len(self.specs)} programs declared"
                   + (f" in {checkpoint.path}" if checkpoint is not None else ""))

    # ---- the API: specs written here only -------------------------------------------------------

    async def declare(self, spec: Spec) -> FleetProgram:
        if spec.name in self.specs:
            raise AlreadyDeclared(spec.name)
        self.specs[spec.name] = spec
        self.event("declared", f"{spec.name}: declared, {spec.replicas} replicas ({spec.strategy}"
                   f"{', unique' if spec.unique else ''}), image {spec.image.hash}", spec.name)
        await self.saver.save()
        self.wakeup.wake(Why.DECLARED, spec.name)
        return self.view(spec.name)

    async def upgrade(self, name: str, image: Image) -> FleetProgram:
        spec = self.specs[name] = self.spec(name).upgraded(image)
        self.event("upgrade", f"{name}: upgrade to image {image.hash} (generation {spec.generation}) declared", name)
        await self.saver.save()
        self.wakeup.wake(Why.DECLARED, name)
        return self.view(name)

    async def remove(self, name: str) -> None:
        self.spec(name)
        del self.specs[name]
        self.event("removed", f"{name}: removed; its replicas are unloaded", name)
        await self.saver.save()
        self.wakeup.wake(Why.DECLARED, name)

    def spec(self, name: str) -> Spec:
        s = self.specs.get(name)
        if s is None:
            raise NoSuchProgram(name)
        return s

    def view(self, name: str) -> FleetProgram:
        """The program's view as the last tick made it (every replica pending before its first)."""
        spec = self.spec(name)
        got = self.views.get(name)
        if got is not None and got[0] == spec.token:
            return got[1]
        return view_of(spec, self.rollouts.get(name))

    def snapshot(self) -> dict[str, Any]:
        return {n: {"spec": s.to_json(), "rollout": r.to_json() if (r := self.rollouts.get(n)) else None}
                for n, s in self.specs.items()}

    def event(self, kind: str, message: str, program: str | None = None, replica: int | None = None,
              node: str | None = None) -> None:
        self.events.append(FleetEvent(time.time(), kind, message, program, replica, node))

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        reasons: list[tuple[Why, str]] = []
        while True:
            try:
                pause = await self.tick(reasons)
                self.last_tick = time.monotonic()
            except Exception as e:  # one bad tick (the GCS away a moment) must not end the loop
                self.event("error", f"controller tick failed: {type(e).__name__}: {e}")
                pause = self.d.fleet_tick
            self.ticked.set()
            reasons = await self.wakeup.wait(pause)

    async def tick(self, reasons: list[tuple[Why, str]] | None = None) -> float:
        """One observe, plan, act (``reasons``: what woke it); the seconds until the next look at
        the latest."""
        obs = await self.observe(reasons or [])
        await self.act(obs, *self.plan(obs))
        self.ticks += 1
        return self.pause()

    def pause(self) -> float:
        """Until the plans' first due time, within a tick; within a busy tick while a replica
        waits on Ray or an agent does not answer (neither tells when it is done); within a fifth of
        one while Ray is placing them (the last look found groups placed: after a node's loss Ray
        places its replicas' groups one after another, over a tenth of a second or more)."""
        d = self.d
        due = min((p.due for p in self.plans.values() if p.due is not None), default=math.inf)
        busy = self.waiting or any(lk.why is not None for lk in self.links.links.values())
        most = min(d.fleet_tick, d.fleet_busy_tick) if busy else d.fleet_tick
        if self.waiting and self.ray.changed:
            most = min(most, d.fleet_busy_tick / 5)
        return max(0.0, min(most, due - time.monotonic()))

    # ---- observe ------------------------------------------------------------------------------------

    async def observe(self, reasons: list[tuple[Why, str]]) -> Observed:
        """Ray's view and every agent's.  Woken only by agents' answers (their reports are in
        already) within a tick of the last look, Ray's view is that look's: the views take the
        reports at once, and the next tick reads Ray again."""
        now = time.monotonic()
        if reasons and all(why is Why.ANSWERED for why, _ in reasons) and now - self.ray_at < self.d.fleet_tick \
                and not self.waiting:
            ray = dataclasses.replace(self.ray, changed=frozenset())
        else:
            full = bool(self.waiting) or self.placed or now - self.looked >= self.d.fleet_tick * 10
            ray = await self.cluster.look(placements=full)
            if full or ray.changed is None:
                self.looked, self.placed = now, False
            self.ray_at = now
            await self._nodes(ray)
        self.ray = ray
        first = self.links.ask(time.monotonic())
        if first:  # an agent's first answer, within a busy tick: the views then show it at once
            await asyncio.wait(first, timeout=self.d.fleet_busy_tick)
        d = self.d
        stop = self.links.stop_within()
        fence = self.started_wall + d.fleet_lease + max(stop, d.orphan + d.orphan_halt) + d.fleet_skew
        w = wall()
        return Observed(ray=ray, agents=self.links.states(w, stop), holders=self.links.holders, now=time.monotonic(),
                        wall=w, started=self.started, fence=fence, deadlines=d)

    async def _nodes(self, ray: RayView) -> None:
        for nid in ray.nodes.keys() - self.nodes.keys():
            self.event("node-joined", f"node {ray.nodes[nid].name} ({nid[:8]}) joined the fleet", node=nid)
        for nid in self.nodes.keys() - ray.nodes.keys():
            self.event("node-lost", f"node {self.nodes[nid].name} ({nid[:8]}) left the cluster", node=nid)
            self.node_losses += 1
            self.links.drop(nid)
            self.shares.pop(nid, None)
            self.parts.pop(nid, None)
        new = [nid for nid in ray.nodes if nid not in self.links.links]
        agents = await asyncio.gather(*(self.cluster.agent(nid) for nid in new))
        for nid, agent in zip(new, agents, strict=True):
            self.links.add(nid, agent, ray.nodes[nid].name)
        self.nodes = dict(ray.nodes)

    # ---- plan ------------------------------------------------------------------------------------------

    def plan(self, obs: Observed) -> tuple[list[tuple[str, list[dict[str, float]], str]], list[str], bool]:
        """Each program whose inputs changed planned again (``plan``: of it, the replicas whose
        inputs changed), each node's share made again where a program's part of it changed; the
        placement groups to make and to give up, and whether the checkpoint is to be written."""
        dirty = self._dirty(obs)
        create: list[tuple[str, list[dict[str, float]], str]] = []
        remove: list[str] = []
        keep = False
        touched: set[str] = set()
        for name in list(self.plans):
            if name not in self.specs or self.plans[name].spec.token != self.specs[name].token:
                old = self.plans.pop(name)
                self.by_pg.pop(old.spec.pg_prefix, None)
                self.owned.difference_update(pg for pg, _ in old.spec.units())
                touched |= self._forget(name, old)
                self.rollouts.pop(name, None)  # removed, or declared again: a new declaration starts anew
                keep = True
        for name, changed in dirty.items():
            spec = self.specs[name]
            got = self.plans.get(name)
            rollout = self.rollouts.get(name) or Rollout.start(spec)
            pp = plan(spec, rollout, obs, got, changed)
            self.plans[name] = pp
            if got is None:
                self.by_pg[spec.pg_prefix] = name
                self.owned.update(pg for pg, _ in spec.units())
            keep |= pp.kept or self.rollouts.get(name) is None
            self.rollouts[name] = pp.rollout
            create += pp.create
            remove += pp.remove
            (self.waiting.add if pp.waiting else self.waiting.discard)(name)
            old_touches = got.touches if got is not None else frozenset()
            for nid in old_touches - pp.touches:
                self.on_node.get(nid, set()).discard(name)
            for nid in pp.touches - old_touches:
                self.on_node[nid].add(name)
            for nid in pp.nodes:
                part = (tuple(pp.orders.get(nid, {}).values()), frozenset(pp.keep.get(nid, {}).values()),
                        frozenset(pp.leased.get(nid, {}).values()))
                if part == NONE:
                    self.parts.get(nid, {}).pop(name, None)
                else:
                    self.parts[nid][name] = part
                touched.add(nid)
            for e in pp.events:
                self.moves += e.kind == "moved"
                self.event(e.kind, e.message, name, e.replica, e.node)
        if touched or obs.ray.changed is None or obs.ray.changed:
            # Level-triggered: any group of the fleet's (raycluster.py) no declared program owns goes (its
            # program removed, or declared again; or removed while no controller ran: groups outlive it).
            remove += [pg for pg in obs.ray.placements.keys() - self.owned]
        for nid in touched:
            self._share(nid)
        return create, sorted(set(remove)), keep

    def _dirty(self, obs: Observed) -> dict[str, set[int] | None]:
        """The programs to plan again, each with the replicas whose inputs changed (None: every
        one): a new or changed spec or a due time passed (every one), a node's report (the
        replicas it says changed), a placement group made, moved or gone, and those waiting on Ray
        or an agent (their reason may change at each look)."""
        out: dict[str, set[int] | None] = {}

        def add(name: str, i: int | None) -> None:
            if name in self.specs:
                got = out.setdefault(name, set())
                if got is not None and i is not None:
                    got.add(i)

        for name, spec in self.specs.items():
            got = self.plans.get(name)
            if got is None or got.spec is not spec or (got.due is not None and got.due <= obs.now):
                out[name] = None
        for name in self.waiting:
            add(name, None)
        deltas, self.links.deltas = self.links.deltas, {}
        for nid, st in obs.agents.items():
            if st is self.seen.get(nid) and nid not in deltas:
                continue
            names = deltas.get(nid, None) if st.report is not None else None
            if names is None:
                for prog in self.on_node.get(nid, ()):
                    out[prog] = None
                continue
            for rep in names:
                parsed = parse_replica_name(rep)
                if parsed is not None:
                    add(*parsed)
        if obs.ray.nodes.keys() != self.seen_nodes or obs.ray.changed is None:
            out = dict.fromkeys(self.specs, None)
        else:
            for pg in obs.ray.changed:
                prefix, _, i = pg.rpartition(".")
                whole, one = self.by_pg.get(pg), self.by_pg.get(prefix)
                if whole is not None:
                    out[whole] = None  # a program's one group
                elif one is not None and i.isdigit():
                    add(one, int(i))
        self.seen, self.seen_nodes = dict(obs.agents), set(obs.ray.nodes)
        return {name: got for name, got in out.items() if name in self.specs}

    def _forget(self, name: str, old: ProgramPlan) -> set[str]:
        """A program's last plan's parts of the nodes' shares dropped; the nodes they were on."""
        nodes = set(old.orders) | set(old.keep) | set(old.leased)
        for nid in nodes:
            self.parts.get(nid, {}).pop(name, None)
        for nid in old.touches:
            self.on_node.get(nid, set()).discard(name)
        self.waiting.discard(name)
        return nodes

    def _share(self, nid: str) -> None:
        parts = self.parts.get(nid, {})
        orders = tuple(o for name in sorted(parts) for o in parts[name][0])
        keep = frozenset().union(*(p[1] for p in parts.values()))
        leased = frozenset().union(*(p[2] for p in parts.values()))
        new = (orders, keep, leased)
        old = self.shares.get(nid)
        if old is None or old[1] != new:
            self.count += 1
            self.shares[nid] = (self.count, new)

    # ---- act ---------------------------------------------------------------------------------------------

    async def act(self, obs: Observed, create: list[tuple[str, list[dict[str, float]], str]], remove: list[str],
                  keep: bool) -> None:
        if keep:
            await self.saver.save()
        self.views = {name: (pp.spec.token, pp.view) for name, pp in self.plans.items() if pp.view is not None}
        if create or remove:
            await self.cluster.place(create, remove)
            self.placed = True
        now, w = time.monotonic(), wall()
        for nid, lk in self.links.links.items():
            count, share = self.shares.get(nid, (0, NONE))
            version = (self.epoch, count)
            held = lk.report.share if lk.report is not None else None
            renew = bool(share[2]) and w - lk.renewed >= self.d.fleet_lease / 3
            if lk.report is None or lk.why is not None or (held == version and not renew):
                continue
            if lk.applying is not None and lk.applying_version == version and not renew:
                continue
            until = w + self.d.fleet_lease if share[2] else None
            have = lk.report.have
            images = {}
            for o in share[0]:
                if o.hash not in have and o.hash not in images:
                    im = self._image(o.name, o.hash)
                    if im is not None:
                        images[o.hash] = im.shipped()
            s = Share(version=version, orders=share[0], keep=share[1], images=images, fleet=self.fleet,
                      leased=share[2], lease_until=until)
            lk.remember(s)
            if until is not None:
                lk.grants.update(dict.fromkeys(share[2], until))
                lk.renewed = w
            # An older apply's answer is only taken in (links.py): this one holds the later share.
            lk.applying = self.links.call(nid, lk.agent.apply(s, lk.report.version), "apply")
            lk.applying_version, lk.apply_by = version, now + self.d.fleet_agent

    def _image(self, replica: str, hash: str) -> Image | None:
        program = replica.rsplit(".fleet-", 1)[0]
        spec = self.specs.get(program)
        return None if spec is None else spec.image_of(hash)
