"""The controller loop's progress on one declared program: written only by the loop (``plan``
returns a new one; nothing else changes it), apart from the spec the API writes (desired.py).

``assigned[i]`` is the image hash replica ``i`` is to run: a deploy assigns the declared image to
every replica, an upgrade moves one replica at a time to the ``target`` (at most one unavailable: a
running replica is first drained, taken out of the calls' routes for ``drain`` seconds, then given
the new image; the next starts only once it runs it, passed its node's start check).  Replicas that
are not running anyway (pending, failed) take the target at once: they cost the budget nothing.
A replica that refuses the declared image makes the target the previous one (``error`` says why)
until the API declares another generation.

``where[i]``: the node (by name) replica ``i`` last ran on, kept in the checkpoint: after the head's
restart each placement group is made again pinned there (``pins``), so that the replicas stay where
they run.  ``owner[i]`` (``unique`` programs only): the node (Ray id) the controller lets run
replica ``i`` and grants its lease to; ``UNKNOWN`` after the controller's start, until a node is
seen running it or every lease an earlier controller granted has run out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshd_mps.fleet.desired import Spec

#: ``owner``: not known (the controller started since): it may run anywhere an earlier controller let it.
UNKNOWN = "?"


@dataclass
class Rollout:
    assigned: list[str]
    target: str
    generation: int  # the spec's generation this rollout follows (another: a new upgrade was declared)
    error: str | None = None  # why the last upgrade stopped (a replica refused its image)
    draining: int | None = None  # the replica being drained for the upgrade (not kept: a restart drains anew)
    drain_since: float = 0.0
    rolling: int | None = None  # the replica given the new image, until it runs it
    where: list[str | None] = field(default_factory=list)
    pins: list[str | None] = field(default_factory=list)
    owner: list[str | None] = field(default_factory=list)

    @classmethod
    def start(cls, spec: Spec) -> Rollout:
        """A new declaration's: every replica assigned the declared image, each placed anew."""
        n = spec.replicas
        return cls(assigned=[spec.image.hash] * n, target=spec.image.hash, generation=spec.generation,
                   where=[None] * n, pins=[None] * n, owner=[None] * n)

    def copy(self) -> Rollout:
        return dataclasses.replace(self, assigned=list(self.assigned), where=list(self.where), pins=list(self.pins),
                                   owner=list(self.owner))

    @property
    def upgrading(self) -> bool:
        return self.assigned.count(self.target) != len(self.assigned)

    @property
    def moving(self) -> bool:
        """Whether the rollout has a step to take (an upgrade or a roll back on its way)."""
        return self.draining is not None or self.rolling is not None or self.upgrading

    def kept(self) -> tuple[Any, ...]:
        """What the checkpoint keeps of it (a change of this is written once in the tick)."""
        return (tuple(self.assigned), self.target, self.generation, self.error, tuple(self.where))

    def to_json(self) -> dict[str, Any]:
        return {"assigned": self.assigned, "target": self.target, "generation": self.generation, "error": self.error,
                "where": self.where}

    @classmethod
    def from_json(cls, d: dict[str, Any], spec: Spec) -> Rollout:
        """Read back for ``spec``; its owners unknown (a controller that starts knows of no lease)."""
        r = cls.start(spec)
        n = spec.replicas
        r.assigned = (list(d.get("assigned") or []) + [spec.image.hash] * n)[:n]
        r.target = d.get("target") or spec.image.hash
        r.generation = int(d.get("generation") or spec.generation)
        r.error = d.get("error")
        r.where = (list(d.get("where") or []) + [None] * n)[:n]
        r.owner = [UNKNOWN] * n if spec.unique else [None] * n
        return r

    # ---- the rolling upgrade ---------------------------------------------------------------------

    def follow(self, spec: Spec) -> None:
        """A generation declared since: its image is the target, the last one's error forgotten."""
        if spec.generation != self.generation:
            self.generation, self.target, self.error = spec.generation, spec.image.hash, None
            self.draining = self.rolling = None

    def roll_back(self, spec: Spec, why: str) -> None:
        """A replica refused the declared image: the previous one is the target again, every
        replica that took the new one rolled back to it (the same steps)."""
        if spec.previous is not None:
            self.target = spec.previous.hash
        self.error = why
        self.draining = self.rolling = None

    def step(self, running: list[bool], runs: list[str | None], drain: float, now: float) -> None:
        """One step of the rollout given, per replica, whether it runs (``running``) and the hash
        it runs (``runs``)."""
        target = self.target
        for i, h in enumerate(self.assigned):
            if h != target and not running[i] and i != self.draining:
                self.assigned[i] = target  # not running anyway: it costs the budget nothing
        if self.draining is not None:
            if now - self.drain_since >= drain:
                self.assigned[self.draining] = target
                self.rolling, self.draining = self.draining, None
            return
        if self.rolling is not None:
            if not (running[self.rolling] and runs[self.rolling] == target):
                return  # still starting on the new image: the budget is spent
            self.rolling = None
        nxt = next((i for i, h in enumerate(self.assigned) if h != target), None)
        if nxt is not None:
            self.draining, self.drain_since = nxt, now
