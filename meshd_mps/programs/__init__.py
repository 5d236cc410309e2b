"""Named resident programs on mailbox slots: load, upgrade in place, unload, call; their faults
recovered and their restart policies carried out.  One module per job (docs/architecture.md);
``Programs`` (facade.py) is the front door."""

from meshd_mps.programs.facade import Programs
from meshd_mps.programs.program import LIVE, PROGRAM_MOVES, Program, ProgramState, Run
from meshd_mps.programs.recorder import Recorder
from meshd_mps.programs.report import RECOVERY_STEPS, FaultReport

__all__ = ["LIVE", "PROGRAM_MOVES", "RECOVERY_STEPS", "FaultReport", "Program", "ProgramState", "Programs", "Recorder",
           "Run"]
