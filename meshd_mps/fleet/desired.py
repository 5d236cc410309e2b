"""What the API declared of a program: its ``Spec``, written only by the API (a deploy makes it, an
upgrade replaces it with the next generation, a remove drops it), and read by the controller's
loop, which never writes it.  What the loop makes of it over time (which image each replica is to
run, where each ran, the upgrade's progress) is the rollout's (fleet/rollout.py).

A spec is frozen: the loop's plan reads the one it was handed, and the API replaces the object
rather than changing it.  Each field is a dataclass field with its JSON form derived from it
(``to_json``/``from_json``): one more field is one line, with a default, and an older checkpoint
without it reads as that default.

How Ray places the replicas (``units``): one placement group per replica for ``SPREAD`` (the
default), so that what fits runs and the rest waits, each placed on its own as room comes (Ray puts
a one-bundle group on the node with the most room that fits: the replicas spread); one group for
all of them for ``PACK`` and ``STRICT_SPREAD``, which are constraints on the replicas together,
and which Ray places whole or not at all.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

from meshd_mps.fleet.capacity import bundle

#: The strategies whose replicas Ray places as one group (all or none).
WHOLE = ("PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
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

    def shipped(self) -> dict[str, Any]:
        """What a node's agent is sent of it (a share's ``images``): the ref of its data, not the data."""
        return {"manifest": self.manifest, "ptx": self.ptx, "data": self.data, "data_bytes": self.data_bytes}


@dataclass(frozen=True)
class Spec:
    """A declared program.  ``unique``: at most one copy of each replica runs at any time, fenced
    by a lease on its node (docs/fleet.md, "Nothing runs twice"); otherwise a replica may briefly
    run on two nodes while it moves.  ``previous``: the image before the last upgrade (a replica
    that refuses the new one rolls the program back to it).  ``token``: new for each declaration,
    in its placement groups' names (a removed program's may still be on their way out when the name
    is declared again)."""

    name: str
    replicas: int
    restart: str
    strategy: str
    image: Image
    gpu: str | None = None
    node: str | None = None
    unique: bool = False
    generation: int = 1
    previous: Image | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(4))

    # ---- placement ---------------------------------------------------------------------------

    @property
    def whole(self) -> bool:
        """Whether Ray places every replica in one group (``WHOLE``)."""
        return self.strategy in WHOLE

    @property
    def pg_prefix(self) -> str:
        """Its placement groups' names start so (the cluster puts the fleet's own prefix first:
        raycluster.py)."""
        return f"{self.name}.{self.token}"

    def unit(self, i: int) -> tuple[str, int]:
        """Replica ``i``'s placement group's name and its bundle's index in it."""
        return (self.pg_prefix, i) if self.whole else (f"{self.pg_prefix}.{i}", 0)

    def units(self) -> list[tuple[str, list[int]]]:
        """Each placement group of the program and the replicas it places (in bundle order)."""
        if self.whole:
            return [(self.pg_prefix, list(range(self.replicas)))]
        return [(f"{self.pg_prefix}.{i}", [i]) for i in range(self.replicas)]

    def bundle(self, pin: str | None = None) -> dict[str, float]:
        """What one replica asks of a node; ``pin``: the node it must be (by name)."""
        return bundle(self.gpu, self.node or pin)

    # ---- images --------------------------------------------------------------------------------

    def upgraded(self, image: Image) -> Spec:
        """The next generation, declaring ``image`` (which keeps the program's data if it brings
        none: each node's daemon keeps it too)."""
        if image.data is None:
            image = dataclasses.replace(image, data=self.image.data, data_bytes=self.image.data_bytes)
        previous = self.image if image.hash != self.image.hash else self.previous
        return dataclasses.replace(self, image=image, generation=self.generation + 1, previous=previous)

    def image_of(self, hash: str) -> Image | None:
        return next((im for im in (self.image, self.previous) if im is not None and im.hash == hash), None)

    def generation_of(self, hash: str | None) -> int:
        return self.generation if hash == self.image.hash else self.generation - 1

    # ---- the checkpoint -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["image"] = self.image.to_json()
        out["previous"] = None if self.previous is None else self.previous.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Spec:
        """A spec read back; a field it lacks takes its default (written by an older meshd-mps)."""
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["image"] = Image.from_json(d["image"])
        kw["previous"] = None if d.get("previous") is None else Image.from_json(d["previous"])
        return cls(**kw)
