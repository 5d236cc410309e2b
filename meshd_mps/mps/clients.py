"""MPS mode: the private daemon, workers verified as its clients, the pool, preload.

There is no fallback: no daemon, a worker that is not a client of *our*
server (the driver silently runs such a process as a plain context), or a
failed load refuses.  The seed's ``Mps``, ``mps_check_clients``,
``mps_spawn``, ``mps_preload`` and ``mps_prewarm``.

Several GPUs: one control daemon (and one server) for the host, a pool and
a client count per GPU; each worker is started with ``--device N`` and stays
on that GPU for its life.  MPS counts its client limit per device.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import structlog

from meshd_mps.protocol import frames
from meshd_mps.mps.control import ControlDaemon
from meshd_mps.errors import CapacityError, ClientLimit, DeviceError, FrameError, ImageRefused, MpsError, NotServedHere, WorkerError, WorkerGone
from meshd_mps.protocol.frames import Done, Launch, Load, Loaded, Op
from meshd_mps.isolation.limits import MPS_QUEUES
from meshd_mps.supervision.pool import Pool
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

#: Clients one MPS server accepts (CUDA 13.0 on the H200: the 49th is refused).
MAX_CLIENTS = 48


def pids_debug(pids: Sequence[int]) -> str:
    return "[" + ", ".join(str(p) for p in pids) + "]"


def worker_argv(mailbox: str, sms: int, gpu: str, device: int = 0, queues: int = MPS_QUEUES) -> list[str]:
    """``meshd-mps worker`` for this interpreter (no PATH lookup, the same venv), on GPU ``device``,
    asking for ``queues`` hardware work queues (limits.py)."""
    argv = [sys.executable, "-m", "meshd_mps", "worker", "--mailbox", mailbox, "--gpu", gpu, "--device", str(device),
            "--queues", str(queues)]
    if sms:
        argv += ["--sms", str(sms)]
    return argv


@dataclass
class Worker:
    """One image in its own MPS client process."""

    proc: WorkerProc
    name: str
    info: Loaded
    fresh: bool
    module: int = 0
    device: int = 0  # the GPU its context is on


class Mps:
    """``devices``: the GPUs driven (CUDA ordinals); ``pool_cap`` idle workers are kept for each."""

    def __init__(self, daemon: ControlDaemon, sup: Supervisor, mailbox: str, sms: int, gpu: str, pool_cap: int,
                 max_clients: int = MAX_CLIENTS, devices: Sequence[int] = (0,)):
        if not devices:
            raise MpsError("mps: no GPU to drive")
        self.daemon = daemon
        self.sup = sup
        self.mailbox = mailbox
        self.sms = sms
        self.gpu = gpu
        self.devices = tuple(devices)
        self.pools = {d: Pool(pool_cap, sup.retire) for d in self.devices}
        self._spawned: dict[int, WorkerProc] = {}  # by pid, for its GPU (pruned to the live ones at each spawn)
        self.server: str | None = None  # the server's pid once a worker was seen in its client list
        self.native: set[int] = set()
        self.max_clients = max_clients
        sup.before_exit = self.terminate
        #: The environment a worker gets on top of ours (tests point it elsewhere).
        self.worker_env: dict[str, str] = dict(daemon.env)

    @property
    def pool(self) -> Pool:
        """The first GPU's pool (the only one on a one-GPU host)."""
        return self.pools[self.devices[0]]

    def idle(self) -> int:
        """Idle pooled workers on every GPU."""
        return sum(len(p) for p in self.pools.values())

    def device_of(self, pid: int) -> int | None:
        """The GPU of our worker ``pid`` (None: not one of ours)."""
        w = self._spawned.get(pid)
        return None if w is None else w.device

    def workers_on(self, device: int) -> list[int]:
        """Our live workers on ``device``, pooled ones included."""
        return sorted(p for p, w in self.sup.workers.items() if p in self._spawned and w.device == device)

    def _device(self, device: int | None) -> int:
        if device is None:
            return self.devices[0]
        if device not in self.devices:
            raise NotServedHere(f"mps: GPU {device} is not one of this backend's (--devices {','.join(map(str, self.devices))})",
                                device=device, devices=self.devices)
        return device

    # ---- clients --------------------------------------------------------------------------
    async def terminate(self, p: WorkerProc) -> None:
        """Have the server end ``p``'s context (``terminate_client``) before ``p`` exits with its
        kernel running: on the H200 such an exit faulted every other client of the GPU, a
        terminated client's did not (scripts/kill_probe.py, docs/reliability.md)."""
        server = await self.server_pid()
        if server is None:
            return
        out = (await self.daemon.control(f"terminate_client {server} {p.pid}")).strip()
        log.info(f"mps: worker {p.pid} retired with its kernel running: terminate_client {server} {p.pid}: {out}",
                 pid=p.pid)

    async def server_pid(self) -> str | None:
        out = await self.daemon.control("get_server_list")
        first = out.split("\n", 1)[0].strip()
        if first.isdigit():
            self.daemon.servers.add(int(first))
        return first or None

    async def clients(self, server: str) -> list[int]:
        out = await self.daemon.control(f"get_client_list {server}")
        return [int(s) for s in (line.strip() for line in out.splitlines()) if s.isdigit()]

    async def check_clients(self, want: Sequence[int]) -> None:
        """Every pid in ``want`` must be a client of our daemon's server, or MpsError."""
        server = await self.server_pid()
        if server is None:
            raise MpsError(f"mps: workers {pids_debug(want)} are up but our daemon runs no server: they are not MPS clients; refusing")
        pids = await self.clients(server)
        for p in want:
            if p not in pids:
                raise MpsError(f"mps: worker {p} is not among server {server}'s clients {pids_debug(pids)}; refusing")
        foreign = [p for p in pids if p not in self.sup.workers and p not in self.native]
        if foreign:
            log.error(f"mps: server {server} has clients that are not meshd's workers: {pids_debug(foreign)}")
        if self.server != server:
            log.info(f"mps: server pid {server}, clients {pids_debug(pids)}")
            self.server = server

    def native_pipe_dir(self) -> str:
        """The pipe dir a native GPU worker must be started with to be a client of our server."""
        return self.daemon.pipe_dir

    async def check_native(self, pid: int) -> None:
        """A native GPU worker that said ready must be a client of our server."""
        self.native.add(pid)
        try:
            await self.check_clients([pid])
        except BaseException:
            self.native.discard(pid)
            raise

    # ---- workers --------------------------------------------------------------------------
    def _count_clients(self, device: int) -> int:
        """MPS clients on ``device``: our workers there, and every native client (its GPU is not
        known to us, so it is counted against each)."""
        return len(self.workers_on(device)) + len(self.native)

    def check_room(self, name: str, device: int) -> None:
        """CapacityError unless GPU ``device`` takes one more program: the server's clients less
        the pool's (kept for the next loads and upgrades), the native clients' and the programs'."""
        busy = len(self.workers_on(device)) - len(self.pools[device])
        have = self.max_clients - self.pools[device].cap - len(self.native)
        if busy >= have:
            gpu = "" if len(self.devices) == 1 else f" of GPU {device}"
            raise CapacityError(
                f"{name}: the MPS server{gpu} takes {self.max_clients} clients (CUDA 13.0); {busy} programs,"
                f" {len(self.native)} native clients and a pool of {self.pools[device].cap} leave no room for another",
                limit="MPS clients", have=have, asked=busy + 1)

    async def spawn(self, program: str | None = None, device: int | None = None) -> WorkerProc:
        """A fresh worker on GPU ``device`` (default: the first), within that GPU's client limit."""
        d = self._device(device)
        n = self._count_clients(d)
        if n >= self.max_clients:
            gpu = "" if len(self.devices) == 1 else f" per GPU, and GPU {d} has them all"
            raise ClientLimit(
                f"mps: {n} clients already: the MPS server takes at most {self.max_clients}"
                f" (CUDA 13.0){gpu}; refusing another worker{' for ' + program if program else ''}",
                have=self.max_clients, asked=n + 1, device=d)
        env = {**os.environ, **self.worker_env}
        live = self.sup.workers
        self._spawned = {p: w for p, w in self._spawned.items() if p in live}
        try:
            w = await self.sup.spawn(worker_argv(self.mailbox, self.sms, self.gpu, d), env, program)
        except WorkerError as e:
            raise e.prefixed("load") from e
        w.device = d
        self._spawned[w.pid] = w
        return w

    async def prewarm(self, n: int, device: int | None = None) -> None:
        """Spawn n on GPU ``device`` (default: the first), READY all, verify them as our clients,
        then pool them; all or none."""
        if n == 0:
            return
        d = self._device(device)
        self.daemon.check_alive()
        t0 = time.monotonic()
        procs: list[WorkerProc] = []
        try:
            for _ in range(n):
                procs.append(await self.spawn(device=d))
            async with anyio.create_task_group() as tg:
                for p in procs:
                    tg.start_soon(self._ready, p)
            await self.check_clients([p.pid for p in procs])
        except BaseException as e:
            for p in procs:
                self.sup.retire(p)
            if isinstance(e, ExceptionGroup):
                raise e.exceptions[0] from e
            raise
        for p in procs:
            self.pools[d].add(p)
        log.info(f"mps: pool of {n} idle workers {pids_debug([p.pid for p in procs])} on GPU {d}"
                 f" ready in {(time.monotonic() - t0) * 1e3:.0f} ms")

    async def _ready(self, p: WorkerProc) -> None:
        try:
            payload = await p.ask(Op.READY)
        except WorkerError as e:
            raise e.prefixed("mps: pool") from e
        try:
            pid = frames.ready_pid(payload)
        except FrameError as e:
            p.mark_unfit(f"worker {p.pid}: bad READY: {e}")
            raise WorkerError(f"mps: pool: worker {p.pid}: bad READY: {e}", pid=p.pid) from e
        if pid != p.pid:
            p.mark_unfit(f"worker {p.pid}: READY says pid {pid}")
            raise WorkerError(f"mps: pool: worker {p.pid}: READY says pid {pid}", pid=p.pid)

    async def preload(self, name: str, cubin: bytes, threads: int, smem: int, scratch: int,
                      device: int | None = None) -> Worker:
        """The image's module loaded in a pooled worker of GPU ``device`` (default: the first) if
        one is fit, else in a fresh one there."""
        d = self._device(device)
        self.daemon.check_alive()  # a pooled worker would fail its LOAD, a fresh one its check
        t0 = time.monotonic()
        req = Load(0, threads, smem, scratch, name, cubin)
        while True:
            p = self.pools[d].take()
            fresh = p is None
            if p is None:
                p = await self.spawn(name, d)
            p.program = name
            try:
                payload = await p.ask(Op.LOAD, req.encode())
                info = Loaded.decode_ok(payload)
                break
            except ImageRefused as e:
                # The image's fault, not the worker's: a pooled one (verified, still fit) goes back.
                p.program = None
                if fresh or len(self.pools[d]) >= self.pools[d].cap:
                    self.sup.retire(p)
                else:
                    self.pools[d].add(p)
                raise e.prefixed("load") from e
            except (WorkerError, FrameError) as e:
                self.sup.retire(p)
                if fresh or not isinstance(e, WorkerGone):
                    raise e.prefixed("load") from e
                # A pooled worker that died while idle (not yet seen dead): try the next one.  One
                # that is alive but misbehaved (no reply, garbage) is not retried: a hang would
                # cost the caller a second load deadline.
                log.info(f"mps: pooled worker {p.pid} was gone ({e}); taking another", pid=p.pid)
        w = Worker(p, name, info, fresh, device=d)
        try:
            if self.sms and self.sms != info.sms:
                raise DeviceError(f"load: the worker's green context has {info.sms} SMs, not {self.sms}")
            if fresh:
                await self.check_clients([p.pid])
        except BaseException:
            # Not verified as our client, or not the context asked for: retired, never pooled, so
            # that no later load takes it unchecked.
            self.sup.retire(p)
            raise
        log.info(
            f"mps: worker {p.pid} ({'new' if fresh else 'pooled'}) on GPU {d} for {name}: module loaded, mailbox at device"
            f" 0x{info.dev:x}, {info.sms} SMs, in {(time.monotonic() - t0) * 1e3:.1f} ms",
            pid=p.pid,
            program=name,
        )
        return w

    async def drop(self, w: Worker) -> bool:
        """Back to its GPU's pool with UNLOAD, unless unfit or the pool is full (then retired)."""
        return await self.pools[w.device].give_back(w.proc, w.module)

    async def close(self) -> None:
        await self.sup.close([w for pool in self.pools.values() for w in pool.drain()])
        await self.daemon.quit()


async def launch(w: Worker, slot: int, nodes: int) -> asyncio.Future[Done]:
    """LAUNCH the worker's module on ``nodes`` blocks; the future its DONE resolves."""
    p = w.proc
    gen, done = p.next_gen(w.module)
    try:
        await p.ask(Op.LAUNCH, Launch(w.module, gen, slot, nodes).encode())
    except WorkerError as e:
        done.cancel()
        raise e.prefixed(w.name, "{what} ({message})") from e
    return done


def query(w: Worker) -> bool:
    """The last launch's stream finished; WorkerError (naming the program) otherwise."""
    try:
        return w.proc.query(w.module)
    except WorkerError as e:
        raise e.prefixed(w.name) from e
