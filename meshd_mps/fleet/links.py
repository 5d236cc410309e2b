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
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.messages import AgentReport, Share
from meshd_mps.fleet.observed import AgentState

#: The shares sent to one node that are remembered (by version): an agent's report names the one it holds.
SENT = 8


class Wakeup:
    """Reasons to look now, put by whoever has news; the loop takes them all before each tick."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = asyncio.Event()

    def wake(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()

    async def wait(self, within: float) -> list[str]:
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

    def apply(self, share: Share) -> Awaitable[AgentReport]: ...


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

    def heard(self, report: AgentReport) -> bool:
        """A report taken (if newer than the one held); whether anything plan reads changed."""
        old = self.report
        if old is not None and report.pid == old.pid and report.version < old.version:
            return False
        changed = old is None or report.version != old.version or report.pid != old.pid or self.why is not None
        self.report, self.why = report, None
        return changed

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
