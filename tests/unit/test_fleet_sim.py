"""The controller's real loop (fleet/loop.py: observe, plan, act) over the simulated cluster of
fleet/simulate.py (nodes, placement groups placed as Ray places them, agents that run their share at
once), in this process: what fits runs and the rest starts as room comes; with one agent hung, the
API answers at once and the other nodes are placed and upgraded as if it were not there; a tenth of
the nodes lost and every replica placed again, no unique one ever on two daemons (the lost nodes'
daemons run on, cut off, until their leases run out); a controller restarted from its checkpoint
starts no unique replica twice.  No Ray cluster: the same loop on Ray is tests/cluster/'s."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("ray")

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.controller import status
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.loop import Reconciler
from meshd_mps.fleet.simulate import SimCluster, replicas

from ..rigs.waits import until

V1, V2 = Image({}, "v1", "1" * 16), Image({}, "v2", "2" * 16)
#: Short leases: a lost node's unique replica stops within a second, and starts elsewhere after; a
#: daemon not heard from stops one within ``orphan`` and ``orphan_halt`` past its lease.
D = Deadlines(fleet_tick=0.1, fleet_busy_tick=0.02, fleet_lease=0.6, fleet_skew=0.05, fleet_rejoin=0.5,
              fleet_agent=1.0, orphan=0.5, orphan_halt=0.2)
FLEET = FleetId("f0", "sim", "simulated")
UP_S = 20.0


@contextlib.asynccontextmanager
async def loop_over(cluster: SimCluster, tmp: str, declared: dict | None = None) -> AsyncIterator[Reconciler]:
    rec = Reconciler(cluster, FLEET, D, Checkpoint(tmp), declared or {})
    task = asyncio.create_task(rec.run())
    try:
        await asyncio.wait_for(rec.ticked.wait(), UP_S)
        yield rec
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def running(rec: Reconciler, name: str) -> int:
    return rec.view(name).running


def spec(name: str, replicas: int, image: Image = V1, **kw) -> Spec:
    return Spec(name, replicas, "on-failure", "SPREAD", image, **kw)


async def test_what_fits_runs_and_the_rest_starts_as_room_comes(tmp):
    cluster = SimCluster(3, slots=2)
    async with loop_over(cluster, tmp) as rec:
        await rec.declare(spec("heartbeat", 8))
        await until(lambda: running(rec, "heartbeat") == 6, UP_S, "6 of 8 running")
        pending = [r for r in rec.view("heartbeat").replicas if r.state == "pending"]
        assert len(pending) == 2 and {r.reason for r in pending} == {"no node has a free slot (2 wanted, 0 free of 6)"}
        cluster.add("n-late")  # room comes
        await until(lambda: running(rec, "heartbeat") == 8, UP_S, "the 2 started once room came")
        assert all(len(v) == 1 for v in replicas(cluster).values()) and len(replicas(cluster)) == 8


async def test_with_one_agent_hung_the_api_answers_at_once_and_the_other_nodes_go_on(tmp):
    cluster = SimCluster(4, slots=4)
    hung = sorted(cluster.nodes)[3]
    async with loop_over(cluster, tmp) as rec:
        cluster.agents[hung].hung = True  # answers nothing from here on
        took = {}
        t0 = time.perf_counter()
        await rec.declare(spec("echo", 8))
        took["deploy"] = time.perf_counter() - t0
        others = lambda: [r for r in rec.view("echo").replicas if r.node != hung]  # noqa: E731
        await until(lambda: len(others()) == 6 and all(r.state == "running" for r in others()), UP_S,
                    "the replicas on the 3 other nodes running")
        t0 = time.perf_counter()
        await rec.upgrade("echo", V2)
        took["upgrade"] = time.perf_counter() - t0
        await until(lambda: all(r.hash == V2.hash and r.state == "running" for r in others()), UP_S,
                    "the other nodes' replicas upgraded")
        t0 = time.perf_counter()
        status(rec)
        took["status"] = time.perf_counter() - t0
        await until(lambda: {n.agent for n in status(rec).nodes if n.node == hung} == {"not answering"}, UP_S,
                    "the hung node's agent shown not answering")
        t0 = time.perf_counter()
        await rec.remove("echo")
        took["remove"] = time.perf_counter() - t0
        assert max(took.values()) < 0.1, took


async def test_a_tenth_of_the_nodes_lost_every_replica_placed_again_and_no_unique_one_twice(tmp):
    cluster = SimCluster(20, slots=4)
    async with loop_over(cluster, tmp) as rec:
        await rec.declare(spec("heartbeat", 30, unique=True))
        await rec.declare(spec("echo", 20))
        await until(lambda: running(rec, "heartbeat") == 30 and running(rec, "echo") == 20, UP_S, "all running")
        twice: list[dict] = []

        async def watch() -> None:
            while True:
                cluster.expire()
                seen = replicas(cluster, lost=True)
                double = {k: v for k, v in seen.items() if k.startswith("heartbeat.") and len(v) > 1}
                if double:
                    twice.append(double)
                await asyncio.sleep(0.01)  # the sampling interval

        sampler = asyncio.create_task(watch())
        try:
            busiest = sorted(cluster.nodes, key=lambda n: -len(cluster.agents[n].programs))[:2]
            cluster.lose(busiest)
            await until(lambda: running(rec, "heartbeat") == 30 and running(rec, "echo") == 20
                        and not any(r.node in busiest for p in ("heartbeat", "echo") for r in rec.view(p).replicas),
                        UP_S, "every replica placed again")
            assert not any(cluster.agents[n].programs.keys() & {f"heartbeat.fleet-{i}" for i in range(30)}
                           for n in busiest), "the lost nodes' unique replicas stopped by their leases"
        finally:
            sampler.cancel()
        assert not twice, f"a unique replica ran on two daemons: {twice[:3]}"
        assert rec.node_losses == 2 and rec.moves >= 1


async def test_a_controller_restarted_from_its_checkpoint_starts_no_unique_replica_twice(tmp):
    cluster = SimCluster(3, slots=2)
    async with loop_over(cluster, tmp) as rec:
        await rec.declare(spec("heartbeat", 3, unique=True))
        await until(lambda: running(rec, "heartbeat") == 3, UP_S, "3 running")
        before = replicas(cluster)
    # The controller gone (its grants stop) and one node cut off with it: the next one starts from
    # the checkpoint, knowing no owner, and adopts what the nodes it reaches run.
    lost = before["heartbeat.fleet-0"][0]
    cluster.lose([lost])
    async with loop_over(cluster, tmp, Checkpoint(tmp).load()) as rec:
        started = time.time()
        await until(lambda: running(rec, "heartbeat") == 2, UP_S, "the 2 found running adopted")
        assert {k: v for k, v in replicas(cluster).items()} == {k: v for k, v in before.items() if v != [lost]}
        await until(lambda: "heartbeat.fleet-0" in replicas(cluster), UP_S, "the lost one started again")
        assert time.time() - started >= D.fleet_lease, "not before every lease of the controller before ran out"
        assert "heartbeat.fleet-0" not in cluster.agents[lost].programs, "stopped on the lost node by its lease"
        assert all(len(v) == 1 for v in replicas(cluster, lost=True).values())
