"""The fleet through failures, on a real Ray cluster of a head and 3 nodes (tests/rigs/fleet.py),
each node with its own daemon, socket and state dir, 2 slots a node: a node lost (its raylet,
daemon and workers killed) and its replicas re-placed or pending with the reason, a call whose
replica's node died (retried only when idempotent), the nodes back without any replica run twice
at any observation (the replicas are loaded with restore adopt), and the head restarted with
nothing lost and nothing halted.  On a cluster of the fleet tests' own (tests/conftest.py: an xdist
scope of its own, beside the other fleet modules'): each test leaves the 3 nodes up again, but the
cluster is not the one it found."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import Counter

import pytest
import ray

from meshd_mps.base.errors import ReplicaLost
from meshd_mps.fleet import Fleet, ProgramSource, ProgramSpec
from meshd_mps.serving.client import ClientError

from ..rigs import fleet as shared
from ..rigs.fleet import FLEET_DEADLINES, NAMESPACE, UP_S, FleetRig, removed
from ..rigs.serve import EXAMPLES
from ..rigs.waits import until

fleet_rig = shared.fleet_rig  # the fleet tests' cluster (tests/rigs/fleet.py)

#: A client that keeps its routes for a minute: its calls go to a replica the controller already
#: knows is gone, as a call on its way when the node died would.
STALE_ROUTES = dataclasses.replace(FLEET_DEADLINES, fleet_tick=60.0)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def no_child_left():
    """Replaces conftest's check after each test: these tests kill and start Ray's processes (a
    node, the head), which are this process's children.  The rig's close checks instead that no
    process of the cluster or its daemons is left at the end (``leftovers`` of its directory, which
    every raylet, Ray worker, daemon and program worker has in its environment or command line)."""
    yield


@pytest.fixture(autouse=True)
async def as_found(fleet_rig):
    """After each test, passed or failed: a node Ray declared dead (a raylet that missed its health
    checks on a loaded machine) joins again, and every program declared is removed and unloaded, as
    a test's own end does; so that one failure leaves the next test the cluster it expects rather than
    failing it too."""
    yield
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for name, n in list(fleet_rig.nodes.items()):
        if n.id not in alive:
            fleet_rig.rejoin(name)
    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    try:
        await removed(fleet_rig, fleet, *(p.name for p in (await fleet.status()).programs))
    finally:
        await fleet.close()


@pytest.fixture(scope="module")
def sources() -> dict[str, ProgramSource]:
    return {n: ProgramSource.read(str(EXAMPLES / n)) for n in ("echo", "heartbeat")}


async def running_where(fleet: Fleet, name: str, n: int, *, not_on: tuple[str, ...] = ()) -> dict[int, str | None]:
    """Where each replica of ``name`` runs, once ``n`` run and none on the nodes ``not_on``."""
    deadline = time.monotonic() + UP_S
    while True:
        p = (await fleet.status(name)).programs[0]
        if p.running >= n and not any(r.node_name in not_on for r in p.replicas):
            return {r.index: r.node_name for r in p.replicas}
        assert time.monotonic() < deadline, f"{name}: not {n} running, none on {not_on}: {p.replicas}"
        await asyncio.sleep(0.05)  # the polling interval


def runs(fleet_rig: FleetRig) -> Counter[str]:
    """How many nodes run each replica (by its name on the daemons)."""
    return Counter(k for n in fleet_rig.nodes.values() for k in n.ps())


def once(fleet_rig: FleetRig) -> None:
    """No replica runs on two nodes now."""
    twice = {k: n for k, n in runs(fleet_rig).items() if n > 1}
    assert not twice, f"replicas run on two nodes: {twice}"


async def test_a_lost_nodes_replicas_run_elsewhere_or_wait_with_the_reason_and_its_return_runs_none_twice(
        fleet_rig, sources):
    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    stale = await Fleet.connect(namespace=NAMESPACE, deadlines=STALE_ROUTES)
    await fleet.deploy(ProgramSpec("echo", sources["echo"], replicas=3))
    await fleet.deploy(ProgramSpec("heartbeat", sources["heartbeat"], replicas=1))
    where = await running_where(fleet, "echo", 3)
    assert len(set(where.values())) >= 2, f"SPREAD: over more than one node: {where}"
    victim = where[0]  # the node of replica 0 (SPREAD: Ray's choice)
    assert victim is not None
    on_victim = sorted(i for i, n in where.items() if n == victim)
    await running_where(fleet, "heartbeat", 1)
    for i in range(3):
        assert (await stale.call("echo", b"before %d" % i)).data == b"before %d" % i

    fleet_rig.kill(victim)
    # A call sent to the lost node's replica: not sent again unless idempotent (each replica is the
    # first a call tries once in 3 calls).
    lost = []
    for i in range(3):
        try:
            reply = await stale.call("echo", b"after %d" % i)
            assert reply.replica.node_name != victim and reply.data == b"after %d" % i
        except ReplicaLost as e:
            lost.append(e)
    assert sorted(int(e.replica) for e in lost) == on_victim and {e.program for e in lost} == {"echo"}, lost
    for i in range(6):
        reply = await stale.call("echo", b"again %d" % i, idempotent=True)
        assert reply.data == b"again %d" % i and reply.replica.node_name != victim

    # Re-placed on the 4 slots left (echo's 3 and heartbeat's 1), all running again.
    where = await running_where(fleet, "echo", 3, not_on=(victim,))
    assert sorted(Counter(where.values()).values()) == [1, 2]
    await running_where(fleet, "heartbeat", 1, not_on=(victim,))
    moved = [e for e in (await fleet.status()).events if e.kind in ("moved", "node-lost")]
    assert any(e.kind == "node-lost" for e in moved) and any(e.kind == "moved" for e in moved), moved

    # A second node lost: 2 slots left for 4 replicas; those without a slot pending with the reason.
    second, last = sorted(set(fleet_rig.nodes) - {victim})
    fleet_rig.kill(second)
    deadline = time.monotonic() + UP_S
    while True:
        st = await fleet.status()
        reps = [r for p in st.programs for r in p.replicas]
        pending = [r for r in reps if r.state == "pending"]
        if pending and all(r.reason and "no node has a free slot" in r.reason for r in pending) and \
                all(r.state in ("pending", "running") for r in reps):
            break
        assert time.monotonic() < deadline, f"no replica pending with the reason: {reps}"
        await asyncio.sleep(0.05)  # the polling interval
    assert len(reps) == 4, "no replica dropped"
    assert all(r.node_name == last for r in reps if r.state == "running")

    # The nodes come back, their daemons restarting from their state dirs (the replicas they ran
    # were loaded with restore adopt: not running, they are left to the fleet, not loaded again):
    # every replica runs again, and at no observation on two nodes.
    fleet_rig.add(victim)
    once(fleet_rig)
    fleet_rig.add(second)
    once(fleet_rig)
    deadline = time.monotonic() + UP_S
    while True:
        once(fleet_rig)
        st = {p.name: p for p in (await fleet.status()).programs}
        if st["echo"].running == 3 and st["heartbeat"].running == 1 and len(runs(fleet_rig)) == 4:
            break
        assert time.monotonic() < deadline, f"not every replica running again: {st}"
        await asyncio.sleep(0.05)  # the polling interval
    await running_where(fleet, "echo", 3)
    await running_where(fleet, "heartbeat", 1)
    for _ in range(10):  # and stays so
        assert set(runs(fleet_rig).values()) == {1} and len(runs(fleet_rig)) == 4, runs(fleet_rig)
        await asyncio.sleep(FLEET_DEADLINES.fleet_tick)
    await removed(fleet_rig, fleet, "echo", "heartbeat")
    await stale.close()
    await fleet.close()


async def test_the_head_restarted_loses_no_program_and_halts_none(fleet_rig, sources):
    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    await fleet.deploy(ProgramSpec("echo", sources["echo"], replicas=3))
    await fleet.deploy(ProgramSpec("heartbeat", sources["heartbeat"], replicas=2, restart="always"))
    await fleet.wait("echo", running=3, timeout=UP_S)
    await fleet.wait("heartbeat", running=2, timeout=UP_S)
    declared = {p.name: (p.hash, p.wanted, p.restart) for p in (await fleet.status()).programs}
    before = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    assert len(before) == 5

    fleet_rig.restart_head()  # the fleet's controller, agents and placement groups end with it

    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    st = await fleet.status()
    assert {p.name: (p.hash, p.wanted, p.restart) for p in st.programs} == declared, "every program declared"
    await fleet.wait("echo", running=3, timeout=UP_S)
    await fleet.wait("heartbeat", running=2, timeout=UP_S)
    for _ in range(5):  # a few ticks: the placements settled, nothing moved or reloaded
        await asyncio.sleep(FLEET_DEADLINES.fleet_tick)
    after = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    assert after.keys() == before.keys(), "each replica on the node it ran on"
    for key, row in after.items():
        assert row["pid"] == before[key]["pid"] and row["restarts"] == 0, f"{key} halted: {row}"
        assert row["heartbeat"] > before[key]["heartbeat"] and row["uptime_s"] > before[key]["uptime_s"]
    st = await fleet.status()
    assert {(r.node_name, r.name): r.pid for p in st.programs for r in p.replicas} == \
        {key: row["pid"] for key, row in after.items()}
    assert not [e for e in st.events if e.kind in ("moved", "failed")], st.events
    reply = await fleet.call("echo", b"after the head")
    assert reply.data == b"after the head"
    await removed(fleet_rig, fleet, *declared)
    await fleet.close()


async def test_a_raylet_restarted_with_no_room_elsewhere_halts_none_of_its_replicas(fleet_rig, sources):
    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    await fleet.deploy(ProgramSpec("heartbeat", sources["heartbeat"], replicas=6, strategy="PACK"))  # every slot
    p = await fleet.wait("heartbeat", running=6, timeout=UP_S)
    before = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    assert len(before) == 6 and {r.node_name for r in p.replicas} == {"n0", "n1", "n2"}
    on_n1 = {k for (name, k) in before if name == "n1"}

    fleet_rig.stop_raylet("n1")  # on this thread (cluster_utils sets signal handlers); the loop waits meanwhile
    deadline = time.monotonic() + UP_S
    while True:  # n1's replicas have no node now (no room elsewhere), and its daemon runs them on
        reps = (await fleet.status("heartbeat")).programs[0].replicas
        if sorted(r.name for r in reps if r.state == "pending") == sorted(on_n1):
            break
        assert time.monotonic() < deadline, f"n1's replicas not pending: {reps}"
        await asyncio.sleep(0.05)  # the polling interval
    for _ in range(5):
        assert set(fleet_rig.nodes["n1"].ps()) == on_n1, "unloaded while its node had no raylet"
        await asyncio.sleep(FLEET_DEADLINES.fleet_tick)
    n1 = fleet_rig.nodes["n1"]
    fleet_rig.add("n1", n1.daemon, n1.state)  # the raylet back, for the same daemon
    deadline = time.monotonic() + UP_S
    while True:
        p = (await fleet.status("heartbeat")).programs[0]
        if p.running == 6 and not any(r.node_name != "n1" for r in p.replicas if r.name in on_n1):
            break
        assert time.monotonic() < deadline, f"not all back: {p.replicas}"
        await asyncio.sleep(0.05)  # the polling interval
    after = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    assert after.keys() == before.keys()
    for key, row in after.items():
        assert row["pid"] == before[key]["pid"] and row["restarts"] == 0 and row["heartbeat"] > before[key]["heartbeat"]
    await removed(fleet_rig, fleet, "heartbeat")
    await fleet.close()


class Twice:
    """Every 0.25 s, on a thread of its own, every node's daemon asked what it runs: each replica
    seen on two daemons at one look is kept (``seen``)."""

    def __init__(self, fleet_rig: FleetRig):
        self.fleet_rig, self.seen, self.looks = fleet_rig, [], 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.25):  # the sampling interval
            runs: Counter[str] = Counter()
            for n in list(self.fleet_rig.nodes.values()):
                with contextlib.suppress(ClientError):
                    runs.update(n.ps().keys())
            self.looks += 1
            if twice := {k: c for k, c in runs.items() if c > 1}:
                self.seen.append(twice)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)


async def test_the_head_restarted_and_its_nodes_back_late_runs_no_unique_replica_twice(fleet_rig, sources):
    """The head restarts, and two nodes' Ray comes back late (their ``ray start`` run again once
    their leases ran out): their daemons stop the unique replicas whose leases no agent renews, the
    new controller starts each again only once every lease the old one granted has run out, and
    the nodes back run none of their old copies (docs/fleet.md, "Nothing runs twice")."""
    fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    spec = ProgramSpec("heartbeat", sources["heartbeat"], replicas=3, unique=True, strategy="STRICT_SPREAD")
    await fleet.deploy(spec)
    p = await fleet.wait("heartbeat", running=3, timeout=UP_S)
    assert {r.node_name for r in p.replicas} == {"n0", "n1", "n2"} and p.unique
    assert all(row["lease_until"] for n in fleet_rig.nodes.values() for row in n.ps().values()), "each loaded with a lease"
    on_n0 = {k: row["pid"] for k, row in fleet_rig.nodes["n0"].ps().items()}
    twice = Twice(fleet_rig)
    try:
        fleet_rig.restart_head(late=frozenset({"n1", "n2"}))
        fleet = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
        # n1's and n2's replicas stop on their daemons when their leases run out (no agent renews them);
        # n0's is found running there, adopted and its lease renewed: it runs on, never halted.
        await until(lambda: not fleet_rig.nodes["n1"].ps() and not fleet_rig.nodes["n2"].ps(), UP_S,
                    "the late nodes' unique replicas stopped by their leases")
        p = await fleet.program("heartbeat")
        assert [r.state for r in p.replicas] == ["pending"] * 3, "STRICT_SPREAD: 3 nodes wanted, 1 there"
        fleet_rig.rejoin("n1")
        fleet_rig.rejoin("n2")
        # Each started again only once every lease the controller before granted has run out.
        p = await fleet.wait("heartbeat", running=3, timeout=UP_S)
    finally:
        twice.stop()
    assert set(on_n0.items()) <= {(k, row["pid"]) for k, row in fleet_rig.nodes["n0"].ps().items()}, "n0's not halted"
    assert twice.looks > 20 and not twice.seen, f"a unique replica ran on two daemons: {twice.seen[:3]}"
    assert sorted(r.name for r in p.replicas) == [f"heartbeat.fleet-{i}" for i in range(3)]
    await removed(fleet_rig, fleet, "heartbeat")
    await fleet.close()
