"""How often the fleet's controller looks (fleet/controller.py ``settled``): every ``fleet_tick``
once every replica runs, every ``fleet_busy_tick`` while one is on its way (placed, starting,
moving, upgrading, pending), so that a node's loss or a deploy does not wait a whole tick at each of
its steps (the bench's (l2): 1.86 s against 0.72 s of direct loads at one look per 0.5 s, 0.95 s
with the busy looks; docs/benchmarks.md).  Plain data: no cluster."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from meshd_mps.fleet.controller import settled
from meshd_mps.fleet.desired import Declared, Image
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


def test_busy_while_a_node_joined_or_left_an_upgrade_rolls_or_a_program_has_no_view_yet():
    assert not settled({"echo": declared()}, view("running", "running"), nodes_changed=True)
    upgrading = declared(NEW, assigned=[OLD.hash, NEW.hash])
    assert upgrading.upgrading and not settled({"echo": upgrading}, view("running", "running"), nodes_changed=False)
    assert not settled({"echo": declared()}, {}, nodes_changed=False), "just declared: not looked at yet"
