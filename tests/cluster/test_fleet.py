"""The fleet on a real Ray cluster (``ray.cluster_utils``: a head and 3 nodes, one raylet each),
each node with its own ``meshd-mps serve --gpu sim --live-restore`` daemon, socket and state dir
(tests/rigs/fleet.py), 2 slots a node: deploy over several nodes, capacity exhausted, the agent
killed, a rolling upgrade with calls in flight, status against each node's ``ps``, calls from a
node, bad specs; and ``meshd-mps fleet`` as a user runs it, from a shell.  On the fleet tests'
shared cluster (``fleet_rig`` and ``fleet`` from tests/rigs/fleet.py); each test removes what it deployed."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import ray

from meshd_mps.base.errors import AlreadyDeclared, BadName, BadSpec, FleetUnavailable, ManifestError, NoSuchProgram
from meshd_mps.fleet import Fleet, ProgramSource, ProgramSpec
from meshd_mps.fleet.agent import agent_name
from meshd_mps.fleet.capacity import node_resources
from meshd_mps.fleet.spec import CallPort, replica_name
from meshd_mps.serving.client import Client, ClientError

from ..rigs import fleet as shared
from ..rigs.fleet import NAMESPACE, UP_S, FleetRig
from ..rigs.serve import EXAMPLES, REPO, cli, env

fleet_rig, fleet, echo, heartbeat = shared.fleet_rig, shared.fleet, shared.echo, shared.heartbeat  # tests/rigs/fleet.py

pytestmark = pytest.mark.timeout(240)


async def pending_reason(fleet: Fleet, name: str) -> str:
    """The reason every replica of ``name`` is pending, once the controller has looked (the
    first view, before its placement group is read, says only that it is being created)."""
    deadline = time.monotonic() + UP_S
    while True:
        rs = (await fleet.status(name)).programs[0].replicas
        reasons = {r.reason for r in rs if r.state == "pending"}
        if len(reasons) == 1 and len(rs) == sum(r.state == "pending" for r in rs) and \
                reasons != {"its placement group is being created"}:
            return reasons.pop() or ""
        assert time.monotonic() < deadline, f"{name}: not pending with one reason: {rs}"
        await asyncio.sleep(0.05)  # the polling interval


def by_node(fleet_rig: FleetRig) -> dict[str, str]:
    return {n.id: name for name, n in fleet_rig.nodes.items()}


async def test_replicas_spread_over_the_nodes_and_each_call_says_which_replica_answered(fleet_rig, fleet, echo):
    agent = ray.get_actor(agent_name(fleet_rig.nodes["n0"].id), namespace=NAMESPACE)
    version = (await agent.watch.remote(-1)).version  # its report now
    watch = agent.watch.remote(version)  # the controller's, made by the test: it answers once n0's agent loaded
    # STRICT_SPREAD: a replica on each node, always (SPREAD's replicas, each placed on its own, spread as
    # far as Ray's view of each node's room at that moment allows: two made at once may share a node).
    p = await fleet.deploy(ProgramSpec("echo", echo, replicas=3, strategy="STRICT_SPREAD"))
    assert [r.state for r in p.replicas] != ["running"] * 3 or p.running == 3
    p = await fleet.wait("echo", running=3, timeout=UP_S)
    nodes = by_node(fleet_rig)
    assert sorted(nodes[r.node] for r in p.replicas) == ["n0", "n1", "n2"], "a replica on each node"
    one, st = await fleet.program("echo"), await fleet.status("echo")
    assert [(r.index, r.node, r.state) for r in one.replicas] == \
        [(r.index, r.node, r.state) for r in st.programs[0].replicas], "program(name): status(name)'s view alone"
    with pytest.raises(NoSuchProgram):
        await fleet.program("not-declared")
    seen = set()
    for i in range(9):
        reply = await fleet.call("echo", b"hello %d" % i)
        assert reply.data == b"hello %d" % i
        assert reply.replica.state == "running" and reply.replica.program == "echo"
        assert reply.via == "call-port", "the test's driver is on the head (no replica there): the agents' call ports"
        seen.add(reply.replica.index)
    assert len(seen) >= 2, f"the calls all went to one replica: {seen}"
    # Within the test's deadline, not after Deadlines.fleet_watch (30 s): each change of its report
    # answers the watch (the share taken, then the round that loaded it), each a later version.
    mine = {replica_name("echo", i) for i in range(3)}
    deadline = time.monotonic() + 20
    while True:
        report = await asyncio.wait_for(watch, max(0.1, deadline - time.monotonic()))
        assert report.version > version, "a watch answers with a later report"
        if mine & (report.programs or {}).keys():
            break  # its report (the controller's views take it at once) holds the replica it loaded
        version = report.version
        watch = agent.watch.remote(version)


async def test_calls_of_any_size_go_through_the_call_ports_and_through_ray_where_a_port_cannot_be_reached(fleet, echo):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=2, strategy="STRICT_SPREAD"))  # two nodes, two ports
    await fleet.wait("echo", running=2, timeout=UP_S)
    assert (await fleet.call("echo", b"first")).via == "call-port"
    big = os.urandom(60_000)  # in echo's payload region (its manifest declares 64 KiB), through a call port
    assert ((reply := await fleet.call("echo", big)).data, reply.via) == (big, "call-port")
    routes = fleet.cache["echo"][1]
    assert len(routes.ports) == 2 and all(p.token for p in routes.ports.values())
    with socket.socket() as s:  # where the caller finds nothing listening (a firewall, a host gone)
        s.bind(("127.0.0.1", 0))
        shut = {n: CallPort("127.0.0.1", s.getsockname()[1], p.token) for n, p in routes.ports.items()}
        fleet.cache["echo"] = (time.monotonic() + 60, routes._replace(ports=shut))  # kept: no fresh routes
        replies = [await fleet.call("echo", b"b%d" % i) for i in range(4)]
        reply = await fleet.call("echo", big[::-1])
    assert [(r.data, r.via) for r in replies] == [(b"b%d" % i, "ray") for i in range(4)]
    assert (reply.data, reply.via) == (big[::-1], "ray"), "a large one through Ray as it is"
    assert set(fleet.unreachable) == set(shut.values()), "each port tried once, then left alone"
    fleet.cache.pop("echo")
    assert (await fleet.call("echo", b"last")).via == "call-port", "the real ports again with the routes"
    assert set(fleet.ports) <= set(routes.ports.values()) and fleet.unreachable == {}, \
        "the ports no route names any more are forgotten, their connections closed"
    await fleet.remove("echo")


async def test_fleet_status_agrees_with_each_nodes_ps(fleet_rig, fleet, echo, heartbeat):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=2, strategy="PACK"))
    await fleet.deploy(ProgramSpec("heartbeat", heartbeat, replicas=2, restart="always"))
    await fleet.wait("echo", running=2, timeout=UP_S)
    await fleet.wait("heartbeat", running=2, timeout=UP_S)
    st = await fleet.status()
    nodes = by_node(fleet_rig)
    on_nodes = {(name, row["name"]): row for name, n in fleet_rig.nodes.items() for row in n.ps().values()}
    in_status = {(nodes[r.node], r.name): r for p in st.programs for r in p.replicas}
    assert set(on_nodes) == set(in_status), "the same replicas on the same nodes"
    for key, r in in_status.items():
        row = on_nodes[key]
        assert (r.pid, r.slot, r.gpu, r.hash) == (row["pid"], row["slot"], row["device"], row["hash"]), key
        assert row["state"] == "running" and r.state == "running"
        assert row["restart"] == ("always" if r.program == "heartbeat" else "on-failure")
    echo_nodes = {nodes[r.node] for r in st.programs[0].replicas}
    assert len(echo_nodes) == 1, f"PACK: both echo replicas on one node, not {echo_nodes}"
    views = {n.name: n for n in st.nodes}
    for name, n in fleet_rig.nodes.items():
        assert views[name].socket == n.daemon.sock and views[name].daemon_pid == n.daemon.proc.pid
        assert views[name].agent == "up" and views[name].slots == 2


async def test_what_fits_runs_and_the_rest_waits_with_the_reason(fleet_rig, fleet, echo, heartbeat):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=3))
    await fleet.wait("echo", running=3, timeout=UP_S)
    # 3 slots free for 4 replicas (SPREAD: a placement group each): 3 run, 1 waits, as a Deployment's would.
    await fleet.deploy(ProgramSpec("heartbeat", heartbeat, replicas=4))
    await fleet.deploy(ProgramSpec("spin", ProgramSource.read(str(EXAMPLES / "spin")), replicas=4,
                                   strategy="STRICT_SPREAD"))
    await fleet.deploy(ProgramSpec("echo2", echo, replicas=1, gpu="A100"))
    deadline = time.monotonic() + UP_S
    while True:
        hb = (await fleet.status("heartbeat")).programs[0]
        waits = [(r.state, r.reason) for r in hb.replicas if r.state != "running"]
        if hb.running == 3 and waits == [("pending", "no node has a free slot (1 wanted, 0 free of 6)")]:
            break
        assert time.monotonic() < deadline, f"not 3 running and 1 pending for want of a slot: {hb.replicas}"
        await asyncio.sleep(0.05)  # the polling interval
    assert await pending_reason(fleet, "spin") == ("STRICT_SPREAD needs 4 nodes with a free slot; 3 such nodes are in"
                                                   " the cluster")
    assert await pending_reason(fleet, "echo2") == "no node has a GPU of kind a100 (the fleet's: simulated_h200)"
    p = await fleet.wait("echo", running=3, timeout=1)  # the running ones unchanged
    assert all(r.state == "running" for r in p.replicas)
    await fleet.remove("echo")  # room again: Ray places the pending heartbeat replica, which starts
    await fleet.wait("heartbeat", running=4, timeout=UP_S)


async def test_the_agent_killed_changes_no_worker_and_resets_no_heartbeat(fleet_rig, fleet, heartbeat):
    await fleet.deploy(ProgramSpec("heartbeat", heartbeat, replicas=3))
    await fleet.wait("heartbeat", running=3, timeout=UP_S)
    before = {(name, k): row for name, n in fleet_rig.nodes.items() for k, row in n.ps().items()}
    agents_before = {n.name: n.agent_pid for n in (await fleet.status()).nodes}
    assert all(n.call_port for n in (await fleet.status()).nodes), "every agent has a call port"
    # The controller learns an agent's end from its watch failing (fleet/loop.py, links.py):
    # one watch of the test's own, which no change answers before the kill.
    watch = ray.get_actor(agent_name(fleet_rig.nodes["n1"].id), namespace=NAMESPACE).watch.remote(2**40)
    for n in fleet_rig.nodes.values():
        ray.kill(ray.get_actor(agent_name(n.id), namespace=NAMESPACE), no_restart=False)
    with pytest.raises(ray.exceptions.RayActorError):
        await asyncio.wait_for(watch, 20)
    lowest: dict[tuple[str, str], int] = {k: row["heartbeat"] for k, row in before.items()}

    def sample() -> None:
        for (name, k) in before:
            row = fleet_rig.nodes[name].ps()[k]
            assert row["pid"] == before[(name, k)]["pid"], f"{k}'s worker changed"
            assert row["restarts"] == 0 and row["state"] == "running"
            assert row["heartbeat"] >= lowest[(name, k)], f"{k}'s heartbeat went back"
            lowest[(name, k)] = row["heartbeat"]

    async def agents_back() -> bool:
        sample()
        st = await fleet.status()
        return all(n.agent == "up" and n.agent_pid not in (None, agents_before[n.name]) and n.call_port
                   for n in st.nodes)

    deadline = time.monotonic() + UP_S
    while not await agents_back():
        assert time.monotonic() < deadline, f"the agents did not come back: {(await fleet.status()).nodes}"
        await asyncio.sleep(0.05)  # the polling interval
    p = await fleet.wait("heartbeat", running=3, timeout=UP_S)
    assert {(r.node, r.pid) for r in p.replicas} == {(fleet_rig.nodes[n].id, row["pid"]) for (n, _k), row in before.items()}
    for (name, k), row in before.items():
        assert fleet_rig.nodes[name].ps()[k]["heartbeat"] > row["heartbeat"], f"{k}'s heartbeat did not advance"


async def test_a_rolling_upgrade_with_calls_in_flight_fails_no_call_and_keeps_two_replicas(fleet_rig, fleet, echo):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=3))
    p = await fleet.wait("echo", running=3, timeout=UP_S)
    new = ProgramSource(echo.manifest, echo.ptx + "\n// v2\n")
    assert new.hash != echo.hash
    calls, failures, answering = 0, [], []
    done = asyncio.Event()
    socks = {r.index: (fleet_rig.nodes[by_node(fleet_rig)[r.node]].daemon.sock, r.name) for r in p.replicas}

    async def caller() -> None:
        nonlocal calls
        while not done.is_set():
            sent = b"in flight %d" % calls
            calls += 1
            try:
                reply = await fleet.call("echo", sent)
                assert reply.data == sent
            except Exception as e:  # counted, not raised: every failure is reported at the end
                failures.append(repr(e))

    def ask(sock: str, name: str) -> bool:
        try:
            return Client(sock, timeout=10).call(name, "up?", timeout=2)["data"] == "up?"
        except ClientError:
            return False

    async def sampler() -> None:
        while not done.is_set():
            ups = await asyncio.gather(*(asyncio.to_thread(ask, s, n) for s, n in socks.values()))
            answering.append(sum(ups))

    tasks = [asyncio.create_task(caller()), asyncio.create_task(caller()), asyncio.create_task(sampler())]
    try:
        up = await fleet.upgrade("echo", new)
    finally:
        done.set()
        await asyncio.gather(*tasks)
    assert up.hash == new.hash and up.running == 3 and not up.upgrading
    assert all(r.hash == new.hash and r.generation == up.generation for r in up.replicas)
    assert calls > 10 and not failures, f"{len(failures)} of {calls} calls failed: {failures[:3]}"
    assert answering and min(answering) >= 2, f"fewer than 2 replicas answered at times: {answering}"
    drained = [e.replica for e in (await fleet.status("echo")).events if e.kind == "draining"]
    assert sorted(drained) == [0, 1, 2], f"one replica at a time, each once: {drained}"


#: The longest an API call may take beside a hung agent (it answers in tens of ms; a call that
#: waited on the agent would take its fleet_agent deadline, 10 s).
API_S = 0.5


async def test_with_one_agent_hung_the_api_answers_at_once_and_the_other_nodes_go_on(fleet_rig, fleet, echo):
    """n2's agent stopped (SIGSTOP: it answers nothing, its node alive to Ray): deploy, status and
    remove answer at once, and the replicas on n0 and n1 are placed and upgraded as if it were not
    there.  The API waits on no agent (fleet/controller.py): one that did would take the hung
    agent's ``fleet_agent`` (10 s).  At once is tens of ms; the bound is ``API_S``, for a suite that
    holds both cores."""
    agent = next(n.agent_pid for n in (await fleet.status()).nodes if n.name == "n2")
    assert agent is not None
    new = ProgramSource(echo.manifest, echo.ptx + "\n// v2\n")
    os.kill(agent, signal.SIGSTOP)
    try:
        took = {}
        t0 = time.perf_counter()
        await fleet.deploy(ProgramSpec("echo", echo, replicas=3, strategy="STRICT_SPREAD"))
        took["deploy"] = time.perf_counter() - t0

        async def others(hash: str) -> bool:
            p = await fleet.program("echo")
            return sorted(r.node_name for r in p.replicas if r.state == "running" and r.hash == hash) == ["n0", "n1"]

        await until_async(lambda: others(echo.hash), "n0's and n1's replicas running")
        upgrading = asyncio.create_task(fleet.upgrade("echo", new))  # waits for n2's too: let run
        await until_async(lambda: others(new.hash), "n0's and n1's replicas upgraded")
        t0 = time.perf_counter()
        st = await fleet.status()
        took["status"] = time.perf_counter() - t0
        assert {n.name: n.agent for n in st.nodes}["n2"] in ("up", "not answering")
    finally:
        os.kill(agent, signal.SIGCONT)
    await asyncio.wait_for(upgrading, UP_S)  # n2's agent back: its replica upgraded too
    t0 = time.perf_counter()
    await fleet.remove("echo")
    took["remove"] = time.perf_counter() - t0
    assert max(took.values()) < API_S, took


async def until_async(cond, what: str) -> None:
    deadline = time.monotonic() + UP_S
    while not await cond():
        assert time.monotonic() < deadline, f"not within {UP_S:g}s: {what}"
        await asyncio.sleep(0.05)  # the polling interval


async def test_a_call_from_a_node_goes_to_the_replica_on_that_node(fleet_rig, fleet, echo):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=3, strategy="STRICT_SPREAD"))  # one on n1
    await fleet.wait("echo", running=3, timeout=UP_S)

    @ray.remote(num_cpus=0)
    class Caller:
        async def calls(self, n: int) -> list[tuple[str, str | None]]:
            f = await Fleet.connect(namespace=NAMESPACE)
            out = []
            try:
                for i in range(n):
                    r = await f.call("echo", b"from here %d" % i)
                    out.append((r.data.decode(), r.replica.node))
            finally:
                await f.close()
            return out

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = fleet_rig.nodes["n1"].id
    c = Caller.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    try:
        got = await c.calls.remote(5)
    finally:
        ray.kill(c)
    assert got == [(f"from here {i}", node) for i in range(5)]


async def test_bad_specs_are_refused_with_the_node_apis_errors(fleet_rig, fleet, echo):
    bad = [
        (ProgramSpec("echo", echo, replicas=0), BadSpec, "replicas"),
        (ProgramSpec("echo", echo, strategy="RANDOM"), BadSpec, "strategy"),  # type: ignore[arg-type]
        (ProgramSpec("e" * 60, echo), BadSpec, "name"),
        (ProgramSpec("echo", echo, hash="0" * 16), BadSpec, "hash"),
        (ProgramSpec("echo", echo, restart="sometimes"), None, None),
        (ProgramSpec("no/slash", echo), BadName, None),
        (ProgramSpec("echo", ProgramSource({"name": "echo"}, echo.ptx)), ManifestError, None),
    ]
    for spec, err, field in bad:
        with pytest.raises(Exception) as e:
            await fleet.deploy(spec)
        if err is not None:
            assert isinstance(e.value, err), (spec.name, e.value)
        if field is not None:
            assert e.value.field == field  # type: ignore[attr-defined]
    assert not (await fleet.status()).programs, "nothing declared by a refused spec"
    await fleet.deploy(ProgramSpec("echo", echo))
    with pytest.raises(AlreadyDeclared):
        await fleet.deploy(ProgramSpec("echo", echo, replicas=2))
    for bad_call in (fleet.call("nope", b"x"), fleet.remove("nope"), fleet.upgrade("nope", echo), fleet.status("nope")):
        with pytest.raises(NoSuchProgram) as e:
            await bad_call
        assert str(e.value) == "no program 'nope' is declared in the fleet" and e.value.program == "nope"


def test_capacity_is_the_nodes_limits_as_ray_resources(fleet_rig):
    n = fleet_rig.nodes["n0"]
    st = n.daemon.client.status()
    assert node_resources(st) == {"meshd_slot": 32.0, "meshd_gpu_simulated_h200": 32.0}  # blink: 32 per GPU
    # An MPS daemon's status, two GPUs with a pool of 2 each: each GPU's capacity is 48 less its pool
    # (what its isolation refuses at: tests/rig/test_limits.py, test_mps_programs_are_the_clients_less_the_pool).
    mps = {**st, "isolation": "mps", "pool": {"capacity": 2}, "devices": [{**d, "capacity": 46} for d in st["devices"] * 2]}
    assert node_resources(mps, node="gpu-box-1", slots=90) == {
        "meshd_slot": 90.0, "meshd_gpu_simulated_h200": 90.0, "meshd_node_gpu_box_1": 90.0}  # MPS: 48 less the pool
    assert node_resources(mps)["meshd_slot"] == 92.0
    assert replica_name("echo", 2) == "echo.fleet-2"


async def test_the_controller_killed_comes_back_from_its_checkpoint_and_halts_nothing(fleet_rig, fleet, echo):
    from meshd_mps.fleet.controller import CONTROLLER

    await fleet.deploy(ProgramSpec("echo", echo, replicas=3))
    p = await fleet.wait("echo", running=3, timeout=UP_S)
    pids = {(r.node, r.pid) for r in p.replicas}
    ray.kill(ray.get_actor(CONTROLLER, namespace=NAMESPACE), no_restart=False)
    started = f"controller started; 1 programs declared in {fleet_rig.fleet_state}/fleet.json"
    deadline = time.monotonic() + UP_S
    while True:  # Ray restarts it (its first words say what it loaded); the same handle reaches the new one
        try:
            st = await fleet.status()
            if [e.message for e in st.events if e.kind == "controller"] == [started] and st.programs[0].running == 3:
                break
        except FleetUnavailable:  # the controller restarting
            pass
        assert time.monotonic() < deadline, "the controller did not come back"
        await asyncio.sleep(0.1)  # the polling interval
    assert {(r.node, r.pid) for r in st.programs[0].replicas} == pids, "the same workers, on the same nodes"
    assert (await fleet.call("echo", b"still here")).data == b"still here"


async def test_gpu_and_node_constraints_place_the_replicas_only_there(fleet_rig, fleet, heartbeat):
    await fleet.deploy(ProgramSpec("heartbeat", heartbeat, replicas=2, gpu="simulated NVIDIA H200", node="n2"))
    p = await fleet.wait("heartbeat", running=2, timeout=UP_S)
    assert {r.node_name for r in p.replicas} == {"n2"} and {r.gpu for r in p.replicas} == {0}
    assert set(fleet_rig.nodes["n2"].ps()) == {"heartbeat.fleet-0", "heartbeat.fleet-1"}
    assert p.gpu == "simulated NVIDIA H200" and p.node == "n2"


async def test_an_upgrade_a_replica_refuses_stops_and_rolls_back(fleet_rig, fleet, echo):
    from meshd_mps.base.errors import UpgradeFailed

    await fleet.deploy(ProgramSpec("echo", echo, replicas=3))
    before = await fleet.wait("echo", running=3, timeout=UP_S)
    # Over the GPU's shared memory per block (another PTX: the image hash is the PTX's and param's).
    too_big = ProgramSource({**echo.manifest, "smem": 300_000}, echo.ptx + "\n// v3\n")
    with pytest.raises(UpgradeFailed) as e:
        await fleet.upgrade("echo", too_big)
    assert e.value.program == "echo" and "shared memory" in e.value.why, e.value
    p = await fleet.wait("echo", running=3, timeout=UP_S)
    assert p.hash == echo.hash and not p.upgrading and p.upgrade_error == e.value.why
    assert {(r.node, r.pid, r.hash) for r in p.replicas} == {(r.node, r.pid, r.hash) for r in before.replicas}
    kinds = [ev.kind for ev in (await fleet.status("echo")).events]
    assert kinds.count("draining") == 1 and "upgrade-failed" in kinds, kinds


# ---- meshd-mps fleet, the CLI, on the same cluster: the round trip a user makes, each command a
# process of its own, as from a shell, its output checked against each node's daemon.


#: Each command connects to the cluster and leaves it: a few seconds of Ray's start each.
CLI_S = 120


def fleet_cli(fleet_rig: FleetRig, *args: str):
    return cli("fleet", *args, "--address", fleet_rig.cluster.address, timeout=CLI_S)


def test_deploy_status_call_remove(fleet_rig):
    r = fleet_cli(fleet_rig, "deploy", str(EXAMPLES / "echo"), "--replicas", "2", "--strategy", "STRICT_SPREAD", "--wait")
    assert r.returncode == 0, r
    assert r.stdout == "echo deployed: 2 replicas, STRICT_SPREAD, every one running\n"

    r = fleet_cli(fleet_rig, "status", "echo", "--json")
    assert r.returncode == 0, r
    (prog,) = json.loads(r.stdout)["programs"]
    reps = sorted(prog["replicas"], key=lambda x: x["index"])
    assert [x["state"] for x in reps] == ["running", "running"]
    by_name = {n.name: n for n in fleet_rig.nodes.values()}
    assert len({x["node_name"] for x in reps}) == 2 <= len(by_name), "STRICT_SPREAD: on two nodes"
    for x in reps:  # what the fleet says is what each node's daemon runs
        ps = by_name[x["node_name"]].ps()
        assert ps[replica_name("echo", x["index"])]["pid"] == x["pid"]
        assert ps[replica_name("echo", x["index"])]["slot"] == x["slot"]

    r = fleet_cli(fleet_rig, "status")
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PROGRAM", "REPLICA", "NODE", "GPU", "SLOT", "STATE", "BEAT-AGE", "REASON"]
    rows = sorted(line.split()[:6] for line in lines[1:])
    assert rows == sorted(["echo", str(x["index"]), x["node_name"], str(x["gpu"]), str(x["slot"]), "running"]
                          for x in reps)

    r = fleet_cli(fleet_rig, "call", "echo", "hello fleet")
    assert r.returncode == 0, r
    assert r.stdout == "hello fleet\n"
    assert r.stderr.startswith("# echo[") and " on node n" in r.stderr, r.stderr
    assert r.stderr.rstrip().rsplit(" ", 1)[1] in ("socket", "call-port", "ray") and ", via " in r.stderr, r.stderr

    r = fleet_cli(fleet_rig, "remove", "echo")
    assert r.returncode == 0 and r.stdout == "echo removed\n", r
    r = fleet_cli(fleet_rig, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["programs"] == [], r


def test_removing_a_program_not_declared(fleet_rig):
    r = fleet_cli(fleet_rig, "remove", "nothing-here")
    assert (r.returncode, r.stdout) == (1, ""), r
    assert r.stderr == "meshd-mps: no program 'nothing-here' is declared in the fleet\n"


def test_calling_a_program_not_declared(fleet_rig):
    r = fleet_cli(fleet_rig, "call", "nothing-here", "x")
    assert (r.returncode, r.stdout) == (1, ""), r
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("meshd-mps: "), r.stderr
    assert "nothing-here" in r.stderr, r.stderr


def test_status_watch_prints_each_change(fleet_rig):
    """``status --watch``: the table, then a row each time a replica changes (as kubectl get -w),
    until Ctrl-C (exit 130)."""
    argv = [sys.executable, "-m", "meshd_mps", "fleet", "status", "--watch", "--address", fleet_rig.cluster.address]
    # Ctrl-C reaches it as a shell's foreground job: SIGINT at its default, not ignored as this run's
    # own may be (a background job of a non-interactive shell starts with SIGINT ignored, and so its
    # children: then Python never raises KeyboardInterrupt, and the watch runs on).
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as watch:
        out, err = watch.stdout, watch.stderr
        assert out is not None and err is not None
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True)
        reader.start()

        def until_row(pred, what: str) -> None:
            end = time.monotonic() + CLI_S
            seen: list[str] = []
            while time.monotonic() < end:
                try:
                    line = lines.get(timeout=1)  # the reader's next line, or a look at whether it still runs
                except queue.Empty:
                    assert watch.poll() is None, f"status --watch exited {watch.returncode}"
                    continue
                seen.append(line)
                if pred(line.split()):
                    return
            raise AssertionError(f"status --watch printed no {what} within {CLI_S}s: {seen}")

        try:
            until_row(lambda w: w[:1] == ["PROGRAM"], "header")
            # the simulation runs an example by its name: echo-*
            r = fleet_cli(fleet_rig, "deploy", str(EXAMPLES / "echo"), "--name", "echo-watched", "--wait")
            assert r.returncode == 0, r
            until_row(lambda w: w[:1] == ["echo-watched"] and w[5:6] == ["running"], "running row")
            r = fleet_cli(fleet_rig, "remove", "echo-watched")
            assert r.returncode == 0, r
            until_row(lambda w: w[:1] == ["echo-watched"] and w[5:6] == ["gone"], "gone row")
        finally:
            watch.send_signal(signal.SIGINT)
            try:
                rc = watch.wait(CLI_S)
            except subprocess.TimeoutExpired:  # deaf to Ctrl-C: killed, its exit status the failure below
                watch.kill()
                rc = watch.wait(CLI_S)
            reader.join(CLI_S)
        assert rc == 130, err.read()
