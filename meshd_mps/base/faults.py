"""Fault attribution: from the evidence of a failure to a verdict, with no processes involved.

Under MPS a fatal fault of one client tears down every client of its GPU, so when a program fails
the question is whose fault it was.  The evidence (gathered by ``Programs``, which also acts on
the verdict) is:

- the pids the MPS server logged as having hit a fatal error (``mps/serverlog.py``), which on the
  H200 named an innocent one run in two, so it is the weakest evidence;
- each program's own mailbox STATE word: one that ran to its end (EXITED) and still failed faulted
  itself, while a torn-down resident one was stopped while RUNNING;
- how each worker ended: one that died on its own (a signal not ours, or an exit with its kernel
  launched) faulted the others, since the torn-down ones lived until retired and exit at QUIT;
- workers that exited on their own with a kernel launched but ran no program yet (a load's LAUNCH):
  then every program there is innocent;
- when each program was seen failing: with nothing else, the first one is taken for the culprit.

Every function here is pure: tests/unit/test_fault_verdict.py feeds it evidence and checks the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Suspect:
    """One program of the GPU that failed, as the evidence shows it."""

    name: str
    pid: int
    failed_at: float = 0.0  # monotonic time it was seen failing (0: not seen failing)
    ended: bool = False  # its STATE word is EXITED: it ran to its own end, and failed
    died: bool = False  # its worker ended on its own, not retired by us
    error: str = ""  # its own failure, as its state says it ("" if none seen yet)
    kernel_error: str = ""  # the CUDA error its stream reported (a DONE that failed), if any


@dataclass(frozen=True)
class Stray:
    """A worker of the GPU that exited on its own with a kernel launched, and ran no program yet."""

    pid: int
    program: str | None  # the image it was loading, if any
    at: float  # monotonic time it exited


@dataclass(frozen=True)
class Verdict:
    culprit: str  # the program, or "worker N" for a stray
    pid: int
    why: str  # the fault, in words (the CUDA error where one was reported)
    program: Suspect | None  # the culprit program; None when a stray worker was the culprit
    lost: tuple[Suspect, ...]  # the innocents taken down with it
    by: str  # the evidence that named it (see EVIDENCE)
    stray: Stray | None = None


#: What ``Verdict.by`` can say, strongest first ("own": no GPU fault, the program's own failure).
EVIDENCE = ("ended", "died", "stray", "server log", "first failure", "own")


def died_on_its_own(returncode: int | None, exited_running: bool, ended_by_us: bool) -> bool:
    """A worker whose process ended by a signal that was not ours, or that exited with its kernel
    launched before it was told to."""
    return exited_running or (returncode is not None and returncode < 0 and not ended_by_us)


def is_gpu_fault(fatal_pids: Sequence[int], failed_together: Sequence[object]) -> bool:
    """A failure is a GPU fault (every client of the GPU torn down) if the server logged a fatal
    fault there, or other programs of that GPU failed with it within the fault window."""
    return bool(fatal_pids) or bool(failed_together)


def failed_together(first: Suspect, others: Sequence[Suspect], window: float) -> list[Suspect]:
    """The other programs seen failing within ``window`` seconds of ``first``."""
    return [q for q in others if q.failed_at and first.failed_at and abs(q.failed_at - first.failed_at) < window]


def name_culprit(hit: Sequence[Suspect], first: Suspect, fatal_pids: Sequence[int], strays: Sequence[Stray],
                 at: float, window: float) -> Verdict:
    """Who faulted the GPU.  ``hit``: every program of the GPU that was running (or had just
    failed); ``first``: the program whose failure started the recovery; ``strays``: workers that
    exited on their own with a kernel launched; ``at``: when ``first`` failed (monotonic)."""
    ended = [q for q in hit if q.ended]
    died = [q for q in hit if q.died]
    culprit: Suspect | None = None
    by = ""
    if len(ended) == 1:
        culprit, by = ended[0], "ended"
    elif len(died) == 1:
        culprit, by = died[0], "died"
    near = [] if culprit else [w for w in strays if abs(w.at - at) < window]
    if culprit is None and not near:
        culprit = next((q for q in hit if q.pid in fatal_pids), None)
        by = "server log"
        if culprit is None:
            culprit = min(hit or [first], key=lambda q: q.failed_at or float("inf"))
            by = "first failure"
    if culprit is not None:
        lost = tuple(q for q in hit if q is not culprit)
        return Verdict(culprit.name, culprit.pid, fault_text(culprit, first), culprit, lost, by)
    w = near[-1]
    return Verdict(w.program or f"worker {w.pid}", w.pid, f"worker {w.pid} exited while its kernel ran", None, tuple(hit),
                   "stray", w)


def died_innocent(v: Verdict) -> bool:
    """The culprit is a program whose worker died (killed from outside, say) with no error of its
    own kernel's: its death faulted the GPU, but nothing its code did, so it comes back with the
    innocents, in the same relaunch (its restart policy and crash-loop count still apply)."""
    return v.by == "died" and v.program is not None and not v.program.kernel_error and not v.program.ended


def fault_text(culprit: Suspect, first: Suspect) -> str:
    """The fault in words: a dead worker's own account, else the CUDA error a stream reported
    (the culprit's, else the first failure's), else whatever was said.  A worker that died with
    no account of its own (its end came after the recovery took its program over) is said to
    have died: another program's CUDA error is the fault's effect on that one, not the cause."""
    if culprit.died and culprit.error:
        return culprit.error
    if culprit.died and not culprit.kernel_error:
        return f"worker {culprit.pid} exited while its kernel ran"
    return culprit.kernel_error or first.kernel_error or culprit.error or first.error or "fatal GPU error"
