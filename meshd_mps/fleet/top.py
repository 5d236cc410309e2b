"""``meshd-mps fleet top``: the fleet, live: per program its replicas wanted, running and pending and
their calls across the fleet (per second, p50/p99, bytes), per replica its node, GPU, slot, state,
heartbeat age and calls, per node its slots, replicas and agent, and the fleet's latest events
(moves, node losses, failures).  Polled through the fleet's public API (``Fleet.status``) every
second; the replicas' call figures are their node daemons' (``ReplicaView.calls``), read from look
to look as ``meshd-mps top`` reads a node's (serving/figures.py), on the same screen
(serving/screen.py)."""

from __future__ import annotations

import time
from typing import Any

from meshd_mps.fleet.client import Fleet
from meshd_mps.fleet.spec import FleetStatus, ReplicaView
from meshd_mps.fleet.tables import node as node_name
from meshd_mps.serving.figures import Rates
from meshd_mps.serving.screen import Cell, Frame, Section
from meshd_mps.serving.tables import duration
from meshd_mps.serving.top import age, figure_cells

PROGRAM_HEAD = ["PROGRAM", "WANTED", "RUNNING", "PENDING", "CALLS/S", "P50", "P99", "IN/S", "OUT/S", "RESTARTS",
                "FAULTS"]
REPLICA_HEAD = ["PROGRAM", "REPLICA", "NODE", "GPU", "SLOT", "STATE", "BEAT-AGE", "CALLS/S", "P50", "P99", "IN/S",
                "OUT/S", "RESTARTS", "FAULTS", "REASON"]
NODE_HEAD = ["NODE", "ALIVE", "AGENT", "SLOTS", "REPLICAS", "FREE", "DAEMON-PID", "CALL-PORT", "REASON"]


def key(r: ReplicaView) -> str:
    """A replica's calls are its node daemon's program's: a replica that moved counts from 0 again."""
    return f"{r.program}[{r.index}]@{r.node}"


def _cell(v: Any) -> Cell:
    return Cell("-" if v is None else str(v), v)


class FleetTop:
    """The frames of the fleet's view (:meth:`frame` is pure: tested alone)."""

    def __init__(self, fleet: Fleet | None, namespace: str):
        self.fleet, self.ns = fleet, namespace
        self.rates = Rates()
        self.seen = -1.0  # the newest event already shown (its wall time); -1: none looked at yet

    async def look(self) -> Frame:
        assert self.fleet is not None
        return self.frame(await self.fleet.status())

    def frame(self, st: FleetStatus, at: float | None = None) -> Frame:
        reps = [r for p in st.programs for r in p.replicas]
        self.rates.add({key(r): r.calls for r in reps if r.calls and r.node}, at)
        alive = sum(n.alive for n in st.nodes)
        header = (f"meshd-mps fleet top  namespace {self.ns}, fleet {(st.fleet or {}).get('id', '-')}  {alive} of"
                  f" {len(st.nodes)} nodes alive, {len(st.programs)} programs, {sum(r.state == 'running' for r in reps)}"
                  f" of {len(reps)} replicas running, moves {st.moves}, node losses {st.node_losses}, last look"
                  f" {'-' if st.tick_age is None else duration(st.tick_age)} ago  {time.strftime('%H:%M:%S')}")
        new = sorted((e for e in st.events if e.at > self.seen), key=lambda e: e.at)
        if new:
            self.seen = new[-1].at
        events = [f"{time.strftime('%H:%M:%S', time.localtime(e.at))} {e.kind}: {e.message}" for e in new]
        return Frame(header, [self.programs(st), self.replicas(reps), self.nodes(st)], events)

    def programs(self, st: FleetStatus) -> Section:
        rows = []
        for p in st.programs:
            placed = [r for r in p.replicas if r.node]
            pending = sum(r.state == "pending" for r in p.replicas)
            restarts, faults = sum(r.restarts for r in placed), sum(r.faults for r in placed)
            rows.append([Cell(p.name, p.name), _cell(p.wanted), _cell(p.running), _cell(pending),
                         *figure_cells(self.rates.merged(key(r) for r in placed)), _cell(restarts), _cell(faults)])
        return Section("PROGRAMS", PROGRAM_HEAD, rows, right=frozenset(range(1, 11)), empty="(no programs declared)")

    def replicas(self, reps: list[ReplicaView]) -> Section:
        rows = []
        for r in sorted(reps, key=lambda r: (r.program, r.index)):
            rows.append([Cell(r.program, r.program), _cell(r.index), Cell(node_name(r), node_name(r)), _cell(r.gpu),
                         _cell(r.slot), _cell(r.state), age(r.heartbeat_age), *figure_cells(self.rates.of(key(r))),
                         _cell(r.restarts), _cell(r.faults), Cell(r.reason or "")])
        return Section("REPLICAS", REPLICA_HEAD, rows, right=frozenset(range(6, 14)), filtered=True)

    @staticmethod
    def nodes(st: FleetStatus) -> Section:
        rows = [[Cell(n.name, n.name), Cell("yes" if n.alive else "no"), Cell(n.agent), _cell(n.slots),
                 _cell(n.replicas), _cell(n.free), _cell(n.daemon_pid), _cell(n.call_port), Cell(n.reason or "")]
                for n in sorted(st.nodes, key=lambda n: (n.name, n.node))]
        return Section("NODES", NODE_HEAD, rows, right=frozenset({3, 4, 5}), empty="(no nodes)")
