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

import contextlib
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from meshd_mps import faults
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
    StateError,
    UpgradeMismatch,
    WorkerError,
)
from meshd_mps.gpu.compiler import Manifest
from meshd_mps.isolation import limits
from meshd_mps.isolation.launch import Launch
from meshd_mps.mps.serverlog import FatalLog
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Done
from meshd_mps.supervision.proc import WorkerProc

log = structlog.get_logger("meshd_mps")



def died_on_its_own(w: WorkerProc) -> bool:
    """The worker's process ended on its own (faults.died_on_its_own, from what its WorkerProc knows)."""
    return faults.died_on_its_own(w.process.returncode, w.exited_running_at > 0, w.killed)


class ProgramState(enum.Enum):
    RUNNING = "running"
    STALLED = "stalled"  # running, but its heartbeat has not advanced for stall_after
    EXITED = "exited"  # its kernel returned by itself (or was halted), DONE ok
    FAILED = "failed"  # its launch failed: an error on its stream, or its worker died
    LOST = "lost"  # torn down by another program's GPU fault; a recovery relaunches or reports it
    FAULTED = "faulted"  # it caused a GPU fault: not relaunched

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
    ProgramState.FAILED: frozenset({ProgramState.LOST, ProgramState.FAULTED}),  # a recovery's verdict
    ProgramState.LOST: frozenset({ProgramState.FAULTED}),  # named the culprit once its clients are gone
    ProgramState.EXITED: frozenset(),
    ProgramState.FAULTED: frozenset(),
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
    phase: ProgramState = ProgramState.RUNNING  # changed only by to(), and by observe() when its launch ends
    error: str = ""  # what the latest move to FAILED or FAULTED said
    lost_to: str = ""  # LOST: the program whose fault took this one down, once named
    failed_at: float = 0.0  # monotonic time its launch was seen failing
    beat: int = -1  # the HEARTBEAT last seen (Programs.sample)
    beat_at: float = field(default_factory=time.monotonic)  # when it was last seen advancing
    beaten: bool = False  # seen advancing at least once: a program that never beats never stalls
    stalled_at: float = 0.0  # monotonic time it was found stalled (0: not stalled)

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
        """The CUDA error its stream reported, if one did: a DONE that failed, or its worker's
        first stream error (the evidence faults.py weighs above a worker's death)."""
        w = self.kernel.worker
        if w is not None and w.proc.err:
            return w.proc.err
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


class Programs:
    """``restart``: after a GPU-wide fault, relaunch the programs lost with it (not the
    one that faulted) on fresh workers."""

    def __init__(self, backend: Backend, restart: bool = True, stall_after: float | None = None):
        self.d = backend.sup.deadlines
        stall_after = self.d.stall if stall_after is None else stall_after
        if not stall_after > 0:
            raise ConfigError(f"stall_after {stall_after!r}: seconds, more than 0")
        self.b = backend
        self.restart = restart
        self.stall_after = stall_after
        self.start_ms: list[float] = []  # the start check's share of each load: LAUNCHED -> STATE = RUNNING
        self.by_name: dict[str, Program] = {}
        self._lock = anyio.Lock()  # one load/upgrade/unload/recovery at a time
        self.loads = 0
        self.load_ms: list[float] = []
        self.faults: list[FaultReport] = []
        self._closing = False
        d = backend.daemon
        self._fatal = FatalLog(None if d is None else f"{d.log_dir}/server.log")
        self.b.sup.start_soon(self._beats, name="heartbeats")

    def _free_slot(self) -> int:
        used = {p.slot for p in self.by_name.values()}
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
        return k, run

    async def _until_started(self, k: Kernel, run: Launch, slot: int) -> None:
        """The start check: a launched kernel counts only once it has set STATE = RUNNING (or
        already ended), within the start deadline; NotStarted otherwise.  A kernel on a hardware
        queue held by a resident one, or whose blocks wait for SMs, is launched but never runs."""
        within = self.b.sup.deadlines.start
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
                   nodes: int = 1, device: int | None = None) -> Program:
        """Compile, preload and launch on a free slot, on GPU ``device`` (None: ``place``'s choice)."""
        m = self._manifest(manifest)
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise ManifestError(f"{m.name}: nodes {nodes!r}: a count of blocks expected")
        async with self._lock:
            if m.name in self.by_name:
                raise AlreadyLoaded(m.name)
            slot = self._free_slot()
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
                        cached=img.prepared.cached, manifest=m, ptx=ptx)
            self._install(p)
            self._count(t0)
            log.info(f"program {m.name} loaded on slot {slot}, GPU {k.device}", program=m.name, pid=k.pid, slot=slot,
                     device=k.device)
            return p

    def _install(self, p: Program) -> None:
        self.by_name[p.name] = p
        self.b.sup.start_soon(self._watch, p, name=f"watch {p.name}")

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

    async def upgrade(self, name: str, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes,
                      expect: int | None = None) -> Program:
        m = self._manifest(manifest)
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
                        compile_ms=img.prepared.compile_ms, cached=img.prepared.cached, manifest=m, ptx=ptx)
            self._install(p)
            self._count(t0)
            log.info(f"program {name} upgraded on slot {p.slot}", program=name, pid=k.pid)
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

    async def call(self, name: str, payload: bytes, within: float | None = None) -> bytes:
        """A request through the program's ring, and its response."""
        within = self.d.call if within is None else within
        p = self.get(name)
        if p.launch.finished():
            raise NotRunning(f"program {name} is not running ({p.state()[0]})", program=name, state=p.state()[0])
        seq = self.b.mailbox.post(p.slot, payload)
        t0 = time.perf_counter()
        with anyio.move_on_after(within):
            while True:
                got = self.b.mailbox.response(p.slot, seq)
                if got is not None:
                    return got
                if p.launch.finished():
                    raise NotRunning(f"program {name} ended before answering ({p.state()[1] or p.state()[0]})", program=name,
                                     state=p.state()[0])
                # The kernel answers in host memory: nothing to wait on but the word.  For the
                # first 200 us just yield (the loop's timers round any sleep up to 1 ms), then back off.
                await anyio.sleep(0 if time.perf_counter() - t0 < 200e-6 else 1e-3)
        raise CallTimeout(name, within)

    # ---- faults ---------------------------------------------------------------------------
    def _device_of_pid(self, pid: int) -> int | None:
        for q in self.by_name.values():
            if q.kernel.pid == pid:
                return q.device
        mps = self.b.mps
        return None if mps is None else mps.device_of(pid)

    def _fatal_pids(self, device: int) -> list[int]:
        return self._fatal.take(device, self._device_of_pid)

    async def _watch(self, p: Program) -> None:
        """Await a program's end; a failure in MPS mode may be a fault that took every client."""
        try:
            d = await p.launch.wait()
            failed = not d.ok
        except Exception:
            failed = True
        if failed:
            p.failed_at = time.monotonic()
        if failed and not self._closing and self.by_name.get(p.name) is p and p.observe() is ProgramState.FAILED:
            await self._on_failure(p)

    @staticmethod
    def _suspect(q: Program, ended: bool = False) -> faults.Suspect:
        w = q.kernel.worker
        return faults.Suspect(q.name, q.kernel.pid, q.failed_at, ended=ended,
                              died=w is not None and died_on_its_own(w.proc), error=q.state()[1],
                              kernel_error=q.kernel_error())

    async def _on_failure(self, p: Program) -> None:
        async with self._lock:
            if self._closing or self.by_name.get(p.name) is not p or p.observe() is not ProgramState.FAILED:
                return  # a recovery already dealt with it
            t0 = time.perf_counter()
            pids: list[int] = []
            together: list[faults.Suspect] = []
            if self.b.isolated:
                # A fault of its GPU if the server logs a fatal fault there, or other programs of
                # that GPU fail with this one (MPS tears down the clients of the faulting GPU only).
                with anyio.move_on_after(self.d.fault_window):
                    while not (pids := self._fatal_pids(p.device)):
                        await anyio.sleep(0.02)  # the server writes its log line within milliseconds
                others = [self._suspect(q) for q in self.on_device(p.device)
                          if q is not p and q.observe() is ProgramState.FAILED]
                together = faults.failed_together(self._suspect(p), others, self.d.fault_window)
            if not faults.is_gpu_fault(pids, together):
                error = p.state()[1]
                self.faults.append(FaultReport(time.time(), error, p.name, p.kernel.pid, False, device=p.device, by="own"))
                log.error(f"program {p.name} failed: {error}", program=p.name, pid=p.kernel.pid, device=p.device)
                return
            await self._recover(p, pids, t0)

    async def _recover(self, first: Program, pids: list[int], t0: float) -> None:
        """Every MPS client of ``first``'s GPU was torn down: retire them all (that GPU's pool's
        too), name the culprit (faults.name_culprit), wait until the server takes clients there
        again, refill that pool, relaunch the lost programs (not the culprit).  Other GPUs are
        not touched."""
        gpu = first.device
        first_seen = self._suspect(first)
        # Every client of that GPU goes down with it: the ones still running fail within ms.
        hit = [q for q in self.on_device(gpu) if q.observe() in (*LIVE, ProgramState.FAILED)]
        for q in hit:
            q.to(ProgramState.LOST)  # their watchers leave them to this recovery
        await self.b.teardown(gpu)  # every worker of that GPU retired and awaited
        if not pids:  # the server may name the culprit only once its clients are gone
            with anyio.move_on_after(self.d.fault_window):
                while not (pids := self._fatal_pids(gpu)):
                    await anyio.sleep(0.02)
        ours = {q.kernel.pid for q in hit}
        strays = [faults.Stray(w.pid, w.program, w.exited_running_at) for w in self.b.sup.exited_running
                  if w.device == gpu and w.pid not in ours]
        suspects = [self._suspect(q, ended=self.b.mailbox.u32(q.slot, abi.STATE) == abi.EXITED) for q in hit]
        v = faults.name_culprit(suspects, first_seen, pids, strays, first.failed_at or time.monotonic(),
                                self.d.fault_window)
        named = {q.name: q for q in [first, *hit]}
        if v.program is not None:
            named[v.program.name].to(ProgramState.FAULTED, v.why)
        if v.by == "first failure":
            log.info("mps: the server log names no culprit; the first program seen failing is taken for it",
                     program=v.culprit)
        if v.stray is not None:  # taken: a later fault does not name it again
            self.b.sup.exited_running = [w for w in self.b.sup.exited_running if w.pid != v.stray.pid]
        lost = [named[q.name] for q in v.lost]
        for q in lost:
            q.lost_to = v.culprit
        r = FaultReport(time.time(), v.why, v.culprit, v.pid, True, [q.name for q in lost], device=gpu, by=v.by)
        log.error(f"mps: GPU fault on GPU {gpu} in program {v.culprit} (worker {v.pid}): {v.why}; "
                  f"lost with it: {', '.join(r.lost) or 'none'}", program=v.culprit, device=gpu)
        # The lost programs' new workers and a full pool, in one batch, once the server takes
        # clients there again (refill logs it if it does not within Deadlines.recover).
        await self.b.refill(gpu, len(lost) if self.restart else 0)
        for q in lost:
            if not self.restart:
                r.not_relaunched[q.name] = "restart policy off"
                continue
            try:
                await self._relaunch(q)
                r.relaunched.append(q.name)
            except MeshError as e:
                r.not_relaunched[q.name] = str(e)
                log.error(f"program {q.name}: not relaunched after the fault: {e}", program=q.name)
        r.ms = (time.perf_counter() - t0) * 1e3
        self.faults.append(r)
        log.info(f"mps: GPU {gpu}: fault recovery done in {r.ms:.0f} ms: relaunched {r.relaunched},"
                 f" not {list(r.not_relaunched)}", device=gpu)

    async def _relaunch(self, q: Program) -> None:
        assert q.manifest is not None
        img = await self.b.prepare(q.manifest, q.ptx, device=q.device)
        try:
            k, run = await self._start(img, q.slot, q.nodes, self._used(q.device, without=q))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.b.drop(img)
            raise
        await self.b.unload(q.kernel)  # the dead worker: already retired
        p = Program(q.name, q.slot, k, run, img.prepared.hash, q.nodes, upgrades=q.upgrades, compile_ms=img.prepared.compile_ms,
                    cached=img.prepared.cached, manifest=q.manifest, ptx=q.ptx, restarts=q.restarts + 1)
        self._install(p)

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
            "regs": p.kernel.regs,
            "nodes": p.nodes,
        }

    def list(self) -> list[dict[str, Any]]:
        self.sample()
        return [self.describe(p) for p in sorted(self.by_name.values(), key=lambda p: p.slot)]

    async def close(self) -> None:
        """Every program halted (briefly) and unloaded, before the backend closes."""
        self._closing = True
        with anyio.CancelScope(shield=True):
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
