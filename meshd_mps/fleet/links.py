"""The controller loop's small parts: ``Wakeup`` (the one way the loop is woken), ``Saver`` (the
checkpoint's one writer) and ``Link`` (the controller's side of one node's agent: its last report,
the calls out to it, the shares it was sent and the leases it was granted).

Why these shapes: Ray has no event for "this actor's node died" or "that agent's daemon changed"
that an asyncio loop can wait on besides a call's own answer, so each agent that answers keeps one
call of the controller's outstanding (its watch: ``NodeAgent.watch``), which answers when the
agent's report changes and fails when the agent ends.  Every answer, every failure, every API
change and every time the plan asked to be looked at again only puts a reason on ``Wakeup``: the
loop then observes, plans and acts once, whatever woke it (controller-runtime's queue, with one
key: the fleet).
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.messages import AgentReport, Share
from meshd_mps.fleet.observed import AgentState

#: The shares sent to one node that are remembered (by version): an agent's report names the one it holds.
SENT = 8


class Why(enum.Enum):
    """Why the loop is woken."""

    DECLARED = "declared"  # the API changed a spec
    ANSWERED = "answered"  # an agent answered with news
    FAILED = "failed"  # an agent's call failed


class Wakeup:
    """Reasons to look now, put by whoever has news; the loop takes them all before each tick."""

    def __init__(self) -> None:
        self.reasons: list[tuple[Why, str]] = []
        self.event = asyncio.Event()

    def wake(self, why: Why, what: str) -> None:
        self.reasons.append((why, what))
        self.event.set()

    async def wait(self, within: float) -> list[tuple[Why, str]]:
        """The reasons put since the last wait, once there is one or ``within`` seconds have passed
        (none then: the plan's own time to look again)."""
        if not self.reasons and within > 0:
            try:
                async with asyncio.timeout(within):
                    await self.event.wait()
            except TimeoutError:
                pass
        got, self.reasons = self.reasons, []
        self.event.clear()
        return got


class Saver:
    """Writes the checkpoint, one write at a time, each of the state as it is when it begins
    (``snapshot``): a caller that asks while a write is on its way is answered by the next one, so
    that a burst of changes is one or two writes, and nothing the loop holds across an agent's
    call is ever waited on here."""

    def __init__(self, checkpoint: Checkpoint | None, snapshot: Callable[[], dict[str, Any]]):
        self.checkpoint = checkpoint
        self.snapshot = snapshot
        self.asked = 0
        self.written = 0
        self.writes = 0
        self.lock = asyncio.Lock()

    async def save(self) -> None:
        self.asked += 1
        mine = self.asked
        async with self.lock:
            if self.written >= mine or self.checkpoint is None:
                return
            upto, data = self.asked, self.snapshot()
            await asyncio.to_thread(self.checkpoint.save, data)
            self.written = upto
            self.writes += 1


class Agent(Protocol):
    """The controller's handle on one node's agent (a Ray actor, or the simulation's)."""

    handle: Any  # what a call through Ray is sent to (fleet/client.py); None in the simulation

    def watch(self, since: int) -> Awaitable[AgentReport]: ...

    def apply(self, share: Share, since: int) -> Awaitable[AgentReport]: ...


@dataclass
class Link:
    """The controller's side of one node's agent."""

    agent: Agent
    report: AgentReport | None = None
    why: str | None = None  # it does not answer now, and why (None: it does)
    watch: asyncio.Future[AgentReport] | None = None
    watch_by: float = 0.0  # its deadline (monotonic): a first ask's is fleet_agent, a watch's fleet_watch more
    applying: asyncio.Future[AgentReport] | None = None
    applying_version: tuple[str, int] | None = None
    apply_by: float = 0.0
    failed_at: float = -math.inf
    sent: dict[tuple[str, int], frozenset[str]] = field(default_factory=dict)  # version -> the names it orders or keeps
    grants: dict[str, float] = field(default_factory=dict)  # unique replica -> the lease granted last (wall)
    renewed: float = -math.inf  # when its leases were last granted (wall)
    state: AgentState = field(default_factory=AgentState)

    def heard(self, report: AgentReport) -> tuple[bool, frozenset[str] | None]:
        """A report taken (if newer than the one held): whether anything plan reads changed, and
        the replicas whose rows changed (None: any may have: a new agent, one that answers again)."""
        old = self.report
        if old is not None and report.pid == old.pid and report.version <= old.version and self.why is None:
            return False, frozenset()
        same = old is not None and report.pid == old.pid and self.why is None
        self.report, self.why = report, None
        return True, (report.changed if same else None)

    def refresh(self) -> None:
        """``state`` made again from the link where what plan reads of it changed (a new object
        then: the loop tells a node with news by its state's identity)."""
        held = self.sent.get(self.report.share) if self.report is not None and self.report.share else None
        st = self.state
        if st.report is not self.report or st.why != self.why or st.held is not held:
            self.state = AgentState(self.report, self.why, held, self.grants, st.name)

    def remember(self, share: Share) -> None:
        self.sent[share.version] = frozenset(o.name for o in share.orders) | share.keep
        while len(self.sent) > SENT:
            del self.sent[next(iter(self.sent))]


def wall() -> float:
    return time.time()


class Links:
    """The controller's side of every node's agent: a ``Link`` each, the calls out to them (each
    within its deadline), what their reports say the daemons run (``holders``: replica -> the
    answering nodes whose daemon has it), and, per node, the replicas whose rows changed since the
    loop last planned (``deltas``; None: any), for the plan to look at those only."""

    def __init__(self, deadlines: Deadlines, wakeup: Wakeup, event: Callable[..., None], fleet: FleetId):
        self.d, self.wakeup, self.event, self.fleet = deadlines, wakeup, event, fleet
        self.links: dict[str, Link] = {}
        self.names: dict[str, str] = {}  # node -> its name
        self.holders: dict[str, set[str]] = {}
        self.deltas: dict[str, set[str] | None] = {}
        self.claimed: dict[str, str] = {}  # node -> the other fleet whose claim keeps this one off its daemon
        #: Nodes that left the cluster with leases granted: their daemons may run those replicas until then.
        self.gone: dict[str, AgentState] = {}

    def add(self, nid: str, agent: Agent, name: str) -> None:
        self.links[nid] = Link(agent, state=AgentState(name=name))
        self.names[nid] = name

    def drop(self, nid: str) -> None:
        """A node gone: its link dropped, its leases remembered until they run out."""
        self.claimed.pop(nid, None)
        self.deltas.pop(nid, None)
        lk = self.links.pop(nid, None)
        if lk is not None:
            self._unhold(nid, lk.report, None)
            if lk.grants:  # its daemon may run on, cut off, until its leases run out: kept till then
                self.gone[nid] = AgentState(lk.report, "its node left the cluster", None, dict(lk.grants),
                                            self.names.get(nid))

    def ask(self, now: float) -> list[asyncio.Future[AgentReport]]:
        """A watch out to every agent that has none (past its quiet after a failure); those that
        ask an agent for its report at once (it has none, or did not answer): the caller may wait
        on them a moment."""
        d = self.d
        first = []
        for nid, lk in self.links.items():
            self._expire(nid, lk, now)
            if lk.watch is None and now - lk.failed_at >= d.fleet_tick:
                since = lk.report.version if lk.report is not None and lk.why is None else -1
                lk.watch = self.call(nid, lk.agent.watch(since), "watch")
                lk.watch_by = now + d.fleet_agent + (d.fleet_watch if since >= 0 else 0.0)
                if since < 0:
                    first.append(lk.watch)
        return first

    def states(self, wall_now: float, stop: float) -> dict[str, AgentState]:
        """Each node's agent as plan reads it (the nodes gone whose leases may still run too)."""
        for nid, st in list(self.gone.items()):
            if max(st.grants.values()) + stop + self.d.fleet_skew < wall_now:
                del self.gone[nid]  # every lease it held has run out
        for lk in self.links.values():
            lk.refresh()
        return {**self.gone, **{nid: lk.state for nid, lk in self.links.items()}}

    def stop_within(self) -> float:
        """The longest any node's daemon may run a program past its lease (the default table's
        orphan timeout at least: a daemon not heard from may have it)."""
        d = self.d
        floor = d.orphan + d.orphan_halt
        return max((lk.report.stop_within or 0.0 for lk in self.links.values() if lk.report is not None),
                   default=floor) if self.links else floor

    def call(self, nid: str, call: Awaitable[AgentReport], kind: str) -> asyncio.Future[AgentReport]:
        f = call if isinstance(call, asyncio.Future) else asyncio.ensure_future(call)
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
            self._down(nid, lk, f"its agent is not reachable ({type(e).__name__})" if e is not None
                       else "its call was cancelled", time.monotonic())
            self.wakeup.wake(Why.FAILED, f"{nid[:8]} {kind}")
            return
        old = lk.report
        news, delta = lk.heard(f.result())
        if news:
            held = lk.sent.get(old.share) if old is not None and old.share else None
            now_held = lk.sent.get(lk.report.share) if lk.report is not None and lk.report.share else None
            if delta is not None and held != now_held:
                delta = delta | ((held or frozenset()) ^ (now_held or frozenset()))
            self._unhold(nid, old, delta)
            self._hold(nid, lk.report, delta)
            self._note(nid, delta)
            self._claim_seen(nid)
            self.wakeup.wake(Why.ANSWERED, f"{nid[:8]} {kind}")

    def _expire(self, nid: str, lk: Link, now: float) -> None:
        """A call past its deadline given up on: its node's agent does not answer."""
        late = False
        if lk.watch is not None and now > lk.watch_by:
            late, lk.watch = True, None
        if lk.applying is not None and now > lk.apply_by:
            late, lk.applying = True, None
        if late:
            self._down(nid, lk, f"its agent did not answer in {self.d.fleet_agent:g}s", now)

    def _down(self, nid: str, lk: Link, why: str, now: float) -> None:
        if lk.why is None:
            self._unhold(nid, lk.report, None)
            self._note(nid, None)
        lk.why, lk.failed_at = why, now

    def _note(self, nid: str, delta: frozenset[str] | None) -> None:
        if delta is None or (nid in self.deltas and self.deltas[nid] is None):
            self.deltas[nid] = None
        else:
            self.deltas.setdefault(nid, set()).update(delta)  # type: ignore[union-attr]

    def _hold(self, nid: str, report: AgentReport | None, only: frozenset[str] | None) -> None:
        runs = report.runs() if report is not None else frozenset()
        for name in runs if only is None else only & runs:
            self.holders.setdefault(name, set()).add(nid)

    def _unhold(self, nid: str, report: AgentReport | None, only: frozenset[str] | None) -> None:
        runs = report.runs() if report is not None else frozenset()
        for name in runs if only is None else only & runs:
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
        name = self.names.get(nid, nid[:8])
        if foreign is not None and was is None:
            self.claimed[nid] = foreign.fleet.id if foreign.fleet is not None else ""  # "": its file cannot be used
            self.event("node-claimed", f"node {name}: {foreign.why}", node=nid)
        elif foreign is None and was is not None:
            del self.claimed[nid]
            self.event("node-released", f"node {name}: its daemon is this fleet's now (fleet {self.fleet.id})", node=nid)
