"""A real Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and N nodes, each its
own raylet) with a ``meshd-mps serve --gpu sim --live-restore`` daemon per node (its own socket and
state dir, started here, outside Ray's process tree, as systemd would start it): the fleet's tests.

The cluster is built as ``meshd-mps fleet bench`` builds its own (meshd_mps/fleet/local.py:
``start_head``, ``join_node``, ``shutdown_cluster``): each node advertises the resources
``capacity.node_resources`` computes from its daemon's status, here with a small ``slots`` so that
capacity runs out early, and its daemon's socket in the node's environment (``$MESHD_MPS_SOCKET``,
which its agent reads).  ``close`` removes every program, stops
the daemons with nothing running (a live-restore stop then leaves nothing) and the cluster.

One cluster serves the cluster tests' modules (fixtures ``fleet_rig`` and ``fleet`` here): one less
saved 14 s of the CPU of test_fleet.py and test_fleet_failover.py (4 raylets with their agents, 3
daemons, the controller and agents).  A module joins with ``from ..rigs import fleet as shared`` and
``fleet_rig, fleet = shared.fleet_rig, shared.fleet`` (not imported by name: ruff takes the tests'
arguments for redefinitions); tests/conftest.py runs the modules of tests/cluster/ (the bench's
smoke aside, which starts its own) as two pytest-xdist scopes, each with its cluster: the failover
tests one, the others one after another, and closes each cluster after the last test that uses
it.  Each test leaves it as it found it: its programs removed (``fleet`` does), every node it
removed added back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from meshd_mps.fleet import Fleet, ProgramSource
from meshd_mps.fleet.local import join_node, shutdown_cluster, start_head
from meshd_mps.fleet.spec import parse_replica_name
from meshd_mps.serving.client import ClientError

from .deadlines import TEST_DEADLINES
from .serve import EXAMPLES, Serve, leftovers
from .waits import poll, until

#: The fleet's own namespace, the one ``meshd-mps fleet`` uses: the CLI's tests share the module's
#: fleet.  (A second fleet, in another namespace, on the same node daemons would fight the first:
#: each node's agents unload the replicas their own controller does not place there.)
NAMESPACE = "meshd-mps"
#: The fleet's reconcile loops tick every 0.2 s (not 0.5: each wait below waits on a few ticks), busy
#: or not (at 0.1 s while busy the suite took ~15 s more of the 2 cores: its tests keep replicas
#: pending for long), a node that ran replicas has 5 s to rejoin after the head's restart, and a
#: unique replica's lease is 3 s (the daemons' orphan timeout is 5 s: ``start_daemon``).
FLEET_DEADLINES = dataclasses.replace(TEST_DEADLINES, fleet_tick=0.2, fleet_busy_tick=0.2, fleet_rejoin=5.0,
                                      fleet_lease=3.0, fleet_skew=0.5, orphan=5.0)
#: The longest a test waits for the fleet to run, move or unload what it was asked.
UP_S = 60.0


def reap_orphans() -> None:
    """What a killed daemon or raylet left and has exited since (re-parented to this subreaper)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def stop_ray_stragglers(mark: str, within: float = 15.0) -> None:
    """Ray's processes of the cluster (``ray::*``, raylet, gcs_server: ``mark`` in their
    environment or command line) still there ``within`` s after ``Cluster.shutdown``: killed.  On a
    machine loaded far past its cores, a Ray agent that was still starting when the shutdown's
    SIGTERM came was seen to stay (its handlers not set yet); it is Ray's, and it must not outlive
    the test.  The daemons and their workers are not touched here: ``close`` stops them itself."""
    deadline = time.monotonic() + within
    while True:
        reap_orphans()
        ray_left = [int(line.split(":")[0]) for line in leftovers([mark]) if _is_ray(int(line.split(":")[0]))]
        if not ray_left or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # the polling interval
    for pid in ray_left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return False
    return comm.startswith("ray::") or comm in ("raylet", "gcs_server")


class Node:
    def __init__(self, name: str, daemon: Serve, state: str, ray_node: Any):
        self.name, self.daemon, self.state, self.ray_node = name, daemon, state, ray_node

    @property
    def id(self) -> str:
        return str(self.ray_node.node_id)

    def ps(self) -> dict[str, dict]:
        """The daemon's fleet programs, by name, as ``meshd-mps ps`` shows them."""
        return {p["name"]: p for p in self.daemon.client.programs() if parse_replica_name(p["name"])}


class FleetRig:
    def __init__(self, nodes: int = 3, slots: int = 2):
        self.dir = tempfile.mkdtemp(prefix="mf-")
        self.fleet_state = os.path.join(self.dir, "fleet")
        self.nodes: dict[str, Node] = {}
        self.slots = slots
        self.cluster: Cluster | None = None
        self.starting: list[Serve] = []
        #: The nodes whose daemon was restarted with live restore (``restart_daemon``): the old
        #: daemon's workers run on, re-parented to this process (a subreaper), the rig's until it
        #: closes (``held``), not a test's leftovers.
        self.restarted: set[str] = set()
        try:
            self.cluster = self.head()
            started = [self.start_daemon(f"n{i}") for i in range(nodes)]  # all at once: each starts its worker
            for i, (daemon, state) in enumerate(started):
                self.add(f"n{i}", daemon, state, wait=False)
            self.cluster.wait_for_nodes(UP_S)  # the raylets start together
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
        except BaseException:
            self.close()  # what started so far: nothing is left behind by a start that failed
            raise

    def head(self) -> Cluster:
        """A new cluster: its head (the controller's checkpoint in ``fleet_state``)."""
        return start_head(self.fleet_state)

    def restart_head(self, late: frozenset[str] = frozenset()) -> None:
        """The head restarts (without GCS fault tolerance the cluster's state goes with it, so every
        raylet starts again too, as systemd or KubeRay would start them): every Ray process of the
        cluster ends and a new cluster starts, each node joining with its daemon, which runs on;
        the nodes ``late`` not yet (``rejoin`` them: their ``ray start`` run again later)."""
        shutdown_cluster(self.cluster)
        reap_orphans()
        self.cluster = self.head()
        for name, n in self.nodes.items():
            if name not in late:
                self.add(name, n.daemon, n.state, wait=False)
        self.cluster.wait_for_nodes(UP_S)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")

    def rejoin(self, name: str) -> None:
        """Node ``name``'s raylet started again (after ``restart_head(late=...)``), for its daemon."""
        n = self.nodes[name]
        self.add(name, n.daemon, n.state)

    def start_daemon(self, name: str) -> tuple[Serve, str]:
        state = os.path.join(self.dir, name, "state")
        os.makedirs(os.path.dirname(state), mode=0o700, exist_ok=True)
        s = Serve(os.path.join(self.dir, name), "blink", os.path.join(self.dir, name, "s.sock"), "--state-dir", state,
                  "--live-restore", "--orphan-timeout", "5")
        self.starting.append(s)
        return s, state

    def restart_daemon(self, name: str) -> None:
        """Node ``name``'s daemon stops (SIGTERM) and starts again on its state dir and socket: with
        ``--live-restore`` its programs run on through the gap and the new daemon adopts them."""
        n = self.nodes[name]
        self.restarted.add(name)
        assert n.daemon.stop() == 0, n.daemon.log()
        n.daemon, _state = self.start_daemon(name)
        n.daemon.wait_ready()

    def add(self, name: str, daemon: Serve | None = None, state: str | None = None, wait: bool = True) -> Node:
        """Node ``name`` joins: its daemon (started here unless given), then its raylet (``wait``:
        until the cluster has it; else the caller waits for all it added, ``cluster.wait_for_nodes``)."""
        if daemon is None or state is None:
            daemon, state = self.start_daemon(name)
        daemon.wait_ready()
        self.nodes[name] = Node(name, daemon, state, None)  # stopped by close() from here on
        assert self.cluster is not None
        n = self.nodes[name]
        n.ray_node, _res = join_node(self.cluster, name, daemon.sock, daemon.client.status(), slots=self.slots, wait=False)
        if wait:
            self.cluster.wait_for_nodes(UP_S)
        return n

    def stop_raylet(self, name: str) -> None:
        """Node ``name``'s raylet stops, and with it the node's Ray workers (its agent among them);
        its daemon runs on.  ``add(name, ...)`` with the same daemon is its restart: to Ray,
        another node.  (On the main thread: cluster_utils sets signal handlers.)"""
        n = self.nodes[name]
        assert self.cluster is not None
        self.cluster.remove_node(n.ray_node)
        mark = os.path.join(self.dir, name) + os.sep
        poll(lambda: (reap_orphans(), not [p for p in leftovers([mark]) if _is_ray(int(p.split(":")[0]))])[1], 30.0,
             f"node {name}'s Ray processes gone")

    def kill(self, name: str) -> Node:
        """The node dies: its raylet and every Ray process of it (its agent), its daemon (SIGKILL)
        and the programs' workers: each has the node's directory in its command line or
        environment (``$MESHD_MPS_SOCKET``)."""
        n = self.nodes.pop(name)
        assert self.cluster is not None
        self.cluster.remove_node(n.ray_node, allow_graceful=False)
        n.daemon.proc.send_signal(signal.SIGKILL)
        n.daemon.proc.wait(30)
        mark = os.path.join(self.dir, name) + os.sep
        for line in leftovers([mark]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        poll(lambda: (reap_orphans(), not leftovers([mark]))[1], 20.0, lambda: f"node {name}'s processes gone:"
             f" {leftovers([mark])}")
        return n

    def close(self) -> None:
        try:
            shutdown_cluster(self.cluster)
        finally:
            for s in {id(s): s for s in [*self.starting, *(n.daemon for n in self.nodes.values())]}.values():
                with contextlib.suppress(ClientError):
                    for p in s.client.programs():
                        s.client.unload(p["name"])
                s.kill()
            stop_ray_stragglers(self.dir)
            poll(lambda: (reap_orphans(), not leftovers([self.dir]))[1], 30.0,
                 lambda: f"no process of the fleet's nodes left: {leftovers([self.dir])}")
            shutil.rmtree(self.dir, ignore_errors=True)


# ---- a cluster for the fleet test modules (two xdist scopes, each its own: tests/conftest.py) -----

_shared: list[FleetRig] = []


@pytest.fixture(scope="module")
def fleet_rig() -> FleetRig:
    """The fleet tests' cluster: a head and 3 nodes of 2 slots each.  Started by the first module
    that uses it; the next ones find it as the last left it (each test removes what it deployed,
    and puts back a node it removed); closed by ``close_shared`` after the last (tests/conftest.py)."""
    if not _shared:
        _shared.append(FleetRig(nodes=3, slots=2))
    return _shared[0]


async def removed(fleet_rig: FleetRig, fleet: Fleet, *names: str) -> None:
    """The programs removed, and every replica unloaded from its daemon: the next test deploys
    programs of the same names, on the same daemons' slots."""
    for name in names:
        await fleet.remove(name)
    await until(lambda: not any(n.ps() for n in fleet_rig.nodes.values()), UP_S, "every replica unloaded")


@pytest.fixture
async def fleet(fleet_rig: FleetRig):
    """A client of the cluster's fleet, in the fleet's own namespace; after the test, every program
    removed and every replica unloaded from its node."""
    f = await Fleet.connect(namespace=NAMESPACE, deadlines=FLEET_DEADLINES)
    try:
        yield f
    finally:
        await removed(fleet_rig, f, *(p.name for p in (await f.status()).programs))
        await f.close()


@pytest.fixture(scope="module")
def echo() -> ProgramSource:
    return ProgramSource.read(str(EXAMPLES / "echo"))


@pytest.fixture(scope="module")
def heartbeat() -> ProgramSource:
    return ProgramSource.read(str(EXAMPLES / "heartbeat"))


def held() -> set[int]:
    """The processes of the shared cluster's restarted nodes (``FleetRig.restarted``)."""
    marks = [os.path.join(r.dir, name) + os.sep for r in _shared for name in r.restarted]
    return {int(line.split(":")[0]) for line in leftovers(marks)} if marks else set()


def uses_shared(item: pytest.Item | None) -> bool:
    """Whether ``item``'s module takes its ``fleet_rig`` from here (the shared cluster)."""
    return item is not None and getattr(getattr(item, "module", None), "fleet_rig", None) is fleet_rig


def close_shared() -> None:
    """The shared cluster closed, if one runs (its next user starts another)."""
    while _shared:
        _shared.pop().close()
