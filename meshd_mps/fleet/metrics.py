"""The fleet's Prometheus metrics, from one ``FleetStatus``: what ``meshd-mps fleet metrics`` prints.

The node daemon's own metrics (serving/metrics.py) are its programs; these are the fleet's: per
program the replicas wanted and in each state, per node its slots and the replicas placed there,
the moves and node losses the controller counted, and the age of its last look.  Read from the
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

from meshd_mps.fleet.spec import FleetStatus, NodeView
from meshd_mps.serving.metrics import CONTENT_TYPE, Family, Labels, Live, new_registry

__all__ = ["CONTENT_TYPE", "STATES", "exposition", "families"]

#: A replica's states (spec.ReplicaState): each listed for every program, 0 when none is in it.
STATES = ("pending", "placing", "starting", "running", "failed", "stopping")


def _node(n: NodeView) -> Labels:
    return {"node": n.name}


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
    ]


def exposition(st: FleetStatus) -> bytes:
    """The Prometheus text format of ``st`` (CONTENT_TYPE)."""
    from prometheus_client import generate_latest

    registry = new_registry()
    registry.register(Live(families(st)))
    return generate_latest(registry)
