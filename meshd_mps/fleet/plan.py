"""``plan``: what the controller does about one declared program, given what it observed.  A pure
function: no I/O, no clock of its own, its inputs left as they are; tested as a function over the
situations of docs/fleet.md's failure table (tests/test_fleet_plan.py).

From the spec (what the API declared), the rollout (the loop's progress so far) and one look
(observed.py) it makes: the program's view (``FleetProgram``: each replica's state and why), the
next rollout, each node's part of the share (the replicas it is to run, those it keeps where they
run, the unique ones it holds the lease of), the placement groups to make or give up, the events,
and when to look again.  Ray places; the plan only reads where Ray put each replica's bundle, and
never picks a node.

A ``unique`` replica (docs/fleet.md, "Nothing runs twice") is ordered on the node Ray placed it on
only once its copy anywhere else is known stopped (that node's fresh report lacks it, and the share
that node holds no longer names it) or the lease that node was granted has run out, with the time
its daemon may take to stop it after (``stop_within``) and the hosts' clock skew; until then it is
``pending`` with the reason.  A replica that may run twice (the default) is ordered where Ray
placed it at once, and the node it leaves unloads it when its share no longer names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd_mps.fleet.capacity import why_pending
from meshd_mps.fleet.desired import Spec
from meshd_mps.fleet.messages import Order
from meshd_mps.fleet.observed import Observed
from meshd_mps.fleet.rollout import UNKNOWN, Rollout
from meshd_mps.fleet.spec import FleetProgram, ReplicaState, ReplicaView, replica_name, resource_key

#: Daemon states that count as running (a stalled program runs: its heartbeat is late).
RUNS = ("running", "stalled")
STARTS = ("restarting",)


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    replica: int | None = None
    node: str | None = None


@dataclass
class ProgramPlan:
    """What ``plan`` makes of one program (see the module's doc); ``due``: look again by then at
    the latest (monotonic; a drain, a lease, a pin's deadline); ``waiting``: a replica waits on Ray
    or on an agent no watch tells of (looked at every ``fleet_busy_tick``); ``touches``: the nodes
    whose news changes this plan; ``kept``: the rollout's part the checkpoint keeps changed."""

    view: FleetProgram
    rollout: Rollout
    orders: dict[str, list[Order]] = field(default_factory=dict)
    keep: dict[str, list[str]] = field(default_factory=dict)
    leased: dict[str, list[str]] = field(default_factory=dict)
    create: list[tuple[str, list[dict[str, float]], str]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    due: float | None = None
    waiting: bool = False
    touches: frozenset[str] = frozenset()
    kept: bool = False


def plan(spec: Spec, rollout: Rollout, obs: Observed, before: FleetProgram | None = None) -> ProgramPlan:
    d = obs.deadlines
    r = rollout.copy()
    r.follow(spec)
    out = ProgramPlan(view=before or _empty(spec), rollout=r)
    placed = _placed(spec, r, obs, out)
    names = [replica_name(spec.name, i) for i in range(spec.replicas)]
    ok = [_authorized(spec, r, obs, out, i, names[i], placed[i]) for i in range(spec.replicas)]

    # The rollout: a refusal of the declared image rolls back; where each runs; one upgrade step.
    for i, nid in enumerate(placed):
        rep = obs.report(nid)
        err = rep.errors.get(names[i]) if rep is not None and ok[i] is None else None
        if err is not None and err[0] == r.target == spec.image.hash and spec.previous is not None \
                and err[0] != spec.previous.hash:
            r.roll_back(spec, err[1])
            out.events.append(Event("upgrade-failed", f"{spec.name}: replica {i} refused image {err[0]}: {err[1]};"
                                    f" rolling back to {r.target}", i, nid))
            break
    pre = [_running(obs, placed[i], names[i], r.assigned[i], i == r.draining or ok[i] is not None)
           for i in range(spec.replicas)]
    for i, (nid, runs) in enumerate(zip(placed, pre, strict=True)):
        here = obs.ray.nodes[nid].named if nid is not None else None
        if runs and here is not None:
            r.where[i] = here
    was = r.draining
    r.step([h is not None for h in pre], pre, drain=d.fleet_tick * 3, now=obs.now)
    if r.draining is not None and r.draining != was:
        out.events.append(Event("draining", f"{spec.name}: replica {r.draining} drained for the upgrade to {r.target}",
                                r.draining))
    if r.draining is not None:
        out.due = _first(out.due, r.drain_since + d.fleet_tick * 3)

    # The views, and each node's share of the program.
    why: str | None = None
    reps = []
    for i, nid in enumerate(placed):
        if nid is None:
            if why is None:
                why = _why_pending(spec, placed, obs)
            reps.append(ReplicaView(spec.name, i, "pending", why, generation=spec.generation_of(r.assigned[i])))
            out.waiting = True
            for h in _kept_on(spec, r, obs, i, names[i]):
                out.keep.setdefault(h, []).append(names[i])
        elif ok[i] is not None:
            node = obs.ray.nodes[nid]
            reps.append(ReplicaView(spec.name, i, "pending", ok[i], nid, node.name,
                                    generation=spec.generation_of(r.assigned[i])))
        else:
            v = _replica(spec, r, obs, i, nid)
            reps.append(v)
            out.waiting |= v.state == "placing"
            gpu = None if spec.gpu is None else resource_key(spec.gpu)
            out.orders.setdefault(nid, []).append(Order(names[i], r.assigned[i], spec.restart, gpu, spec.unique))
        owner = r.owner[i]
        if spec.unique and owner not in (None, UNKNOWN) and owner in obs.ray.nodes and nid in (None, owner):
            out.leased.setdefault(owner, []).append(names[i])  # not once placed elsewhere: its lease there runs out
    out.view = FleetProgram(name=spec.name, replicas=tuple(reps), wanted=spec.replicas, hash=r.target,
                            generation=spec.generation_of(r.target), restart=spec.restart, strategy=spec.strategy,
                            gpu=spec.gpu, node=spec.node, upgrading=r.upgrading, upgrade_error=r.error,
                            unique=spec.unique)
    out.events += _changes(spec, before, out.view)
    out.touches = frozenset(n for n in (*placed, *r.owner) if n is not None and n != UNKNOWN) \
        | frozenset(h for nm in names for h in obs.holders.get(nm, ()))
    out.kept = r.kept() != rollout.kept()
    if out.kept is False and r == rollout:
        out.rollout = rollout  # unchanged: the same object (the loop compares identities)
    return out


# ---- where Ray placed each replica, and its pins ----------------------------------------------------


def _placed(spec: Spec, r: Rollout, obs: Observed, out: ProgramPlan) -> list[str | None]:
    """Each replica's node (None: placed nowhere, or on a node gone); the placement groups to make
    (pinned where their replicas last ran: after the head's restart they must land there), and
    those to give up (pinned to a node that did not rejoin within ``fleet_rejoin``)."""
    d = obs.deadlines
    placed: list[str | None] = [None] * spec.replicas
    for pg, idxs in spec.units():
        pl = obs.ray.placements.get(pg)
        if pl is None:
            for i in idxs:
                r.pins[i] = r.where[i] if spec.node is None else None
            out.create.append((pg, [spec.bundle(r.pins[i]) for i in idxs], spec.strategy))
            continue
        for b, i in enumerate(idxs):
            nid = pl.nodes[b] if b < len(pl.nodes) else None
            placed[i] = nid if nid in obs.ray.nodes else None
    names = {n.named for n in obs.ray.nodes.values()}
    lost = [i for i in range(spec.replicas) if r.pins[i] is not None and placed[i] is None and r.pins[i] not in names]
    if lost:
        rejoin = obs.started + d.fleet_rejoin
        if obs.now < rejoin:
            out.due = _first(out.due, rejoin)
        else:
            for i in lost:
                out.events.append(Event("unpinned", f"{spec.name}: replica {i}'s node {r.pins[i]} did not rejoin;"
                                        " Ray places it anew", i))
                r.where[i] = r.pins[i] = None
            out.remove += sorted({spec.unit(i)[0] for i in lost})
    return placed


def _why_pending(spec: Spec, placed: list[str | None], obs: Observed) -> str:
    if not any(spec.unit(i)[0] in obs.ray.placements for i in range(spec.replicas)):
        return "its placement group is being created"
    count = sum(1 for nid in placed if nid is None)
    nodes = [dict(n.resources) for n in obs.ray.nodes.values()]
    return why_pending(spec.bundle(), nodes, dict(obs.ray.available), count, spec.strategy)


# ---- unique replicas: one copy at most -------------------------------------------------------------


def _authorized(spec: Spec, r: Rollout, obs: Observed, out: ProgramPlan, i: int, name: str,
                nid: str | None) -> str | None:
    """None if replica ``i`` may run on ``nid`` (its owner then, for a unique one), else why not
    yet.  A replica that may run twice always may; a unique one once no copy may run elsewhere."""
    if not spec.unique or nid is None:
        return None
    owner = r.owner[i]
    others = sorted(obs.holders.get(name, frozenset()) - {nid})
    if owner == nid:
        return None
    if others:
        where = obs.ray.nodes[others[0]].name if others[0] in obs.ray.nodes else others[0][:8]
        return f"unique: waiting for its copy on node {where} to be unloaded"
    if owner is None or nid in obs.holders.get(name, frozenset()):
        r.owner[i] = nid  # nothing of it ran under this controller, or it runs here (its node came back)
        return None
    d = obs.deadlines
    if owner == UNKNOWN:
        end = obs.fence
        what = "every lease an earlier controller granted runs out"
    else:
        gone = owner not in obs.ray.nodes
        a = obs.agents.get(owner)
        if not gone and a is not None and a.why is None and a.report is not None and a.held is not None \
                and name not in a.held and name not in a.report.runs():
            r.owner[i] = nid  # known stopped there, and the share that node holds no longer names it
            return None
        grant = a.grants.get(name) if a is not None else None
        if grant is None:
            r.owner[i] = nid  # that node was never granted its lease: it cannot have run it
            return None
        end = grant + obs.stop_within(owner) + d.fleet_skew
        where = obs.ray.nodes[owner].name if not gone else (a.name if a is not None and a.name else owner[:8])
        what = f"its copy on node {where} is stopped (or its lease there runs out)"
    if obs.wall >= end:
        r.owner[i] = nid
        return None
    out.due = _first(out.due, obs.now + (end - obs.wall))
    return f"unique: not started until {what}, in {end - obs.wall:.1f}s at the latest"


def _kept_on(spec: Spec, r: Rollout, obs: Observed, i: int, name: str) -> list[str]:
    """The nodes that keep replica ``i``, which Ray placed nowhere now, running where it runs (a
    unique one on one node only, which becomes its owner: its copy there is the one)."""
    holders = sorted(obs.holders.get(name, frozenset()))
    if not spec.unique:
        return holders
    owner = r.owner[i]
    if owner in holders:
        return [owner] if owner is not None else []
    if len(holders) == 1 and (owner in (None, UNKNOWN) or owner not in obs.ray.nodes):
        r.owner[i] = holders[0]
        return holders
    return []


# ---- a replica's view ---------------------------------------------------------------------------------


def _running(obs: Observed, nid: str | None, name: str, want: str, aside: bool) -> str | None:
    """The hash replica ``name`` runs on ``nid`` if it runs there what it is to run and is not set
    aside (drained, or not started there yet), else None."""
    rep = obs.report(nid)
    if rep is None or aside or rep.claim is not None or nid is None:
        return None
    p = rep.program(name)
    if p is None or p.hash != want or p.state not in RUNS or rep.busy.get(name) == "unloading":
        return None
    return p.hash


def _replica(spec: Spec, r: Rollout, obs: Observed, i: int, nid: str) -> ReplicaView:
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
                           p.heartbeat, spec.generation_of(p.hash))

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


def _changes(spec: Spec, before: FleetProgram | None, now: FleetProgram) -> list[Event]:
    """A replica moved, or its state changed, since the view before."""
    old = {r.index: r for r in before.replicas} if before else {}
    out = []
    for r in now.replicas:
        o = old.get(r.index)
        if o is not None and o.node and r.node and o.node != r.node:
            out.append(Event("moved", f"{spec.name}: replica {r.index} moved from node {o.node_name} to {r.node_name}",
                             r.index, r.node))
        if o is None or o.state != r.state:
            why = f": {r.reason}" if r.reason else ""
            out.append(Event(r.state, f"{spec.name}: replica {r.index} {r.state}{why}", r.index, r.node))
    return out


def _empty(spec: Spec) -> FleetProgram:
    return FleetProgram(name=spec.name, replicas=(), wanted=spec.replicas, hash=spec.image.hash,
                        generation=spec.generation, restart=spec.restart, strategy=spec.strategy, gpu=spec.gpu,
                        node=spec.node, unique=spec.unique)


def view_of(spec: Spec, rollout: Rollout | None = None) -> FleetProgram:
    """A program's view before the loop has looked at it: every replica pending."""
    r = rollout or Rollout.start(spec)
    reps = tuple(ReplicaView(spec.name, i, "pending", "its placement group is being created",
                             generation=spec.generation_of(r.assigned[i])) for i in range(spec.replicas))
    return FleetProgram(name=spec.name, replicas=reps, wanted=spec.replicas, hash=r.target,
                        generation=spec.generation_of(r.target), restart=spec.restart, strategy=spec.strategy,
                        gpu=spec.gpu, node=spec.node, upgrading=r.upgrading, upgrade_error=r.error, unique=spec.unique)


def _first(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)
