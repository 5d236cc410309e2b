"""The fleet's controller at the scale it exists for, in one process and without Ray: the real loop
(loop.py: observe, plan, act) over a simulated cluster (``SimCluster``: nodes, and placement
groups placed as Ray places them) and simulated node agents (``SimAgent``: each node's daemon as
the replicas it runs, loaded, upgraded and unloaded at once, or after ``delay``, or never while
``hung``).  Ray cannot run 1,000 nodes on one machine; the controller's own work (its ticks, its
memory, its lookups) can be measured here (``meshd-mps fleet bench --simulate N``: simbench.py),
and its behaviour through a hung agent or a lost tenth of the nodes tested cheaply
(tests/unit/test_fleet_sim.py).

How Ray places, as far as the controller can tell: a one-bundle group goes on the node with the
most free slots among those that have what it asks (Ray's scorer for bundles); a ``SPREAD``
group's bundles on distinct nodes where it can, a ``PACK`` group's on as few as it can, a
``STRICT_SPREAD`` group's on distinct nodes or not at all; a group is placed whole or waits; a
dead node's bundles are placed again.  Groups wait in the order they were made.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import time
from collections.abc import Mapping

from meshd_mps.fleet.capacity import NODE_PREFIX, SLOT
from meshd_mps.fleet.messages import AgentReport, DaemonProgram, Share, changed_since
from meshd_mps.fleet.observed import NodeInfo, Placement, RayView

#: A simulated daemon's stop_within (s): the lease's check and a halt.
STOP_WITHIN = 1.0


class SimAgent:
    """A node's agent and daemon in one: its ``programs`` (replica name -> image hash), run as the
    shares say at once (``delay``: that many seconds later); ``hung``: answers nothing."""

    handle = None

    def __init__(self, nid: str, delay: float = 0.0):
        self.nid, self.delay = nid, delay
        self.programs: dict[str, str] = {}
        self.states: dict[str, str] = {}  # a replica's state on the daemon where not "running"
        self.leases: dict[str, float] = {}
        self.share: Share | None = None
        self.version = 1
        self.history: collections.deque[tuple[int, frozenset[str] | None]] = collections.deque(maxlen=64)
        self.hung = False
        self.waiting: list[tuple[int, asyncio.Future[AgentReport]]] = []
        self.report_ = self._report()
        self.applied = 0

    def watch(self, since: int) -> asyncio.Future[AgentReport]:
        f: asyncio.Future[AgentReport] = asyncio.get_running_loop().create_future()
        if not self.hung and self.version > since:
            f.set_result(self._since(since))
        else:
            self.waiting.append((since, f))
        return f

    def _since(self, since: int) -> AgentReport:
        return dataclasses.replace(self.report_, changed=changed_since(self.history, self.version, since))

    def apply(self, share: Share, since: int) -> asyncio.Future[AgentReport]:
        f: asyncio.Future[AgentReport] = asyncio.get_running_loop().create_future()
        if self.hung:
            return f
        self.applied += 1
        cur = self.share
        if cur is None or share.version[0] != cur.version[0] or share.version >= cur.version:
            self.share = share
            if self.delay:
                asyncio.get_running_loop().call_later(self.delay, self._run)
            else:
                self._run()
        f.set_result(self._since(since))
        return f

    def _run(self) -> None:
        """The share made real on the daemon: loads and upgrades done, the others unloaded."""
        s = self.share
        if s is None or self.hung:
            return
        want = {o.name: o.hash for o in s.orders}
        changed = set()
        for name in [n for n in self.programs if n not in want and n not in s.keep]:
            del self.programs[name]
            self.leases.pop(name, None)
            changed.add(name)
        changed |= {n for n, h in want.items() if self.programs.get(n) != h}
        self.programs.update(want)
        if s.lease_until is not None:
            for name in s.leased & self.programs.keys():
                if self.leases.get(name, 0.0) < s.lease_until:
                    self.leases[name] = s.lease_until
                    changed.add(name)
        self.publish(changed)

    def set_state(self, name: str, state: str) -> None:
        """Replica ``name``'s state on the daemon (a restart, a stall), reported at once."""
        self.states[name] = state
        self.publish({name})

    def publish(self, changed: set[str]) -> None:
        """A new report (``changed``: its replicas that changed), and the watches it is news to
        answered."""
        self.version += 1
        self.history.append((self.version, frozenset(changed)))
        self.report_ = self._report()
        if self.hung:
            return
        still = []
        for since, f in self.waiting:
            if f.done():
                continue
            if self.version > since:
                f.set_result(self._since(since))
            else:
                still.append((since, f))
        self.waiting = still

    def _report(self) -> AgentReport:
        progs = {name: DaemonProgram(name, self.states.get(name, "running"), h, lease_until=self.leases.get(name))
                 for name, h in self.programs.items()}
        return AgentReport(node=self.nid, version=self.version, socket=f"/sim/{self.nid}.sock", pid=1, programs=progs,
                           share=self.share.version if self.share is not None else None,
                           have=frozenset(self.programs.values()), stop_within=STOP_WITHIN)

    def expire(self, now: float) -> None:
        """As the daemon does (serving/leases.py): a replica whose lease ran out is unloaded, also
        on a node the cluster lost (its daemon may run on, cut off)."""
        out = [n for n, t in self.leases.items() if t <= now]
        for name in out:
            self.programs.pop(name, None)
            del self.leases[name]
        if out and not self.hung:
            self.publish(set(out))

    def lose(self) -> None:
        """The node gone from the cluster: every watch out fails, as a dead actor's calls do; its
        daemon runs on what it ran, each unique replica until its lease runs out."""
        self.hung = True
        for _since, f in self.waiting:
            if not f.done():
                f.set_exception(ConnectionError(f"node {self.nid} lost"))
        self.waiting = []


class SimCluster:
    """The loop's cluster (loop.py ``Cluster``), simulated: ``nodes`` of ``slots`` each."""

    def __init__(self, nodes: int, slots: int = 48, delay: float = 0.0):
        self.slots = slots
        self.nodes: dict[str, NodeInfo] = {}
        self.free: dict[str, int] = {}
        self.agents: dict[str, SimAgent] = {}
        self.groups: dict[str, tuple[list[dict[str, float]], str]] = {}  # name -> bundles, strategy
        self.placements: dict[str, Placement] = {}
        self.pending: dict[str, None] = {}  # groups to place, in the order made
        self.changed: set[str] = set()
        self.delay = delay
        self.looks = 0
        self.heap: list[tuple[int, str]] = []  # (-free, node) for the one-bundle groups
        for i in range(nodes):
            self.add(f"n{i:05d}")

    def add(self, name: str) -> str:
        nid = f"{name}-{len(self.agents):08x}"
        self.nodes[nid] = NodeInfo(nid, {SLOT: float(self.slots), NODE_PREFIX + name: float(self.slots)}, name)
        self.free[nid] = self.slots
        self.agents[nid] = SimAgent(nid, self.delay)
        heapq.heappush(self.heap, (-self.slots, nid))
        return nid

    def lose(self, nids: list[str]) -> None:
        """Nodes gone (their daemons with them): their groups' bundles placed anew at the next look."""
        gone = set(nids)
        for nid in gone:
            self.nodes.pop(nid)
            self.free.pop(nid)
            self.agents[nid].lose()
        for name, pl in self.placements.items():
            if gone & set(pl.nodes):
                self.placements[name] = Placement(tuple(None if n in gone else n for n in pl.nodes), "RESCHEDULING")
                self.changed.add(name)
                self.pending[name] = None

    # ---- the loop's side -------------------------------------------------------------------------

    def expire(self) -> None:
        """Every daemon's leases, lost nodes' too, enforced now (each daemon checks its own)."""
        now = time.time()
        for a in self.agents.values():
            a.expire(now)

    async def look(self, placements: bool = True) -> RayView:
        """Ray's view (simulated: read whole at every look, ``placements`` or not)."""
        self.looks += 1
        self.expire()
        for name in list(self.pending):
            if self._place(name):
                del self.pending[name]
        avail = {SLOT: float(sum(self.free.values()))}
        changed, self.changed = frozenset(self.changed), set()
        return RayView(self.nodes, self.placements, avail, changed)

    async def agent(self, nid: str) -> SimAgent:
        return self.agents[nid]

    async def place(self, create: list[tuple[str, list[dict[str, float]], str]], remove: list[str]) -> None:
        for name in remove:
            self._release(name)
            self.groups.pop(name, None)
            self.pending.pop(name, None)
            self.placements.pop(name, None)
            self.changed.add(name)
        for name, bundles, strategy in create:
            if name not in self.groups:
                self.groups[name] = (bundles, strategy)
                self.placements[name] = Placement((None,) * len(bundles), "PENDING")
                self.pending[name] = None
                self.changed.add(name)

    # ---- Ray's placement, simulated -----------------------------------------------------------------

    def _fits(self, nid: str, b: Mapping[str, float]) -> bool:
        res = self.nodes[nid].resources
        return self.free[nid] >= b.get(SLOT, 0) and all(k in res for k in b)

    def _place(self, name: str) -> bool:
        """The group's bundles placed nowhere placed, all or none (a lost node's alone: as Ray
        does, the others stay where they are)."""
        bundles, strategy = self.groups[name]
        pl = self.placements.get(name)
        at: list[str | None] = list(pl.nodes) if pl is not None else [None] * len(bundles)
        if len(bundles) == 1 and set(bundles[0]) == {SLOT}:
            nid = self._roomiest()
            if nid is None:
                return False
            at = [nid]
        elif strategy == "PACK":
            taken = dict(self.free)
            for j, b in enumerate(bundles):
                if at[j] is not None:
                    continue
                used = set(at)
                order = sorted(self.nodes, key=lambda n: (n not in used, taken[n] == 0, n))
                fit = [n for n in order if taken[n] >= 1 and all(k in self.nodes[n].resources for k in b)]
                if not fit:
                    return False
                at[j] = fit[0]
                taken[fit[0]] -= 1
        else:  # SPREAD, STRICT_SPREAD: the node with fewest of the group's bundles, then the most room
            counts = collections.Counter(n for n in at if n is not None)
            heap: list[tuple[int, int, str]] = [(counts[n], -f, n) for n, f in self.free.items() if f >= 1]
            heapq.heapify(heap)
            for j, b in enumerate(bundles):
                if at[j] is not None:
                    continue
                passed: list[tuple[int, int, str]] = []
                while heap:
                    c, neg, n = heapq.heappop(heap)
                    if all(k in self.nodes[n].resources for k in b) and (strategy != "STRICT_SPREAD" or c == 0):
                        break
                    passed.append((c, neg, n))
                else:
                    return False
                at[j] = n
                if -neg > 1:
                    passed.append((c + 1, neg + 1, n))
                for e in passed:
                    heapq.heappush(heap, e)
        was = pl.nodes if pl is not None else (None,) * len(bundles)
        for nid, before in zip(at, was, strict=True):
            if before is None and nid is not None:
                self.free[nid] -= 1
                heapq.heappush(self.heap, (-self.free[nid], nid))
        self.placements[name] = Placement(tuple(at), "CREATED")
        self.changed.add(name)
        return True

    def _roomiest(self) -> str | None:
        """The node with the most free slots (the heap holds stale entries: skipped)."""
        while self.heap:
            neg, nid = self.heap[0]
            if nid not in self.free or -neg != self.free[nid]:
                heapq.heappop(self.heap)
                continue
            return nid if self.free[nid] > 0 else None
        return None

    def _release(self, name: str) -> None:
        """A removed group's slots freed."""
        pl = self.placements.get(name)
        for nid in pl.nodes if pl is not None else ():
            if nid is not None and nid in self.free:
                self.free[nid] += 1
                heapq.heappush(self.heap, (-self.free[nid], nid))


def replicas(cluster: SimCluster, lost: bool = False) -> dict[str, list[str]]:
    """Every daemon's replicas (name -> nodes), the lost nodes' with ``lost`` (their daemons may
    run on, cut off), for a test to count copies."""
    out: dict[str, list[str]] = {}
    for nid, a in cluster.agents.items():
        if lost or nid in cluster.nodes:
            for name in a.programs:
                out.setdefault(name, []).append(nid)
    return out
