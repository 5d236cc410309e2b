"""The fleet controller's loop: each tick ``observe()`` (Ray's view, and every node agent's report,
asked concurrently, each within its deadline), then ``plan`` (fleet/plan.py, a pure function, for
each program whose inputs changed), then ``act()`` (placement groups made or given up, each node
sent its share where it changed, the leases renewed), and the checkpoint written once if the tick
changed what it keeps.

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
import math
import secrets
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from meshd_mps.deadlines import DEFAULT, Deadlines
from meshd_mps.errors import AlreadyDeclared, NoSuchProgram
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.links import Agent, Link, Saver, Wakeup, wall
from meshd_mps.fleet.messages import AgentReport, Order, Share
from meshd_mps.fleet.observed import AgentState, NodeInfo, Observed, RayView
from meshd_mps.fleet.plan import ProgramPlan, plan, view_of
from meshd_mps.fleet.rollout import Rollout
from meshd_mps.fleet.spec import FleetEvent, FleetProgram

EVENTS = 500


class Cluster(Protocol):
    """What the loop asks of the cluster: Ray's view, an agent per node, placement groups."""

    async def look(self) -> RayView: ...

    async def agent(self, nid: str) -> Agent: ...

    async def place(self, create: list[tuple[str, list[dict[str, float]], str]], remove: list[str]) -> None: ...


NodeShare = tuple[tuple[Order, ...], frozenset[str], frozenset[str]]  # orders, keep, leased


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
        self.plans: dict[str, tuple[Spec, ProgramPlan]] = {}
        self.links: dict[str, Link] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.ray = RayView()
        self.seen: dict[str, AgentState] = {}  # each node's agent as the last plan saw it
        self.seen_nodes: set[str] = set()
        self.by_pg: dict[str, str] = {}  # a placement group's name (or its prefix) -> its program
        self.holders: dict[str, set[str]] = {}  # replica name -> the answering nodes whose daemon has it
        self.on_node: dict[str, set[str]] = collections.defaultdict(set)  # node -> the programs its news changes
        self.shares: dict[str, tuple[int, NodeShare]] = {}  # node -> its share's count and content
        self.parts: dict[str, dict[str, NodeShare]] = collections.defaultdict(dict)  # node -> program -> its part
        self.waiting: set[str] = set()  # programs with a replica that waits on Ray
        self.events: collections.deque[FleetEvent] = collections.deque(maxlen=EVENTS)
        self.wakeup = Wakeup()
        self.saver = Saver(checkpoint, self.snapshot)
        self.epoch = secrets.token_hex(4)
        self.count = 0
        self.started = time.monotonic()
        self.started_wall = wall()
        self.last_tick: float | None = None
        self.ticks = 0
        self.tick_s = 0.0  # the last tick's CPU time (process time), for the simulation's rows
        self.moves = self.node_losses = 0
        self.claimed: dict[str, str] = {}  # node -> the other fleet whose claim keeps this one off its daemon
        #: Nodes that left the cluster with leases granted: their daemons may run those replicas until then.
        self.gone: dict[str, AgentState] = {}
        self.swept = False  # the placement groups of programs no longer declared removed once at the start
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
        self.wakeup.wake(f"{spec.name} declared")
        return self.view(spec.name)

    async def upgrade(self, name: str, image: Image) -> FleetProgram:
        spec = self.specs[name] = self.spec(name).upgraded(image)
        self.event("upgrade", f"{name}: upgrade to image {image.hash} (generation {spec.generation}) declared", name)
        await self.saver.save()
        self.wakeup.wake(f"{name} upgraded")
        return self.view(name)

    async def remove(self, name: str) -> None:
        self.spec(name)
        del self.specs[name]
        self.event("removed", f"{name}: removed; its replicas are unloaded", name)
        await self.saver.save()
        self.wakeup.wake(f"{name} removed")

    def spec(self, name: str) -> Spec:
        s = self.specs.get(name)
        if s is None:
            raise NoSuchProgram(name)
        return s

    def view(self, name: str) -> FleetProgram:
        """The program's view as the last tick made it (every replica pending before its first)."""
        spec = self.spec(name)
        got = self.plans.get(name)
        if got is not None and got[0].token == spec.token:
            return got[1].view
        return view_of(spec, self.rollouts.get(name))

    def snapshot(self) -> dict[str, Any]:
        return {n: {"spec": s.to_json(), "rollout": r.to_json() if (r := self.rollouts.get(n)) else None}
                for n, s in self.specs.items()}

    def event(self, kind: str, message: str, program: str | None = None, replica: int | None = None,
              node: str | None = None) -> None:
        self.events.append(FleetEvent(time.time(), kind, message, program, replica, node))

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                pause = await self.tick()
                self.last_tick = time.monotonic()
            except Exception as e:  # one bad tick (the GCS away a moment) must not end the loop
                self.event("error", f"controller tick failed: {type(e).__name__}: {e}")
                pause = self.d.fleet_tick
            self.ticked.set()
            await self.wakeup.wait(pause)

    async def tick(self) -> float:
        """One observe, plan, act; the seconds until the next look at the latest."""
        obs = await self.observe()
        cpu = time.process_time()
        work = self.plan(obs)
        self.tick_s = time.process_time() - cpu
        await self.act(obs, *work)
        self.ticks += 1
        return self.pause(obs)

    def pause(self, obs: Observed) -> float:
        """Until the plans' first due time, within a tick; within a busy tick while a replica
        waits on Ray or an agent does not answer (neither tells when it is done)."""
        d = self.d
        due = min((p.due for _s, p in self.plans.values() if p.due is not None), default=math.inf)
        busy = self.waiting or any(lk.why is not None for lk in self.links.values())
        most = min(d.fleet_tick, d.fleet_busy_tick) if busy else d.fleet_tick
        return max(0.0, min(most, due - time.monotonic()))

    # ---- observe ------------------------------------------------------------------------------------

    async def observe(self) -> Observed:
        ray = await self.cluster.look()
        await self._nodes(ray)
        self.ray = ray
        now = time.monotonic()
        first = []
        d = self.d
        for nid, lk in self.links.items():
            self._expire(nid, lk, now)
            if lk.watch is None and now - lk.failed_at >= d.fleet_tick:
                since = lk.report.version if lk.report is not None and lk.why is None else -1
                lk.watch = self._call(nid, lk.agent.watch(since), "watch")
                lk.watch_by = now + d.fleet_agent + (d.fleet_watch if since >= 0 else 0.0)
                if since < 0:
                    first.append(lk.watch)
        if first:  # an agent's first answer, within a busy tick: the views then show it at once
            await asyncio.wait(first, timeout=self.d.fleet_busy_tick)
        for lk in self.links.values():
            lk.refresh()
        stop = max((lk.report.stop_within or 0.0 for lk in self.links.values() if lk.report is not None),
                   default=d.orphan + d.orphan_halt)
        fence = self.started_wall + d.fleet_lease + max(stop, d.orphan + d.orphan_halt) + d.fleet_skew
        w = wall()
        for nid, st in list(self.gone.items()):
            if max(st.grants.values()) + stop + d.fleet_skew < w:
                del self.gone[nid]  # every lease it held has run out
        agents = {**self.gone, **{nid: lk.state for nid, lk in self.links.items()}}
        return Observed(ray=ray, agents=agents, holders=self.holders, now=time.monotonic(), wall=w,
                        started=self.started, fence=fence, deadlines=d)

    async def _nodes(self, ray: RayView) -> None:
        for nid in ray.nodes.keys() - self.nodes.keys():
            self.event("node-joined", f"node {ray.nodes[nid].name} ({nid[:8]}) joined the fleet", node=nid)
        for nid in self.nodes.keys() - ray.nodes.keys():
            self.event("node-lost", f"node {self.nodes[nid].name} ({nid[:8]}) left the cluster", node=nid)
            self.node_losses += 1
            self.claimed.pop(nid, None)
            lk = self.links.pop(nid, None)
            if lk is not None:
                self._unhold(nid, lk.report)
                if lk.grants:  # its daemon may run on, cut off, until its leases run out: kept till then
                    self.gone[nid] = AgentState(lk.report, "its node left the cluster", None, dict(lk.grants),
                                                self.nodes[nid].name)
            self.shares.pop(nid, None)
            self.parts.pop(nid, None)
        new = [nid for nid in ray.nodes if nid not in self.links]
        agents = await asyncio.gather(*(self.cluster.agent(nid) for nid in new))
        for nid, agent in zip(new, agents, strict=True):
            self.links[nid] = Link(agent, state=AgentState(name=ray.nodes[nid].name))
        self.nodes = dict(ray.nodes)

    def _call(self, nid: str, call: Awaitable[AgentReport], kind: str) -> asyncio.Future[AgentReport]:
        f = asyncio.ensure_future(call)
        f.add_done_callback(lambda f: self._answered(nid, f, kind))
        return f

    def _answered(self, nid: str, f: asyncio.Future[AgentReport], kind: str) -> None:
        """An agent's answer (or failure) taken in, and the loop woken for it."""
        lk = self.links.get(nid)
        if lk is None or f not in (lk.watch, lk.applying):
            if not f.cancelled():
                f.exception()  # taken: a call dropped (its node gone, its deadline passed) may still fail
            return
        if kind == "watch":
            lk.watch = None
        else:
            lk.applying = None
        if f.cancelled() or f.exception() is not None:
            e = None if f.cancelled() else f.exception()
            lk.why = f"its agent is not reachable ({type(e).__name__})" if e is not None else "its call was cancelled"
            lk.failed_at = time.monotonic()
            self._unhold(nid, lk.report)
            self.wakeup.wake(f"{nid[:8]} {kind} failed")
            return
        old = lk.report
        if lk.heard(f.result()):
            self._unhold(nid, old)
            self._hold(nid, lk.report)
            self._claim_seen(nid)
            self.wakeup.wake(f"{nid[:8]} {kind} answered")

    def _expire(self, nid: str, lk: Link, now: float) -> None:
        """A call past its deadline given up on: its node's agent does not answer."""
        late = False
        if lk.watch is not None and now > lk.watch_by:
            late, lk.watch = True, None
        if lk.applying is not None and now > lk.apply_by:
            late, lk.applying = True, None
        if late:
            lk.why = f"its agent did not answer in {self.d.fleet_agent:g}s"
            lk.failed_at = now
            self._unhold(nid, lk.report)

    def _hold(self, nid: str, report: AgentReport | None) -> None:
        for name in report.runs() if report is not None else ():
            self.holders.setdefault(name, set()).add(nid)

    def _unhold(self, nid: str, report: AgentReport | None) -> None:
        for name in report.runs() if report is not None else ():
            s = self.holders.get(name)
            if s is not None:
                s.discard(nid)
                if not s:
                    del self.holders[name]

    def _claim_seen(self, nid: str) -> None:
        """An event when a node's daemon turns out to be another fleet's, or this fleet's again."""
        lk = self.links[nid]
        foreign = lk.report.claim if lk.report is not None else None
        was = self.claimed.get(nid)
        name = self.nodes[nid].name if nid in self.nodes else nid[:8]
        if foreign is not None and was is None:
            self.claimed[nid] = foreign.fleet.id if foreign.fleet is not None else ""  # "": its file cannot be used
            self.event("node-claimed", f"node {name}: {foreign.why}", node=nid)
        elif foreign is None and was is not None:
            del self.claimed[nid]
            self.event("node-released", f"node {name}: its daemon is this fleet's now (fleet {self.fleet.id})", node=nid)

    # ---- plan ------------------------------------------------------------------------------------------

    def plan(self, obs: Observed) -> tuple[list[tuple[str, list[dict[str, float]], str]], list[str], bool]:
        """Each program whose inputs changed planned again (``plan``), each node's share made again
        where a program's part of it changed; the placement groups to make and to give up, and
        whether the checkpoint is to be written."""
        dirty = self._dirty(obs)
        create: list[tuple[str, list[dict[str, float]], str]] = []
        remove: list[str] = []
        keep = False
        touched: set[str] = set()
        for name in list(self.plans):
            if name not in self.specs or self.plans[name][0].token != self.specs[name].token:
                old_spec, old = self.plans.pop(name)
                self.by_pg.pop(old_spec.pg_prefix, None)
                remove += [pg for pg, _ in old_spec.units() if pg in obs.ray.placements]
                touched |= self._forget(name, old)
                if name not in self.specs:
                    self.rollouts.pop(name, None)
                    keep = True
        for name in dirty:
            spec = self.specs[name]
            got = self.plans.get(name)
            rollout = self.rollouts.get(name)
            if rollout is None or (got is not None and got[0].token != spec.token):
                rollout = Rollout.start(spec)
            pp = plan(spec, rollout, obs, got[1].view if got is not None else None)
            if got is not None:
                touched |= self._forget(name, got[1])
            self.plans[name] = (spec, pp)
            self.by_pg[spec.pg_prefix] = name
            keep |= pp.kept or self.rollouts.get(name) is None
            self.rollouts[name] = pp.rollout
            create += pp.create
            remove += pp.remove
            (self.waiting.add if pp.waiting else self.waiting.discard)(name)
            for nid in pp.touches:
                self.on_node[nid].add(name)
            for nid in pp.orders.keys() | pp.keep.keys() | pp.leased.keys():
                self.parts[nid][name] = (tuple(pp.orders.get(nid, ())), frozenset(pp.keep.get(nid, ())),
                                         frozenset(pp.leased.get(nid, ())))
                touched.add(nid)
            for e in pp.events:
                self.moves += e.kind == "moved"
                self.event(e.kind, e.message, name, e.replica, e.node)
        if not self.swept:  # a program removed while no controller ran (its groups outlive it)
            mine = {pg for s in self.specs.values() for pg, _ in s.units()}
            remove += [pg for pg in obs.ray.placements if pg not in mine]  # the fleet's own (raycluster.py)
            self.swept = True
        for nid in touched:
            self._share(nid)
        return create, sorted(set(remove)), keep

    def _dirty(self, obs: Observed) -> list[str]:
        """The programs to plan again: new or changed specs, a due time passed, a node of theirs
        with news, and while Ray's view changed, those waiting on it."""
        out = set()
        for name, spec in self.specs.items():
            got = self.plans.get(name)
            if got is None or got[0] is not spec or (got[1].due is not None and got[1].due <= obs.now):
                out.add(name)
        changed = [nid for nid, st in obs.agents.items() if st is not self.seen.get(nid)]
        for nid in changed:
            out |= self.on_node.get(nid, set())
        out |= self.waiting  # each look: Ray may have placed them (no event says so)
        if obs.ray.nodes.keys() != self.seen_nodes or obs.ray.changed is None:
            out |= self.specs.keys()
        else:
            for pg in obs.ray.changed:
                prog = self.by_pg.get(pg) or self.by_pg.get(pg.rpartition(".")[0])
                if prog is not None:
                    out.add(prog)
        self.seen, self.seen_nodes = dict(obs.agents), set(obs.ray.nodes)
        return sorted(n for n in out if n in self.specs)

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
        if create or remove:
            await self.cluster.place(create, remove)
        now, w = time.monotonic(), wall()
        for nid, lk in self.links.items():
            count, share = self.shares.get(nid, (0, ((), frozenset(), frozenset())))
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
                        images[o.hash] = {"manifest": im.manifest, "ptx": im.ptx}
            s = Share(version=version, orders=share[0], keep=share[1], images=images, fleet=self.fleet,
                      leased=share[2], lease_until=until)
            lk.remember(s)
            if until is not None:
                lk.grants.update(dict.fromkeys(share[2], until))
                lk.renewed = w
            lk.applying = self._call(nid, lk.agent.apply(s), "apply")  # an older one's answer is only taken
            lk.applying_version, lk.apply_by = version, now + self.d.fleet_agent
        if keep:
            await self.saver.save()

    def _image(self, replica: str, hash: str) -> Image | None:
        program = replica.rsplit(".fleet-", 1)[0]
        spec = self.specs.get(program)
        return None if spec is None else spec.image_of(hash)
