"""A program's state, its moves, and the one method that changes it.

One :class:`Program` per name, for as long as the name is loaded: an upgrade or a relaunch starts a
new *generation* of the same object (``Program.to`` with a new launch), never a copy of it.  A task
that watches one launch keeps the generation it started with and compares it (``Registry.current``):
a stale task finds another generation, or no program of its name.

Reading never changes anything: ``state`` and ``seen`` show what the end of a launch makes of the
program without taking it in; ``observe`` takes it in, and is called by whoever owns that change
(the launch's watcher, a recovery under the lock), never by a read.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from meshd_mps.base.callstats import CallStats
from meshd_mps.base.errors import StateError
from meshd_mps.base.restart import DEFAULT as DEFAULT_RESTART, Policy
from meshd_mps.base.restore import DEFAULT as DEFAULT_RESTORE, Restore
from meshd_mps.isolation import limits

if TYPE_CHECKING:
    from meshd_mps.backend import Kernel
    from meshd_mps.gpu.compiler import Manifest
    from meshd_mps.isolation.launch import Launch
    from meshd_mps.programs.datastore import ProgramData
    from meshd_mps.protocol.frames import Done
    from meshd_mps.protocol.ring import Ring

log = structlog.get_logger("meshd_mps")


class ProgramState(enum.Enum):
    RUNNING = "running"
    STALLED = "stalled"  # running, but its heartbeat has not advanced for stall_after
    EXITED = "exited"  # its kernel returned by itself (or was halted), DONE ok
    FAILED = "failed"  # its launch failed: an error on its stream, or its worker died
    LOST = "lost"  # torn down by another program's GPU fault; a recovery relaunches or reports it
    FAULTED = "faulted"  # it caused a GPU fault
    RESTARTING = "restarting"  # ended, and relaunched once its backoff is over (its restart policy)
    CRASH_LOOP = "crash-loop"  # failed too often too fast (restart.py): not relaunched again

    @property
    def shown(self) -> str:
        """The state the API and ps show: a lost program is a failed one (``lost_to`` says whose
        fault it was)."""
        return "failed" if self is ProgramState.LOST else self.value


#: The moves Program.to allows within one launch (supervisord's ProcessStates: one table, one
#: transition method).  A new launch (a load's, an upgrade's, a relaunch's) is the other move: from
#: any state to RUNNING, as a new generation (``Program.to`` with ``run``).
PROGRAM_MOVES: dict[ProgramState, frozenset[ProgramState]] = {
    ProgramState.RUNNING: frozenset({ProgramState.STALLED, ProgramState.EXITED, ProgramState.FAILED, ProgramState.LOST,
                                     ProgramState.FAULTED}),
    ProgramState.STALLED: frozenset({ProgramState.RUNNING, ProgramState.EXITED, ProgramState.FAILED, ProgramState.LOST,
                                     ProgramState.FAULTED}),
    # A recovery's verdict, or its restart policy's:
    ProgramState.FAILED: frozenset({ProgramState.LOST, ProgramState.FAULTED, ProgramState.RESTARTING,
                                    ProgramState.CRASH_LOOP}),
    # Named the culprit once its clients are gone; or its relaunch after the fault failed:
    ProgramState.LOST: frozenset({ProgramState.FAULTED, ProgramState.RESTARTING, ProgramState.CRASH_LOOP}),
    ProgramState.EXITED: frozenset({ProgramState.RESTARTING, ProgramState.CRASH_LOOP}),  # restart policy always
    ProgramState.FAULTED: frozenset({ProgramState.RESTARTING, ProgramState.CRASH_LOOP}),
    ProgramState.RESTARTING: frozenset({ProgramState.CRASH_LOOP}),  # its relaunch failed once too often
    ProgramState.CRASH_LOOP: frozenset(),
}
#: States in which a program still has a kernel (its launch has not ended).
LIVE = frozenset({ProgramState.RUNNING, ProgramState.STALLED})

#: Generations, unique in this process: a program unloaded and loaded again is a new object whose
#: generation no stale task of the old one can hold.
_GENERATIONS = itertools.count(1)


@dataclass(frozen=True)
class Run:
    """One launch of a program, as a load, an upgrade or a relaunch starts it."""

    kernel: Kernel
    launch: Launch
    hash: int
    compile_ms: float = 0.0
    cached: bool = False
    manifest: Manifest | None = None
    ptx: bytes = b""


#: ``Program.to``'s keyword for a field it leaves as it is.
_KEEP: object = object()


@dataclass
class Program:
    name: str
    slot: int
    kernel: Kernel
    launch: Launch
    hash: int
    nodes: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)  # its launch's wall time (kept across a live restore)
    upgrades: int = 0
    compile_ms: float = 0.0
    cached: bool = False
    manifest: Manifest | None = None
    ptx: bytes = b""
    restarts: int = 0
    restart: Policy = DEFAULT_RESTART  # its restart policy (restart.py)
    restore: Restore = DEFAULT_RESTORE  # what the next start does with it (restore.py); chosen at load, kept
    failures: tuple[float, ...] = ()  # monotonic times of its recent failures (restart.decide)
    restart_at: float = 0.0  # RESTARTING: the monotonic time of its relaunch
    phase: ProgramState = ProgramState.RUNNING  # changed only by to()
    error: str = ""  # what the latest move to FAILED or FAULTED said
    lost_to: str = ""  # LOST: the program whose fault took this one down, once named
    failed_at: float = 0.0  # monotonic time its launch was seen failing
    #: Its failure dealt with as its own (its report made): left FAILED so (restart policy never),
    #: it is no part of a later fault of its GPU.
    settled: bool = False
    beat: int = -1  # the HEARTBEAT last seen (Heartbeats.sample)
    beat_at: float = field(default_factory=time.monotonic)  # when it was last seen advancing
    beaten: bool = False  # seen advancing at least once: a program that never beats never stalls
    sampled_at: float = field(default_factory=time.monotonic)  # when ``beat`` was read (or its launch)
    stalled_at: float = 0.0  # monotonic time it was found stalled (0: not stalled)
    ring: Ring | None = field(default=None, repr=False)  # the host's end of its slot's ring (Calls.ring)
    data: ProgramData | None = None  # its data (programs/data.py): set at load, replaced by an upgrade to other data
    #: Its calls (calls.py records them): observations, as ``beat`` is, kept across its launches.
    calls: CallStats = field(default_factory=CallStats, repr=False)
    answer_s: float = 0.0  # its calls' typical time to an answer (a moving mean): an observation, as ``calls``
    faults: int = 0  # its launches seen failing (``to`` with ``failed_at``), across its launches
    generation: int = field(default_factory=lambda: next(_GENERATIONS))  # its launch's (see the module's doc)

    @property
    def data_bytes(self) -> int:
        """The device memory its data holds (0: it has none)."""
        return self.data.spec.alloc if self.data is not None else 0

    @property
    def device(self) -> int:
        """The GPU it runs on."""
        return self.kernel.device

    def to(self, state: ProgramState | None, error: str = "", *, run: Run | None = None, upgraded: bool = False,
           restart: Policy | None = None, lost_to: str | None = None, failures: tuple[float, ...] | None = None,
           restart_at: float | None = None, settled: bool | None = None, failed_at: float | None = None,
           stalled_at: float | None = None, data: ProgramData | object | None = _KEEP) -> bool:
        """The one writer of a program's state: its phase, and the fields that go with a move (each
        keyword not None is written, whether the phase moves or not; ``state`` None: it stays
        where it is, only the fields are written).  A move PROGRAM_MOVES does
        not list is refused (StateError), unless ``run`` is given: a new launch, to RUNNING from any
        state, which starts a new generation (``upgraded``: by an upgrade, whose count it adds to and
        whose failures and relaunches it forgets; else a relaunch, counted in ``restarts``).
        True if the phase moved."""
        if state is None:
            state = self.phase
        if run is not None:
            if state is not ProgramState.RUNNING:
                raise StateError(f"program {self.name}: a new launch is RUNNING, not {state.value}",
                                 what=f"program {self.name}", frm=self.phase.value, to=state.value)
            self._launched(run, upgraded)
        elif state != self.phase and state not in PROGRAM_MOVES[self.phase]:
            raise StateError(f"program {self.name}: {self.phase.value} -> {state.value} is not a move a program makes",
                             what=f"program {self.name}", frm=self.phase.value, to=state.value)
        moved = state != self.phase
        if moved:
            log.debug("program state", program=self.name, frm=self.phase.value, to=state.value)
            self.phase = state
        if error:
            self.error = error
        if data is not _KEEP:
            self.data = data  # type: ignore[assignment]
        for k, v in (("restart", restart), ("lost_to", lost_to), ("failures", failures), ("restart_at", restart_at),
                     ("settled", settled), ("failed_at", failed_at), ("stalled_at", stalled_at)):
            if v is not None:
                setattr(self, k, v)
        if failed_at:  # a launch seen failing: counted (the metrics' faults of this program)
            self.faults += 1
        return moved or run is not None

    def _launched(self, run: Run, upgraded: bool) -> None:
        """A new generation (``to`` only): the launch's fields, and everything about the old
        launch forgotten."""
        now = time.monotonic()
        self.kernel, self.launch, self.hash = run.kernel, run.launch, run.hash
        self.compile_ms, self.cached, self.manifest, self.ptx = run.compile_ms, run.cached, run.manifest, run.ptx
        self.generation = next(_GENERATIONS)
        if upgraded:
            self.upgrades += 1
            self.restarts, self.failures = 0, ()
        else:
            self.restarts += 1
        self.started, self.started_wall = now, time.time()
        self.phase = ProgramState.RUNNING
        self.error = self.lost_to = ""
        self.failed_at = self.restart_at = self.stalled_at = 0.0
        self.settled = self.beaten = False
        self.beat, self.beat_at, self.sampled_at, self.ring = -1, now, now, None

    def saw_beat(self, hb: int, now: float) -> None:
        """A heartbeat read from its slot (Heartbeats.sample): an observation, not a state."""
        self.sampled_at = now
        if hb != self.beat:
            if self.advanced(hb):
                self.beaten = True
            self.beat, self.beat_at = hb, now

    def advanced(self, hb: int) -> bool:
        """Whether ``hb``, read from its slot, is a beat since the last sample: another count, and
        not the zero its slot was given at launch (a count is beats since)."""
        return hb != self.beat and (self.beat >= 0 or hb != 0)

    # ---- reads (none of them changes anything) --------------------------------------------------
    def ended(self) -> tuple[ProgramState, str] | None:
        """What the end of its launch makes of it, if the launch ended while it was live: (the
        state, the error); None otherwise.  A read: ``observe`` takes it in."""
        if self.phase not in LIVE or not self.launch.finished():
            return None
        f = self.launch.inner
        if f.cancelled():
            return ProgramState.FAILED, "cancelled"
        if (e := f.exception()) is not None:
            return ProgramState.FAILED, str(e)
        d: Done = f.result()
        return (ProgramState.EXITED, "") if d.ok else (ProgramState.FAILED, d.message)

    def seen(self) -> ProgramState:
        """Its state, the end of its launch counted in (a read: nothing is changed)."""
        end = self.ended()
        return self.phase if end is None else end[0]

    def kernel_error(self) -> str:
        """The CUDA error its stream reported, if one did: a DONE that failed, or (MPS) its own
        worker's first stream error (the evidence faults.py weighs above a worker's death)."""
        k = self.kernel
        if own := k.own_error():
            return own
        f = self.launch.inner
        if f.done() and not f.cancelled() and f.exception() is None and not f.result().ok:
            return str(f.result().message)
        return ""

    def share(self) -> float:
        """The part of its GPU's resident blocks it holds while it runs (limits.py)."""
        return 0.0 if self.launch.finished() else limits.share(self.nodes, self.kernel.per_sm, self.kernel.sms)

    def beat_age(self, now: float | None = None, hb: int | None = None) -> float | None:
        """Seconds since its heartbeat was last seen advancing (None: it never beat).  ``hb``: the
        heartbeat read now, as shown beside the age (describe): if it advanced since the watcher's
        last sample, it beat within ``now - sampled_at``, which is the age then; without it the
        age of a program that beats, read between its launch and the next sample, would be "never"
        beside a count that advances."""
        now = now or time.monotonic()
        if hb is not None and self.advanced(hb):
            return now - self.sampled_at
        return (now - self.beat_at) if self.beaten else None

    def state(self) -> tuple[str, str]:
        """(running | stalled | exited | failed | faulted, the error text), as the API shows it; a
        read: the end of its launch is shown, not taken in."""
        end = self.ended()
        st, error = (self.phase, self.error) if end is None else (end[0], end[1] or self.error)
        if st is ProgramState.STALLED:
            return st.shown, f"no heartbeat for {self.beat_age() or 0:.1f}s"
        if st is ProgramState.RESTARTING:
            return st.shown, f"relaunched in {max(0.0, self.restart_at - time.monotonic()):.1f}s after: {error}"
        return st.shown, error if st not in LIVE else ""

    # ---- the one step that takes an observation in --------------------------------------------
    def observe(self) -> ProgramState:
        """The end of its launch (if it ended) taken into its state, through ``to``: called by
        whoever owns that change (the launch's watcher, a recovery under the lock), never by a read.
        The state."""
        if (end := self.ended()) is not None:
            self.to(*end)
        return self.phase
