"""A fleet on one machine, for the bench (``meshd-mps fleet bench``): a real Ray cluster of a head
and N nodes (``ray.cluster_utils.Cluster``), each node with its own ``meshd-mps serve`` daemon
(``--gpu sim``: the explicit CPU simulation), socket and state dir, advertising the capacity that
daemon reports (``capacity.node_resources``), and its agent told the socket through the raylet's
environment (``$MESHD_MPS_SOCKET``), as ``ray start`` beside a daemon on a host does.

The cluster's parts (``start_head``, ``join_node``, ``shutdown_cluster``) are the fleet tests' too
(tests/rigs/fleet.py, whose daemons are the tests' own ``meshd-mps serve`` rig): one way to build a
fleet on one machine.

Everything it starts is stopped and waited for at ``close()``: the cluster (``cluster.shutdown()``
after ``ray.shutdown()``), every daemon (SIGTERM, then SIGKILL past its deadline) and the temporary
directory.  Ray's subreaper option is never enabled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.cluster_utils import Cluster

from meshd_mps import standin
from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.defaults import SOCKET_ENV
from meshd_mps.base.errors import Timeout
from meshd_mps.fleet.capacity import node_resources
from meshd_mps.fleet.checkpoint import ENV as FLEET_STATE_ENV
from meshd_mps.gpu.device import SIM_GPUS_ENV
from meshd_mps.serving.client import Client, ClientError

#: A daemon's start (the simulated GPU's worker included) and its stop: the daemon's own API
#: deadlines bound each request; these bound the whole.
START_S = 60.0
STOP_S = 30.0
#: How often a start is looked at again (a poll interval, not a deadline).
POLL_S = 0.05
#: The head's health checks of each raylet (Ray's GCS: ``_system_config``), for a cluster on one
#: machine: a killed raylet is known dead after 3 failed checks 1 s apart (~3 s) instead of Ray's 5
#: checks 3 s apart (~15 s).  Only the period and the count: each check still has Ray's 10 s to be
#: answered, and a node its first 5 s, so that a node that is alive but slow on a loaded machine is
#: never declared dead (its raylet then exits, and what is pinned to it with NodeAffinity cannot run).
NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def start_head(state_dir: str, num_cpus: int = 0) -> Cluster:
    """A new cluster of one head: no ``meshd_slot`` (it places no replica), the controller's
    checkpoint in ``state_dir``, a killed raylet known dead in ~3 s (``NODE_DEATH``); no dashboard
    and no log monitor (nothing reads them, and the drivers connect with ``log_to_driver=False``:
    two processes less)."""
    return Cluster(initialize_head=True, head_node_args={
        "num_cpus": num_cpus, "env_vars": {FLEET_STATE_ENV: state_dir}, "include_dashboard": False,
        "include_log_monitor": False, "_system_config": NODE_DEATH})


def join_node(cluster: Cluster, name: str, socket: str, status: dict[str, Any], *, slots: int | None = None,
              num_cpus: int = 0, wait: bool = True) -> tuple[Any, dict[str, float]]:
    """Node ``name`` joins ``cluster`` beside its daemon: a raylet advertising the capacity that the
    daemon's ``status`` reports (``capacity.node_resources``, at most ``slots``), the daemon's socket
    in its environment (``$MESHD_MPS_SOCKET``, which its agent reads).  ``wait``: until the cluster
    has it (else the caller waits for all it added, ``cluster.wait_for_nodes``).  Returns the Ray
    node and its resources."""
    res = node_resources(status, node=name, slots=slots)
    return cluster.add_node(wait=wait, num_cpus=num_cpus, resources=res, env_vars={SOCKET_ENV: socket}), res


def shutdown_cluster(cluster: Cluster | None) -> None:
    """This process's driver disconnected, then ``cluster`` shut down, and its session's directory
    removed: Ray keeps a session's logs and sockets under its temporary dir after shutdown, for
    debugging; a cluster of ours alone goes with them."""
    session = None
    try:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            head = cluster.head_node
            session = head.get_session_dir_path() if head is not None else None
            cluster.shutdown()
    finally:
        if session is not None:
            _remove_session(session)


@dataclass(eq=False)  # one object per node: hashed by identity (the bench counts replicas per node)
class Node:
    """One node of the local fleet: its daemon (``proc``, ``socket``, ``state``) and its Ray node."""

    name: str
    socket: str
    state: str
    proc: subprocess.Popen[bytes]
    resources: dict[str, float]
    ray_node: Any = None

    @property
    def node_id(self) -> str:
        return str(self.ray_node.node_id)

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.socket, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The daemon stopped and reaped (SIGKILL past STOP_S)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)


class LocalFleet:
    """``LocalFleet(nodes=4, sim_gpus=3)``: start with :meth:`start`, end with :meth:`close` (always)."""

    def __init__(self, nodes: int = 4, sim_gpus: int = 3, isolation: str = "blink", deadlines: Deadlines = DEFAULT):
        self.count, self.sim_gpus, self.isolation, self.d = nodes, sim_gpus, isolation, deadlines
        self.dir = tempfile.mkdtemp(prefix="meshd-fleet.")
        self.nodes: list[Node] = []
        self.cluster: Cluster | None = None

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return str(self.cluster.address)

    @property
    def state_dir(self) -> str:
        """The controller's checkpoint directory (on the head: this machine)."""
        return os.path.join(self.dir, "fleet-state")

    def start(self) -> LocalFleet:
        for i in range(self.count):
            self.nodes.append(self._daemon(f"n{i}"))
        statuses = [self._ready(n) for n in self.nodes]
        # A CPU on the head: the controller and the bench's driver run there.
        self.cluster = start_head(self.state_dir, num_cpus=1)
        for n, status in zip(self.nodes, statuses, strict=True):
            n.ray_node, n.resources = join_node(self.cluster, n.name, n.socket, status, num_cpus=1)
        self.cluster.wait_for_nodes(START_S)
        return self

    def _env(self) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if k not in (SOCKET_ENV, "CUDA_MPS_PIPE_DIRECTORY")}
        e["PATH"] = os.pathsep.join([standin.BIN_DIR, os.path.dirname(sys.executable), e.get("PATH", "")])
        e[SIM_GPUS_ENV] = str(self.sim_gpus)
        e.setdefault("MESHD_MPS_LOG_LEVEL", "warning")
        return e

    def _daemon(self, name: str) -> Node:
        sock = os.path.join(self.dir, f"{name}.sock")
        state = os.path.join(self.dir, f"{name}-state")
        argv = [sys.executable, "-m", "meshd_mps", "serve", "--gpu", "sim", "--isolation", self.isolation,
                "--socket", sock, "--state-dir", state, "--log-format", "json"]
        with open(os.path.join(self.dir, f"{name}.log"), "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self._env())
        return Node(name, sock, state, proc, {})

    def _ready(self, n: Node) -> dict[str, Any]:
        end = time.monotonic() + START_S
        while True:
            if n.proc.poll() is not None:
                raise RuntimeError(f"node {n.name}: meshd-mps serve exited with {n.proc.returncode}: {self.log(n)}")
            try:
                return Client(n.socket, timeout=5).status()
            except ClientError:
                if time.monotonic() > end:
                    raise Timeout(f"node {n.name}: meshd-mps serve not answering on {n.socket} within {START_S:g}s") from None
                time.sleep(POLL_S)

    def log(self, n: Node) -> str:
        with open(os.path.join(self.dir, f"{n.name}.log"), errors="replace") as f:
            return f.read()[-2000:]

    def kill_node(self, n: Node) -> None:
        """The node dies: its raylet killed (not a graceful leave), and its daemon gone with its
        programs (stopped without live restore: nothing of it runs on)."""
        assert self.cluster is not None
        self.cluster.remove_node(n.ray_node, allow_graceful=False)
        n.stop()

    def close(self) -> None:
        try:
            shutdown_cluster(self.cluster)
        finally:
            for n in self.nodes:
                n.stop()
            shutil.rmtree(self.dir, ignore_errors=True)


def _remove_session(session: str) -> None:
    """A session dir, the ``session_latest`` link to it, and Ray's dir if nothing else is left in it."""
    shutil.rmtree(session, ignore_errors=True)
    root = os.path.dirname(session)
    latest = os.path.join(root, "session_latest")
    with contextlib.suppress(OSError):
        if os.path.realpath(latest) == os.path.realpath(session):
            os.unlink(latest)
    with contextlib.suppress(OSError):
        os.rmdir(root)  # only if empty: another cluster's sessions stay
