"""meshd-mps's private MPS control daemon: started, spoken to, quit and reaped.

``nvidia-cuda-mps-control -d`` daemonizes: the process we start exits and its
child, the daemon, is re-parented.  meshd-mps makes itself a child subreaper
(PR_SET_CHILD_SUBREAPER) so the daemon becomes its child and can be reaped
after ``quit``; otherwise it stays a zombie (seen on the H200).  The same
code drives the real binary and the stand-in that tests put first on PATH.

Live restore: ``detach()`` leaves the daemon and its server running with the
marker in place, and the next meshd-mps ``adopt()``s it by the pid it wrote in
its pipe directory (checked against the marker's pid and start time), instead
of quitting it (``quit_left``, the non-live case).  An adopted daemon is not
our child: its death is seen through a pidfd.  The marker, and what a dead
meshd-mps left, are owner.py's (imported from here too, as they always were).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import stat
import time
from collections.abc import Callable

import anyio
import structlog

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import MpsError, NotAdoptable
from meshd_mps.mps.owner import (  # the marker's names re-exported: tests and backend.py import them from here
    MARKER as MARKER,
    TEMP_PREFIX as TEMP_PREFIX,
    Owner as Owner,
    left_dirs,
    quit_left,
)
from meshd_mps.supervision import child, procfs
from meshd_mps.supervision.procfs import processes

log = structlog.get_logger("meshd_mps")

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants (the daemonized control process) become our children."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise MpsError(f"mps: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


def _children_where(match: Callable[[list[str], str], bool]) -> set[int]:
    """Our direct children (zombies too) for which ``match(argv, comm)`` holds."""
    me = os.getpid()
    return {p.pid for p in processes() if p.ppid == me and match(p.argv, p.comm)}


def _children_running(program: str) -> set[int]:
    """Children running ``program``: by command line, not name (a script's process is
    named after its interpreter, the stand-in's "python3", and its program is the interpreter's
    first argument that is not an option: ``python3 -S .../nvidia-cuda-mps-control -d``)."""
    def runs(argv: list[str], comm: str) -> bool:
        script = next((a for a in argv[1:] if not a.startswith("-")), "")
        return program in (os.path.basename(argv[0]) if argv else "", os.path.basename(script))
    return _children_where(runs)


def _mps_orphans() -> set[int]:
    """MPS processes re-parented to us: a server whose daemon died becomes our child."""
    return _children_where(lambda argv, comm: comm.startswith("nvidia-cuda-mps") or any("nvidia-cuda-mps" in a for a in argv))


def _reap_now(pid: int) -> bool:
    try:
        got, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return got == pid


def _make_private_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # something else there (a file, a symlink): said below
    except OSError as e:
        raise MpsError(f"mps: {path}: {e.strerror or e}") from e
    try:
        st = os.lstat(path)
    except OSError as e:
        raise MpsError(f"mps: {path}: {e.strerror or e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise MpsError(f"mps: {path} is not a directory")
    if st.st_uid != os.getuid():
        raise MpsError(f"mps: {path} belongs to uid {st.st_uid}, not to us; refusing")
    os.chmod(path, 0o700)


#: The file where ``nvidia-cuda-mps-control -d`` writes its pid, in its pipe directory (the
#: stand-in writes it too).
PID_FILE = "nvidia-cuda-mps-control.pid"

class ControlDaemon:
    """One private control daemon under ``dir`` (``dir/pipe``, ``dir/log``)."""

    def __init__(self, dir: str, temporary: bool, deadlines: Deadlines = DEFAULT, gpu: str = "cuda"):
        """``gpu``: "sim" where the workers are the simulated GPU's, whose daemon is the stand-in
        (only for the advice where the control binary is missing: PATH decides which one runs)."""
        self.deadlines = deadlines
        self.gpu = gpu
        self.dir = os.path.abspath(dir)
        self.temporary = temporary
        self.pipe_dir = os.path.join(self.dir, "pipe")
        self.log_dir = os.path.join(self.dir, "log")
        self.pid: int | None = None
        self.binary: str | None = None
        self.started = False
        self.servers: set[int] = set()  # server pids seen: one whose daemon died becomes our child
        self.died: str | None = None  # why it is gone while still needed (it was killed or crashed)
        self.adopted = False  # started by an earlier meshd-mps (adopt): not our child, watched by pidfd
        self._pidfd = -1

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to reach this daemon."""
        return {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}

    async def _run(self, args: list[str], stdin: str | None, within: float) -> tuple[int, str]:
        assert self.binary is not None
        env = {**os.environ, **self.env}
        try:
            proc = await child.spawn([self.binary, *args], env, stdin=stdin is not None, merge_stderr=True)
        except OSError as e:  # out of fds or processes: the command's own error, not a bare OSError
            what = " ".join(args) or (stdin or "").strip()
            raise MpsError(f"mps: {what}: cannot start {self.binary}: {e.strerror or e}") from e
        assert proc.stdout is not None
        out = b""
        try:
            with anyio.fail_after(within):
                if proc.stdin is not None:
                    proc.stdin.write((stdin or "").encode())
                    await proc.stdin.drain()
                    proc.stdin.close()
                out = await proc.stdout.read()
                await proc.wait()
        except TimeoutError as e:
            raise MpsError(f"mps: {CONTROL} {' '.join(args) or repr(stdin)}: no answer in {within:g}s") from e
        except (BrokenPipeError, ConnectionResetError):  # it exited without reading its command
            with anyio.move_on_after(within):
                out = await proc.stdout.read()
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.move_on_after(self.deadlines.control_kill, shield=True):
                    await proc.wait()
            proc.close()
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace")

    async def control(self, command: str) -> str:
        """One control command (``get_server_list``, ...); its output, or MpsError."""
        rc, out = await self._run([], command + "\n", self.deadlines.control_command)
        if rc != 0:
            raise MpsError(f"mps: {command}: {out.strip() or f'exit status {rc}'}")
        return out

    def _which(self) -> str:
        """The control binary on PATH; MpsError advising what fits this GPU where there is none."""
        binary = shutil.which(CONTROL)
        if binary is not None:
            return binary
        if self.gpu == "sim":
            from meshd_mps.standin import BIN_DIR

            fix = (f"the simulated GPU's MPS isolation runs meshd-mps's stand-in daemon, in {BIN_DIR}: put that"
                   f" directory first on PATH (PATH={BIN_DIR}:$PATH; README.md, the CPU section)")
        else:
            fix = "install the NVIDIA driver's MPS binaries (they come with the driver's utilities)"
        raise MpsError(f"mps: {CONTROL} not found on PATH: {fix}; refusing MPS isolation")

    async def start(self) -> None:
        self.binary = self._which()
        _make_private_dir(self.dir)
        _make_private_dir(self.pipe_dir)
        _make_private_dir(self.log_dir)
        if self.temporary:
            await sweep(os.path.dirname(self.dir), self.deadlines, but=self.dir)
        rc, out = await self._run([], "get_server_list\n", self.deadlines.control_command)
        if rc == 0:
            owner = Owner.read(self.dir)
            if owner is None or not owner.this_boot():
                raise MpsError(f"mps: a control daemon already runs on {self.pipe_dir} and it is not ours (no {MARKER}"
                               " of this boot in its directory); refusing")
            if owner.meshd_alive():
                raise MpsError(f"mps: meshd-mps {owner.meshd_pid} runs the control daemon of {self.dir}; refusing")
            await self._quit_left(owner)
        become_subreaper()
        before = _children_running(CONTROL)
        t0 = time.monotonic()
        rc, out = await self._run(["-d"], None, self.deadlines.control_start)
        if rc != 0:
            raise MpsError(f"mps: {CONTROL} -d: {out.strip() or f'exit status {rc}'}")
        self.started = True
        try:
            with anyio.fail_after(self.deadlines.control_start):
                while True:
                    rc, out = await self._run([], "get_server_list\n", self.deadlines.control_command)
                    if rc == 0:
                        break
                    await anyio.sleep(0.01)  # the daemon is coming up: poll its socket
        except TimeoutError as e:
            within = self.deadlines.control_start
            raise MpsError(f"mps: the control daemon did not answer within {within:g}s: {out.strip()}") from e
        with anyio.move_on_after(self.deadlines.control_adopt):  # the daemonized process is re-parented to us soon after -d
            while not (pids := _children_running(CONTROL) - before):
                await anyio.sleep(0.005)
        self.pid = min(pids) if pids else None
        if self.pid is None:
            log.warning("mps: the control daemon's pid was not found among our children; it is reaped at quit by name")
        Owner.me(self.pid, self.temporary).write(self.dir)
        log.info(
            f"mps: control daemon {self.pid} ready in {(time.monotonic() - t0) * 1e3:.0f} ms",
            pipe=self.pipe_dir,
            log_dir=self.log_dir,
        )

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._pidfd >= 0:
            return self._adopted_alive()
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == self.pid:
            if self.started:  # not at our quit: it was killed or crashed
                code = os.waitstatus_to_exitcode(status)
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                self.died = f"the MPS control daemon {pid} died ({how})"
                log.error(f"mps: {self.died}; running programs go on, new workers cannot be verified as clients")
            self.pid = None
            return False
        return True

    def _adopted_alive(self) -> bool:
        """The adopted daemon's pidfd: readable once it has exited.  Its status is its parent's
        to read, unless we happen to be that parent (a subreaper)."""
        p = select.poll()
        p.register(self._pidfd, select.POLLIN)
        if not p.poll(0):
            return True
        how = "its status is not ours to know"
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.pid or 0, os.WNOHANG)
            if pid == self.pid:
                code = os.waitstatus_to_exitcode(status)
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        os.close(self._pidfd)
        self._pidfd = -1
        if self.started:
            self.died = f"the MPS control daemon {self.pid} died ({how})"
            log.error(f"mps: {self.died}; running programs go on, new workers cannot be verified as clients")
        self.pid = None
        return False

    async def adopt(self) -> None:
        """Take over the control daemon an earlier meshd-mps left running in this directory (live
        restore), instead of quitting it: its pid from ``pipe/nvidia-cuda-mps-control.pid``, which
        must be the marker's daemon (pid and start time, this boot) and alive, and answer; the
        marker's meshd-mps gone (or this process: a daemon we detached).  Then it is watched
        through a pidfd and the marker names us.  ``NotAdoptable`` saying why otherwise (the
        caller may ``start()`` a fresh one)."""

        def refuse(why: str) -> NotAdoptable:
            return NotAdoptable(f"mps: no control daemon to adopt in {self.dir}: {why}", dir=self.dir, why=why)

        self.binary = self._which()
        owner = Owner.read(self.dir)
        if owner is None or not owner.this_boot():
            raise refuse(f"no {MARKER} of this boot")
        if owner.meshd_pid != os.getpid() and owner.meshd_alive():
            raise refuse(f"meshd-mps {owner.meshd_pid} runs it")
        pid = _read_pid(os.path.join(self.pipe_dir, PID_FILE))
        if pid is None:
            raise refuse(f"no {PID_FILE} in {self.pipe_dir}")
        if owner.daemon_pid is not None and owner.daemon_pid != pid:
            raise refuse(f"its pid file names {pid}, its marker {owner.daemon_pid}")
        start = procfs.starttime(pid)
        if start is None or not procfs.alive(pid, start):
            raise refuse(f"control daemon {pid} is not running")
        if owner.daemon_start is not None and start != owner.daemon_start:
            raise refuse(f"process {pid} is not the daemon of the marker (another start time: the pid was reused)")
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            raise refuse(f"control daemon {pid}: pidfd_open: {e.strerror}") from e
        try:
            rc, out = await self._run([], "get_server_list\n", self.deadlines.control_command)
        except BaseException:
            os.close(pidfd)
            raise
        if rc != 0:
            os.close(pidfd)
            raise refuse(f"control daemon {pid} does not answer: {out.strip() or f'exit status {rc}'}")
        self.pid, self._pidfd, self.started, self.adopted = pid, pidfd, True, True
        first = out.split("\n", 1)[0].strip()
        if first.isdigit():
            self.servers.add(int(first))
        Owner.me(pid, self.temporary).write(self.dir)
        log.info(f"mps: control daemon {pid} adopted from meshd-mps {owner.meshd_pid}", pipe=self.pipe_dir,
                 server=first or None)

    def detach(self) -> None:
        """Stop without quitting it (live restore): the daemon and its server run on, the marker
        and the directory stay for the next meshd-mps to ``adopt``; ``quit`` then does nothing."""
        if self.started:
            log.info(f"mps: control daemon {self.pid} left running for the next meshd-mps", dir=self.dir)
        self.started = False
        self.temporary = False
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def lost(self) -> str | None:
        """Why the daemon is gone while still needed (None: it runs, or we quit it); a waitpid."""
        if self.started and self.pid is not None:
            self.alive()
        if self.died:
            for p in _mps_orphans() | self.servers:  # its server exits with it: no zombie kept till close
                _reap_now(p)
        return self.died

    def check_alive(self) -> None:
        """MpsError if the daemon died underneath us: no new worker can then be verified as a client
        of our server (on the H200 its server exits with it, a running kernel goes on unreported,
        idle clients' calls fail with MPS_RPC_FAILURE, a fresh worker runs as a plain context)."""
        if why := self.lost():
            raise MpsError(f"mps: {why}: no new worker can be verified as a client of our server; refusing"
                           " (running programs go on; restart meshd-mps to load again)")

    async def _reap(self, within: float) -> bool:
        if self.pid is None:
            return True
        with anyio.move_on_after(within):
            while self.alive():
                await anyio.sleep(0.005)  # waitpid has no awaitable form for a re-parented child
            return True
        return False

    async def _reap_orphans(self) -> None:
        """A server whose daemon died exits with it (a zombie of ours, H200); reap it, or kill it."""
        left = {p for p in _mps_orphans() | self.servers if not _reap_now(p)}
        with anyio.move_on_after(self.deadlines.control_reap):
            while left:
                await anyio.sleep(0.01)
                left = {p for p in left if not _reap_now(p)}
        for p in left:
            log.error(f"mps: process {p} outlived its daemon; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with anyio.move_on_after(self.deadlines.control_reap):
            while left:
                await anyio.sleep(0.01)
                left = {p for p in left if not _reap_now(p)}

    async def _quit_left(self, owner: Owner) -> None:
        """The control daemon (and its server) that an earlier meshd-mps left running in this
        directory when it died: ``quit``, then killed if it lingers, so that the fresh start owns
        the directory (its clients, that meshd-mps's workers, exited at its death)."""
        await quit_left(owner, self.dir, self._run, self.deadlines)

    async def quit(self) -> None:
        """``quit``, then the daemon reaped (killed if it lingers); the directory removed if ours."""
        if self.started:
            self.started = False
            t0 = time.monotonic()
            try:
                rc, out = await self._run([], "quit\n", self.deadlines.control_quit)
                if rc != 0:
                    log.error(f"mps: quit: {out.strip() or f'exit status {rc}'}")
            except MpsError as e:
                log.error(str(e))
            if not await self._reap(self.deadlines.control_reap):
                log.error(f"mps: control daemon {self.pid} did not exit {self.deadlines.control_reap:g}s after quit; killing it")
                if self.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                if not await self._reap(self.deadlines.control_reap):
                    log.error(f"mps: control daemon {self.pid} not reaped; left behind")
            await self._reap_orphans()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, MARKER))
            log.info(f"mps: control daemon quit in {(time.monotonic() - t0) * 1e3:.0f} ms")
        if self.temporary:
            shutil.rmtree(self.dir, ignore_errors=True)


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


async def sweep(tmp: str, deadlines: Deadlines = DEFAULT, but: str | None = None) -> list[str]:
    """Clean what dead meshd-mps runs of this user left in their default MPS directories
    (``left_dirs``): each one's control daemon and server quit (each is a context and GPU memory
    held, one per crash), the directory removed.  Returns the directories removed."""
    removed: list[str] = []
    binary = shutil.which(CONTROL)
    for d, owner in left_dirs(tmp, but):
        if owner is not None and owner.daemon_alive() and binary is not None:
            left = ControlDaemon(d, temporary=True, deadlines=deadlines)
            left.binary = binary
            await quit_left(owner, d, left._run, deadlines)
        shutil.rmtree(d, ignore_errors=True)
        log.info(f"mps: removed {d}, left by a meshd-mps that is gone", dir=d)
        removed.append(d)
    return removed
