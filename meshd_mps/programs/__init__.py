"""Named resident programs on mailbox slots: load, upgrade in place, unload, call.

The layer ``meshd-mps serve`` exposes.  An upgrade prepares the new image
first (in MPS mode that includes the preload into a pooled worker, while the
old version keeps running), then halts the old one through its slot and
starts the new one on the same slot.

Several GPUs: a program goes to the GPU named, else to the one with the
fewest programs (ties to the lowest ordinal), and stays there through
upgrades and fault relaunches.  MPS contains a fatal fault to the clients of
the faulting GPU, so a fault's recovery is scoped to that GPU: only its
workers and pool are retired and only its programs relaunched.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from meshd_mps import faults, restart
from meshd_mps.backend import Backend, Image, Kernel
from meshd_mps.errors import (
    AlreadyLoaded,
    CallTimeout,
    ConfigError,
    HaltTimeout,
    ManifestError,
    MeshError,
    NoFreeSlot,
    NotLoaded,
    NotRunning,
    NotStarted,
    RingFull,
    SlotTaken,
    StateError,
    Unavailable,
    UpgradeMismatch,
    WorkerError,
)
from meshd_mps.gpu.compiler import Manifest
from meshd_mps.isolation import limits
from meshd_mps.isolation.base import Found
from meshd_mps.isolation.launch import Launch
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Done
from meshd_mps.protocol.ring import MASK, SPIN, Ring, check_payload

if TYPE_CHECKING:
    from meshd_mps.state.desired import Recorder

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


#: The moves Program.to allows (supervisord's ProcessStates: one table, one transition method).
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


@dataclass
class Program:
    name: str
    slot: int
    kernel: Kernel
    launch: Launch
    hash: int
    nodes: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    upgrades: int = 0
    compile_ms: float = 0.0
    cached: bool = False
    manifest: Manifest | None = None
    ptx: bytes = b""
    restarts: int = 0
    policy: restart.Policy = restart.DEFAULT
    failures: tuple[float, ...] = ()  # monotonic times of its recent failures (restart.decide)
    restart_at: float = 0.0  # RESTARTING: the monotonic time of its relaunch
    phase: ProgramState = ProgramState.RUNNING  # changed only by to(), and by observe() when its launch ends
    error: str = ""  # what the latest move to FAILED or FAULTED said
    lost_to: str = ""  # LOST: the program whose fault took this one down, once named
    failed_at: float = 0.0  # monotonic time its launch was seen failing
    #: Its failure dealt with as its own (its report made): left FAILED so (restart policy never),
    #: it is no part of a later fault of its GPU.
    settled: bool = False
    beat: int = -1  # the HEARTBEAT last seen (Programs.sample)
    beat_at: float = field(default_factory=time.monotonic)  # when it was last seen advancing
    beaten: bool = False  # seen advancing at least once: a program that never beats never stalls
    stalled_at: float = 0.0  # monotonic time it was found stalled (0: not stalled)
    ring: Ring | None = field(default=None, repr=False)  # the host's end of its slot's ring (Programs.ring)

    @property
    def device(self) -> int:
        """The GPU it runs on."""
        return self.kernel.device

    def to(self, state: ProgramState, error: str = "") -> bool:
        """The one way the state changes: False if it is there already, StateError if
        PROGRAM_MOVES does not allow the move."""
        if state == self.phase:
            return False
        if state not in PROGRAM_MOVES[self.phase]:
            raise StateError(f"program {self.name}: {self.phase.value} -> {state.value} is not a move a program makes",
                             what=f"program {self.name}", frm=self.phase.value, to=state.value)
        log.debug("program state", program=self.name, frm=self.phase.value, to=state.value)
        self.phase = state
        if error:
            self.error = error
        return True

    def observe(self) -> ProgramState:
        """The state, once the end of its launch (if it ended) is taken into it."""
        if self.phase in LIVE and self.launch.finished():
            f = self.launch.inner
            if f.cancelled():
                self.to(ProgramState.FAILED, "cancelled")
            elif (e := f.exception()) is not None:
                self.to(ProgramState.FAILED, str(e))
            else:
                d: Done = f.result()
                self.to(ProgramState.EXITED) if d.ok else self.to(ProgramState.FAILED, d.message)
        return self.phase

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

    def beat_age(self, now: float | None = None) -> float | None:
        """Seconds since its heartbeat was last seen advancing (None: it never beat)."""
        return ((now or time.monotonic()) - self.beat_at) if self.beaten else None

    def state(self) -> tuple[str, str]:
        """(running | stalled | exited | failed | faulted, the error text), as the API shows it."""
        st = self.observe()
        if st is ProgramState.STALLED:
            return st.shown, f"no heartbeat for {self.beat_age() or 0:.1f}s"
        if st is ProgramState.RESTARTING:
            return st.shown, f"relaunched in {max(0.0, self.restart_at - time.monotonic()):.1f}s after: {self.error}"
        return st.shown, self.error if st not in LIVE else ""


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


#: A recovery's steps, as FaultReport.steps and the bench show them: the fault's evidence weighed
#: (``decide``), the GPU's workers retired and exited (``teardown``), the first new context
#: (``server_ready``: the server takes clients again), the rest of them (``contexts``), the lost
#: programs loaded and started again (``relaunch``).
RECOVERY_STEPS = ("decide", "teardown", "server_ready", "contexts", "relaunch")


class Programs:
    """``policy``: the restart policy of a program loaded without one (restart.py)."""

    def __init__(self, backend: Backend, policy: restart.Policy | str = restart.DEFAULT, stall_after: float | None = None):
        self.d = backend.deadlines
        stall_after = self.d.stall if stall_after is None else stall_after
        if not stall_after > 0:
            raise ConfigError(f"stall_after {stall_after!r}: seconds, more than 0")
        self.b = backend
        self.policy = restart.Policy.parse(policy)
        self.stall_after = stall_after
        self.start_ms: list[float] = []  # the start check's share of each load: LAUNCHED -> STATE = RUNNING
        self.by_name: dict[str, Program] = {}
        self._lock = anyio.Lock()  # one load/upgrade/unload/recovery at a time
        self.loads = 0
        self.load_ms: list[float] = []
        self.faults: list[FaultReport] = []
        self.failed_total = 0  # launches of loaded programs that failed (the metrics' counters)
        self.deaths_total = 0  # ... of them because the worker process died
        self.relaunched_total = 0  # programs relaunched by a recovery or their restart policy
        #: Where successful loads, upgrades and unloads are recorded (state/desired.py); None: nowhere.
        self.recorder: Recorder | None = None
        self._closing = False
        self.b.start_soon(self._beats, name="heartbeats")

    def _free_slot(self, want: int | None = None) -> int:
        """A mailbox slot no program holds: ``want`` (a restore's), else the lowest."""
        used = {p.slot for p in self.by_name.values()}
        if want is not None:
            if not 0 <= want < abi.SLOTS or want in used:
                holder = next((p.name for p in self.by_name.values() if p.slot == want), None)
                raise SlotTaken(want, holder)
            return want
        for s in range(abi.SLOTS):
            if s not in used:
                return s
        raise NoFreeSlot(abi.SLOTS)

    def get(self, name: str) -> Program:
        p = self.by_name.get(name)
        if p is None:
            raise NotLoaded(name)
        return p

    @staticmethod
    def _manifest(manifest: Manifest | bytes | str | Mapping[str, Any]) -> Manifest:
        return manifest if isinstance(manifest, Manifest) else Manifest.parse(manifest)

    async def _start(self, img: Image, slot: int, nodes: int, used: float) -> tuple[Kernel, Launch]:
        """Loaded, launched, and seen started; anything less is rolled back.  ``used``: the shares
        of its GPU's blocks that the other programs hold (the module's real occupancy is checked
        against what they leave before it is launched)."""
        name = img.name

        def admit(info: frames.Loaded) -> None:
            limits.check_resident(name, nodes, info.per_sm, info.sms, used)

        k = await self.b.load(img, admit)
        return k, await self._launch(k, slot, nodes)

    async def _launch(self, k: Kernel, slot: int, nodes: int) -> Launch:
        """A loaded kernel launched on ``slot`` and seen started; anything less is rolled back."""
        try:
            self.b.mailbox.reset_slot(slot)
            run = await self.b.launch(k, slot, nodes)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.b.unload(k)
            raise
        try:
            await self._until_started(k, run, slot)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.b.abandon(k, slot)
            raise
        return run

    async def _until_started(self, k: Kernel, run: Launch, slot: int) -> None:
        """The start check: a launched kernel counts only once it has set STATE = RUNNING (or
        already ended), within the start deadline; NotStarted otherwise.  A kernel on a hardware
        queue held by a resident one, or whose blocks wait for SMs, is launched but never runs."""
        within = self.d.start
        mb = self.b.mailbox
        t0 = time.perf_counter()
        with anyio.move_on_after(within):
            while mb.u32(slot, abi.STATE) == abi.IDLE and not run.inner.done():
                # The kernel writes STATE within microseconds of LAUNCHED: yield first, then back off.
                await anyio.sleep(0 if time.perf_counter() - t0 < 200e-6 else 1e-3)
            self.start_ms.append((time.perf_counter() - t0) * 1e3)
            del self.start_ms[:-1000]
            return
        why = self.b.not_started_why(k.device)
        log.error(f"program {k.name}: its kernel did not start within {within:g}s; rolling the load back", program=k.name,
                  pid=k.pid, slot=slot, device=k.device)
        raise NotStarted(f"{k.name}: the kernel was launched but did not start within {within:g}s (STATE is not RUNNING):"
                         f" likely {why}; the load was rolled back", program=k.name, within=within, likely=why)

    def _used(self, device: int, without: Program | None = None) -> float:
        """The shares of GPU ``device``'s resident blocks its running programs hold (``without`` one)."""
        return sum(p.share() for p in self.on_device(device) if p is not without)

    def place(self, device: int | None = None) -> int:
        """The GPU for a new program: ``device`` if it is one of ours, else the one with the
        fewest programs (ties to the lowest ordinal)."""
        if device is not None:
            return self.b.device_or_first(device)
        count = {d: 0 for d in self.b.devices}
        for p in self.by_name.values():
            count[p.device] = count.get(p.device, 0) + 1
        return self.b.least_loaded(count)

    def on_device(self, device: int) -> list[Program]:
        return [p for p in self.by_name.values() if p.device == device]

    async def load(self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, expect: int | None = None,
                   nodes: int = 1, device: int | None = None, policy: restart.Policy | str | None = None,
                   slot: int | None = None) -> Program:
        """Compile, preload and launch on a free slot (``slot``: that one, a restore's), on GPU
        ``device`` (None: ``place``'s choice); ``policy``: its restart policy (None: the default of
        these Programs)."""
        m = self._manifest(manifest)
        pol = self.policy if policy is None else restart.Policy.parse(policy)
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise ManifestError(f"{m.name}: nodes {nodes!r}: a count of blocks expected")
        async with self._lock:
            if self._closing:
                raise Unavailable(f"{m.name}: meshd-mps is shutting down: no program is loaded now")
            if m.name in self.by_name:
                raise AlreadyLoaded(m.name)
            slot = self._free_slot(slot)
            gpu = self.place(device)
            used = self._used(gpu)
            self.b.admit(gpu, m.name, nodes, used)  # every limit, before anything changes
            t0 = time.perf_counter()
            img = await self.b.prepare(m, ptx, expect, device=gpu)
            try:
                k, run = await self._start(img, slot, nodes, used)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.b.drop(img)
                raise
            p = Program(m.name, slot, k, run, img.prepared.hash, nodes, compile_ms=img.prepared.compile_ms,
                        cached=img.prepared.cached, manifest=m, ptx=ptx, policy=pol)
            self._install(p)
            self._count(t0)
            log.info(f"program {m.name} loaded on slot {slot}, GPU {k.device}", program=m.name, pid=k.pid, slot=slot,
                     device=k.device)
            await self._record(p)
            return p

    async def _record(self, p: Program) -> None:
        """The change into the desired state (if one is kept) before the request is answered; a
        write that fails is logged, the program runs on (the state is then behind, and says so)."""
        if self.recorder is not None:
            try:
                await self.recorder.loaded(p)
            except MeshError as e:
                log.error(f"program {p.name}: not recorded in the desired state: {e}", program=p.name)

    async def _forget(self, name: str) -> None:
        if self.recorder is not None:
            try:
                await self.recorder.unloaded(name)
            except MeshError as e:
                log.error(f"program {name}: its unload not recorded in the desired state: {e}", program=name)

    def _install(self, p: Program) -> None:
        self.by_name[p.name] = p
        self.b.start_soon(self._watch, p, name=f"watch {p.name}")

    def _count(self, t0: float) -> None:
        self.loads += 1
        self.load_ms.append((time.perf_counter() - t0) * 1e3)
        del self.load_ms[:-1000]

    async def _halt(self, p: Program, within: float | None = None) -> None:
        """HALT through the slot and wait for the program's DONE; an MPS worker that
        does not stop is killed, since it would never be fit again."""
        if p.launch.finished():
            return
        within = self.d.halt if within is None else within
        self.b.mailbox.halt(p.slot)
        with anyio.move_on_after(within):
            with contextlib.suppress(WorkerError):
                await p.launch.wait()
            return
        if self.b.retire_stuck(p.kernel):
            log.error(f"program {p.name} did not halt in {within:g}s; retiring its worker", pid=p.kernel.pid)
            return
        raise HaltTimeout(f"program {p.name} did not halt within {within:g}s", programs=(p.name,), within=within)

    # ---- live restore -------------------------------------------------------------------------
    async def adopt(self, f: Found, manifest: Manifest, ptx: bytes, hash: int, nodes: int,
                    policy: restart.Policy | str | None = None) -> Program:
        """A program an earlier meshd-mps left running (live restore, ``Backend.found``), taken
        over as it runs: its worker, kernel and launch unchanged, nothing halted, its heartbeat
        counted on from the mailbox.  The caller (state/desired.py) matched it to its record."""
        pol = self.policy if policy is None else restart.Policy.parse(policy)
        assert f.launch is not None, "adopt: a module with no launch runs nothing"
        async with self._lock:
            if f.name in self.by_name:
                raise AlreadyLoaded(f.name)
            slot = self._free_slot(f.launch.slot)
            k = self.b.take(f, manifest)
            assert k.launch is not None
            p = Program(f.name, slot, k, k.launch, hash, nodes, cached=True, manifest=manifest, ptx=ptx, policy=pol)
            p.beat = self.b.mailbox.heartbeat(slot)
            p.beaten = p.beat > 0  # it beat before we came: a stall from here on is one
            self._install(p)
            log.info(f"program {f.name} adopted on slot {slot}, GPU {k.device}, worker {k.pid}: it runs on",
                     program=f.name, pid=k.pid, slot=slot, device=k.device, heartbeat=p.beat)
            return p

    async def discard(self, f: Found, why: str) -> None:
        """An adopted module that the desired state does not want (no record names it, another
        version, a half-done load or upgrade): its kernel halted through its slot if it runs, and
        the module unloaded (MPS: its worker back to the pool; blink: in one blink)."""
        async with self._lock:
            k = self.b.take(f, None)
            log.warning(f"program {f.name} on worker {k.pid}: halted and unloaded at adoption: {why}", program=f.name,
                        pid=k.pid, slot=f.launch.slot if f.launch else None)
            if k.launch is not None:
                await self.b.abandon(k, k.launch.slot)
            else:
                await self.b.unload(k)

    async def detach(self) -> None:
        """Live restore's stop: the programs are forgotten here, never halted; their workers run on
        for the next meshd-mps (Backend.detach)."""
        async with self._last():
            n = len(self.by_name)
            self.by_name.clear()
        log.info(f"{n} programs left running for the next meshd-mps")

    @contextlib.asynccontextmanager
    async def _last(self) -> AsyncIterator[None]:
        """Closing, shielded: nothing starts from now on (``_closing``), and the block runs under
        the lock once the load, upgrade or relaunch under way has ended (each bounded by its own
        deadlines, all by ``recover`` here), so that what it installs is closed with the rest."""
        self._closing = True
        with anyio.CancelScope(shield=True):
            locked = False
            with anyio.move_on_after(self.d.recover):
                await self._lock.acquire()
                locked = True
            if not locked:
                log.error(f"programs: a load, upgrade or relaunch still held the lock {self.d.recover:g}s into the"
                          " close; closing without it")
            try:
                yield
            finally:
                if locked:
                    self._lock.release()

    async def upgrade(self, name: str, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes,
                      expect: int | None = None, policy: restart.Policy | str | None = None) -> Program:
        """A new image on the program's slot; its restart policy kept unless ``policy`` is given, and
        its failures forgotten (a crash-looping program comes back by an upgrade)."""
        m = self._manifest(manifest)
        pol = None if policy is None else restart.Policy.parse(policy)
        if m.name != name:
            raise UpgradeMismatch(f"upgrade {name}: the manifest names {m.name!r}", program=name, field="name")
        async with self._lock:
            old = self.get(name)
            used = self._used(old.device, without=old)
            self.b.admit(old.device, name, old.nodes, used, new=False)
            t0 = time.perf_counter()
            # MPS: loaded in a worker of the program's GPU while the old one runs.
            img = await self.b.prepare(m, ptx, expect, device=old.device)
            stopped = False
            try:
                await self._halt(old)
                stopped = True
                await self.b.unload(old.kernel)
                k, run = await self._start(img, old.slot, old.nodes, used)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.b.drop(img)
                    if stopped:
                        await self._restore(old)
                raise
            p = Program(name, old.slot, k, run, img.prepared.hash, old.nodes, upgrades=old.upgrades + 1,
                        compile_ms=img.prepared.compile_ms, cached=img.prepared.cached, manifest=m, ptx=ptx,
                        policy=old.policy if pol is None else pol)
            self._install(p)
            self._count(t0)
            log.info(f"program {name} upgraded on slot {p.slot}", program=name, pid=k.pid)
            await self._record(p)
            return p

    async def _restore(self, old: Program) -> None:
        """A failed upgrade loses nothing: the old version is started again on its slot."""
        try:
            await self._relaunch(old)
            log.info(f"program {old.name}: upgrade failed; the old version runs again", program=old.name)
        except BaseException as e:  # reported, and the upgrade's own error is raised
            self.by_name.pop(old.name, None)
            log.error(f"program {old.name}: upgrade failed and the old version did not restart: {e}", program=old.name)

    async def unload(self, name: str) -> None:
        async with self._lock:
            p = self.get(name)
            await self._halt(p)
            del self.by_name[name]
            await self.b.unload(p.kernel)
            log.info(f"program {name} unloaded from slot {p.slot}", program=name)
            await self._forget(name)

    # ---- the ring ----------------------------------------------------------------------------
    #: After the spin (ring.SPIN), a wait yields to the loop for this long, then sleeps BACKOFF.
    YIELDS = 200e-6
    BACKOFF = 1e-3
    #: How long ``call_many`` holds the loop between yields while its responses keep coming (s):
    #: a yield each ring.SPIN (20 us) cost ~5 % of its throughput at 8 outstanding against one each
    #: 50 or 100 us (the 2-core CPU machine, uvloop, a process answering; on the H200:
    #: scripts/issue18_probes.py hold).  Other tasks wait at most this, plus a response's spin (ring.SPIN).
    HOLD = 50e-6

    def _ring(self, name: str) -> tuple[Program, Ring]:
        p = self.get(name)
        if p.launch.finished():
            raise NotRunning(f"program {name} is not running ({p.state()[0]})", program=name, state=p.state()[0])
        if p.ring is None:
            p.ring = Ring(self.b.mailbox, p.slot)
        return p, p.ring

    def _current_ring(self, p: Program) -> None:
        """A response read from ``p``'s slot is its own only while ``p`` is still the program of its
        name: a new launch on the slot (an upgrade, a relaunch) starts the ring again and answers
        other requests; an unload leaves nobody to answer."""
        if self.by_name.get(p.name) is not p:
            raise NotRunning(f"program {p.name} was replaced or unloaded before its response was read",
                             program=p.name, state=p.state()[0])

    async def _answer(self, p: Program, ring: Ring, seq: int, within: float, deadline: float) -> bytes:
        """The response to ``seq``: a spin of ring.SPIN (the bus answers in ~5 us on the H200),
        then yields to the loop for YIELDS, then BACKOFF sleeps, until ``deadline`` (monotonic)."""
        got = ring.spin(seq, SPIN)
        t0 = time.monotonic()
        while got is None:
            if p.launch.finished():
                raise NotRunning(f"program {p.name} ended before answering ({p.state()[1] or p.state()[0]})",
                                 program=p.name, state=p.state()[0])
            self._current_ring(p)
            now = time.monotonic()
            if now >= deadline:
                raise CallTimeout(p.name, within)
            # asyncio.sleep, not anyio's: this is the hot path (anyio's costs its backend lookup).
            await asyncio.sleep(0 if now - t0 < self.YIELDS else self.BACKOFF)
            got = ring.response(seq)
        self._current_ring(p)
        return got

    async def call(self, name: str, payload: bytes, within: float | None = None) -> bytes:
        """A request through the program's ring, and its response.  The wait gives the loop back
        once first (other callers post meanwhile, while the GPU answers), then spins for at most
        ring.SPIN, then backs off: nothing is spent while nothing is asked.  Spinning at once
        instead measured no faster on the H200, and slower at p99 (docs/benchmarks.md, Issue 18)."""
        within = self.d.call if within is None else within
        p, ring = self._ring(name)
        seq = ring.post(payload)
        try:
            await asyncio.sleep(0)
            return await self._answer(p, ring, seq, within, time.monotonic() + within)
        except BaseException:
            ring.forget(seq)
            raise

    async def call_many(self, name: str, payloads: Sequence[bytes], within: float | None = None,
                        window: int = abi.RING) -> list[bytes]:
        """Requests through the program's ring, pipelined: up to ``window`` (1..RING) outstanding,
        posted in batches as the ring has room (each batch published by one REQ_HEAD), the
        responses read half a window at a time, so that the program serves the other half
        meanwhile; their responses, in order.  ``within`` bounds each response's wait.  The loop
        is given back at least every HOLD (plus a response's spin, ring.SPIN).

        A batch's requests have consecutive sequence numbers; two batches need not: another caller
        (``call``) may post between them while this one gives the loop back.  So each batch's first
        number is kept, and a read never runs past its batch."""
        within = self.d.call if within is None else within
        window = max(1, min(window, abi.RING))
        half = (window + 1) // 2
        for x in payloads:
            check_payload(x)
        p, ring = self._ring(name)
        total = len(payloads)
        out: list[bytes] = []
        sent = done = 0
        #: The batches posted and not wholly read, in order: (the first one's sequence number, its
        #: first request's index in ``payloads``, how many).
        batches: deque[tuple[int, int, int]] = deque()
        clock = time.perf_counter
        held = clock()
        try:
            while done < total:
                # Posted in one batch, one REQ_HEAD, as far as the window and the ring's room go
                # (smaller batches measured no faster on the H200).
                k = min(window - (sent - done), total - sent)
                if k > 0:
                    first, k = ring.post_some(payloads, sent, k)
                    if k:
                        batches.append((first, sent, k))
                        sent += k
                if sent == done:  # other callers hold the whole ring
                    raise RingFull(p.slot, abi.RING)
                # At most half the window's responses are read before the next post: the program
                # serves one half while the host reads the other and refills it (on the 2-core CPU
                # machine 0.9 us a request at 8 outstanding, against 1.3 us reading all of them).
                first, at, k = batches[0]
                seq = (first + done - at) & MASK
                most = min(half, at + k - done)
                if not ring.take(seq, most, out):
                    out.append(await self._answer(p, ring, seq, within, time.monotonic() + within))
                    ring.take((seq + 1) & MASK, most - 1, out)
                done = len(out)
                if done == at + k:
                    batches.popleft()
                if (now := clock()) - held > self.HOLD:
                    await asyncio.sleep(0)
                    held = now
        except BaseException:
            for first, at, k in batches:  # the requests posted and not read: this caller's own
                for i in range(max(len(out), at), at + k):
                    ring.forget((first + i - at) & MASK)
            raise
        return out

    # ---- faults and restarts ------------------------------------------------------------------
    async def _watch(self, p: Program) -> None:
        """Await a program's end: a failure may be a fault of its GPU (``_on_failure``); a kernel
        that returned by itself is relaunched under restart policy always.  An end of ours (a halt
        for an unload or an upgrade, a close) is left alone: the lock is taken first, and by then
        the program is replaced or gone."""
        died = False
        try:
            d = await p.launch.wait()
            failed = not d.ok
        except Exception as e:
            failed, died = True, isinstance(e, WorkerError)
        if self._closed() or self.by_name.get(p.name) is not p:
            return
        if failed:
            p.failed_at = time.monotonic()
            self.failed_total += 1
            self.deaths_total += died
        st = p.observe()
        if st is ProgramState.FAILED:
            await self._on_failure(p)
        elif st is ProgramState.EXITED and p.policy is restart.Policy.ALWAYS:
            async with self._lock:
                if self._current(p, ProgramState.EXITED):
                    self._after_end(p, restart.End.EXITED)

    def _current(self, p: Program, state: ProgramState) -> bool:
        """``p`` is still the loaded program of its name, in ``state`` (nothing dealt with it meanwhile),
        and the backend is not closing (its close kills every worker: no fault of anyone's)."""
        return not self._closed() and self.by_name.get(p.name) is p and p.observe() is state

    def _closed(self) -> bool:
        return self._closing or self.b.closed

    def _suspect(self, q: Program, ended: bool = False) -> faults.Suspect:
        return faults.Suspect(q.name, q.kernel.pid, q.failed_at, ended=ended,
                              died=q.kernel.died_on_its_own(), error=q.state()[1],
                              kernel_error=q.kernel_error())

    async def _on_failure(self, p: Program) -> None:
        async with self._lock:
            if not self._current(p, ProgramState.FAILED):
                return  # a recovery already dealt with it
            t0 = time.perf_counter()
            ev = await self.b.evidence(p.device, wait=self.d.fault_window)
            pids = ev.fatal_pids
            if not ev.gpu_wide:
                # A fault of its GPU if the server logs a fatal fault there, or other programs of
                # that GPU fail with this one (MPS tears down the clients of the faulting GPU only).
                others = [self._suspect(q) for q in self.on_device(p.device)
                          if q is not p and q.observe() is ProgramState.FAILED]
                if not faults.is_gpu_fault(pids, faults.failed_together(self._suspect(p), others, self.d.fault_window)):
                    error = p.state()[1]
                    self.faults.append(FaultReport(time.time(), error, p.name, p.kernel.pid, False, device=p.device,
                                                   by="own", seen_at=p.failed_at))
                    log.error(f"program {p.name} failed: {error}", program=p.name, pid=p.kernel.pid, device=p.device)
                    p.settled = True
                    self._after_end(p, restart.End.FAILED)
                    return
            # Blink: one context, whose error is sticky: a failure is every program's of the GPU.
            await self._recover(p, pids, t0)

    async def _recover(self, first: Program, pids: list[int], t0: float) -> None:
        """Every program of ``first``'s GPU was torn down (MPS: every client; blink: the context):
        retire its workers while their successors start, held; name the culprit
        (faults.name_culprit); once the server takes clients again bring the lost programs back
        (not the culprit, whose restart policy decides), then refill the pool.  Other GPUs are not
        touched."""
        gpu = first.device
        steps: dict[str, float] = {}
        t = t0

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = round((now - t) * 1e3, 2)
            t = now

        first_seen = self._suspect(first)
        # Every program of that GPU goes down with it: the ones still running fail within ms (some
        # FAILED already, not yet seen by their watchers).  One whose failure was dealt with before
        # as its own (restart policy never leaves it FAILED) is no part of this fault.
        hit = [q for q in self.on_device(gpu)
               if (st := q.observe()) in LIVE or (st is ProgramState.FAILED and not q.settled)]
        for q in hit:
            q.to(ProgramState.LOST)  # their watchers leave them to this recovery
        step("decide")
        back = [q for q in hit if q.policy is not restart.Policy.NEVER]
        await self.b.teardown(gpu, ahead=len(back))  # every worker of that GPU retired and awaited
        ev = await self.b.evidence(gpu, ours={q.kernel.pid for q in hit})
        pids = pids or ev.fatal_pids  # the server may name the culprit only once its clients are gone
        step("teardown")
        strays = ev.strays
        suspects = [self._suspect(q, ended=self.b.mailbox.u32(q.slot, abi.STATE) == abi.EXITED) for q in hit]
        v = faults.name_culprit(suspects, first_seen, pids, strays, first.failed_at or time.monotonic(),
                                self.d.fault_window)
        named = {q.name: q for q in [first, *hit]}
        culprit = named[v.program.name] if v.program is not None else None
        if culprit is not None:
            culprit.to(ProgramState.FAULTED, v.why)
        if v.by == "first failure":
            log.info("the fault's evidence names no culprit; the first program seen failing is taken for it",
                     program=v.culprit, device=gpu)
        if v.stray is not None:
            self.b.took(gpu, v.stray)
        lost = [named[q.name] for q in v.lost]
        for q in lost:
            q.lost_to = v.culprit
        r = FaultReport(time.time(), v.why, v.culprit, v.pid, True, [q.name for q in lost], device=gpu, by=v.by,
                        seen_at=first.failed_at, steps=steps)
        log.error(f"GPU fault on GPU {gpu} in program {v.culprit} (worker {v.pid}): {v.why}; "
                  f"lost with it: {', '.join(r.lost) or 'none'}", program=v.culprit, device=gpu)
        back = [q for q in lost if q.policy is not restart.Policy.NEVER]
        for q in lost:
            if q not in back:
                r.not_relaunched[q.name] = "restart policy never"
        ready = await self.b.refill(gpu, len(back))
        ctx = self.b.first_context_at(gpu)
        if ctx:
            steps["server_ready"] = round(max(0.0, ctx - t) * 1e3, 2)
            t = max(t, ctx)
        step("contexts")
        if back and not ready:
            for q in back:  # tried again by their restart policy, at once
                q.error = r.not_relaunched[q.name] = f"GPU {gpu} took no new workers within {self.d.recover:g}s"
                self._after_end(q, restart.End.LOST)
            back = []
        failed = await self._bring_back(back)
        step("relaunch")
        self.b.recovered(gpu)
        for q in back:
            if q.name in failed:
                r.not_relaunched[q.name] = str(failed[q.name])
                log.error(f"program {q.name}: not relaunched after the fault: {failed[q.name]}", program=q.name)
                q.error = f"relaunch after the fault failed: {failed[q.name]}"
                self._after_end(q, restart.End.FAILED)
            else:
                r.relaunched.append(q.name)
        if culprit is not None:
            self._after_end(culprit, restart.End.FAULTED)
        r.ms = (time.perf_counter() - t0) * 1e3
        self.faults.append(r)
        log.info(f"GPU {gpu}: fault recovery done in {r.ms:.0f} ms: relaunched {r.relaunched},"
                 f" not {list(r.not_relaunched)}", device=gpu, steps=steps)

    def _after_end(self, p: Program, end: restart.End) -> None:
        """Its restart policy's decision (restart.decide) carried out: a relaunch scheduled after
        its backoff, or a crash loop declared, or nothing."""
        dec = restart.decide(p.policy, end, p.failures, time.monotonic(), self.d)
        p.failures = dec.failures
        if dec.crash_loop:
            p.to(ProgramState.CRASH_LOOP, f"{dec.why}; the last: {p.error or end.value}")
            log.error(f"program {p.name}: {p.error}", program=p.name, failures=len(dec.failures))
            return
        if not dec.relaunch:
            if end is not restart.End.LOST:
                log.info(f"program {p.name}: not relaunched ({dec.why})", program=p.name)
            return
        if self._closed():
            return
        p.to(ProgramState.RESTARTING)
        p.restart_at = time.monotonic() + dec.delay
        log.warning(f"program {p.name}: relaunched in {dec.delay:g}s (restart policy {p.policy.value}, failure"
                    f" {len(dec.failures)} of {restart.CRASH_LOOP_BURST} within {self.d.crash_loop_interval:g}s)",
                    program=p.name)
        self.b.start_soon(self._restart_later, p, name=f"restart {p.name}")

    async def _restart_later(self, p: Program) -> None:
        await anyio.sleep(max(0.0, p.restart_at - time.monotonic()))
        async with self._lock:
            if not self._current(p, ProgramState.RESTARTING):
                return  # unloaded, upgraded or closed meanwhile
            failed = await self._bring_back([p])
            if p.name in failed:
                p.error = f"relaunch failed: {failed[p.name]}"
                log.error(f"program {p.name}: {p.error}", program=p.name)
                self._after_end(p, restart.End.FAILED)
            else:
                log.info(f"program {p.name} relaunched (restart {self.by_name[p.name].restarts})", program=p.name)

    async def _relaunch(self, q: Program) -> None:
        """``q`` started again on its slot (a failed upgrade's old version); its error raised."""
        failed = await self._bring_back([q])
        if q.name in failed:
            raise failed[q.name]

    async def _bring_back(self, qs: list[Program]) -> dict[str, MeshError]:
        """The programs ``qs`` relaunched on their slots, on fresh workers: every image loaded first
        (MPS: each into its own worker, at once), then every one launched, so that in blink mode no
        load halts a relaunched one.  What failed, by name."""
        failed: dict[str, MeshError] = {}
        loaded: list[tuple[Program, Kernel, Image]] = []
        shares = {d: self._used(d) for d in {q.device for q in qs}}  # the GPU's blocks held, the batch's added

        async def load(q: Program) -> None:
            assert q.manifest is not None

            def admit(info: frames.Loaded) -> None:
                limits.check_resident(q.name, q.nodes, info.per_sm, info.sms, shares[q.device])
                shares[q.device] += limits.share(q.nodes, info.per_sm, info.sms)

            try:
                img = await self.b.prepare(q.manifest, q.ptx, device=q.device)
                try:
                    loaded.append((q, await self.b.load(img, admit), img))
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self.b.drop(img)
                    raise
            except MeshError as e:
                failed[q.name] = e

        async with anyio.create_task_group() as tg:
            for q in qs:
                tg.start_soon(load, q)
        # The old workers (retired already) or modules go first, their launches ended: in blink mode
        # an unload is a blink, which would halt the relaunched ones (one that is slow to see HALT
        # would refuse it).  One that cannot be unloaded is left, and said; the relaunch goes on.
        for q, _k, _img in loaded:
            try:
                await self.b.unload(q.kernel)
            except MeshError as e:
                log.warning(f"program {q.name}: its old module was not unloaded before its relaunch: {e}",
                            program=q.name)
        for q, k, img in loaded:
            try:
                run = await self._launch(k, q.slot, q.nodes)
            except MeshError as e:
                failed[q.name] = e
                continue
            self.relaunched_total += 1
            self._install(Program(q.name, q.slot, k, run, img.prepared.hash, q.nodes, upgrades=q.upgrades,
                                  compile_ms=img.prepared.compile_ms, cached=img.prepared.cached, manifest=q.manifest,
                                  ptx=q.ptx, restarts=q.restarts + 1, policy=q.policy, failures=q.failures))
        return failed

    # ---- heartbeats --------------------------------------------------------------------------
    async def _beats(self) -> None:
        """Watch every program's heartbeat, often enough to see a stall within a fraction of
        ``stall_after`` (a read of one word per program)."""
        every = min(1.0, self.stall_after / 4)
        while True:
            self.sample()
            await anyio.sleep(every)

    def sample(self) -> None:
        """Note each program's heartbeat; a running one whose heartbeat has not advanced for
        ``stall_after`` is stalled.  The start and the end of a stall are logged once each."""
        now = time.monotonic()
        mb = self.b.mailbox
        for p in list(self.by_name.values()):
            hb = mb.heartbeat(p.slot)
            if hb != p.beat:
                if p.beat >= 0 or hb:  # its slot was zeroed at launch: a count is beats since
                    p.beaten = True
                p.beat, p.beat_at = hb, now
            ended = p.launch.finished()
            if p.stalled_at and (ended or p.beat_at > p.stalled_at):
                if not ended:
                    p.to(ProgramState.RUNNING)
                how = f"it ended ({p.state()[0]})" if ended else "it beats again"
                log.info(f"program {p.name} no longer stalled after {now - p.stalled_at + self.stall_after:.1f}s: {how}",
                         program=p.name, slot=p.slot)
                p.stalled_at = 0.0
            elif p.beaten and not p.stalled_at and not ended and now - p.beat_at >= self.stall_after:
                p.stalled_at = now
                p.to(ProgramState.STALLED)
                log.warning(f"program {p.name} stalled: its heartbeat has not advanced for {now - p.beat_at:.1f}s",
                            program=p.name, slot=p.slot, heartbeat=hb)

    def describe(self, p: Program) -> dict[str, Any]:
        state, error = p.state()
        age = p.beat_age()
        mb = self.b.mailbox
        return {
            "name": p.name,
            "slot": p.slot,
            "state": state,
            "error": error,
            "pid": p.kernel.pid,
            "device": p.device,
            "heartbeat": mb.heartbeat(p.slot),
            "beat_age_s": None if age is None else round(age, 3),
            "uptime_s": round(time.monotonic() - p.started, 3),
            "hash": f"{p.hash:016x}",
            "upgrades": p.upgrades,
            "restarts": p.restarts,
            "restart": p.policy.value,
            "regs": p.kernel.regs,
            "nodes": p.nodes,
        }

    def list(self) -> list[dict[str, Any]]:
        self.sample()
        return [self.describe(p) for p in sorted(self.by_name.values(), key=lambda p: p.slot)]

    async def close(self) -> None:
        """Every program halted (briefly) and unloaded, before the backend closes."""
        async with self._last():
            progs = list(self.by_name.values())
            for p in progs:  # all halted first: in blink mode the unloads then halt nobody
                self.b.mailbox.halt(p.slot)
            for p in progs:
                try:
                    await self._halt(p, within=self.d.close_halt)
                except MeshError as e:
                    log.error(f"program {p.name}: {e}")
            for p in progs:
                try:
                    await self.b.unload(p.kernel)
                except MeshError as e:
                    log.error(f"program {p.name}: {e}")
            self.by_name.clear()
