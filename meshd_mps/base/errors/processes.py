"""Errors of the mailbox, the frame protocol, the workers, the MPS daemon and the device."""

from __future__ import annotations

from typing import ClassVar

from meshd_mps.base.errors.base import Conflict, MeshError, Unavailable
from meshd_mps.base.errors.config import DeviceError

# ---- the mailbox and the frame protocol ------------------------------------------------------


class MailboxError(MeshError):
    """The mailbox cannot be opened, or a slot or entry out of its layout."""


class RingFull(Conflict, MailboxError):
    """Every entry of a program's request ring is outstanding; the message says how it empties
    (protocol/ring.py).  ``given_up``: the entries held for callers that have gone."""

    FIELDS = ("program", "slot", "ring", "given_up")

    def __init__(self, message: str, *, program: str | None, slot: int, ring: int, given_up: int):
        super().__init__(message)
        self.program, self.slot, self.ring, self.given_up = program, slot, ring, given_up


class FrameError(MeshError):
    """A frame that breaks the protocol (docs/protocol.md): its sender is not to be trusted again."""


# ---- workers and MPS ------------------------------------------------------------------------------


class WorkerError(MeshError):
    """A worker process failed: it died, hung, lied or broke the frame protocol.  ``pid`` is the
    worker's (0 where no process was started)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("pid",)

    def __init__(self, message: str, *, pid: int = 0):
        super().__init__(message)
        self.pid = pid


class WorkerGone(WorkerError):
    """The worker's process exited (or closed its pipes): a pooled one that died while idle is
    replaced by the next one, since nothing was asked of it yet."""


class NoContext(WorkerError, Unavailable):
    """The worker is up but got no GPU context (its READY failed): the MPS server refused the
    client, e.g. while it tears a fault's clients down.  A held worker may ask again."""


class WorkerUnfit(WorkerError):
    """The worker broke the protocol or missed a deadline: never asked again, retired."""


class NoReply(WorkerUnfit):
    FIELDS = ("pid", "within")

    def __init__(self, message: str, *, pid: int, within: float):
        super().__init__(message, pid=pid)
        self.within = within


class SpawnFailed(WorkerError):
    """The worker's program could not be started at all."""


class ProtocolMismatch(WorkerError):
    """A worker (met through its socket, to be adopted) that speaks another version of the frame
    protocol (``frames.PROTOCOL_VERSION``): ``theirs`` and ``ours``.  It was left as it runs."""

    FIELDS = ("pid", "theirs", "ours")

    def __init__(self, pid: int, theirs: int, ours: int):
        super().__init__(f"worker {pid}: frame protocol version {theirs}, this meshd-mps speaks {ours}; not adopted",
                         pid=pid)
        self.theirs = theirs
        self.ours = ours


class PeerMismatch(WorkerUnfit):
    """A worker socket whose process (SO_PEERCRED's pid) is not the one its HELLO names: whoever
    listens there is not the worker it claims to be, and is never asked."""

    FIELDS = ("pid", "claimed")

    def __init__(self, message: str, *, pid: int, claimed: int):
        super().__init__(message, pid=pid)
        self.claimed = claimed


class MpsError(MeshError):
    """The MPS control daemon or its server misbehaved, or a worker is not its client."""


class NotAdoptable(MpsError):
    """No control daemon to adopt in ``dir``: ``why`` says what was missing (its pid file, a live
    process with the marker's start time, a dead owner, an answer)."""

    FIELDS = ("dir", "why")

    def __init__(self, message: str, *, dir: str, why: str):
        super().__init__(message)
        self.dir = dir
        self.why = why


class StateError(MeshError):
    """A lifecycle move its state table does not allow: a bug of meshd-mps, never the caller's."""

    FIELDS = ("what", "frm", "to")

    def __init__(self, message: str, *, what: str, frm: str, to: str):
        super().__init__(message)
        self.what = what
        self.frm = frm
        self.to = to


class NvmlUnavailable(DeviceError):
    """NVML (nvidia-ml-py over libnvidia-ml.so.1) cannot be opened here: ``why`` says what is
    missing (the package, the library, the kernel driver, the permission).  The daemon still runs
    its programs; it only cannot see the processes beside them (``gpu/nvml.py``)."""

    FIELDS = ("why",)

    def __init__(self, message: str, *, why: str):
        super().__init__(message)
        self.why = why
