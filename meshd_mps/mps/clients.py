"""The private MPS daemon's clients, host-wide: workers verified as clients of our server, counted
per GPU, spawned with its environment; the native clients.

There is no fallback: no daemon, a worker that is not a client of *our*
server (the driver silently runs such a process as a plain context), or a
failed load refuses.  The seed's ``mps_check_clients`` and ``mps_spawn``.
MPS mode (``isolation/mps.py``: ``Mps``, each GPU's pool, preload and
prewarm) builds on :class:`Clients`; nothing here knows of the modes.

Several GPUs: one control daemon (and one server) for the host, a pool and
a client count per GPU; each worker is started with ``--device N`` and stays
on that GPU for its life.  MPS counts its client limit per device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from meshd_mps.base.errors import ClientLimit, MpsError, NotAdoptable, WorkerError
from meshd_mps.mps.control import PIPE_ENV, ControlDaemon
from meshd_mps.mps.serverlog import FatalLog
from meshd_mps.protocol import abi
from meshd_mps.supervision import procfs
from meshd_mps.supervision.argv import worker_argv
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

#: Clients one MPS server accepts (CUDA 13.0 on the H200: the 49th is refused).
MAX_CLIENTS = 48

#: What one new MPS client cost every running client, measured: a resident probe program's worst
#: beat gap when a client was created beside it, by the clients there then (an H100, bench row (h);
#: the H200 gave 0.44 ms at 8).  ``stall_estimate_us`` draws a line through them.
CLIENT_STALL_US: tuple[tuple[int, float], tuple[int, float]] = ((8, 505.0), (44, 1614.0))


@dataclass(frozen=True)
class NewClient:
    """A worker created for one program at its load (the pool had only its reserve, or none): the
    MPS clients of its GPU with it, and the estimated stall it cost each running program there."""

    clients: int
    stall_us: float  # stall_estimate_us(clients): an estimate, not a measurement

    def as_dict(self) -> dict[str, Any]:
        return {"clients": self.clients, "stall_us_estimate": self.stall_us}


def stall_estimate_us(clients: int) -> float:
    """An estimate (not a measurement) of the stall one new MPS client costs each running program
    when the server then has ``clients`` clients: the line through ``CLIENT_STALL_US``
    (docs/benchmarks.md, row h)."""
    (n0, s0), (n1, s1) = CLIENT_STALL_US
    return round(max(0.0, s0 + (s1 - s0) * (clients - n0) / (n1 - n0)), 1)


def pids_debug(pids: Sequence[int]) -> str:
    return "[" + ", ".join(str(p) for p in pids) + "]"


class Clients:
    """The daemon, our workers as its server's clients (each on its GPU), the native clients."""

    def __init__(self, daemon: ControlDaemon, sup: Supervisor, mailbox: str, sms: int, gpu: str,
                 max_clients: int = MAX_CLIENTS, listen: str | None = None):
        self.sup = sup
        self.daemon = daemon
        #: Live restore: workers serve on sockets there and outlive us, and the daemon an earlier
        #: meshd-mps left running in our directory is adopted rather than quit.
        self.listen = listen
        self.mailbox = mailbox
        self.sms = sms
        self.gpu = gpu
        self._spawned: dict[int, WorkerProc] = {}  # by pid, for its GPU (pruned to the live ones at each spawn)
        self._device_by_pid: dict[int, int] = {}  # every worker's GPU, dead ones too (the server log names them late)
        self.fatal = FatalLog(None)  # the server's log, read from the daemon's start on
        self.server: str | None = None  # the server's pid once a worker was seen in its client list
        self._native: dict[int, int | None] = {}  # native client pid -> its start time (procfs)
        self.max_clients = max_clients
        #: MPS clients our workers created (a context each), for the metrics: each stalled the running
        #: programs of its GPU once (``stall_estimate_us``).
        self.created = 0
        sup.before_exit = self.terminate
        #: The environment a worker gets on top of ours (tests point it elsewhere).
        self.worker_env: dict[str, str] = dict(daemon.env)
        self._set_pipe_env = False  # start set our own PIPE_ENV; close puts back what it was
        self._saved_pipe_env: str | None = None

    def gpu_count(self) -> int:
        """The GPUs whose workers are counted here (MPS mode: those it drives)."""
        return 1

    @property
    def keeps_workers(self) -> bool:
        """The workers an earlier meshd-mps left are clients of the server we adopted with its
        daemon; with a fresh daemon their server is gone, and so are their contexts."""
        return self.daemon.adopted

    async def start(self) -> None:
        """The daemon started (live restore: the one left running in our directory adopted, if it
        can be); meshd-mps's own cuInit (device attributes, no context) joins no daemon."""
        if self.listen is not None:
            try:
                await self.daemon.adopt()
            except NotAdoptable as e:
                log.info(f"{e}; starting a fresh one (the workers left, if any, are reloaded)", why=e.why)
        if not self.daemon.adopted:
            await self.daemon.start()
        self.fatal = FatalLog(f"{self.daemon.log_dir}/server.log")
        self._saved_pipe_env = os.environ.get(PIPE_ENV)
        self._set_pipe_env = True
        os.environ[PIPE_ENV] = os.path.join(self.daemon.dir, "none")
        log.info(f"mps: mailbox {abi.MAILBOX_BYTES} bytes ({self.mailbox}); workers run --gpu {self.gpu}")

    # ---- clients --------------------------------------------------------------------------
    def device_of(self, pid: int) -> int | None:
        """The GPU of our worker ``pid`` (None: not one of ours)."""
        return self._device_by_pid.get(pid)

    def workers_on(self, device: int) -> list[int]:
        """Our live workers on ``device``, pooled ones included."""
        return sorted(p for p, w in self.sup.workers.items() if p in self._spawned and w.device == device)

    def spawned_on(self, device: int) -> list[WorkerProc]:
        """Our workers on ``device`` not yet exited, retiring ones included."""
        return [w for w in self._spawned.values() if w.device == device and not w.process.exited]

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

    async def client_list(self) -> tuple[str | None, list[int]]:
        """Our server's pid and its clients' (None and none: it runs no server)."""
        server = await self.server_pid()
        return server, (await self.clients(server) if server is not None else [])

    async def check_clients(self, want: Sequence[int]) -> None:
        """Every pid in ``want`` must be a client of our daemon's server, or MpsError."""
        server, pids = await self.client_list()
        if server is None:
            raise MpsError(f"mps: workers {pids_debug(want)} are up but our daemon runs no server:"
                           " they are not MPS clients; refusing")
        for p in want:
            if p not in pids:
                raise MpsError(f"mps: worker {p} is not among server {server}'s clients {pids_debug(pids)}; refusing")
        self.note_clients(server, pids)

    def note_clients(self, server: str, pids: Sequence[int]) -> None:
        """The server's client list seen: clients that are not ours logged, the server's pid kept."""
        foreign = [p for p in pids if p not in self.sup.workers and p not in self.native]
        if foreign:
            log.error(f"mps: server {server} has clients that are not meshd's workers: {pids_debug(foreign)}")
        if self.server != server:
            log.info(f"mps: server pid {server}, clients {pids_debug(pids)}")
            self.server = server

    @property
    def native(self) -> set[int]:
        """The native clients that still run: one that exited is dropped here, at the next look
        (it no longer takes one of the server's clients)."""
        for pid, start in list(self._native.items()):
            if start is None or procfs.starttime(pid) != start:
                del self._native[pid]
                log.info(f"mps: native client {pid} exited; dropped", pid=pid)
        return set(self._native)

    def native_pipe_dir(self) -> str:
        """The pipe dir a native GPU worker must be started with to be a client of our server."""
        return self.daemon.pipe_dir

    def native_env(self) -> dict[str, str]:
        """What a CUDA process needs in its environment to join our server (docs/operations.md)."""
        return dict(self.daemon.env)

    async def check_native(self, pid: int) -> None:
        """A native client (a CUDA process that is not one of our workers, started with
        ``native_env``) registered: it must be a client of our server; it is then counted
        against the server's clients and not logged as foreign, until it exits."""
        self._native[pid] = procfs.starttime(pid)
        try:
            await self.check_clients([pid])
        except BaseException:
            self._native.pop(pid, None)
            raise
        log.info(f"mps: native client {pid} registered", pid=pid)

    def drop_native(self, pid: int) -> bool:
        """``pid`` no longer counted as a native client; False if it was not one."""
        if pid not in self._native:
            return False
        del self._native[pid]
        return True

    # ---- workers --------------------------------------------------------------------------
    def count_clients(self, device: int) -> int:
        """MPS clients on ``device``: our workers there, and every native client (its GPU is not
        known to us, so it is counted against each)."""
        return len(self.workers_on(device)) + len(self.native)

    async def spawn(self, program: str | None, device: int, hold: bool = False) -> WorkerProc:
        """A fresh worker on GPU ``device``, within that GPU's client limit (``hold``: no context
        until its READY, see worker_argv)."""
        n = self.count_clients(device)
        if n >= self.max_clients:
            gpu = "" if self.gpu_count() <= 1 else f" per GPU, and GPU {device} has them all"
            raise ClientLimit(
                f"mps: {n} clients already: the MPS server takes at most {self.max_clients}"
                f" (CUDA 13.0){gpu}; refusing another worker{' for ' + program if program else ''}",
                have=self.max_clients, asked=n + 1, device=device)
        env = {**os.environ, **self.worker_env}
        live = self.sup.workers
        self._spawned = {p: w for p, w in self._spawned.items() if p in live}
        try:
            w = await self.sup.spawn(worker_argv(self.mailbox, self.sms, self.gpu, device, hold=hold), env, program,
                                     listen=self.listen)
        except WorkerError as e:
            raise e.prefixed("load") from e
        w.device = device
        if not hold:  # a held worker creates its client at its READY (``created_by_ready``)
            self.created += 1
        self.took(w)
        return w

    def took(self, w: WorkerProc) -> None:
        """``w`` (spawned, or adopted) one of our workers, on its GPU."""
        self._spawned[w.pid] = w
        self._device_by_pid[w.pid] = w.device
        if len(self._device_by_pid) > 4 * self.max_clients * max(1, self.gpu_count()):
            del self._device_by_pid[next(iter(self._device_by_pid))]

    # ---- state ----------------------------------------------------------------------------
    def daemon_status(self) -> dict[str, Any]:
        """The server and the daemon."""
        return {"server": self.server, "mps_dir": self.daemon.dir,
                "daemon_died": self.daemon.lost(),  # first: a status poll notices a death
                "daemon_pid": self.daemon.pid}

    async def close(self) -> None:
        """The daemon quit (its directory removed if temporary), our environment as it was."""
        await self.daemon.quit()
        self._env_back()

    async def detach(self) -> None:
        """The daemon left running, for the next meshd-mps to adopt; our environment as it was."""
        self.daemon.detach()
        self._env_back()

    def _env_back(self) -> None:
        if self._set_pipe_env:
            self._set_pipe_env = False
            if self._saved_pipe_env is None:
                os.environ.pop(PIPE_ENV, None)
            else:
                os.environ[PIPE_ENV] = self._saved_pipe_env
