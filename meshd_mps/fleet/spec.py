"""What the fleet is asked for and what it shows: a program's spec and source, and the views of its
replicas, nodes and events.  Plain data (picklable, no Ray), checked once here, so that the client,
the controller and the CLI share one definition of each word."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from meshd_mps.base import restart
from meshd_mps.base.errors import BadSpec
from meshd_mps.base.names import check_name
from meshd_mps.gpu.compiler import Manifest, image_hash
from meshd_mps.state.program_files import program_body

Strategy = Literal["SPREAD", "PACK", "STRICT_SPREAD"]
STRATEGIES: tuple[str, ...] = ("SPREAD", "PACK", "STRICT_SPREAD")
ReplicaState = Literal["pending", "placing", "starting", "running", "failed", "stopping"]

#: A replica's program on its node's daemon is ``<program>.fleet-<index>``: the suffix marks what
#: the fleet owns there (an agent unloads only those), the index tells replicas of one node apart;
#: the program's own name comes first, as the simulated GPU runs an example by its name's start.
SUFFIX = ".fleet-"
#: The longest fleet program name: the daemon's names stop at 64 characters, and the suffix and
#: index (at most 999 replicas) take 10 of them.
MAX_NAME = 54
MAX_REPLICAS = 999


def replica_name(program: str, index: int) -> str:
    """The name a replica's program has on its node's daemon."""
    return f"{program}{SUFFIX}{index}"


def parse_replica_name(name: str) -> tuple[str, int] | None:
    """(program, index) of a daemon program the fleet owns (``<program>.fleet-<1 to 3 digits>``);
    None for any other program.  (Not a regular expression: the controller reads one for each
    replica a node reports changed.)"""
    program, suffix, index = name.rpartition(SUFFIX)
    if not suffix or not program or not 1 <= len(index) <= 3 or not (index.isascii() and index.isdigit()):
        return None
    return program, int(index)


@dataclass(frozen=True)
class ProgramSource:
    """A program's image: its manifest (a JSON object) and its PTX text, as ``meshd-mps load``
    sends them.  :meth:`read` reads a program directory or files (CUDA C compiled here)."""

    manifest: dict[str, Any]
    ptx: str
    #: Its data file (docs/program-abi.md, "Data"), read by ``Fleet.deploy`` into Ray's object store.
    data: str | None = None

    @classmethod
    def read(cls, dir: str | None = None, *, manifest: str | None = None, ptx: str | None = None,
             cuda: str | None = None, arch: str | None = None, data: str | None = None) -> ProgramSource:
        """From files, exactly as ``meshd-mps load`` reads them (ProgramFilesError, a BadRequest,
        says what is wrong); CUDA C is compiled for ``arch`` (default compute_90); ``data``: its data
        file (default: the manifest's ``data``, beside it)."""
        body = program_body(dir, manifest, ptx, cuda, arch=arch)
        if data is None and isinstance(body["manifest"], dict) and body["manifest"].get("data"):
            data = os.path.join(os.path.dirname(manifest) if manifest else (dir or "."), body["manifest"]["data"])
        return cls(manifest=body["manifest"], ptx=body["ptx"], data=data)

    def check(self) -> Manifest:
        """The manifest parsed (ManifestError, as the node API says it)."""
        if not isinstance(self.ptx, str):
            raise BadSpec("source: the PTX must be text", field="source")
        return Manifest.parse(self.manifest)

    @property
    def hash(self) -> str:
        """The image hash (16 hex digits), as every node's daemon computes it."""
        param = self.check().param
        return f"{image_hash(self.ptx.encode(), param):016x}"


@dataclass(frozen=True)
class ProgramSpec:
    """A program declared to the fleet: ``replicas`` copies placed by Ray with ``strategy``, each
    needing one slot (of a GPU of model ``gpu``, on node ``node``, where given).  ``unique``: no
    replica ever runs on two nodes at once, fenced by a lease (docs/fleet.md, "Nothing runs
    twice"); without it a replica may briefly run on two while it moves."""

    name: str
    source: ProgramSource
    replicas: int = 1
    restart: str = restart.DEFAULT.value
    strategy: Strategy = "SPREAD"
    gpu: str | None = None
    node: str | None = None
    hash: str | None = None
    unique: bool = False

    def check(self) -> None:
        """BadSpec (or the node API's own BadName, ManifestError, BadRestartPolicy) for a spec
        that cannot be deployed; nothing else is asked."""
        if not isinstance(self.name, str):
            raise BadSpec("name: a program name (text) expected", field="name")
        check_name(self.name, "name")
        if len(self.name) > MAX_NAME:
            raise BadSpec(f"name {self.name!r}: at most {MAX_NAME} characters in a fleet (its replicas are named"
                          f" {replica_name(self.name, 0)!r} on their nodes)", field="name")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or not 1 <= self.replicas <= MAX_REPLICAS:
            raise BadSpec(f"replicas {self.replicas!r}: a whole number from 1 to {MAX_REPLICAS}", field="replicas")
        if not isinstance(self.unique, bool):
            raise BadSpec(f"unique {self.unique!r}: true or false", field="unique")
        if self.strategy not in STRATEGIES:
            raise BadSpec(f"strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}", field="strategy")
        restart.Policy.parse(self.restart)
        for f in ("gpu", "node"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not resource_key(v)):
                raise BadSpec(f"{f} {v!r}: a name with a letter or digit in it", field=f)
        if not isinstance(self.source, ProgramSource):
            raise BadSpec("source: a ProgramSource (ProgramSource.read(DIR))", field="source")
        got = self.source.hash
        if self.hash is not None and self.hash.lower() != got:
            raise BadSpec(f"hash {self.hash}: the image's hash is {got}", field="hash")


def resource_key(name: str) -> str:
    """A GPU model's or a node's name as it appears in a Ray resource key (``meshd_gpu_<key>``,
    ``meshd_node_<key>``), the same on the node that advertises it and in the bundle that asks for
    it: lower case, the vendor and any parenthesis dropped, every other run of non-alphanumerics one
    ``_`` ("NVIDIA H200" -> ``h200``; the simulation's "simulated NVIDIA H200 (meshd-mps --gpu sim)"
    -> ``simulated_h200``)."""
    s = re.sub(r"\(.*?\)", " ", name).lower().replace("nvidia", " ")
    return re.sub(r"[^a-z0-9]+", "_", s).strip("_")


# ---- the views ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the controller sees it: where Ray placed its bundle (``node``: the Ray node
    id, ``node_name``), and what that node's daemon says of it (``gpu``, ``slot``, ``pid``, ``hash``,
    ``heartbeat_age``, ``calls``, ``restarts``, ``faults``); ``reason`` says why it is pending or failed.
    ``generation``: the program's generation whose image it runs (or is starting)."""

    program: str
    index: int
    state: ReplicaState
    reason: str | None = None
    node: str | None = None
    node_name: str | None = None
    gpu: int | None = None
    slot: int | None = None
    pid: int | None = None
    hash: str | None = None
    heartbeat_age: float | None = None
    heartbeat: int | None = None
    generation: int = 0
    #: Its program's figures on its node's daemon: calls (callstats.CallStats.as_dict: outcomes,
    #: latency counts, bytes), relaunches since its last load or upgrade, launches failed.
    calls: dict[str, Any] | None = None
    restarts: int = 0
    faults: int = 0

    @property
    def name(self) -> str:
        """Its program's name on its node's daemon."""
        return replica_name(self.program, self.index)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FleetProgram:
    """A declared program and its replicas; ``hash`` is the image its replicas are brought to (the
    one declared, or after a replica refused it, the one before: ``upgrade_error`` says why),
    ``generation`` that image's, ``upgrading`` whether replicas still run another; ``unique``: at
    most one copy of each replica runs at any time."""

    name: str
    replicas: tuple[ReplicaView, ...]
    wanted: int
    hash: str
    generation: int
    restart: str
    strategy: str
    gpu: str | None = None
    node: str | None = None
    upgrading: bool = False
    upgrade_error: str | None = None
    unique: bool = False

    @property
    def running(self) -> int:
        return sum(r.state == "running" and r.hash == self.hash for r in self.replicas)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["running"] = self.running
        return d


@dataclass(frozen=True)
class NodeView:
    """A node of the fleet: its Ray node id and name, whether it is alive and its agent answers,
    its capacity (``slots``) and the replicas placed there, its daemon's socket and pid, its agent's
    call port;
    ``claimed_by``: the other fleet (its id) whose claim on the daemon keeps this one off it
    (``reason`` says which, and why)."""

    node: str
    name: str
    alive: bool
    agent: str  # "up", "not answering", "starting"
    slots: int
    replicas: int
    gpus: tuple[str, ...] = ()
    socket: str | None = None
    daemon_pid: int | None = None
    agent_pid: int | None = None
    reason: str | None = None
    claimed_by: str | None = None
    call_port: str | None = None  # host:port where calls reach this node's daemon with no Ray hop (fleet/callport.py)
    call_port_error: str | None = None  # why it has none (its calls go through Ray)

    @property
    def free(self) -> int:
        """Slots this fleet may still fill here: none on a daemon another fleet holds, or on a
        node gone."""
        return 0 if self.claimed_by is not None or not self.alive else max(0, self.slots - self.replicas)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FleetEvent:
    """Something that happened to a replica, a program or a node (a move, a failure, an upgrade
    step), with its wall time (``at``, seconds since the epoch)."""

    at: float
    kind: str
    message: str
    program: str | None = None
    replica: int | None = None
    node: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FleetStatus:
    """The whole fleet: ``fleet`` its id (``id``, ``namespace``, ``cluster``: what its agents claim
    node daemons by), ``moves`` and ``node_losses`` since its controller started, ``tick_age`` the
    seconds since the controller's last look (None before the first)."""

    programs: tuple[FleetProgram, ...]
    nodes: tuple[NodeView, ...]
    events: tuple[FleetEvent, ...] = field(default=())
    fleet: dict[str, str] | None = None
    moves: int = 0
    node_losses: int = 0
    tick_age: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"programs": [p.to_json() for p in self.programs],
                "nodes": [{**n.to_json(), "free": n.free} for n in self.nodes],
                "events": [e.to_json() for e in self.events], "fleet": self.fleet, "moves": self.moves,
                "node_losses": self.node_losses, "tick_age": self.tick_age}


Via = Literal["socket", "call-port", "ray"]


@dataclass(frozen=True)
class FleetReply:
    """A call's response, the replica that gave it, and how the call reached that replica's node:
    ``socket`` (the caller's own node: its daemon's socket), ``call-port`` (another node's agent's
    call port, fleet/callport.py) or ``ray`` (an actor call of that node's agent)."""

    data: bytes
    replica: ReplicaView
    via: Via = "ray"


class CallPort(NamedTuple):
    """A node agent's call port: where a call reaches that node's daemon with no Ray hop, and the
    token it asks for (never shown: ``NodeView.call_port`` is the address alone)."""

    host: str
    port: int
    token: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Routes(NamedTuple):
    """Where a program's calls may go now (the controller's ``routes``): its running replicas, and
    by node, the daemon's socket, the agent (a Ray actor handle) and the call port."""

    replicas: list[ReplicaView]
    sockets: dict[str, str]
    agents: dict[str, Any]
    ports: dict[str, CallPort]
