"""``plan``: what the controller does about one declared program, given what it observed.  A pure
function: no I/O, no clock of its own, its inputs left as they are; tested as a function over the
situations of docs/fleet.md's failure table (tests/unit/test_fleet_plan.py).

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

Its cost is the replicas whose inputs changed, not the program's: given the plan before
(``before``) and the replicas whose node's report, placement or lease changed since
(``changed``), it works out only those, and takes the others from ``before`` as they were (the
same result as a plan of every replica: tests/unit/test_fleet_plan.py checks it).  Without them it
plans every replica.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from meshd_mps.fleet.capacity import why_pending
from meshd_mps.fleet.desired import Spec
from meshd_mps.fleet.messages import Order
from meshd_mps.fleet.observed import Observed
from meshd_mps.fleet.rollout import UNKNOWN, Rollout
from meshd_mps.fleet.spec import FleetProgram, ReplicaView, replica_name, resource_key
from meshd_mps.fleet.views import Event, changes, program, replica, running

T = TypeVar("T")
#: A node's part of a share, by replica index (the loop joins every program's).
Part = dict[str, dict[int, T]]
PARTS = ("orders", "keep", "leased")


@dataclass
class ProgramPlan:
    """What ``plan`` makes of one program (the module's doc).  Per replica: ``placed`` (its node,
    None: placed nowhere), ``fenced`` (a unique one not let run there yet, and why), ``runs`` (the
    image it runs where it is to), ``views``; per node, its part: ``orders``, ``keep``, ``leased``
    (``nodes``: those whose part this plan changed).  ``due``: look again by then at the latest
    (monotonic; a drain, a lease, a pin's deadline); ``waiting``: a replica waits on Ray or on an
    agent no watch tells of (looked at every ``fleet_busy_tick``); ``touches``: the nodes whose news
    changes it; ``kept``: the rollout's part the checkpoint keeps changed."""

    spec: Spec
    rollout: Rollout
    placed: list[str | None]
    fenced: list[str | None]
    runs: list[str | None]
    views: list[ReplicaView]
    at: dict[str, list[str | None]]  # "orders", "keep", "leased": the node whose part has each replica
    view: FleetProgram | None = None
    orders: Part[Order] = field(default_factory=dict)
    keep: Part[str] = field(default_factory=dict)
    leased: Part[str] = field(default_factory=dict)
    why: str | None = None  # the reason of the replicas placed nowhere
    placing: set[int] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    copied: set[tuple[str, str]] = field(default_factory=set)  # (part, node): its dict is this plan's own
    create: list[tuple[str, list[dict[str, float]], str]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    due: float | None = None
    waiting: bool = False
    touches: frozenset[str] = frozenset()
    kept: bool = False


def plan(spec: Spec, rollout: Rollout, obs: Observed, before: ProgramPlan | None = None,
         changed: Iterable[int] | None = None) -> ProgramPlan:
    d = obs.deadlines
    n = spec.replicas
    r = rollout.copy()
    r.follow(spec)
    same = before is not None and changed is not None and before.spec is spec and _steady(before.rollout, r)
    if same:
        assert before is not None and changed is not None
        idx = {i for i in changed if 0 <= i < n}
        out = ProgramPlan(spec, r, list(before.placed), list(before.fenced), list(before.runs), list(before.views),
                          {k: list(v) for k, v in before.at.items()}, orders=dict(before.orders),
                          keep=dict(before.keep), leased=dict(before.leased), why=before.why,
                          placing=set(before.placing))
        if before.due is not None and before.due > obs.now:
            out.due = before.due  # the replicas not planned again still wait for it
    else:
        idx = set(range(n))
        out = ProgramPlan(spec, r, [None] * n, [None] * n, [None] * n, [], {k: [None] * n for k in PARTS})
        if before is not None and before.spec.token == spec.token:
            out.orders, out.keep, out.leased, out.at = dict(before.orders), dict(before.keep), dict(before.leased), \
                {k: list(v) for k, v in before.at.items()}
    old: list[ReplicaView | None] = list(before.views) if before is not None else [None] * n
    if not out.views:
        out.views = [ReplicaView(spec.name, i, "pending") for i in range(n)]  # each made below
    names = [replica_name(spec.name, i) for i in range(n)] if not same else None

    def name(i: int) -> str:
        return names[i] if names is not None else replica_name(spec.name, i)

    _place(spec, r, obs, out, idx)
    if spec.unique:
        for i in idx:
            out.fenced[i] = _fence(spec, r, obs, out, i, name(i), out.placed[i])

    # The rollout: a refusal of the declared image rolls back; where each runs; one upgrade step.
    for i in sorted(idx):
        rep = obs.report(out.placed[i])
        err = rep.errors.get(name(i)) if rep is not None and out.fenced[i] is None else None
        if err is not None and err[0] == r.target == spec.image.hash and spec.previous is not None \
                and err[0] != spec.previous.hash:
            r.roll_back(spec, err[1])
            out.events.append(Event("upgrade-failed", f"{spec.name}: replica {i} refused image {err[0]}: {err[1]};"
                                    f" rolling back to {r.target}", i, out.placed[i]))
            idx = set(range(n))  # every replica's image changes
            break
    for i in idx:
        nid = out.placed[i]
        out.runs[i] = running(obs, nid, name(i), r.assigned[i], i == r.draining or out.fenced[i] is not None)
        here = obs.ray.nodes[nid].named if nid is not None else None
        if out.runs[i] is not None and here is not None:
            r.where[i] = here
    if r.moving:
        was, draining = list(r.assigned), r.draining
        r.step([h is not None for h in out.runs], out.runs, drain=d.fleet_tick * 3, now=obs.now)
        idx |= {i for i in range(n) if r.assigned[i] != was[i]} | {i for i in (draining, r.draining) if i is not None}
        if r.draining is not None and r.draining != draining:
            out.events.append(Event("draining", f"{spec.name}: replica {r.draining} drained for the upgrade to"
                                    f" {r.target}", r.draining))
        if r.draining is not None:
            out.due = _first(out.due, r.drain_since + d.fleet_tick * 3)

    # The replicas placed nowhere share one reason: when it changes, each says the new one.
    pending = out.placed.count(None)
    why = _why_pending(spec, out.placed, obs, pending) if pending else None
    if why != out.why:
        idx |= {i for i in range(n) if out.placed[i] is None}
        out.why = why

    for i in sorted(idx):
        v = _view(spec, r, obs, out, i, name(i))
        out.views[i] = v
        (out.placing.add if v.state == "placing" else out.placing.discard)(i)
        out.events += changes(spec, old[i], v)
    out.view = program(spec, r, tuple(out.views))
    out.waiting = pending > 0 or bool(out.placing)
    out.touches = frozenset({*out.placed, *r.owner, *out.keep, *out.leased} - {None, UNKNOWN})  # type: ignore[arg-type]
    out.kept = r.kept() != rollout.kept()
    if not out.kept and r == rollout:
        out.rollout = rollout  # unchanged: the same object (the loop compares identities)
    return out


def _steady(a: Rollout, b: Rollout) -> bool:
    """Whether two rollouts give every replica's view the same program-level inputs."""
    return (a.target, a.generation, a.error, a.draining, a.rolling) == (b.target, b.generation, b.error, b.draining,
                                                                        b.rolling)


def _view(spec: Spec, r: Rollout, obs: Observed, out: ProgramPlan, i: int, name: str) -> ReplicaView:
    """Replica ``i``'s view, and its parts of the nodes' shares."""
    nid = out.placed[i]
    gen = spec.generation_of(r.assigned[i])
    order = keep = lease = None
    if nid is None:
        v = ReplicaView(spec.name, i, "pending", out.why, generation=gen)
        keep = _kept_on(spec, r, obs, i, name)
    elif out.fenced[i] is not None:
        v = ReplicaView(spec.name, i, "pending", out.fenced[i], nid, obs.ray.nodes[nid].name, generation=gen)
    else:
        v = replica(spec, r, obs, i, nid)
        order = Order(name, r.assigned[i], spec.restart, None if spec.gpu is None else resource_key(spec.gpu),
                      spec.unique)
    owner = r.owner[i]
    if spec.unique and owner not in (None, UNKNOWN) and owner in obs.ray.nodes and nid in (None, owner):
        lease = owner  # not once placed elsewhere: its lease there runs out
    _set(out, "orders", out.orders, nid if order is not None else None, i, order)
    _set(out, "keep", out.keep, keep, i, name)
    _set(out, "leased", out.leased, lease, i, name)
    return v


def _set(out: ProgramPlan, label: str, part: Part[T], nid: str | None, i: int, value: T | None) -> None:
    """Replica ``i``'s entry of ``part`` (named ``label``): on node ``nid`` only (None: on none);
    each node's dict copied before its first change in this plan (``before``'s stays as it was),
    and each node changed noted."""
    at = out.at[label]
    was = at[i]
    if was == nid and (nid is None or part[nid].get(i) == value):
        return
    for node, add in ((was, False), (nid, True)):
        if node is None or (add and value is None):
            continue
        if (label, node) not in out.copied:
            part[node] = dict(part.get(node, {}))
            out.copied.add((label, node))
        if add:
            part[node][i] = value  # type: ignore[assignment]
        else:
            part[node].pop(i, None)
            if not part[node]:
                del part[node]
                out.copied.discard((label, node))
        out.nodes.add(node)
    at[i] = nid if value is not None else None


# ---- where Ray placed each replica, and its pins ----------------------------------------------------


def _place(spec: Spec, r: Rollout, obs: Observed, out: ProgramPlan, idx: set[int]) -> None:
    """Each replica of ``idx``'s node (None: placed nowhere, or on a node gone); the placement
    groups to make (pinned where their replicas last ran: after the head's restart they must land
    there), and those to give up (pinned to a node that did not rejoin within ``fleet_rejoin``)."""
    d = obs.deadlines
    missing: set[str] = set()
    for i in idx:
        pg, b = spec.unit(i)
        pl = obs.ray.placements.get(pg)
        nid = None if pl is None or b >= len(pl.nodes) else pl.nodes[b]
        out.placed[i] = nid if nid in obs.ray.nodes else None
        if pl is None:
            missing.add(pg)
    for pg, idxs in spec.units() if missing else ():
        if pg in missing:
            for i in idxs:
                r.pins[i] = r.where[i] if spec.node is None else None
            out.create.append((pg, [spec.bundle(r.pins[i]) for i in idxs], spec.strategy))
    if r.pins.count(None) == spec.replicas:
        return
    names = {n.named for n in obs.ray.nodes.values()}
    lost = [i for i, pin in enumerate(r.pins) if pin is not None and out.placed[i] is None and pin not in names]
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


def _why_pending(spec: Spec, placed: list[str | None], obs: Observed, count: int) -> str:
    if not any(pg in obs.ray.placements for pg, _ in spec.units()):
        return "its placement group is being created"
    nodes = [dict(n.resources) for n in obs.ray.nodes.values()]
    return why_pending(spec.bundle(), nodes, dict(obs.ray.available), count, spec.strategy)


# ---- unique replicas: one copy at most -------------------------------------------------------------


def _fence(spec: Spec, r: Rollout, obs: Observed, out: ProgramPlan, i: int, name: str, nid: str | None) -> str | None:
    """None if unique replica ``i`` may run on ``nid`` (its owner then), else why not yet: a copy
    may still run elsewhere."""
    if nid is None:
        return None
    owner = r.owner[i]
    held = obs.holders.get(name, frozenset())
    others = sorted(held - {nid})
    if owner == nid:
        return None
    if others:
        return f"unique: waiting for its copy on node {_name(obs, others[0])} to be unloaded"
    if owner is None or nid in held:
        r.owner[i] = nid  # nothing of it ran under this controller, or it runs here (its node came back)
        return None
    if owner == UNKNOWN:
        end = obs.fence
        what = "every lease an earlier controller granted runs out"
    else:
        a = obs.agents.get(owner)
        if owner in obs.ray.nodes and a is not None and a.why is None and a.report is not None \
                and a.held is not None and name not in a.held and name not in a.report.runs():
            r.owner[i] = nid  # known stopped there, and the share that node holds no longer names it
            return None
        grant = a.grants.get(name) if a is not None else None
        if grant is None:
            r.owner[i] = nid  # that node was never granted its lease: it cannot have run it
            return None
        end = grant + obs.stop_within(owner) + obs.deadlines.fleet_skew
        what = f"its copy on node {_name(obs, owner)} is stopped (or its lease there runs out)"
    if obs.wall >= end:
        r.owner[i] = nid
        return None
    out.due = _first(out.due, obs.now + (end - obs.wall))
    return f"unique: not started until {what}, in {end - obs.wall:.1f}s at the latest"


def _name(obs: Observed, nid: str) -> str:
    """Node ``nid``'s name, also once it has left the cluster."""
    if nid in obs.ray.nodes:
        return obs.ray.nodes[nid].name
    a = obs.agents.get(nid)
    return a.name if a is not None and a.name else nid[:8]


def _kept_on(spec: Spec, r: Rollout, obs: Observed, i: int, name: str) -> str | None:
    """The node that keeps replica ``i``, which Ray placed nowhere now, running where it runs (a
    unique one becomes its owner there: its copy there is the one).  A copy on two nodes (a move
    between two that had both come back) is kept on the first: the other unloads it."""
    holders = sorted(obs.holders.get(name, frozenset()))
    if not holders:
        return None
    owner = r.owner[i]
    if not spec.unique:
        return holders[0]
    if owner in holders:
        return owner
    if len(holders) == 1 and (owner in (None, UNKNOWN) or owner not in obs.ray.nodes):
        r.owner[i] = holders[0]
        return holders[0]
    return None


def _first(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)
