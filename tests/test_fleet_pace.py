"""How often the fleet's controller looks (fleet/pace.py ``settled``): every ``fleet_tick``
once every replica runs, every ``fleet_busy_tick`` while one is on its way (placed, starting,
moving, upgrading, pending) or an agent does not answer, so that a node's loss or a deploy does not
wait a whole tick at each of its steps (the bench's (l2): 1.86 s against 0.72 s of direct loads at one look per 0.5 s, 0.95 s
with the busy looks; docs/benchmarks.md); and the agents' watch calls (``Watches``), which end a
pause at once.  Plain data and plain futures: no cluster."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pytest

pytest.importorskip("ray")

from meshd_mps.fleet.desired import Declared, Image
from meshd_mps.fleet.pace import Watches, settled
from meshd_mps.fleet.spec import FleetProgram, ReplicaView

OLD, NEW = Image({}, "ptx a", "a" * 12), Image({}, "ptx b", "b" * 12)


def declared(image: Image = OLD, assigned: list[str] | None = None) -> Declared:
    return Declared("echo", 2, "on-failure", "SPREAD", None, None, image, assigned=assigned or [])


def view(*states: str) -> dict[str, FleetProgram]:
    reps = tuple(ReplicaView("echo", i, s, None, hash=OLD.hash) for i, s in enumerate(states))
    return {"echo": FleetProgram("echo", reps, len(states), OLD.hash, 1, "on-failure", "SPREAD")}


def test_settled_once_every_replica_runs_and_nothing_moves():
    assert settled({}, {}, nodes_changed=False), "no program: nothing on its way"
    assert settled({"echo": declared()}, view("running", "running"), nodes_changed=False)
    assert settled({"echo": declared()}, view("running", "failed"), nodes_changed=False), "a failed one waits for its retry"


@pytest.mark.parametrize("state", ["pending", "placing", "starting", "stopping"])
def test_busy_while_a_replica_is_on_its_way(state):
    assert not settled({"echo": declared()}, view("running", state), nodes_changed=False)


def test_a_replica_its_watched_agent_is_loading_needs_no_busy_looks():
    """Its agent's watch answers once the load is done: looks every fleet_busy_tick meanwhile
    would only slow the node's loads ((l2): 1.30-1.35x of the direct loads with them, 1.03-1.16x
    without, 2026-12-07)."""
    assert settled({"echo": declared()}, view("running", "starting"), nodes_changed=False, loading=frozenset({("echo", 1)}))
    assert not settled({"echo": declared()}, view("running", "starting"), nodes_changed=False,
                       loading=frozenset({("echo", 0)})), "another replica's load says nothing of this one"
    assert not settled({"echo": declared()}, view("pending", "starting"), nodes_changed=False,
                       loading=frozenset({("echo", 1)})), "a pending one waits on Ray, which no watch tells of"


def test_busy_while_a_node_joined_or_left_an_upgrade_rolls_or_a_program_has_no_view_yet():
    assert not settled({"echo": declared()}, view("running", "running"), nodes_changed=True)
    assert not settled({"echo": declared()}, view("running", "running"), nodes_changed=False, unanswered=True), \
        "an agent that did not answer: its node may be about to be called lost (its next ask hangs until then)"
    upgrading = declared(NEW, assigned=[OLD.hash, NEW.hash])
    assert upgrading.upgrading and not settled({"echo": upgrading}, view("running", "running"), nodes_changed=False)
    assert not settled({"echo": declared()}, {}, nodes_changed=False), "just declared: not looked at yet"


# ---- Watches: the agents' watch calls end the controller's pause ---------------------------------
# An agent's ``watch.remote(since).future()`` is a concurrent future that the call's answer (or its
# failure) completes; here the test completes it, to see what the controller's pace does with it.
# That the real call answers after an agent's loads and fails when the agent is killed is tested on
# the cluster (tests/test_fleet.py).


class Agent:
    """What ``Watches`` uses of an agent's handle: ``watch.remote(since).future()``."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, concurrent.futures.Future[Any]]] = []
        self.watch = self

    def remote(self, since: int) -> Agent:
        self.sent.append((since, concurrent.futures.Future()))
        return self

    def future(self) -> concurrent.futures.Future[Any]:
        return self.sent[-1][1]


async def test_a_pause_ends_when_a_watch_answers_or_fails_or_a_change_is_declared():
    w, poke, a = Watches(quiet_after_failure=60.0), asyncio.Event(), Agent()
    w.renew(["n1"], {"n1": a}, {"n1": 4})
    assert [s for s, _ in a.sent] == [4], "one watch, for a change past the agent's last rounds"
    w.renew(["n1"], {"n1": a}, {"n1": 4})
    assert len(a.sent) == 1, "not a second while one is outstanding"

    t0 = time.monotonic()
    a.sent[0][1].set_result(5)  # the agent loaded something
    await asyncio.wait_for(w.pause(poke, 60.0), 20)
    poke.set()
    await asyncio.wait_for(w.pause(poke, 60.0), 20)
    assert not poke.is_set(), "a pause clears the poke it ended on"
    assert time.monotonic() - t0 < 30, "neither waited for its minute"

    w.renew(["n1"], {"n1": a}, {"n1": 5})
    a.sent[-1][1].set_exception(RuntimeError("the agent ended"))
    await asyncio.wait_for(w.pause(poke, 60.0), 20)
    assert w.answers() == {}, "a failed watch reports nothing"


async def test_an_answered_watch_hands_its_report_to_the_views_until_it_is_renewed():
    """The controller takes an answered watch's report (the agent's ``observe``) into its views
    before its next look (fleet/controller.py ``_reported``): ``answers`` holds it until ``renew``."""
    w, a = Watches(quiet_after_failure=60.0), Agent()
    w.renew(["n1"], {"n1": a}, {"n1": 2})
    assert w.answers() == {}, "nothing answered yet"
    report = {"rounds": 3, "programs": [{"name": "echo.fleet-0", "state": "running"}]}
    a.sent[0][1].set_result(report)
    await asyncio.sleep(0)  # the answer is in
    assert w.answers() == {"n1": report}
    w.renew(["n1"], {"n1": a}, {"n1": 3})
    assert w.answers() == {} and [s for s, _ in a.sent] == [2, 3]


async def test_a_failed_watch_is_not_sent_again_at_once_and_none_goes_to_an_agent_that_did_not_answer():
    w, poke, a, b = Watches(quiet_after_failure=60.0), asyncio.Event(), Agent(), Agent()
    w.renew(["n1"], {"n1": a, "n2": b}, {})
    assert len(a.sent) == 1 and b.sent == [], "n2 did not answer the look: no watch"
    a.sent[0][1].set_exception(RuntimeError("AttributeError: an older agent has no watch"))
    await asyncio.sleep(0)  # the future's callbacks
    w.renew(["n1", "n2"], {"n1": a, "n2": b}, {})
    assert len(a.sent) == 1, "a watch that failed is not sent again within quiet_after_failure"
    assert len(b.sent) == 1
    assert list(w.calls) == ["n2"], "the failed one is not waited on: the loop does not spin on it"
    w.forget("n2")
    done = asyncio.ensure_future(w.pause(poke, 0.05))
    await asyncio.wait_for(done, 20)  # its period: nothing left to end it sooner


async def test_a_watch_that_ended_during_the_look_ends_the_next_pause_at_once_and_only_that_one():
    """The look may have asked the agent before its change: its watch's end, seen only after the
    look, must not wait for the tick.  Until the next look renews it, it ends no other pause (a
    look that keeps failing before its renew would make the loop spin)."""
    w, poke, a = Watches(quiet_after_failure=60.0), asyncio.Event(), Agent()
    w.renew(["n1"], {"n1": a}, {})
    a.sent[0][1].set_result(1)
    await asyncio.sleep(0)  # the answer is in: the watch is done before the pause begins
    assert w.calls["n1"].done()
    await asyncio.wait_for(w.pause(poke, 60.0), 20)
    assert w.calls["n1"] in w.ended, "its end was used: the next pause waits its period"
    await asyncio.wait_for(w.pause(poke, 0.05), 20)
    w.renew(["n1"], {"n1": a}, {"n1": 1})
    assert len(a.sent) == 2 and not w.ended, "renewed, for a change past the agent's rounds"
