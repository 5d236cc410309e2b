"""Which fleet a node daemon belongs to: the claim file beside its socket.

Two fleets (two Ray namespaces, or two clusters) whose agents reach one daemon would undo each
other: each agent makes the daemon run its own fleet's share and unloads the other replicas
(``*.fleet-*``).  So a daemon belongs to one fleet at a time, and an agent loads and unloads
there only while its fleet holds the claim: ``<socket>.fleet``, a small JSON file in the socket's
own directory (the daemon's user's alone, which the agent shares on hosts, in a KubeRay pod and
under Slurm), naming the fleet (``FleetId``: a random id kept in the controller's checkpoint, its
Ray namespace and cluster) and when its agent last renewed it.

A claim binds another fleet while the daemon runs any fleet replica, or for ``lease`` seconds after
its agent last renewed it (every look of the agent's loop): so it outlives the agent's restart
(the file stays), the daemon's (live restore keeps the replicas, the file stays) and the head's (the
id is in the checkpoint, the replicas run on).  It lapses once its fleet is gone: nothing of it runs
there and no agent of it renews it.  Taken under ``flock``, so two agents never both take it.
No daemon API: the daemon keeps programs and knows nothing of fleets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

#: The claim's file is the daemon's socket's path with this after it.
SUFFIX = ".fleet"
#: The longest a claim file may be (it is a few hundred bytes): more is not a claim.
MAX_BYTES = 4096
#: A claim is written again once a ``RENEW``-th of its lease has passed (not at every look).
RENEW = 6
#: How long a look waits for another agent's look at the same file (each holds it for a read and
#: a write).
LOCK_S = 2.0


@dataclass(frozen=True)
class FleetId:
    """A fleet: ``id`` made once by its controller and kept in its checkpoint, its Ray
    ``namespace`` and ``cluster`` (the GCS address), for the user to tell which fleet it is."""

    id: str
    namespace: str
    cluster: str

    def __str__(self) -> str:
        return f"fleet {self.id} (namespace {self.namespace!r} of the Ray cluster at {self.cluster})"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> FleetId | None:
        if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("id", "namespace", "cluster")):
            return None
        return cls(id=d["id"], namespace=d["namespace"], cluster=d["cluster"])


@dataclass(frozen=True)
class Claim:
    """A daemon's fleet and when its agent last renewed the claim (``renewed``, epoch seconds)."""

    fleet: FleetId
    renewed: float

    def to_json(self) -> dict[str, Any]:
        return {"fleet": self.fleet.to_json(), "renewed": self.renewed}

    @classmethod
    def from_json(cls, d: Any) -> Claim | None:
        """None for anything that is not a claim (an empty or torn file: nobody's)."""
        if not isinstance(d, dict) or not isinstance(d.get("renewed"), (int, float)):
            return None
        fleet = FleetId.from_json(d.get("fleet"))
        return None if fleet is None else cls(fleet, float(d["renewed"]))


def claim_path(socket: str) -> str:
    return socket + SUFFIX


def binds(claim: Claim | None, me: FleetId, replicas: bool, lease: float, now: float) -> bool:
    """Whether ``claim`` keeps fleet ``me`` off the daemon: another fleet's, and that fleet's
    replicas run there (``replicas``: the daemon runs any ``*.fleet-*`` program) or its agent
    renewed it within ``lease`` seconds."""
    if claim is None or claim.fleet.id == me.id:
        return False
    return replicas or now - claim.renewed < lease


def why(claim: Claim, replicas: bool, now: float) -> str:
    """The reason a user reads on the node and on each replica Ray placed there."""
    held = "which runs its replicas there" if replicas else \
        f"whose agent renewed its claim {max(0.0, now - claim.renewed):.0f}s ago"
    return f"the node's daemon belongs to another {claim.fleet}, {held}: this fleet loads and unloads nothing there"


def look(path: str, me: FleetId, running: Collection[str], mine: Collection[str], lease: float,
         now: float | None = None) -> tuple[Claim | None, str] | None:
    """An agent's look: None if fleet ``me`` holds the daemon's claim now (``take``), else the
    other fleet's claim and why this one touches nothing there.  ``running``: the fleet replicas
    the daemon runs; ``mine``: those fleet ``me`` has there (its share, and those it leaves alone).
    A daemon no fleet claims that runs replicas not ``mine`` is not taken either: whose they are
    is not known (the claim file was removed, or they are from a meshd-mps before claims), and
    taking it would unload them."""
    now = time.time() if now is None else now
    strangers = sorted(set(running) - set(mine))
    if strangers and read(path) is None:
        shown = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        return None, (f"the node's daemon runs fleet replicas that no fleet claims ({shown}) and this fleet does not"
                      " place there: it loads and unloads nothing there until they are unloaded (meshd-mps unload)")
    held = take(path, me, bool(running), lease, now)
    return None if held is None else (held, why(held, bool(running), now))


def take(path: str, me: FleetId, replicas: bool, lease: float, now: float | None = None) -> Claim | None:
    """Fleet ``me``'s claim on the daemon, renewed or taken (None: ours now), unless another
    fleet's binds (``binds``): then that claim, left as it is.  Blocking (a thread's); OSError if
    the file cannot be read or written (the agent then touches nothing either)."""
    now = time.time() if now is None else now
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        _lock(fd, path)
        raw = os.pread(fd, MAX_BYTES + 1, 0)
        held: Claim | None = None
        if 0 < len(raw) <= MAX_BYTES:
            with contextlib.suppress(ValueError):
                held = Claim.from_json(json.loads(raw))
        if binds(held, me, replicas, lease, now):
            return held
        if held is not None and held.fleet == me and 0 <= now - held.renewed < lease / RENEW:
            return None  # ours, renewed lately: not written at every look
        data = json.dumps(Claim(me, now).to_json()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return None
    finally:
        os.close(fd)  # the lock goes with it


def read(path: str) -> Claim | None:
    """The claim as it is (None: none, or not a claim); for a look that takes nothing."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        return Claim.from_json(json.loads(raw)) if len(raw) <= MAX_BYTES else None
    except ValueError:
        return None


def _lock(fd: int, path: str) -> None:
    deadline = time.monotonic() + LOCK_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.EWOULDBLOCK, f"{path}: held by another agent for {LOCK_S:g}s") from None
            time.sleep(0.01)  # the polling interval: another agent's read and write
