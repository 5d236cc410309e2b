"""A declared program as the controller keeps it (and its checkpoint holds), and the one step of a
rolling upgrade: pure decisions over what was declared and what the nodes report, no Ray.

``assigned[i]`` is the image hash replica ``i`` is to run: a deploy assigns the image to every
replica, an upgrade moves one replica at a time to the new one (at most one unavailable: a running
replica is first drained, taken out of the calls' routes for ``drain`` seconds, then given the new
image; the next starts only once it runs it, passed its node's start check).  Replicas that are not
running anyway (pending, failed) take the new image at once: they cost the budget nothing.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from meshd_mps.fleet.capacity import bundle


@dataclass
class Image:
    """A declared program's image, and its data: ``data`` a Ray ObjectRef that the controller owns
    (the bytes are in the object store, never here), ``data_bytes`` its size for the events.  The
    checkpoint keeps neither: an ObjectRef does not outlive its owner, so after the head's restart
    a replica placed anew has no data (its load is refused, said in its reason) until the program
    is deployed again with it."""

    manifest: dict[str, Any]
    ptx: str
    hash: str
    data: Any = None
    data_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """For the checkpoint: the data's size, not the data (a replica placed anew without it is
        refused, with the reason)."""
        out = {"manifest": self.manifest, "ptx": self.ptx, "hash": self.hash}
        return {**out, "data_bytes": self.data_bytes} if self.data_bytes else out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Image:
        return cls(manifest=d["manifest"], ptx=d["ptx"], hash=d["hash"], data=d.get("data"),
                   data_bytes=int(d.get("data_bytes") or 0))


@dataclass
class Declared:
    name: str
    replicas: int
    restart: str
    strategy: str
    gpu: str | None
    node: str | None
    image: Image
    generation: int = 1
    assigned: list[str] = field(default_factory=list)
    old: Image | None = None
    upgrade_error: str | None = None
    draining: int | None = None  # the replica being drained for the upgrade (not kept: a restart drains anew)
    drain_since: float = 0.0
    rolling: int | None = None  # the replica given the new image, until it runs it
    where: list[str | None] = field(default_factory=list)  # the node (by name) each replica last ran on
    pins: list[str | None] = field(default_factory=list)  # the node each bundle of the placement group asks for
    token: str = field(default_factory=lambda: secrets.token_hex(4))

    def __post_init__(self) -> None:
        if not self.assigned:
            self.assigned = [self.image.hash] * self.replicas
        self.where = (self.where + [None] * self.replicas)[:self.replicas]
        self.pins = (self.pins + [None] * self.replicas)[:self.replicas]


    @property
    def pg_name(self) -> str:
        """Its placement group's name (detached: it outlives the controller), new for each
        declaration (a removed one's may still be on its way out when the name is declared again)."""
        return f"meshd-mps.{self.name}.{self.token}"

    def bundles(self) -> list[dict[str, float]]:
        """One per replica; a bundle pinned (``pins``) asks for its node by name."""
        return [bundle(self.gpu, self.node or self.pins[i]) for i in range(self.replicas)]

    def pin_where_running(self) -> None:
        """Pin each bundle of the next placement group to the node its replica ran on: after the
        head's restart the placement groups are gone, and the new ones must land where the programs
        still run (the nodes Ray chose before), not where a fresh placement would put them."""
        self.pins = list(self.where) if self.node is None else [None] * self.replicas

    def image_of(self, hash: str) -> Image | None:
        return next((im for im in (self.image, self.old) if im is not None and im.hash == hash), None)

    @property
    def upgrading(self) -> bool:
        return any(h != self.image.hash for h in self.assigned)

    def generation_of(self, hash: str | None) -> int:
        return self.generation if hash == self.image.hash else self.generation - 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "replicas": self.replicas, "restart": self.restart, "strategy": self.strategy,
                "gpu": self.gpu, "node": self.node, "image": self.image.to_json(), "generation": self.generation,
                "assigned": self.assigned, "old": None if self.old is None else self.old.to_json(),
                "upgrade_error": self.upgrade_error, "where": self.where,
                "pins": self.pins, "token": self.token}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Declared:
        return cls(name=d["name"], replicas=d["replicas"], restart=d["restart"], strategy=d["strategy"], gpu=d["gpu"],
                   node=d["node"], image=Image.from_json(d["image"]), generation=d["generation"],
                   assigned=list(d["assigned"]), old=None if d.get("old") is None else Image.from_json(d["old"]),
                   upgrade_error=d.get("upgrade_error"), where=list(d.get("where") or []),
                   pins=list(d.get("pins") or []), token=d["token"])

    # ---- the rolling upgrade ---------------------------------------------------------------------

    def upgrade_to(self, image: Image) -> None:
        """Declare ``image``: the rollout starts at the next step."""
        if image.hash != self.image.hash:
            self.old = self.image
        if image.data is None:  # an upgrade keeps the program's data (each node's daemon keeps it too)
            image.data, image.data_bytes = self.image.data, self.image.data_bytes
        self.image = image
        self.generation += 1
        self.upgrade_error = None
        self.draining = self.rolling = None

    def roll_back(self, why: str) -> None:
        """A replica refused the new image: declare the old one again, and roll every replica that
        took the new one back to it (the same steps)."""
        if self.old is not None:
            self.image, self.old = self.old, self.image
            self.generation += 1
        self.upgrade_error = why
        self.draining = self.rolling = None

    def step(self, running: list[bool], runs: list[str | None], drain: float, now: float | None = None) -> bool:
        """One step of the rollout given, per replica, whether it runs (``running``) and the hash
        it runs (``runs``); True if ``assigned`` changed (the checkpoint is written again)."""
        now = time.monotonic() if now is None else now
        target = self.image.hash
        changed = False
        for i, h in enumerate(self.assigned):
            if h != target and not running[i] and i != self.draining:
                self.assigned[i] = target  # not running anyway: it costs the budget nothing
                changed = True
        if self.draining is not None:
            if now - self.drain_since >= drain:
                self.assigned[self.draining] = target
                self.rolling, self.draining = self.draining, None
                changed = True
            return changed
        if self.rolling is not None:
            if not (running[self.rolling] and runs[self.rolling] == target):
                return changed  # still starting on the new image: the budget is spent
            self.rolling = None
        nxt = next((i for i, h in enumerate(self.assigned) if h != target), None)
        if nxt is not None:
            self.draining, self.drain_since = nxt, now
        elif self.old is not None:
            self.old = None
            changed = True
        return changed
