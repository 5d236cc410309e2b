"""``plan`` (fleet/plan.py) as a function, over the situations of docs/fleet.md's failure table: a
deploy where what fits runs, the agent killed, a raylet restarted with no room elsewhere, the head
restarted (pins, and a pin given up), a node lost (a replica moved at once; a unique one only once
its old copy is stopped or its lease ran out), capacity exhausted, another fleet's daemon, a daemon
that does not answer, an upgrade rolled one replica at a time and one refused and rolled back.
Plain data in, plain data out: no Ray, no cluster, no clock."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("ray")

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.fleet.capacity import SLOT
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.messages import AgentReport, DaemonProgram, ForeignClaim, Order
from meshd_mps.fleet.observed import AgentState, NodeInfo, Observed, Placement, RayView
from meshd_mps.fleet.plan import plan
from meshd_mps.fleet.rollout import UNKNOWN, Rollout

OLD, NEW = Image({}, "ptx a", "a" * 16), Image({}, "ptx b", "b" * 16)
D = Deadlines(fleet_tick=0.5, fleet_rejoin=60.0, fleet_lease=30.0, fleet_skew=1.0)
NOW, WALL = 1000.0, 50_000.0


def spec(replicas: int = 3, **kw) -> Spec:
    return Spec(kw.pop("name", "echo"), replicas, "on-failure", kw.pop("strategy", "SPREAD"), kw.pop("image", OLD),
                token="t0", **kw)


def node(i: int, slots: int = 2) -> NodeInfo:
    return NodeInfo(f"id{i}", {SLOT: float(slots), f"meshd_node_n{i}": float(slots)}, f"host{i}")


def report(i: int, *running: str, hash: str = OLD.hash, version: int = 1, **kw) -> AgentReport:
    progs = {name: DaemonProgram(name, "running", hash, pid=100 + k, slot=k) for k, name in enumerate(running)}
    return AgentReport(node=f"id{i}", version=version, socket=f"/n{i}.sock", pid=10 + i,
                       programs=kw.pop("programs", progs), **kw)


def observed(nodes: list[int], placed: dict[str, tuple[str | None, ...]], reports: dict[int, AgentReport],
             *, now: float = NOW, wall: float = WALL, started: float = 0.0, fence: float = 0.0,
             agents: dict[int, AgentState] | None = None, free: float = 0.0) -> Observed:
    states = {f"id{i}": AgentState(report=r, held=frozenset(r.programs or ())) for i, r in reports.items()}
    states.update({f"id{i}": a for i, a in (agents or {}).items()})
    holders: dict[str, set[str]] = {}
    for nid, a in states.items():
        if a.report is not None and a.why is None:
            for name in a.report.runs():
                holders.setdefault(name, set()).add(nid)
    ray = RayView({f"id{i}": node(i) for i in nodes}, {k: Placement(v) for k, v in placed.items()}, {SLOT: free})
    return Observed(ray, states, holders, now=now, wall=wall, started=started, fence=fence, deadlines=D)


def one_each(s: Spec, nodes: list[str | None]) -> dict[str, tuple[str | None, ...]]:
    """Each replica's placement group (SPREAD: one per replica) placed on ``nodes[i]``."""
    return {s.unit(i)[0]: (n,) for i, n in enumerate(nodes)}


def states(p) -> list[tuple[str, str | None]]:
    return [(r.state, r.node_name) for r in p.view.replicas]


def on(part: dict) -> dict[str, list]:
    """A node's part of the share (orders, keep, leased), as lists in replica order."""
    return {nid: [v for _i, v in sorted(by_index.items())] for nid, by_index in part.items()}


def ordered(p, nid: str) -> list[str]:
    return [o.name for o in on(p.orders).get(nid, [])]


# ---- placing: what fits runs ---------------------------------------------------------------------


def test_a_deploy_makes_a_placement_group_per_replica_and_every_replica_waits_for_it():
    s = spec(3)
    p = plan(s, Rollout.start(s), observed([0, 1], {}, {0: report(0), 1: report(1)}))
    assert [c[0] for c in p.create] == ["echo.t0.0", "echo.t0.1", "echo.t0.2"]
    assert all(c[1] == [{SLOT: 1.0}] for c in p.create)
    assert {r.state for r in p.view.replicas} == {"pending"} and p.waiting and not p.orders
    whole = spec(3, strategy="PACK")
    p = plan(whole, Rollout.start(whole), observed([0], {}, {}))
    assert p.create == [("echo.t0", [{SLOT: 1.0}] * 3, "PACK")], "PACK: one group, placed whole"


def test_what_fits_runs_and_the_rest_waits_with_the_reason():
    s = spec(8)
    at = ["id0", "id1", "id2"] * 2 + [None, None]
    obs = observed([0, 1, 2], one_each(s, at), {i: report(i) for i in range(3)})
    p = plan(s, Rollout.start(s), obs)
    assert [r.state for r in p.view.replicas] == ["starting"] * 6 + ["pending"] * 2
    assert {r.reason for r in p.view.replicas[6:]} == {"no node has a free slot (2 wanted, 0 free of 6)"}
    assert sorted(len(v) for v in p.orders.values()) == [2, 2, 2] and not p.create
    assert on(p.orders)["id0"][0] == Order("echo.fleet-0", OLD.hash, "on-failure", None, False)


# ---- the failure table ------------------------------------------------------------------------------


def test_the_agent_killed_or_not_answering_changes_nothing_it_ran():
    s = spec(2)
    obs = observed([0, 1], one_each(s, ["id0", "id1"]), {0: report(0, "echo.fleet-0"), 1: report(1, "echo.fleet-1")},
                   agents={1: AgentState(report(1, "echo.fleet-1"), why="its agent is not reachable (RayActorError)")})
    p = plan(s, Rollout.start(s), obs)
    assert states(p) == [("running", "n0"), ("running", "n1")], "its last report stands"
    fresh = observed([0, 1], one_each(s, ["id0", "id1"]), {0: report(0, "echo.fleet-0")})
    p = plan(s, Rollout.start(s), fresh)
    assert p.view.replicas[1].state == "placing" and p.waiting, "a new agent not heard yet"


def test_a_raylet_restarted_with_no_room_elsewhere_keeps_its_replicas_running_where_they_run():
    s = spec(2)
    # n1's raylet is a new node (id9) with the same daemon; Ray has not placed its replica anywhere yet.
    obs = observed([0, 9], one_each(s, ["id0", None]), {0: report(0, "echo.fleet-0"), 9: report(9, "echo.fleet-1")})
    p = plan(s, Rollout.start(s), obs)
    assert [r.state for r in p.view.replicas] == ["running", "pending"], "pending, never dropped"
    assert on(p.keep) == {"id9": ["echo.fleet-1"]} and "id9" not in p.orders, "left running, not unloaded"


def test_the_head_restarted_pins_each_placement_group_where_its_replica_ran_until_the_node_rejoins():
    s = spec(2)
    r = Rollout.from_json({"where": ["n0", "n1"]}, s)
    p = plan(s, r, observed([0], {}, {}, now=10.0))
    assert p.create == [("echo.t0.0", [{SLOT: 1.0, "meshd_node_n0": 1.0}], "SPREAD"),
                        ("echo.t0.1", [{SLOT: 1.0, "meshd_node_n1": 1.0}], "SPREAD")]
    pinned = p.rollout
    # n1 is not back: within fleet_rejoin it waits (looked at again then), past it Ray places it anew.
    obs = observed([0], one_each(s, ["id0", None]), {0: report(0, "echo.fleet-0")}, now=10.0)
    p = plan(s, pinned, obs)
    assert not p.remove and p.due == pytest.approx(60.0) and p.view.replicas[1].state == "pending"
    p = plan(s, pinned, dataclasses.replace(obs, now=61.0))
    assert p.remove == ["echo.t0.1"] and p.rollout.where == ["n0", None]
    assert [e.kind for e in p.events if e.kind == "unpinned"] == ["unpinned"]


def test_a_lost_nodes_replica_is_started_where_ray_placed_it_at_once():
    s = spec(2)
    before = plan(s, Rollout.start(s), observed([0, 1], one_each(s, ["id0", "id1"]),
                                                {0: report(0, "echo.fleet-0"), 1: report(1, "echo.fleet-1")}))
    obs = observed([0], one_each(s, ["id0", "id0"]), {0: report(0, "echo.fleet-0")})
    p = plan(s, before.rollout, obs, before)
    assert ordered(p, "id0") == ["echo.fleet-0", "echo.fleet-1"]
    assert any(e.kind == "moved" and e.replica == 1 for e in p.events)


def test_capacity_and_constraints_say_why_a_replica_waits():
    s = spec(1, gpu="A100")
    p = plan(s, Rollout.start(s), observed([0], one_each(s, [None]), {}))
    assert p.view.replicas[0].reason == "no node has a GPU of kind a100 (the fleet's: none)"
    s = spec(3, strategy="STRICT_SPREAD")
    p = plan(s, Rollout.start(s), observed([0, 1], {s.pg_prefix: (None, None, None)}, {}))
    assert p.view.replicas[0].reason == "STRICT_SPREAD needs 3 nodes with a free slot; 2 such nodes are in the cluster"


def test_another_fleets_daemon_or_a_daemon_not_answering_leaves_its_replica_waiting_with_the_reason():
    s = spec(2)
    claimed = report(0, claim=ForeignClaim(None, "the node's daemon belongs to another fleet"))
    down = report(1, programs=None, error="no daemon on /n1.sock")
    p = plan(s, Rollout.start(s), observed([0, 1], one_each(s, ["id0", "id1"]), {0: claimed, 1: down}))
    assert [(r.state, r.reason) for r in p.view.replicas] == [
        ("pending", "the node's daemon belongs to another fleet"),
        ("placing", "the node's daemon does not answer: no daemon on /n1.sock")]


# ---- unique replicas: never two copies --------------------------------------------------------------


def test_a_unique_replica_moves_only_once_its_old_copy_is_unloaded():
    s = spec(1, unique=True)
    r = Rollout.start(s)
    r.owner = ["id1"]
    # Ray moved it to n0 while n1 (alive, answering) still runs it: not started on n0 yet.
    obs = observed([0, 1], one_each(s, ["id0"]), {0: report(0), 1: report(1, "echo.fleet-0")})
    p = plan(s, r, obs)
    assert not p.orders and p.view.replicas[0].state == "pending"
    assert "waiting for its copy on node n1 to be unloaded" in (p.view.replicas[0].reason or "")
    assert "id1" not in p.leased, "its lease there is not renewed"
    # n1 unloaded it, and the share n1 holds no longer names it: started on n0, which holds its lease.
    obs = observed([0, 1], one_each(s, ["id0"]), {0: report(0), 1: report(1)},
                   agents={1: AgentState(report(1), held=frozenset())})
    p = plan(s, p.rollout, obs)
    assert ordered(p, "id0") == ["echo.fleet-0"] and on(p.orders)["id0"][0].unique
    assert p.rollout.owner == ["id0"] and on(p.leased) == {"id0": ["echo.fleet-0"]}


def test_a_unique_replica_of_a_lost_node_waits_for_its_lease_there_to_run_out():
    s = spec(1, unique=True)
    r = Rollout.start(s)
    r.owner = ["id1"]
    grant = WALL + 5.0  # the last lease granted to n1 runs to WALL+5, and its daemon stops it within 1 s
    lost = AgentState(report(1, "echo.fleet-0", stop_within=1.0), why="its agent is not reachable",
                      grants={"echo.fleet-0": grant})
    obs = observed([0], one_each(s, ["id0"]), {0: report(0)}, agents={1: lost})
    p = plan(s, r, obs)
    assert not p.orders and p.view.replicas[0].state == "pending" and "lease" in (p.view.replicas[0].reason or "")
    assert p.due == pytest.approx(NOW + 5.0 + 1.0 + D.fleet_skew), "looked at again when the lease is out"
    p = plan(s, r, dataclasses.replace(obs, wall=grant + 1.0 + D.fleet_skew))
    assert ordered(p, "id0") == ["echo.fleet-0"]


def test_after_the_controller_starts_a_unique_replica_runs_where_it_is_found_or_waits_for_every_old_lease():
    s = spec(2, unique=True)
    r = Rollout.from_json({}, s)
    assert r.owner == [UNKNOWN, UNKNOWN]
    obs = observed([0, 1], one_each(s, ["id0", "id1"]), {0: report(0, "echo.fleet-0"), 1: report(1)}, fence=WALL + 20)
    p = plan(s, r, obs)
    assert [o.name for n in on(p.orders).values() for o in n] == ["echo.fleet-0"], "found running on n0: adopted"
    assert p.view.replicas[1].state == "pending" and p.due == pytest.approx(NOW + 20)
    p = plan(s, p.rollout, dataclasses.replace(obs, wall=WALL + 20))
    assert p.rollout.owner == ["id0", "id1"] and ordered(p, "id1") == ["echo.fleet-1"]


def test_a_replica_that_may_run_twice_is_started_at_once_wherever_its_old_copy_is():
    s = spec(1)
    obs = observed([0, 1], one_each(s, ["id0"]), {0: report(0), 1: report(1, "echo.fleet-0")})
    p = plan(s, Rollout.start(s), obs)
    assert ordered(p, "id0") == ["echo.fleet-0"] and "id1" not in p.orders and not p.keep


# ---- upgrades -------------------------------------------------------------------------------------------


def test_an_upgrade_drains_one_replica_at_a_time_and_a_refusal_rolls_back():
    s = spec(2)
    up = s.upgraded(NEW)
    both = one_each(s, ["id0", "id1"])
    runs = {0: report(0, "echo.fleet-0"), 1: report(1, "echo.fleet-1")}
    p = plan(up, Rollout.start(s), observed([0, 1], both, runs))
    assert p.rollout.target == NEW.hash and p.rollout.draining == 0 and p.view.replicas[0].state == "stopping"
    assert p.due == pytest.approx(NOW + 3 * D.fleet_tick) and p.view.upgrading
    p = plan(up, p.rollout, observed([0, 1], both, runs, now=NOW + 2))
    assert p.rollout.assigned == [NEW.hash, OLD.hash] and on(p.orders)["id0"][0].hash == NEW.hash
    # n0's daemon refuses the new image: the previous one is the target again, the error said.
    refused = report(0, "echo.fleet-0", errors={"echo.fleet-0": (NEW.hash, "upgrade refused (HTTP 400): smem")})
    p = plan(up, p.rollout, observed([0, 1], both, {0: refused, 1: runs[1]}, now=NOW + 3))
    assert p.rollout.target == OLD.hash and p.view.hash == OLD.hash and p.view.upgrade_error
    assert [e.kind for e in p.events].count("upgrade-failed") == 1


# ---- a plan of the replicas that changed is a plan of every one --------------------------------------


@pytest.mark.parametrize("unique", [False, True])
def test_planning_only_the_replicas_that_changed_gives_the_same_plan_as_planning_every_one(unique):
    s = spec(6, unique=unique)
    names = [f"echo.fleet-{i}" for i in range(6)]
    first = observed([0, 1, 2], one_each(s, ["id0", "id1", "id2"] * 2),
                     {0: report(0, names[0], names[3]), 1: report(1, names[1], names[4]), 2: report(2, names[2])})
    before = plan(s, Rollout.start(s), first)
    # n1's replica 1 restarts on its daemon, replica 4 is placed anew on n2 (n1 gone for it), replica 5 starts.
    restarting = dict(report(1, names[1], names[4]).programs or {})
    restarting[names[1]] = dataclasses.replace(restarting[names[1]], state="restarting")
    then = observed([0, 1, 2], one_each(s, ["id0", "id1", "id2", "id0", "id2", "id2"]),
                    {0: report(0, names[0], names[3]), 1: report(1, programs=restarting), 2: report(2, names[2], names[5])})
    part = plan(s, before.rollout, then, before, changed={1, 4, 5})
    whole = plan(s, before.rollout, then)
    assert part.view == whole.view and [r.state for r in part.view.replicas] != [r.state for r in before.view.replicas]
    assert (on(part.orders), on(part.keep), on(part.leased)) == (on(whole.orders), on(whole.keep), on(whole.leased))
    assert part.rollout.kept() == whole.rollout.kept() and part.rollout.owner == whole.rollout.owner
    # (A unique replica 4 waits for its copy on n1 to be unloaded: n2's share is as it was.)
    assert part.nodes >= ({"id1"} if unique else {"id1", "id2"}), "the nodes whose share changed are said"
    assert on(before.orders)["id0"] == on(part.orders)["id0"][:2], "the plan before is left as it was"
