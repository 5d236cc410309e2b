"""What the controller and a node's agent say to each other, typed (plain frozen dataclasses that
Ray pickles): the ``Share`` the controller hands an agent (the node's whole share of the fleet), and
the ``AgentReport`` an agent answers with (what its node's daemon runs of the fleet, and the
agent's own state).

A report has a ``version``, which its agent moves on whenever anything in it changes except the
heartbeats' counts and ages: the controller's watch call (``NodeAgent.watch``) answers when the
version passes the one the controller holds, so that nothing changed is nothing sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.spec import CallPort


@dataclass(frozen=True)
class Order:
    """One replica of a node's share: its name on the daemon, the image hash it is to run, its
    restart policy, its GPU model's resource key (None: any), and whether it is ``unique`` (loaded
    with the share's lease, renewed while the share grants it)."""

    name: str
    hash: str
    restart: str
    gpu: str | None = None
    unique: bool = False


@dataclass(frozen=True)
class Share:
    """A node's whole share: ``version`` (the controller's ``epoch``, made at its start, and a count:
    an agent takes a share of another epoch, or a later one), the ``orders``, the replicas to
    ``keep`` where they run (Ray has placed them nowhere yet), the images the agent lacks (by
    hash: ``{"manifest", "ptx"}``), the fleet's id, and the lease: the unique replicas this node
    may run (``leased``) until ``lease_until`` (wall-clock seconds), renewed by later shares."""

    version: tuple[str, int]
    orders: tuple[Order, ...] = ()
    keep: frozenset[str] = frozenset()
    images: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    fleet: FleetId | None = None
    leased: frozenset[str] = frozenset()
    lease_until: float | None = None


@dataclass(frozen=True)
class DaemonProgram:
    """A fleet replica as its node's daemon lists it (``GET /v1/programs``)."""

    name: str
    state: str
    hash: str | None = None
    pid: int | None = None
    slot: int | None = None
    device: int | None = None
    error: str | None = None
    beat_age: float | None = None
    heartbeat: int | None = None
    lease_until: float | None = None
    calls: dict[str, Any] | None = None  # its calls' figures on the daemon (callstats.CallStats.as_dict)
    restarts: int = 0
    faults: int = 0

    @classmethod
    def from_row(cls, d: Mapping[str, Any]) -> DaemonProgram:
        return cls(name=str(d.get("name")), state=str(d.get("state")), hash=d.get("hash"), pid=d.get("pid"),
                   slot=d.get("slot"), device=d.get("device"), error=d.get("error"), beat_age=d.get("beat_age_s"),
                   heartbeat=d.get("heartbeat"), lease_until=d.get("lease_until"), calls=d.get("calls"),
                   restarts=int(d.get("restarts") or 0), faults=int(d.get("faults") or 0))

    def key(self) -> tuple[Any, ...]:
        """What a change of is news at once (the heartbeat and the calls' figures move all the time:
        they are reported at most every ``Deadlines.fleet_report``)."""
        return (self.name, self.state, self.hash, self.pid, self.slot, self.device, self.error, self.lease_until,
                self.restarts, self.faults)

    def figures(self) -> tuple[Any, ...]:
        """What moves all the time: its heartbeat and its calls."""
        return (self.heartbeat, (self.calls or {}).get("total"))


@dataclass(frozen=True)
class ForeignClaim:
    """Another fleet's claim on the node's daemon (claim.py): whose (None: a claim file that cannot
    be used), and why this fleet touches nothing there."""

    fleet: FleetId | None
    why: str


@dataclass(frozen=True)
class AgentReport:
    """An agent's report.  ``programs``: the daemon's fleet replicas, by name (None: the daemon did
    not answer, ``error`` says why); ``share``: the version of the share the agent holds (None: none
    yet); ``have``: the images it holds; ``errors``: per replica, the hash and why its last load
    or upgrade was refused; ``busy``: the replicas it is loading, upgrading or unloading now;
    ``stop_within``: how long past its lease a program of this daemon may still run (the daemon's
    status, serving/leases.py); ``changed``: the replicas whose rows changed since the report the
    caller held (None: read it whole)."""

    node: str
    version: int
    socket: str
    pid: int
    programs: Mapping[str, DaemonProgram] | None = None
    error: str | None = None
    daemon_pid: int | None = None
    share: tuple[str, int] | None = None
    have: frozenset[str] = frozenset()
    errors: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    busy: Mapping[str, str] = field(default_factory=dict)
    claim: ForeignClaim | None = None
    call_port: CallPort | None = None
    call_port_error: str | None = None
    stop_within: float | None = None
    changed: frozenset[str] | None = None

    def program(self, name: str) -> DaemonProgram | None:
        """The daemon's row of replica ``name``."""
        return None if self.programs is None else self.programs.get(name)

    def runs(self) -> frozenset[str]:
        """The replicas the daemon has now (whatever their state), and those the agent is loading."""
        got = self.__dict__.get("_runs")
        if got is None:
            got = frozenset(self.programs or ()) | {n for n, w in self.busy.items() if w != "unloading"}
            object.__setattr__(self, "_runs", got)
        return got


def changed_since(history: Iterable[tuple[int, frozenset[str] | None]], version: int, since: int) -> frozenset[str] | None:
    """The replicas changed after report ``since``, from an agent's ``history`` of (version, the
    replicas that version changed, None: more than replicas) whose last is ``version``; None where
    it does not reach back that far (the caller then reads the report whole)."""
    entries = list(history)
    if since < 0 or since > version or not entries or entries[0][0] > since + 1:
        return None
    out: set[str] = set()
    for v, names in entries:
        if v > since:
            if names is None:
                return None
            out |= names
    return frozenset(out)
