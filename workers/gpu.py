"""What the worker loop needs of a GPU: the real one and the simulation both fit it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from meshd_mps.frames import Done, Load, Loaded

DoneCallback = Callable[[Done], None]


class GpuError(Exception):
    """A GPU call failed; the text is sent to the supervisor as the reply's error."""


class Gpu(Protocol):
    def load(self, req: Load) -> Loaded:
        """Load ``req.cubin`` as module ``req.module``; its entry is ``mesh_main``."""
        ...

    def launch(self, module: int, gen: int, slot: int, nodes: int, on_done: DoneCallback) -> None:
        """Start ``mesh_main(mailbox_dev, slot)`` on ``nodes`` blocks; ``on_done`` runs once
        from another thread when the launch's stream finishes (or fails)."""
        ...

    def unload(self, module: int) -> None: ...

    def stack_limit(self, set_to: int | None) -> int:
        """The context's per-thread stack limit (CU_LIMIT_STACK_SIZE), set first if asked."""
        ...

    def misbehaviour(self, phase: str) -> str | None:
        """The simulation's scripted protocol faults; the real GPU has none."""
        ...

    def close(self) -> None: ...
