"""When the fleet's controller looks next: ``settled`` (every ``fleet_tick`` once nothing is on its
way, every ``fleet_busy_tick`` while something is) and ``Watches``, the agents' watch calls that
cut a pause short when an agent has changed its daemon's programs or has ended.  Ray has no event
for "this actor's node died" or "that actor is done" that an asyncio loop can wait on besides a
call's own answer, so each agent keeps one call of the controller's outstanding."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import Any

from meshd_mps.fleet.desired import Declared
from meshd_mps.fleet.spec import FleetProgram


def settled(programs: dict[str, Declared], views: dict[str, FleetProgram], nodes_changed: bool,
            unanswered: bool = False, loading: frozenset[tuple[str, int]] = frozenset()) -> bool:
    """Nothing on its way: every replica running (or failed, waiting for its retry), or ``loading``
    (its node's agent loads or upgrades it now, and its watch answers once it has: the looks
    meanwhile would only slow the loads down), no upgrade, no node joined or lost at the last look,
    every node's agent answered it (one that did not may be on a node Ray is about to call lost:
    an agent's end fails its ask before Ray says so, its next ask hangs until it does).  Else the
    controller looks again after
    ``fleet_busy_tick``: a node's loss, a deploy or an upgrade takes a few looks (Ray places, the
    agents load, the views see it run), and at ``fleet_tick`` each would wait up to a whole tick
    ((l2): 1.86 s against 0.72 s of direct loads, then 0.95 s).  A replica pending for want of
    capacity keeps the looks at that pace while it waits."""
    if nodes_changed or unanswered:
        return False
    for name, p in programs.items():
        v = views.get(name)
        if v is None or p.upgrading:
            return False
        if any(r.state not in ("running", "failed") and (name, r.index) not in loading for r in v.replicas):
            return False
    return True


class Watches:
    """Each answering agent's watch call (``NodeAgent.watch``), outstanding: it answers after the
    agent changed its daemon's programs, and fails when the agent ends (its node lost, the actor
    killed); either way the controller's pause (``pause``) ends then, not at the tick."""

    def __init__(self, quiet_after_failure: float):
        self.quiet = quiet_after_failure
        self.calls: dict[str, asyncio.Future[Any]] = {}
        self.failed: dict[str, float] = {}  # node -> when its last watch failed (monotonic)
        self.ended: set[asyncio.Future[Any]] = set()  # ended, and a pause ended for it already

    def renew(self, answered: Iterable[str], agents: dict[str, Any], rounds: dict[str, int]) -> None:
        """The watches that answered or failed dropped; one sent to each agent of ``answered`` (it
        answered this look) that has none, for a change past its ``rounds``.  None to an agent that
        did not answer, nor within ``quiet_after_failure`` of its last watch's failure: a watch
        that fails at once (an agent of an older meshd-mps without ``watch``, one dying) would make
        the loop look without pause."""
        now = time.monotonic()
        for nid, f in list(self.calls.items()):
            if f.done():
                del self.calls[nid]
                self.ended.discard(f)
                if f.cancelled() or f.exception() is not None:
                    self.failed[nid] = now
        for nid in answered:
            if nid not in self.calls and nid in agents and now - self.failed.get(nid, -math.inf) >= self.quiet:
                f = asyncio.wrap_future(agents[nid].watch.remote(rounds.get(nid, 0)).future())
                f.add_done_callback(_taken)
                self.calls[nid] = f

    def out(self) -> frozenset[str]:
        """The nodes whose agent's watch is still out."""
        return frozenset(nid for nid, f in self.calls.items() if not f.done())

    def answers(self) -> dict[str, Any]:
        """The answers of the watches that answered (an agent's report) and are not renewed yet."""
        return {nid: f.result() for nid, f in self.calls.items()
                if f.done() and not f.cancelled() and f.exception() is None}

    def forget(self, nid: str) -> None:
        """A node gone: its watch (failed, or about to) is not waited on."""
        f = self.calls.pop(nid, None)
        if f is not None:
            self.ended.discard(f)
        self.failed.pop(nid, None)

    async def pause(self, poke: asyncio.Event, period: float) -> None:
        """``period``, cut short by ``poke`` (a declared change) or a watch's end, none if a watch
        ended since the last pause (during the look, which may have read the agent before its
        change); ``poke`` cleared.  A watch's end shortens one pause only: until ``renew`` drops
        it, a look that keeps failing before it gets there does not make the loop spin."""
        ended = [f for f in self.calls.values() if f.done() and f not in self.ended]
        self.ended.update(ended)
        poked = asyncio.ensure_future(poke.wait())
        try:
            if not ended:
                pending = [f for f in self.calls.values() if not f.done()]
                done, _ = await asyncio.wait([poked, *pending], timeout=period, return_when=asyncio.FIRST_COMPLETED)
                self.ended.update(f for f in done if f is not poked)
        finally:
            poked.cancel()
        poke.clear()


def _taken(f: asyncio.Future[Any]) -> None:
    """A watch's failure taken (an agent's end is the next look's to see), whether or not the
    watch is still kept: asyncio would log it as never retrieved."""
    if not f.cancelled():
        f.exception()
