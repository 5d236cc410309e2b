"""What a GPU fault cost (``FaultReport``), and the steps of its recovery (``RECOVERY_STEPS``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FaultReport:
    """What a GPU fault cost: who caused it, who was lost with it, who came back.  ``gpu_wide``:
    every MPS client of GPU ``device`` was torn down (a fault, not one program's own failure);
    ``by``: the evidence that named the culprit (faults.EVIDENCE)."""

    at: float
    error: str
    faulted: str | None
    pid: int | None
    gpu_wide: bool
    lost: list[str] = field(default_factory=list)
    relaunched: list[str] = field(default_factory=list)
    not_relaunched: dict[str, str] = field(default_factory=dict)
    ms: float = 0.0
    device: int = 0
    by: str = ""
    seen_at: float = 0.0  # monotonic time its first failure was seen
    #: ms each step of the recovery took (RECOVERY_STEPS), in order; their sum is ``ms``.
    steps: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, obj: Any) -> FaultReport:
        """A report kept as ``as_dict`` wrote it (the fault history a live restore carries over);
        ValueError if it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(obj, dict) or not {"at", "error", "faulted", "pid", "gpu_wide"} <= set(obj) <= names:
            raise ValueError(f"not a fault report: {obj!r:.200}")
        return cls(**obj)


#: A recovery's steps, as FaultReport.steps and the bench show them: the fault's evidence weighed
#: (``decide``), the GPU's workers retired and exited (``teardown``), the first new context
#: (``server_ready``: the server takes clients again), the rest of them (``contexts``), the lost
#: programs loaded and started again (``relaunch``).
RECOVERY_STEPS = ("decide", "teardown", "server_ready", "contexts", "relaunch")
