"""The fleet's Prometheus metrics, from one ``FleetStatus``: what ``meshd-mps fleet metrics`` prints.

The node daemon's own metrics (serving/metrics.py) are its programs; these are the fleet's: per
program the replicas wanted and in each state, per node its slots and the replicas placed there,
the moves and node losses the controller counted, the age of its last look, and per replica its
state, heartbeat age, relaunches, faults and calls (as its node's daemon counts them).  Read from the
same views ``fleet status`` shows, never counted twice, with the daemon's families
(``serving.metrics.Family``) and a registry of their own.  Names: ``meshd_mps_fleet_*``, in the
API's words (``replicas``, ``slots``, ``node``, ``program``).

Why not Ray's own metrics (``ray.util.metrics``, exported by each node's metrics agent): the
``fleet`` extra installs Ray without its ``default`` extra, and there each node's dashboard agent
runs ``--minimal``, with no metrics agent and no export port (Ray writes -1 for both): the samples
would go nowhere.  Exporting them needs ``ray[default]`` (grpcio, OpenCensus, OpenTelemetry,
aiohttp-cors and more) on every node.  The exposition here needs nothing but the controller, and a
scrape gets it through node_exporter's textfile directory or any exporter that runs a command.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshd_mps.base.callstats import BUCKETS, OUTCOMES
from meshd_mps.fleet.spec import FleetStatus, NodeView, ReplicaView
from meshd_mps.serving.metrics import CONTENT_TYPE, Buckets, Family, Labels, Live, new_registry

__all__ = ["CONTENT_TYPE", "STATES", "exposition", "families"]

#: A replica's states (spec.ReplicaState): each listed for every program, 0 when none is in it.
STATES = ("pending", "placing", "starting", "running", "failed", "stopping")


def _node(n: NodeView) -> Labels:
    return {"node": n.name}


def _replica(r: ReplicaView) -> dict[str, str]:
    return {"program": r.program, "replica": str(r.index), "node": r.node_name or r.node or ""}


def replica_families(st: FleetStatus) -> list[Family]:
    """Per replica: its state, heartbeat age, relaunches and faults, and its calls (outcomes,
    latency, bytes) as its node's daemon counts them.  A replica that moved to another node is
    another series (its ``node``), whose counters start again, as a restarted target's do."""
    reps = [r for p in st.programs for r in p.replicas]
    placed = [r for r in reps if r.node is not None]
    counted = [r for r in placed if r.calls]
    keys = ("program", "replica", "node")

    def calls(r: ReplicaView) -> dict:
        return r.calls or {}

    def latency() -> list[tuple[Labels, Buckets]]:
        out: list[tuple[Labels, Buckets]] = []
        for r in counted:
            counts = list(calls(r).get("counts") or [])
            if len(counts) == len(BUCKETS) + 1:  # a daemon of another version's buckets: left out
                out.append((_replica(r), (counts, float(calls(r).get("seconds", 0.0)))))
        return out

    return [
        Family("meshd_mps_fleet_replica_state", "gauge", "Each replica's state (always 1, in the label state).",
               lambda: [({**_replica(r), "state": r.state}, 1.0) for r in reps], (*keys, "state")),
        Family("meshd_mps_fleet_replica_beat_age_seconds", "gauge",
               "Seconds since each placed replica's heartbeat was last seen advancing on its node.",
               lambda: [(_replica(r), float(r.heartbeat_age)) for r in placed if r.heartbeat_age is not None], keys),
        Family("meshd_mps_fleet_replica_restarts", "gauge", "Each placed replica's relaunches since its last load or"
               " upgrade on its node.", lambda: [(_replica(r), float(r.restarts)) for r in placed], keys),
        Family("meshd_mps_fleet_replica_faults_total", "counter", "Each placed replica's launches that failed on its"
               " node.", lambda: [(_replica(r), float(r.faults)) for r in placed], keys),
        Family("meshd_mps_fleet_replica_calls_total", "counter", "Calls through each replica's ring on its node, by"
               " outcome.", lambda: [({**_replica(r), "outcome": o}, float((calls(r).get("outcomes") or {}).get(o, 0)))
                                    for r in counted for o in OUTCOMES], (*keys, "outcome")),
        Family("meshd_mps_fleet_replica_call_seconds", "histogram", "Each answered call's time on the replica's node,"
               " from the call to its response.", latency, keys),
        Family("meshd_mps_fleet_replica_bytes_in_total", "counter", "Request bytes sent into each replica's ring.",
               lambda: [(_replica(r), float(calls(r).get("bytes_in", 0))) for r in counted], keys),
        Family("meshd_mps_fleet_replica_bytes_out_total", "counter", "Response bytes read from each replica's ring.",
               lambda: [(_replica(r), float(calls(r).get("bytes_out", 0))) for r in counted], keys),
    ]


def families(st: FleetStatus) -> list[Family]:
    def per_program_state() -> Iterable[tuple[Labels, float]]:
        for p in st.programs:
            for s in STATES:
                yield {"program": p.name, "state": s}, float(sum(r.state == s for r in p.replicas))

    def per_node(read: str) -> Iterable[tuple[Labels, float]]:
        return [(_node(n), float(getattr(n, read))) for n in st.nodes]

    fleet = st.fleet or {}
    return [
        Family("meshd_mps_fleet_info", "gauge", "This fleet: its id, Ray namespace and cluster (always 1).",
               lambda: [({"fleet": fleet.get("id", ""), "namespace": fleet.get("namespace", ""),
                          "cluster": fleet.get("cluster", "")}, 1)], ("fleet", "namespace", "cluster")),
        Family("meshd_mps_fleet_programs", "gauge", "Programs declared.", lambda: len(st.programs)),
        Family("meshd_mps_fleet_program_replicas_wanted", "gauge", "Replicas each program declares.",
               lambda: [({"program": p.name}, float(p.wanted)) for p in st.programs], ("program",)),
        Family("meshd_mps_fleet_program_replicas", "gauge", "Each program's replicas, by state (pending: no node"
               " yet, or a node it cannot run on; running: its image declared runs).",
               per_program_state, ("program", "state")),
        Family("meshd_mps_fleet_program_replicas_running", "gauge",
               "Each program's replicas that run its declared image (what fleet.wait counts).",
               lambda: [({"program": p.name}, float(p.running)) for p in st.programs], ("program",)),
        Family("meshd_mps_fleet_nodes", "gauge", "Nodes of the fleet, alive or not yet forgotten.", lambda: len(st.nodes)),
        Family("meshd_mps_fleet_node_up", "gauge", "1 when the node is alive and its agent answers.",
               lambda: [(_node(n), float(n.alive and n.agent == "up")) for n in st.nodes], ("node",)),
        Family("meshd_mps_fleet_node_claimed_elsewhere", "gauge",
               "1 when another fleet holds the node's daemon (this fleet touches nothing there).",
               lambda: [(_node(n), float(n.claimed_by is not None)) for n in st.nodes], ("node",)),
        Family("meshd_mps_fleet_node_slots", "gauge", "Each node's capacity: its meshd_slot resource.",
               lambda: per_node("slots"), ("node",)),
        Family("meshd_mps_fleet_node_replicas", "gauge", "Replicas Ray placed on each node: its slots used.",
               lambda: per_node("replicas"), ("node",)),
        Family("meshd_mps_fleet_node_slots_free", "gauge",
               "Slots this fleet may still fill on each node (0 on a node another fleet holds, or gone).",
               lambda: per_node("free"), ("node",)),
        Family("meshd_mps_fleet_moves_total", "counter",
               "Replicas that moved to another node (a node lost), since the controller started.", lambda: st.moves),
        Family("meshd_mps_fleet_node_losses_total", "counter",
               "Fleet nodes that left the cluster, since the controller started.", lambda: st.node_losses),
        Family("meshd_mps_fleet_tick_age_seconds", "gauge",
               "Seconds since the controller's last look at the cluster (no sample before the first).",
               lambda: st.tick_age),
        *replica_families(st),
    ]


def exposition(st: FleetStatus) -> bytes:
    """The Prometheus text format of ``st`` (CONTENT_TYPE)."""
    from prometheus_client import generate_latest

    registry = new_registry()
    registry.register(Live(families(st)))
    return generate_latest(registry)
