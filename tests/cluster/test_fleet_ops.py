"""The fleet's operations on a real Ray cluster (tests/rigs/fleet.py: a head and 3 nodes, each with
its own simulated-GPU daemon, 2 slots a node): a second fleet (another Ray namespace) on the same
node daemons touches nothing there and says why, while the first runs on undisturbed, across a
restart of a node's daemon too (live restore); the fleet's
metrics (``meshd-mps fleet metrics``) agree with its status after a deploy and after a deploy that
finds no capacity.  The fleet tests' shared cluster (``fleet_rig`` and ``fleet`` from tests/rigs/fleet.py); each test removes
what it deployed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.util.placement_group import placement_group_table

from meshd_mps.fleet import Fleet, FleetStatus, ProgramSpec
from meshd_mps.fleet.agent import agent_name
from meshd_mps.fleet.controller import CONTROLLER

from ..rigs import fleet as shared
from ..rigs.fleet import FLEET_DEADLINES, NAMESPACE, FleetRig
from ..rigs.serve import cli

fleet_rig, fleet, echo, heartbeat = shared.fleet_rig, shared.fleet, shared.echo, shared.heartbeat  # tests/rigs/fleet.py
UP_S = 60.0
#: Each command connects to the cluster and leaves it: a few seconds of Ray's start each.
CLI_S = 120

pytestmark = pytest.mark.timeout(240)


def fleet_cli(fleet_rig: FleetRig, *args: str):
    return cli("fleet", *args, "--address", fleet_rig.cluster.address, timeout=CLI_S)


async def eventually(cond, what: str | Callable[[], str]):
    """``cond()`` (async) until it returns something truthy, within UP_S (``what``: said, or made, then)."""
    deadline = time.monotonic() + UP_S
    while not (got := await cond()):
        assert time.monotonic() < deadline, f"not within {UP_S:g}s: {what if isinstance(what, str) else what()}"
        await asyncio.sleep(0.05)  # the polling interval
    return got


@contextlib.asynccontextmanager
async def second_fleet(fleet_rig: FleetRig):
    """Another fleet in the same cluster (its own namespace and checkpoint, its own agents on the
    same nodes, so on the same daemons); removed after, its controller and agents too."""
    ns = f"meshd-mps-second-{os.getpid()}"
    other = await Fleet.connect(namespace=ns, deadlines=FLEET_DEADLINES)
    try:
        yield ns, other
    finally:
        try:
            theirs = f"meshd-mps.{(await other.status()).fleet['id']}."  # its placement groups' names
            for p in (await other.status()).programs:
                await other.remove(p.name)
            await eventually(lambda: _none_left(theirs), "the second fleet's placement groups removed by its loop")
            await other.close()
        finally:
            for name in [CONTROLLER, *(agent_name(n.id) for n in fleet_rig.nodes.values())]:
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)


async def _none_left(prefix: str) -> bool:
    table = await asyncio.to_thread(placement_group_table)
    return not any((t.get("name") or "").startswith(prefix) and t.get("state") != "REMOVED" for t in table.values())


async def test_a_second_fleet_on_the_same_daemons_touches_nothing_and_says_why(fleet_rig, fleet, heartbeat):
    await fleet.deploy(ProgramSpec("heartbeat", heartbeat, replicas=3, restart="always"))
    await fleet.wait("heartbeat", running=3, timeout=UP_S)
    mine = (await fleet.status()).fleet
    assert mine is not None and mine["namespace"] == NAMESPACE and mine["id"]
    before = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    assert sorted(k for _n, k in before) == [f"heartbeat.fleet-{i}" for i in range(3)]
    lowest = {k: row["heartbeat"] for k, row in before.items()}

    def undisturbed() -> None:
        """Every node's daemon runs the first fleet's replicas only, on the same workers, beating."""
        now = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
        assert now.keys() == before.keys(), f"the daemons' replicas changed: {sorted(now)}"
        for k, row in now.items():
            assert (row["pid"], row["restarts"], row["state"]) == (before[k]["pid"], 0, "running"), (k, row)
            assert row["heartbeat"] >= lowest[k], f"{k}'s heartbeat went back"
            lowest[k] = row["heartbeat"]

    async with second_fleet(fleet_rig) as (ns, other):
        theirs = await other.status()
        assert theirs.fleet is not None and theirs.fleet["id"] != mine["id"]
        # The same program's name: its replicas would be the same daemon programs (heartbeat.fleet-i).
        await other.deploy(ProgramSpec("heartbeat", heartbeat, replicas=3))

        async def refused() -> FleetStatus | None:
            undisturbed()
            st = await other.status()
            reps, nodes = st.programs[0].replicas, [n for n in st.nodes if n.alive]
            ok = len(nodes) == 3 and all(n.claimed_by == mine["id"] and f"fleet {mine['id']}" in (n.reason or "")
                                         for n in nodes) \
                and all(r.state == "pending" and r.node and f"fleet {mine['id']}" in (r.reason or "") for r in reps)
            return st if ok else None

        st = await eventually(refused, "the second fleet's replicas pending on the first fleet's daemons")
        (prog,) = st.programs
        assert prog.running == 0 and {r.node for r in prog.replicas} == {n.id for n in fleet_rig.nodes.values()}
        assert "belongs to another fleet" in (prog.replicas[0].reason or "")
        claimed = [e for e in st.events if e.kind == "node-claimed"]
        assert len(claimed) == 3 and all(f"fleet {mine['id']}" in e.message for e in claimed), st.events
        assert all(n.free == 0 for n in st.nodes)

        # What the user sees of the second fleet: the replicas pending, each node and why (stderr), the events.
        r = fleet_cli(fleet_rig, "status", "--namespace", ns)
        assert r.returncode == 0, r
        rows = [line.split(maxsplit=7) for line in r.stdout.splitlines()[1:]]
        assert len(rows) == 3 and all(w[5] == "pending" and f"fleet {mine['id']}" in w[7] for w in rows), r.stdout
        said = [line for line in r.stderr.splitlines() if line.startswith("# node ")]
        assert sorted(line.split()[2] for line in said) == ["n0:", "n1:", "n2:"], r.stderr
        assert all(f"belongs to another fleet {mine['id']} (namespace 'meshd-mps'" in line for line in said), said
        r = fleet_cli(fleet_rig, "events", "--namespace", ns)
        assert r.returncode == 0, r
        assert sum(" node-claimed " in line and f"fleet {mine['id']}" in line for line in r.stdout.splitlines()) == 3

        # The claim outlives its daemon's restart with live restore (the file stays beside the
        # socket, the replicas run on and are adopted): after n0's new daemon is up and both fleets'
        # agents have looked at it, the second fleet is still kept off n0 and the first holds it.
        fleet_rig.restart_daemon("n0")
        undisturbed()
        pid = fleet_rig.nodes["n0"].daemon.proc.pid

        last: dict[str, object] = {}

        async def seen_again(f: Fleet, claimed_by: str | None) -> FleetStatus | None:
            undisturbed()
            st = await f.status()
            last["n0"] = n0 = next(n for n in st.nodes if n.name == "n0")
            return st if n0.daemon_pid == pid and n0.claimed_by == claimed_by else None

        st = await eventually(lambda: seen_again(other, mine["id"]),
                              lambda: f"the second fleet's agent looked at n0's new daemon {pid}: {last}")
        assert all(r.state == "pending" for r in st.programs[0].replicas), st.programs
        await eventually(lambda: seen_again(fleet, None),
                         lambda: f"the first fleet's agent looked at n0's new daemon {pid}: {last}")

        # The first fleet ran on through all of the second's looks: same workers, heartbeats on.
        seen = dict(lowest)
        await eventually(lambda: _advanced(undisturbed, lowest, seen), "every replica's heartbeat advanced")
        p = await fleet.wait("heartbeat", running=3, timeout=UP_S)
        assert {(r.node, r.pid) for r in p.replicas} == {(fleet_rig.nodes[n].id, row["pid"]) for (n, _k), row in before.items()}
        assert all(n.claimed_by is None and n.reason is None for n in (await fleet.status()).nodes)
    undisturbed()


async def _advanced(sample, lowest: dict, seen: dict) -> bool:
    sample()
    return all(lowest[k] > seen[k] for k in seen)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def agree(metrics: dict, st: FleetStatus) -> None:
    """The metrics' numbers are the status': each program's replicas wanted, by state, running;
    each node's slots, replicas and free slots; the moves and node losses."""
    for p in st.programs:
        prog = (("program", p.name),)
        assert metrics[("meshd_mps_fleet_program_replicas_wanted", prog)] == p.wanted
        assert metrics[("meshd_mps_fleet_program_replicas_running", prog)] == p.running
        for state in ("pending", "placing", "starting", "running", "failed", "stopping"):
            key = ("meshd_mps_fleet_program_replicas", (("program", p.name), ("state", state)))
            assert metrics[key] == sum(r.state == state for r in p.replicas), key
    assert metrics[("meshd_mps_fleet_programs", ())] == len(st.programs)
    assert metrics[("meshd_mps_fleet_nodes", ())] == len(st.nodes)
    for n in st.nodes:
        node = (("node", n.name),)
        assert (metrics[("meshd_mps_fleet_node_slots", node)], metrics[("meshd_mps_fleet_node_replicas", node)],
                metrics[("meshd_mps_fleet_node_slots_free", node)]) == (n.slots, n.replicas, n.free), n
        assert metrics[("meshd_mps_fleet_node_up", node)] == 1
    assert metrics[("meshd_mps_fleet_moves_total", ())] == st.moves
    assert metrics[("meshd_mps_fleet_node_losses_total", ())] == st.node_losses
    assert metrics[("meshd_mps_fleet_tick_age_seconds", ())] >= 0
    assert st.fleet is not None
    info = (("cluster", st.fleet["cluster"]), ("fleet", st.fleet["id"]), ("namespace", NAMESPACE))
    assert metrics[("meshd_mps_fleet_info", info)] == 1


async def test_the_fleet_metrics_agree_with_its_status(fleet_rig, fleet, echo):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=3))
    await fleet.wait("echo", running=3, timeout=UP_S)
    r = fleet_cli(fleet_rig, "metrics")
    assert r.returncode == 0, r
    got, st = scrape(r.stdout), await fleet.status()
    agree(got, st)
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo"), ("state", "running")))] == 3
    assert sorted(got[("meshd_mps_fleet_node_slots_free", (("node", n),))] for n in fleet_rig.nodes) == [1, 1, 1]

    # No capacity for all 4 (3 slots free of 6): 3 run, 1 pending, none dropped.
    await fleet.deploy(ProgramSpec("echo-more", echo, replicas=4))

    async def three_and_one() -> bool:
        p = (await fleet.status("echo-more")).programs[0]
        waits = [x for x in p.replicas if x.state != "running"]
        return p.running == 3 and len(waits) == 1 and waits[0].state == "pending" and "free slot" in (waits[0].reason or "")

    await eventually(three_and_one, "echo-more: 3 running, 1 pending for want of a free slot")
    r = fleet_cli(fleet_rig, "metrics")
    assert r.returncode == 0, r
    got, st = scrape(r.stdout), await fleet.status()
    agree(got, st)
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo-more"), ("state", "pending")))] == 1
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo-more"), ("state", "running")))] == 3
    assert got[("meshd_mps_fleet_program_replicas_wanted", (("program", "echo-more"),))] == 4
    assert got[("meshd_mps_fleet_program_replicas_running", (("program", "echo"),))] == 3
