"""A replica's view (``ReplicaView``) as plan.py makes it, from where Ray placed it and what its
node's agent reports; the events between two views; a program's view before the loop has looked
at it.  Pure functions of plain data."""

from __future__ import annotations

from dataclasses import dataclass

from meshd_mps.fleet.desired import Spec
from meshd_mps.fleet.observed import Observed
from meshd_mps.fleet.rollout import Rollout
from meshd_mps.fleet.spec import FleetProgram, ReplicaState, ReplicaView, replica_name

#: Daemon states that count as running (a stalled program runs: its heartbeat is late).
RUNS = ("running", "stalled")
STARTS = ("restarting",)


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    replica: int | None = None
    node: str | None = None


def running(obs: Observed, nid: str | None, name: str, want: str, aside: bool) -> str | None:
    """The hash replica ``name`` runs on ``nid`` if it runs there what it is to run and is not set
    aside (drained, or not started there yet), else None."""
    rep = obs.report(nid)
    if rep is None or aside or rep.claim is not None or nid is None:
        return None
    p = rep.program(name)
    if p is None or p.hash != want or p.state not in RUNS or rep.busy.get(name) == "unloading":
        return None
    return p.hash


def replica(spec: Spec, r: Rollout, obs: Observed, i: int, nid: str) -> ReplicaView:
    """Replica ``i``, placed on ``nid`` and let run there: what its node's daemon says of it."""
    name = replica_name(spec.name, i)
    node = obs.ray.nodes[nid]
    want = r.assigned[i]
    gen = spec.generation_of(want)
    rep = obs.report(nid)
    if rep is None:
        return ReplicaView(spec.name, i, "placing", "waiting for the node's agent", nid, node.name, generation=gen)
    if rep.claim is not None:  # another fleet's daemon: its programs are not this fleet's replicas
        return ReplicaView(spec.name, i, "pending", rep.claim.why, nid, node.name, generation=gen)
    if rep.programs is None:
        return ReplicaView(spec.name, i, "placing", f"the node's daemon does not answer: {rep.error}", nid, node.name,
                           generation=gen)
    p = rep.program(name)
    err = rep.errors.get(name)
    if p is None:
        if err is not None and err[0] == want:
            return ReplicaView(spec.name, i, "failed", err[1], nid, node.name, generation=gen)
        return ReplicaView(spec.name, i, "starting", "loading on its node", nid, node.name, generation=gen)

    def seen(state: ReplicaState, why: str | None) -> ReplicaView:
        assert p is not None
        return ReplicaView(spec.name, i, state, why, nid, node.name, p.device, p.slot, p.pid, p.hash, p.beat_age,
                           p.heartbeat, spec.generation_of(p.hash), p.calls, p.restarts, p.faults)

    if rep.busy.get(name) == "unloading":
        # An earlier share's (the program removed, then declared again): gone in a moment, then loaded
        # again; no call goes to it meanwhile.
        return seen("stopping", "being unloaded on its node (an earlier share's)")
    if i == r.draining:
        return seen("stopping", f"drained for the upgrade to {r.target}")
    if p.hash != want:
        return seen("starting", f"upgrading to image {want}")
    if p.state in RUNS:
        return seen("running", "stalled: its heartbeat is late" if p.state == "stalled" else None)
    if p.state in STARTS:
        return seen("starting", f"{p.state} on its node")
    return seen("failed", p.error or f"{p.state} on its node")


def changes(spec: Spec, old: ReplicaView | None, new: ReplicaView) -> list[Event]:
    """The replica moved, or its state changed, since the view before."""
    out = []
    if old is not None and old.node and new.node and old.node != new.node:
        out.append(Event("moved", f"{spec.name}: replica {new.index} moved from node {old.node_name} to"
                         f" {new.node_name}", new.index, new.node))
    if old is None or old.state != new.state:
        why = f": {new.reason}" if new.reason else ""
        out.append(Event(new.state, f"{spec.name}: replica {new.index} {new.state}{why}", new.index, new.node))
    return out


def program(spec: Spec, r: Rollout, replicas: tuple[ReplicaView, ...]) -> FleetProgram:
    return FleetProgram(name=spec.name, replicas=replicas, wanted=spec.replicas, hash=r.target,
                        generation=spec.generation_of(r.target), restart=spec.restart, strategy=spec.strategy,
                        gpu=spec.gpu, node=spec.node, upgrading=r.upgrading, upgrade_error=r.error, unique=spec.unique)


def view_of(spec: Spec, rollout: Rollout | None = None) -> FleetProgram:
    """A program's view before the loop has looked at it: every replica pending."""
    r = rollout or Rollout.start(spec)
    return program(spec, r, tuple(ReplicaView(spec.name, i, "pending", "its placement group is being created",
                                              generation=spec.generation_of(r.assigned[i])) for i in range(spec.replicas)))
