"""One GPU's isolation, the one interface both modes implement; and a mode's host-wide part.

``Backend`` chooses the mode once, at open, and from then on only delegates: to the
:class:`Isolation` of an image's or a kernel's GPU.  Blink (blink.py) runs every program of
a GPU as a module of its one CUDA context; MPS (mps.py) runs each in a worker process of
its own, an MPS client.  What a mode needs across GPUs (MPS: the control daemon, the client
checks and counts) is its :class:`Mode`, which makes the GPUs' isolations.

A program is launched one way in both modes, :meth:`Module.start`: the only difference is
the worker process its module is in (the GPU's context, or the program's own).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from meshd_mps.base.errors import FrameError, MeshError, OldWorker, WorkerError
from meshd_mps.base.faults import Stray
from meshd_mps.gpu.compiler import Manifest, Prepared
from meshd_mps.isolation.launch import Launch
from meshd_mps.isolation.preflight import abi_mismatch
from meshd_mps.mps.clients import NewClient
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Done, HelloModule, Loaded, Op, PayloadsReq
from meshd_mps.protocol.payloads import Region
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

#: ``admit``: sees what the worker reported of a loaded module, and raises to refuse it.
Admit = Callable[[Loaded], None]


@dataclass(eq=False)
class Module:
    """A module loaded in a worker process, as its LOADED reported it: all that a launch needs."""

    name: str
    proc: WorkerProc
    module: int  # its number in that worker's context
    info: Loaded
    #: MPS: the client made for it at its load, and its estimated cost (None: a pooled worker's, or blink).
    new_client: NewClient | None = field(default=None, kw_only=True)

    async def start(self, slot: int, nodes: int) -> asyncio.Future[Done]:
        """LAUNCH of a new generation on ``nodes`` blocks (the one launch path of both modes);
        the future its DONE resolves."""
        p = self.proc
        gen, done = p.next_gen(self.module)
        try:
            await p.ask(Op.LAUNCH, frames.LAUNCH_BODY.pack(self.module, gen, slot, nodes))  # LaunchReq.encode() less its object
        except WorkerError as e:
            done.cancel()
            raise e.prefixed(self.name, "{what} ({message})") from e
        return done

    def query(self) -> bool:
        """The last launch's stream finished; WorkerError (naming the program) otherwise."""
        try:
            return self.proc.query(self.module)
        except WorkerError as e:
            raise e.prefixed(self.name) from e


@dataclass
class Image:
    """A checked, compiled image (the seed's mesh_prepared) for GPU ``device``; in MPS mode
    already loaded in a worker, so that ``load`` only hands it over."""

    prepared: Prepared
    device: int | None = None  # the GPU it is for (None: the backend's first)
    preloaded: Module | None = None  # MPS: its worker's module, until load takes it or drop gives it back
    #: Its program's payload region (None: none declared), which ``load`` has its worker map: the
    #: program's, made and closed by whoever owns the program (Registry.payloads, backend/payloads.py).
    payloads: Region | None = None

    @property
    def name(self) -> str:
        return self.prepared.manifest.name


@dataclass(frozen=True)
class Evidence:
    """What one GPU holds about a failure, read in one call (``Isolation.evidence``) for faults.py to
    weigh: the mode's differences stay in its isolation."""

    #: The pids the MPS server logged as having hit a fatal error on that GPU, taken (a later look
    #: does not see them again); none where there is no server (blink).
    fatal_pids: list[int]
    #: Workers of that GPU, none of the caller's, that ended on their own with a kernel launched:
    #: the culprit where no program is (faults.name_culprit); ``Isolation.took`` once one is named.
    strays: list[Stray]
    #: Every failure of a program's launch is its GPU's (blink: one context, whose error is
    #: sticky); False: whether it was a fault of the GPU is for the rest of the evidence to say.
    gpu_wide: bool


@dataclass(frozen=True)
class BlinkStats:
    """A GPU's blinks (module changes that halted and relaunched every running program of it): how
    many, the last one's length (ms, None before the first) and its monotonic end."""

    count: int = 0
    last_ms: float | None = None
    last_at: float = 0.0


@dataclass(eq=False)
class Found:
    """A module that an adopted worker holds, as its HELLO said (live restore): which version of
    which program it is (``tag``: the hash its LOAD carried), and its launch whose DONE no daemon
    has had (``launch``, resolved by ``done``; None: none, so nothing of it runs)."""

    module: Module
    isolation: Isolation
    tag: int
    launch: frames.HelloLaunch | None = None
    done: asyncio.Future[Done] | None = None

    @property
    def name(self) -> str:
        return self.module.name

    @property
    def device(self) -> int:
        return self.isolation.device


@dataclass(eq=False)
class Kernel:
    """A loaded program: its module, in the process it runs in (MPS: a worker of its own; blink:
    its GPU's context), and the isolation that loaded it, which every later operation is."""

    name: str
    manifest: Manifest | None  # None: an adopted module that no record names (it is halted and unloaded)
    module: Module
    isolation: Isolation = field(repr=False)
    launch: Launch | None = None
    unloaded: bool = False  # unloaded or abandoned: a second time is nothing to do
    #: Its program's payload region, mapped by its worker (None: none; an adopted module's is set
    #: by whoever takes it: the worker maps it still, the daemon opens it again).
    payloads: Region | None = None
    # What its worker reported at LOADED:
    regs: int = field(init=False)
    local: int = field(init=False)
    per_sm: int = field(init=False)
    scratch: int = field(init=False)
    rt_abi: int = field(init=False)
    sms: int = field(init=False)  # the SMs of its context (a green context's, else the device's)

    def __post_init__(self) -> None:
        i = self.module.info
        self.regs, self.local, self.per_sm, self.scratch, self.rt_abi, self.sms = (
            i.regs, i.local, i.per_sm, i.scratch, i.rt_abi, i.sms)

    @property
    def device(self) -> int:
        """The GPU it runs on."""
        return self.isolation.device

    @property
    def proc(self) -> WorkerProc:
        """The process it runs in."""
        return self.module.proc

    @property
    def pid(self) -> int:
        return self.module.proc.pid

    def own_error(self) -> str:
        """The first CUDA error its own worker's stream reported ("" where the process is not the
        program's own, blink, or none was): evidence that faults.py weighs above a worker's death."""
        return self.isolation.own_error(self)

    def died_on_its_own(self) -> bool:
        """Its process ended on its own (a signal not ours, an exit with its kernel running), as
        evidence against it alone: only where the process is the program's own (MPS)."""
        return self.isolation.died_on_its_own(self)


class Isolation(ABC):
    """One GPU's isolation mode: prepare, load, launch, query, unload, status; and, for a fault of
    the GPU, teardown and refill.  Made by its :class:`Mode`, opened by the backend."""

    def __init__(self, sup: Supervisor, device: int):
        self.sup = sup
        self.device = device
        #: perf_counter time the last ``refill``'s first new context came up (0: none yet): the
        #: server took clients again (a recovery's steps).
        self.first_context_at = 0.0
        #: Live restore: the modules the adopted workers hold, until the programs take them.
        self.found: list[Found] = []
        #: Set once the workers a teardown started ahead (``hold_ahead``) are up, or failed to start.
        self._holding: anyio.Event | None = None

    @abstractmethod
    async def open(self, adopted: Sequence[WorkerProc] = ()) -> None:
        """Its workers started (blink: the context; MPS: the pool); ``adopted``: this GPU's workers
        that an earlier meshd-mps left running (live restore), taken in first (``found``)."""

    def take(self, f: Found, manifest: Manifest | None) -> Kernel:
        """An adopted module as a kernel of ours, its outstanding launch (if any) its launch."""
        k = Kernel(f.name, manifest, f.module, self)
        if f.launch is not None and f.done is not None:
            k.launch = Launch(k.name, f.launch.slot, f.launch.nodes, f.done)
            self._launched(k, k.launch)
        return k

    def found_in(self, w: WorkerProc, make: Callable[[HelloModule], Module]) -> list[Found]:
        """The modules an adopted worker's HELLO says it holds (each made by ``make``), with the
        latest launch of each whose DONE we have not had."""
        assert w.hello is not None
        out = []
        for hm in w.hello.modules:
            launches = [la for la in w.hello.launches if la.module == hm.id]
            la = max(launches, key=lambda la: la.gen) if launches else None
            out.append(Found(make(hm), self, hm.tag, la, None if la is None else w.outstanding.get((la.module, la.gen))))
        return out

    @abstractmethod
    async def prepare(self, prepared: Prepared, new: bool = False) -> Image:
        """The image for this GPU; MPS: preloaded into a pooled worker, else a fresh one (``new``, a
        new program's: never the pool's reserve, which is kept for upgrades and relaunches)."""

    @abstractmethod
    def capacity(self) -> int:
        """Programs this GPU runs at once, by the mode's own limit: what ``check_room`` refuses at,
        and what the status says (the fleet advertises it to Ray: fleet/capacity.py)."""

    @abstractmethod
    def check_room(self, name: str) -> None:
        """CapacityError unless this GPU takes one more program (the mode's own count)."""

    @abstractmethod
    async def load(self, img: Image, admit: Admit | None = None) -> Kernel:
        """The image's module, ready to launch; ``admit`` sees what the worker reported and raises
        to refuse it, and a refused module is unloaded (blink: within the load's own blink)."""

    async def launch(self, k: Kernel, slot: int, nodes: int) -> Launch:
        """``mesh_main`` on ``nodes`` blocks, its slot set to RUN already; the Launch its DONE ends."""
        assert not k.unloaded, f"{k.name}: launched once unloaded"
        k.launch = Launch(k.name, slot, nodes, await k.module.start(slot, nodes))
        self._launched(k, k.launch)
        return k.launch

    def _launched(self, k: Kernel, run: Launch) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """A launch begun (blink keeps it, to halt and relaunch it around each blink)."""

    def query(self, k: Kernel) -> bool:
        """The last launch finished; WorkerError (naming the program) on a stream error or a death."""
        return k.module.query()

    async def unload(self, k: Kernel) -> None:
        """MPS: the worker back to the pool (UNLOAD) or retired; blink: the module unloaded (a blink)."""
        if k.unloaded:
            return
        k.unloaded = True
        await self._unload(k)

    @abstractmethod
    async def _unload(self, k: Kernel) -> None: ...

    async def abandon(self, k: Kernel, slot: int) -> None:
        """A launch given up before its kernel started (HALT is on its slot already): its module
        unloaded.  MPS: a worker whose kernel does not return is retired; blink: in one blink,
        which halts the kernels it may be queued behind."""
        if k.unloaded:
            return
        k.unloaded = True
        await self._abandon(k, slot)

    @abstractmethod
    async def _abandon(self, k: Kernel, slot: int) -> None: ...

    async def drop(self, img: Image) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """An image prepared but never loaded: what it holds goes back."""

    @abstractmethod
    def retire_stuck(self, k: Kernel) -> bool:
        """A kernel that did not halt: True if its process was retired for it (MPS: it would never
        be fit again), False if it cannot be (blink: the context is every program's)."""

    @abstractmethod
    def not_started_why(self) -> str:
        """The likely reasons a launched kernel does not start, in this mode, in words."""

    async def stack_limit(self, set_to: int | None = None) -> int | None:
        """The shared context's stack limit in bytes per thread (set first if asked); None where each
        program's context is its own (MPS; the seed's SIZE_MAX, set a no-op)."""
        return None

    def mailbox_dev(self) -> int:
        """The mailbox's device address in the GPU's shared context; 0 where each worker has its own."""
        return 0

    def pooled(self) -> tuple[int, int]:
        """(idle pooled workers, the pool's cap): none where there is no pool (blink)."""
        return 0, 0

    def reserve(self) -> tuple[int, int]:
        """(the pool's reserve idle now, the reserve): the idle workers no load takes, kept for an
        upgrade or a relaunch; none where there is no pool (blink)."""
        return 0, 0

    def keep_reserve(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """After a launch: a pool short of its reserve (an upgrade's old worker not given back, a
        relaunch that took it) refilled to it, paced (MPS)."""

    async def ahead(self, loads: int) -> int:
        """Before a start launches any program: what ``loads`` new programs need made now (MPS:
        their workers, in one batch), none of it once programs run; how many workers were made."""
        return 0

    def settled(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """The start's restore is done (MPS: what ``ahead`` made and no load took goes to the pool)."""

    @abstractmethod
    def load_count(self) -> int:
        """Images loaded or prepared here."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """This GPU's part of the status: its workers, and its pool or its context and blinks."""

    @abstractmethod
    async def teardown(self, ahead: int = 0) -> list[WorkerProc]:
        """After a fault of this GPU: every worker of it retired, and awaited within ``recover``;
        meanwhile the workers for ``ahead`` lost programs are started, without a context yet."""

    def hold_ahead(self, n: int, spawn: Callable[[], Awaitable[WorkerProc]], keep: Callable[[WorkerProc], None]) -> None:
        """``n`` workers ``spawn``ed at once, each given to ``keep``, in a task of the supervisor's:
        a teardown starts them and does not wait for them, ``held_started`` does (``refill``).  A
        worker on a socket (live restore) is spawned only once it listens and has said HELLO, after
        its imports (~0.15 s): started one after another inside the teardown, 7 of them made the
        teardown 1.3 s on the H100 against 0.25 s on pipes.  One that fails is logged:
        ``refill`` starts its own then."""
        done = self._holding = anyio.Event()

        async def one() -> None:
            try:
                keep(await spawn())
            except MeshError as e:
                log.warning(f"GPU {self.device}: a worker was not started ahead of the refill: {e}", device=self.device)

        async def every() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    for _ in range(n):
                        tg.start_soon(one)
            finally:
                done.set()

        if n <= 0:
            done.set()
            return
        try:
            self.sup.start_soon(every, name=f"workers ahead, GPU {self.device}")
        except MeshError as e:  # the supervisor is closing: nothing more is started
            done.set()
            log.warning(f"GPU {self.device}: no worker started ahead of the refill: {e}", device=self.device)

    async def held_started(self) -> None:
        """The workers the last teardown started ahead are up (or failed to start); the caller's
        deadline bounds the wait."""
        if self._holding is not None:
            await self._holding.wait()

    @abstractmethod
    async def refill(self, extra: int = 0) -> bool:
        """After ``teardown``, once the GPU takes workers again: what ``extra`` lost programs need
        to be loaded again (MPS: a worker each; blink: the new context), within ``recover``;
        False if not."""

    def recovered(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """The lost programs are back (MPS: the pool refills now, paced)."""

    @abstractmethod
    async def evidence(self, ours: Collection[int] = (), wait: float = 0.0) -> Evidence:
        """This GPU's evidence about a failure: the server log's culprits (MPS: watched for up to
        ``wait`` seconds until one shows), the strays that are none of ``ours`` (pids), and whether
        every failure is the GPU's (blink: one context, whose error is sticky)."""

    def blink_stats(self) -> BlinkStats | None:
        """This GPU's blinks; None where its module changes halt nothing (MPS: a program's own worker)."""
        return None

    def took(self, stray: Stray) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """``stray`` was named a fault's culprit: a later fault does not name it again."""

    def own_error(self, k: Kernel) -> str:
        """``k``'s own worker's first stream error: only where the process is the program's own (MPS)."""
        return ""

    def died_on_its_own(self, k: Kernel) -> bool:
        """``k``'s process ended on its own (a signal not ours, an exit with its kernel running),
        as evidence against ``k`` alone: only where the process is the program's own (MPS)."""
        return False

    async def close(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """Before the supervisor kills every worker (MPS: the idle ones get EOF first)."""

    def detach(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """Live restore's stop, before the supervisor detaches the workers: nothing more is started
        (MPS: the pool is not refilled); every worker, pooled ones too, is left for the next meshd-mps."""

    async def _map_payloads(self, name: str, p: WorkerProc, module: int, region: Region) -> None:
        """Module ``module`` of worker ``p`` given its program's payload region (PAYLOADS): mapped and
        registered there, with nothing of the module running (blink: within the load's blink).
        OldWorker for a worker an older meshd-mps started that does not speak PAYLOADS."""
        version = p.hello.version if p.hello is not None else frames.PROTOCOL_VERSION
        if version < frames.PAYLOADS_SINCE:
            raise OldWorker(f"{name}: its payload region cannot be given to worker {p.pid}, which an older meshd-mps"
                            f" started (frame protocol {version}; PAYLOADS needs {frames.PAYLOADS_SINCE}): start"
                            " meshd-mps without live restore once, or load it where no such worker is",
                            program=name, pid=p.pid, version=version, needs=frames.PAYLOADS_SINCE)
        req = PayloadsReq(module, region.layout.max_request, region.layout.max_response, region.path)
        try:
            frames.u64_value(Op.PAYLOADS, await p.ask(Op.PAYLOADS, req.encode()))
        except (WorkerError, FrameError) as e:
            raise e.prefixed(f"{name}: payload region") from e

    async def _check_abi(self, k: Kernel) -> None:
        """A module built for another program ABI is unloaded and refused."""
        if k.rt_abi != abi.RT_ABI:
            await self.unload(k)
            raise abi_mismatch(k.name, k.rt_abi)


class Mode(ABC):
    """An isolation mode's host-wide part, and the maker of its GPUs' isolations (``gpus``)."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.gpus: dict[int, Isolation] = {}

    async def start(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """Before the GPUs are looked at (MPS: the daemon)."""

    @abstractmethod
    def _make(self, device: int) -> Isolation: ...

    def add(self, device: int) -> Isolation:
        """GPU ``device``'s isolation, made and kept (not opened)."""
        g = self.gpus[device] = self._make(device)
        return g

    async def open(self, devices: Sequence[int], adopted: Mapping[int, Sequence[WorkerProc]] | None = None) -> None:
        """Every GPU's isolation made and opened, all at once: contexts on different GPUs do not
        wait for each other.  ``adopted``: each GPU's workers left running by an earlier meshd-mps."""
        for d in devices:
            self.add(d)
        try:
            async with anyio.create_task_group() as tg:
                for d, g in self.gpus.items():
                    tg.start_soon(g.open, (adopted or {}).get(d, ()))
        except ExceptionGroup as e:
            raise e.exceptions[0] from e

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """The host-wide part of the backend's status (every GPU's, added up)."""

    @property
    def keeps_workers(self) -> bool:
        """Live restore: the workers an earlier meshd-mps left are usable (MPS: their server is the
        one we adopted; blink: always).  False: they are halted and told to QUIT, and reloaded."""
        return True

    async def close(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """After every worker is gone (MPS: the daemon quit)."""

    async def detach(self) -> None:  # noqa: B027 - an optional hook, by default nothing to do
        """Live restore's stop, once the workers are detached (MPS: the daemon left running)."""
