"""What the worker loop needs of a GPU: the real one and the simulation both fit it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import DataReq, Done, Load, Loaded, WriteReq
from meshd_mps.protocol.payloads import Layout

from .warm import MAX_QUEUES, QUEUES_ENV

DoneCallback = Callable[[Done], None]
S = TypeVar("S")


class Sized(Protocol):
    alloc: int


R = TypeVar("R", bound=Sized)


class GpuError(Exception):
    """A GPU call failed; the text is sent to the supervisor as the reply's error, ``word`` as its
    ok word (``frames.FAILED``; for LOADED, the image's own fault: ``frames.REFUSED``, or
    ``frames.NO_ENTRY`` for an image without ``mesh_main``).  ``refused=True``: REFUSED."""

    def __init__(self, message: str, *, refused: bool = False, word: int | None = None):
        super().__init__(message)
        self.word = word if word is not None else frames.REFUSED if refused else frames.FAILED

    @property
    def refused(self) -> bool:
        """The image's fault, not the worker's."""
        return self.word in frames.LOADED_ONLY


def write_target(by_slot: Mapping[int, R], req: WriteReq) -> R:
    """The slot's data region a WRITE goes to: GpuError for a slot without data, or a write past its end."""
    r = by_slot.get(req.slot)
    if r is None:
        raise GpuError(f"slot {req.slot} has no program data")
    if req.offset + len(req.data) > r.alloc:
        raise GpuError(f"a write of {len(req.data)} bytes at {req.offset} is past slot {req.slot}'s {r.alloc} bytes")
    return r


class Streams(Generic[S]):
    """A context's streams, one per hardware work queue, made in order when the context opens.

    A kernel on a queue that holds a resident kernel never starts, and the driver, not we, picks a
    new stream's queue.  The first N streams of a fresh context are on its N queues; a stream made
    per module is not, once more than N were made (on the H200, driver 580: a 9th module's stream
    shared module 1's queue, and after it was destroyed the next module's stream still shared a
    resident kernel's queue and never started).  So the streams are made once, and each module
    takes the lowest-numbered free one and gives it back at unload: up to ``len(streams)``
    resident programs each have a queue of their own, and one more is refused at load.
    """

    def __init__(self, streams: Sequence[S]):
        self.streams = list(streams)
        self._free = set(range(len(self.streams)))

    def take(self) -> tuple[int, S]:
        """(the queue's number, its stream); GpuError naming the limit when every one is held."""
        if not self._free:
            n = len(self.streams)
            raise GpuError(
                f"cuStreamCreate: all {n} hardware work queues of this context hold a module; a stream on a"
                f" shared queue would never start its kernel beside a resident one (unload a module, or start"
                f" the worker with more --queues: {QUEUES_ENV}, at most {MAX_QUEUES})"
            )
        i = min(self._free)
        self._free.remove(i)
        return i, self.streams[i]

    def give(self, i: int) -> None:
        self._free.add(i)


class Gpu(Protocol):
    def load(self, req: Load) -> Loaded:
        """Load ``req.cubin`` as module ``req.module``; its entry is ``mesh_main``."""
        ...

    def payloads(self, module: int, path: str, layout: Layout) -> int:
        """Module ``module``'s payload region: the file at ``path`` mapped and registered with the
        context as host-mapped memory; its device address, which each launch of the module writes
        into its slot (``protocol.payloads.write_slot``) before the kernel starts."""
        ...

    def launch(self, module: int, gen: int, slot: int, nodes: int, on_done: DoneCallback) -> None:
        """Start ``mesh_main(mailbox_dev, slot)`` on ``nodes`` blocks, the module's payload region
        (if it has one) written into the slot first; ``on_done`` runs once from another thread when
        the launch's stream finishes (or fails)."""
        ...

    def unload(self, module: int) -> None: ...

    def data(self, req: DataReq) -> int:
        """Slot ``req.slot``'s program data: ``req.alloc`` bytes of device memory, the first
        ``req.length`` copied in from ``req.path`` (the rest zeroed), on a stream of the worker's
        own; the slot's earlier region freed first (``alloc`` 0: only that).  Its device address."""
        ...

    def write(self, req: WriteReq) -> None:
        """``req.data`` copied into slot ``req.slot``'s data at ``req.offset``, complete on the
        device when this returns; the kernels run on meanwhile."""
        ...

    def stack_limit(self, set_to: int | None) -> int:
        """The context's per-thread stack limit (CU_LIMIT_STACK_SIZE), set first if asked."""
        ...

    def misbehaviour(self, phase: str) -> str | None:
        """The simulation's scripted protocol faults; the real GPU has none."""
        ...

    def close(self) -> None: ...
