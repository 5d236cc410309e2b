"""``meshd-mps serve``: the daemon's lifecycle (start, serve, stop), its signals and its socket.

Start: the socket is bound first (``unix_socket.py``: in a directory only the daemon's user can
write, created 0600, a stale one replaced), so that a client connecting during start-up waits for
its answer; then the Backend and Programs open, and the control API (``api.py``, on aiohttp)
serves on that socket.

Signals: SIGTERM, SIGINT or SIGHUP shuts down cleanly (stop accepting, the in-flight requests get
``Deadlines.http_grace`` to finish, every program halted and unloaded, the backend closed, the
socket removed; exit status 0).  A second signal during that forces the exit: every descendant
process is killed and reaped (``reaper.py``), the socket and a temporary MPS directory removed,
and the process exits with 128 + the signal's number.  The signal handlers only record the
signal; a task of the loop acts on it.  SIGHUP is a hang-up (the terminal closed): a clean stop,
as SIGTERM, never the default's death without cleanup; it does not reload anything.  Workers lead
process groups of their own (``supervision/child.py``), so a signal sent to the daemon's group
(Ctrl-C, the shell's ``kill %1``) reaches only the daemon.

Every task of the daemon (the signal watcher, the NVML watch) lives in the one task group of
:meth:`Daemon.run`; the start-up runs in its own cancel scope, which the first signal cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import os
import platform
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import structlog
from aiohttp import web

from meshd_mps.backend import Backend
from meshd_mps.base import defaults, eventloop
from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import MeshError, NoDriver
from meshd_mps.base.log import setup_logging
from meshd_mps.base.version import version
from meshd_mps.gpu.compiler import nvjitlink_version
from meshd_mps.gpu.device import check_driver
from meshd_mps.gpu.nvml import Nvml, NvmlLike, SimNvml
from meshd_mps.mps.control import become_subreaper
from meshd_mps.neighbours import NeighbourWatch, classify, look
from meshd_mps.programs import Programs
from meshd_mps.programs.datastore import DataStore
from meshd_mps.serving import leases, reaper, sdnotify
from meshd_mps.serving.api import Api
from meshd_mps.serving.client import default_socket, program_body
from meshd_mps.serving.exporter import Exporter
from meshd_mps.serving.leases import Leases
from meshd_mps.serving.metrics import Metrics
from meshd_mps.serving.unix_socket import BACKLOG, ControlSocket
from meshd_mps.state.config import SERVE_DEFAULTS, DeclaredProgram, pool_of
from meshd_mps.state.desired import Recorder, Restored, restore
from meshd_mps.state.statedir import DATA_DIR, resolve_state_dir
from meshd_mps.state.store import Store
from meshd_mps.supervision import cpus

log = structlog.get_logger("meshd_mps")

#: What the CLI adds to NoDriver's own words (which name the setting, gpu="sim"): its flag.
NO_DRIVER_HINT = "on the command line: meshd-mps serve --gpu sim"

NEIGHBOURS_S = 2.0  # NVML is asked this often for the processes on our GPUs
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ---- configuration ---------------------------------------------------------------------------


@dataclass
class Config:
    """serve's options, checked (``cli.serve_config``); each default is ``SERVE_DEFAULTS``'s."""

    isolation: str = SERVE_DEFAULTS["isolation"]
    sms: int = SERVE_DEFAULTS["sms"]
    mps_dir: str | None = SERVE_DEFAULTS["mps_dir"]
    pool: int | None = SERVE_DEFAULTS["pool"]  # None: POOL_BY_ISOLATION's (state/config.py)
    gpu: str = SERVE_DEFAULTS["gpu"]
    socket: str | None = SERVE_DEFAULTS["socket"]
    cache_dir: str | None = SERVE_DEFAULTS["cache_dir"]
    log_level: str | None = SERVE_DEFAULTS["log_level"]
    log_format: str | None = SERVE_DEFAULTS["log_format"]  # json | console | None (JSON unless stderr is a TTY)
    loop: str = SERVE_DEFAULTS["loop"]  # auto (uvloop if installed) | uvloop | asyncio
    devices: tuple[int, ...] | None = None  # the GPUs to drive (None: every visible one, SERVE_DEFAULTS' "all")
    stall_after: float | None = SERVE_DEFAULTS["stall_after"]  # seconds without a heartbeat before "stalled"
    # --state-dir as given (None: state.store.resolve_state_dir's default), --live-restore and the
    # workers' --orphan-timeout (None: Deadlines.orphan), the --config file (absolute) and its [program.NAME] tables.
    state_dir: str | None = SERVE_DEFAULTS["state_dir"]
    live_restore: bool = SERVE_DEFAULTS["live_restore"]
    orphan_timeout: float | None = SERVE_DEFAULTS["orphan_timeout"]
    config_file: str | None = None
    programs: tuple[DeclaredProgram, ...] = ()
    daemon_cpus: frozenset[int] | None = None  # --daemon-cpus (supervision/cpus.py); None: unplaced
    metrics_address: tuple[str, int] | None = None  # --metrics-address (exporter.py); None: off


def main(cfg: Config) -> int:
    """Run the daemon until a signal stops it; the exit status."""
    as_json = setup_logging("meshd", cfg.log_level, json=None if cfg.log_format is None else cfg.log_format == "json")
    os.environ[defaults.LOG_FORMAT_ENV] = "json" if as_json else "console"  # the workers' lines in the daemon's format
    try:
        if cfg.daemon_cpus is not None:  # before the loop starts a thread: every later one inherits it
            rest = cpus.place(cfg.daemon_cpus)
            log.info(f"the daemon on CPUs {cpus.text(cfg.daemon_cpus)}, its workers and MPS on {cpus.text(rest)}",
                     daemon_cpus=sorted(cfg.daemon_cpus), children_cpus=sorted(rest))
        return eventloop.run(Daemon(cfg).run, cfg.loop)
    except NoDriver as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        print(f"meshd-mps: {NO_DRIVER_HINT}", file=sys.stderr)
        return 1
    except (MeshError, OSError) as e:
        msg = str(e) if isinstance(e, MeshError) else f"{type(e).__name__}: {e}"
        print(f"meshd-mps: {msg}", file=sys.stderr)
        return 1


def _sole(group: BaseExceptionGroup) -> BaseException:
    """The one error a task group wrapped, for ``main`` to report by its type (else the group)."""
    leaves: list[BaseException] = []
    todo: list[BaseException] = [group]
    while todo:
        e = todo.pop()
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        else:
            leaves.append(e)
    return leaves[0] if len(leaves) == 1 else group


# ---- versions -----------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"meshd-mps": version(), "python": platform.python_version()}
    try:
        out["cuda-bindings"] = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        try:
            from cuda import bindings

            out["cuda-bindings"] = str(getattr(bindings, "__version__", "unknown"))
        except ImportError:
            out["cuda-bindings"] = "not installed"
    try:
        major, minor = nvjitlink_version()
        out["nvjitlink"] = f"{major}.{minor}"
    except Exception as e:  # no library: the daemon still serves status
        out["nvjitlink"] = f"unavailable ({type(e).__name__})"
    return out


# ---- the daemon ---------------------------------------------------------------------------


class Daemon:
    def __init__(self, cfg: Config, deadlines: Deadlines = DEFAULT):
        self.cfg = cfg
        self.deadlines = deadlines
        self.socket_path = os.path.abspath(cfg.socket or default_socket(cfg.gpu))
        self.state_path = resolve_state_dir(cfg.state_dir, gpu=cfg.gpu)
        self.backend: Backend | None = None
        self.programs: Programs | None = None
        self.metrics: Metrics | None = None
        self.store: Store | None = None
        self.restored: Restored | None = None
        self.leases: Leases | None = None
        self.signals: list[tuple[int, float]] = []  # each signal and when it came
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._starting: anyio.CancelScope | None = None  # the start-up's scope, cancelled by the first signal
        self.sock = ControlSocket(self.socket_path)
        self.exporter = Exporter(cfg.metrics_address) if cfg.metrics_address is not None else None
        self.t0 = time.monotonic()
        self.started = datetime.now(UTC)
        self.versions: dict[str, str] = {}

    # ---- lifecycle ------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for s in SIGNALS:
            loop.add_signal_handler(s, self._on_signal, s)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_signals, name="signals")
                try:
                    status = await self._run(tg)
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _sole(group)  # noqa: B904 - the group stays its context
        finally:
            for s in SIGNALS:
                loop.remove_signal_handler(s)
        return status

    async def _run(self, tg: anyio.abc.TaskGroup) -> int:
        if self.cfg.gpu == "cuda":
            check_driver()  # before anything is made, whatever the isolation
        try:
            become_subreaper()  # orphans of ours (the MPS daemon's) are ours to reap
        except MeshError as e:
            log.warning(str(e))
        fresh = self._fresh()
        served = refused = False
        try:
            sock = self._bind()
        except BaseException:
            self._unmake(fresh)
            raise
        try:
            if self.exporter is not None:
                self.exporter.bind()  # a port in use stops the start before anything runs
            with anyio.CancelScope() as starting:
                self._starting = starting
                if self._stop.is_set():  # the signal came before this scope did
                    starting.cancel()
                await self._open()  # its error (NoDriver, MpsError, ...) ends the start
            self._starting = None
            if starting.cancelled_caught:
                log.info("stopped during start-up")
                return 0
            served = True
            await self._serve(sock, tg)
            return 0
        except Exception:
            refused = not served
            raise
        finally:
            with anyio.CancelScope(shield=True):
                sock.close()  # closing it twice is nothing
                if self.exporter is not None:
                    await self.exporter.close()
                await self._close_backend()
                self._remove_socket()
            if served:
                log.info("meshd-mps stopped")
            if refused:
                self._unmake(fresh)

    def _fresh(self) -> list[str]:
        """What this start would make (the socket's directory, the state dir), for a refusal to remove."""
        return [d for d in (os.path.dirname(self.socket_path), self.state_path) if not os.path.lexists(d)]

    def _unmake(self, fresh: list[str]) -> None:
        """A refused start leaves nothing of its own: the state dir, if it was not there before and
        this start held it (its lock: no other daemon used it), goes with what the start put in it
        (the lock, ptx/); the socket's directory, if it was not there before, goes if it is empty
        (another daemon's socket in it stays)."""
        if self.state_path in fresh and self.store is not None:
            shutil.rmtree(self.state_path, ignore_errors=True)
        sock_dir = os.path.dirname(self.socket_path)
        if sock_dir in fresh:
            with contextlib.suppress(OSError):
                os.rmdir(sock_dir)

    async def _open(self) -> None:
        c = self.cfg
        pool = pool_of(c.isolation, c.pool)
        self.versions = await anyio.to_thread.run_sync(versions)
        # First: its lock makes the state dir ours alone, and with it (live restore) the mailbox file, the MPS
        # directory and the workers' sockets under it.  Refused: another user's dir, another daemon on it.
        self.store = await anyio.to_thread.run_sync(functools.partial(Store.open, self.state_path, gpu=c.gpu,
                                                                      socket=self.socket_path))
        d = self.deadlines if c.orphan_timeout is None else dataclasses.replace(self.deadlines, orphan=c.orphan_timeout)
        b = await Backend.open(isolation=c.isolation, sms=c.sms, mps_dir=c.mps_dir, pool=pool,  # type: ignore[arg-type]
                               gpu=c.gpu, cache_dir=c.cache_dir, devices=c.devices, deadlines=d,
                               live=self.store.dir if c.live_restore else None,
                               clear=None if c.live_restore else self.store.dir)
        self.backend = b
        self.leases = Leases(self.store.dir, d, live=c.live_restore)  # read before the restore adopts their programs
        # stall_after only when given: Programs' own default (Deadlines.stall) otherwise.
        data = await anyio.to_thread.run_sync(DataStore, os.path.join(self.store.dir, DATA_DIR))
        self.programs = Programs(b, data=data) if c.stall_after is None else Programs(b, stall_after=c.stall_after, data=data)
        self.metrics = Metrics(b, self.programs, self.versions.get("meshd-mps", ""), self.t0)
        await self._restore()

    async def _restore(self) -> None:
        """Reconciled with the desired state before the daemon reports ready: the adopted programs
        (live restore) taken over, the unwanted ones halted, every other recorded program and every
        declared one loaded again; from here on every change is recorded (state/desired.py)."""
        c, b, ps, store = self.cfg, self.backend, self.programs, self.store
        assert b is not None and ps is not None and b.info is not None and store is not None
        arch = b.info.compute

        def body(d: DeclaredProgram) -> dict[str, Any]:
            out = program_body(d.dir, d.manifest, d.ptx, d.cuda, d.hash, d.nodes, d.device, arch=arch, restart=d.restart)
            m = out["manifest"]
            if isinstance(m, dict) and m.get("data"):  # its data file, beside the manifest (the operator's, as the PTX)
                out["data_file"] = os.path.join(os.path.dirname(d.manifest), m["data"])
            return out

        ps.recorder = Recorder(store)  # the declared programs loaded now are recorded too
        self.restored = await restore(ps, store, c.programs, body, b.found)

    async def _serve(self, sock: socket.socket, tg: anyio.abc.TaskGroup) -> None:
        """The control API on the bound socket until the first signal, then its drain."""
        b, ps, metrics = self.backend, self.programs, self.metrics
        assert b is not None and ps is not None and metrics is not None and b.caps is not None
        api = Api(b, ps, metrics, socket_path=self.socket_path, versions=self.versions, started=self.started, t0=self.t0,
                  deadlines=self.deadlines, leases=self.leases)
        api.state = {"dir": self.store.dir if self.store else None, "live_restore": self.cfg.live_restore,
                     "restore": self.restored.as_dict() if self.restored else None,
                     "adoption": b.adoption if b.live is not None else None,
                     # serve --config: its [program.NAME] tables are loaded at every start (an unload warns so).
                     "config_file": self.cfg.config_file, "declared": [d.name for d in self.cfg.programs]}
        # Idle connections and the handlers cancelled by the drain get as long again to go.
        runner = web.AppRunner(api.app(), shutdown_timeout=self.deadlines.http_grace, access_log=None)
        await runner.setup()
        listener: asyncio.AbstractServer | None = None
        try:
            # What web.SockSite does, with our connection handler (api.Protocol) in aiohttp's place.
            assert runner.server is not None
            listener = await asyncio.get_running_loop().create_server(api.protocols(runner.server), sock=sock,
                                                                      backlog=BACKLOG)
            if len(b.devices) == 1:
                where = f"device {b.caps.name}"
            else:
                where = "devices " + ", ".join(f"{d}: {b.device_caps[d].name}" for d in b.devices)
            log.info(
                f"meshd-mps {self.versions.get('meshd-mps')} serves on {self.socket_path}: isolation {b.isolation},"
                f" gpu {b.gpu}, {where}",
                socket=self.socket_path, isolation=b.isolation, gpu=b.gpu, device=b.caps.name, devices=list(b.devices),
            )
            if self.exporter is not None:
                await self.exporter.serve(metrics)
                api.metrics_address = self.exporter.where
                log.info(f"the metrics at http://{self.exporter.where}/metrics", metrics_address=self.exporter.where)
            sdnotify.notify("READY=1", f"STATUS=serving on {self.socket_path}", within=self.deadlines.notify)  # Type=notify
            watch: anyio.CancelScope = await tg.start(self._neighbours, name="neighbours")
            lease: anyio.CancelScope = await tg.start(functools.partial(leases.keep, api.leases, ps), name="leases")
            try:
                await self._stop.wait()
                listener.close()  # stop accepting: new connections are refused
                await api.drain()
            finally:
                lease.cancel()
                watch.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if listener is not None:
                    listener.close()
                await runner.cleanup()  # idle connections closed, the app's cleanup

    async def _close_backend(self) -> None:
        """Every program halted and the backend closed; with live restore both left running instead,
        for the next daemon to adopt (Backend.detach)."""
        if self.store is not None:
            self.store.close()
        # With no program running there is nothing to keep: a full stop, which leaves nothing behind.
        live = self.backend is not None and self.backend.live is not None and bool(self.programs and self.programs.by_name)
        if self.programs is not None:
            try:
                await (self.programs.detach() if live else self.programs.close())
            except Exception:
                log.error("closing the programs failed", traceback=traceback.format_exc())
        if self.backend is not None:
            if live:
                pids = await self.backend.detach()
                log.info(f"live restore: {len(pids)} workers left running for the next meshd-mps (for up to"
                         f" {self.backend.sup.deadlines.orphan:g} s)", pids=pids)
            else:
                await self.backend.close()

    async def _neighbours(self, *, task_status: anyio.abc.TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED) -> None:
        """Every NEIGHBOURS_S, NVML's view of our GPUs: a process outside our server is logged once
        when it comes and once when it goes, and shown in status and the metrics (neighbours.py).
        Without NVML the daemon says why once and goes on without it."""
        b, metrics = self.backend, self.metrics
        assert b is not None and metrics is not None
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            try:
                opener = SimNvml.open if b.gpu == "sim" else Nvml.open
                with anyio.fail_after(self.deadlines.nvml):
                    nvml: NvmlLike = await anyio.to_thread.run_sync(opener, abandon_on_cancel=True)
            except (MeshError, TimeoutError) as e:
                log.warning(f"NVML: not watching the GPUs' other processes: {e}", why=getattr(e, "why", str(e)))
                return
            watch = metrics.watch = NeighbourWatch(b.isolation)
            try:
                while True:
                    try:
                        views = await look(nvml, b.devices, self.deadlines.nvml)
                        mps = b.mps
                        server = {int(mps.server)} if mps is not None and mps.server and mps.server.isdigit() else set()
                        native = set(mps.native) if mps is not None else set()
                        for v in views:
                            watch.observe(classify(v, set(b.sup.workers), server, native))
                    except MeshError as e:
                        log.warning(f"NVML: {e}")
                    await anyio.sleep(NEIGHBOURS_S)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(nvml.close)

    # ---- signals ----------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        """Called by the loop: only records the signal, and when it came."""
        self.signals.append((sig, time.monotonic()))
        self._wake.set()

    async def _watch_signals(self) -> None:
        """The first signal stops; a later one forces the exit, unless it is the first one's echo:
        the same signal within ``Deadlines.signal_echo`` (``make serve`` passes on to its child the
        SIGTERM that a shell's ``kill -TERM %1`` sent to the whole job, the child included)."""
        handled = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while handled < len(self.signals):
                sig, at = self.signals[handled]
                handled += 1
                first, since = self.signals[0]
                if handled > 1 and sig == first and at - since < self.deadlines.signal_echo:
                    log.info(f"{signal.Signals(sig).name} again {(at - since) * 1e3:.0f} ms after the first: the same"
                             " request, passed on by a parent (make) or sent to the whole job; a later one forces the exit")
                elif handled == 1:
                    log.info(f"{signal.Signals(sig).name}: shutting down (a second signal forces the exit)")
                    sdnotify.notify("STOPPING=1", f"STATUS=shutting down on {signal.Signals(sig).name}",
                                    within=self.deadlines.notify)
                    self._stop.set()
                    if self._starting is not None:
                        self._starting.cancel()
                else:
                    self._force_exit(sig)

    def _force_exit(self, sig: int) -> None:
        name = signal.Signals(sig).name
        b = self.backend
        if b is not None and b.live is not None:
            # As a SIGKILL would: the workers run on, and halt themselves past their orphan timeout.
            log.error(f"{name} during shutdown: forcing the exit; live restore: the workers and the MPS daemon are"
                      " left for the next meshd-mps")
            self._remove_socket()
            sys.stderr.flush()
            os._exit(128 + sig)
        kids = reaper.descendants(os.getpid())
        log.error(f"{name} during shutdown: forcing the exit; killing {len(kids)} processes", pids=sorted(kids))
        reaper.kill_all(kids)
        reaper.reap_all(within=self.deadlines.reap)
        self._remove_socket()
        if b is not None and b.daemon is not None and b.daemon.temporary:
            shutil.rmtree(b.daemon.dir, ignore_errors=True)
        log.error(f"meshd-mps exits on {name} (status {128 + sig})")
        sys.stderr.flush()
        os._exit(128 + sig)

    # ---- the socket (unix_socket.py) ---------------------------------------------------------
    def _bind(self) -> socket.socket:
        return self.sock.bind()

    def _remove_socket(self) -> None:
        self.sock.remove()
