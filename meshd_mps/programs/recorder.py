"""What ``Programs`` tells whoever keeps its desired state (state/desired.py implements it): a
Protocol here, so that programs never import the layer above that keeps the state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from meshd_mps.programs.datastore import Kept
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.report import FaultReport


class Recorder(Protocol):
    async def loaded(self, p: Program) -> None:
        """A load or an upgrade, before it is answered: the program as it runs now."""

    async def unloaded(self, name: str) -> None:
        """An unload, before it is answered."""

    async def history(self, programs: Sequence[Program], faults: Sequence[FaultReport]) -> None:
        """What a live restore carries over changed (a launch, a relaunch, a fault's report): each
        program's launch time and restarts, and the recent fault reports."""

    def data_kept(self) -> Kept:
        """The data the desired state names (records not loaded now included): kept by the data's gc."""
        ...
