"""Who runs the control daemon of an MPS directory, and what a dead meshd-mps left in one.

The ``Owner`` marker names the meshd-mps (and the daemon) of a directory by pid and start time.
A meshd-mps killed outright (SIGKILL, the OOM killer) leaves its control daemon and server
running, and a default directory behind; the next start reads the marker, sees its meshd-mps
gone, and quits them (``quit_left``), or finds the directories to sweep (``left_dirs``).  Apart
from the daemon's own lifecycle (control.py) because it is about processes that are not ours:
each is watched by (pid, start time), never waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import anyio
import structlog

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import MpsError
from meshd_mps.supervision import procfs
from meshd_mps.supervision.procfs import processes

log = structlog.get_logger("meshd_mps")

#: The marker a control daemon's directory holds while a meshd-mps runs it (``Owner``).
MARKER = "meshd-mps.owner.json"
#: The prefix of a default (temporary) MPS directory: ``tempfile.mkdtemp(prefix=...)``.
TEMP_PREFIX = "meshd-mps."


@dataclass(frozen=True)
class Owner:
    """Who runs the control daemon of a directory, written there once the daemon is up and removed
    at its quit.  A process is named by its pid and start time (a pid alone can be reused), within
    one boot.  After a SIGKILL or an OOM kill of meshd-mps the daemon and its server live on; the
    next start finds this marker, sees its meshd-mps gone, and quits them first."""

    meshd_pid: int
    meshd_start: int
    daemon_pid: int | None
    daemon_start: int | None
    boot: str
    temporary: bool

    @classmethod
    def me(cls, daemon_pid: int | None, temporary: bool) -> Owner:
        me = os.getpid()
        return cls(me, procfs.starttime(me) or 0, daemon_pid, None if daemon_pid is None else procfs.starttime(daemon_pid),
                   procfs.boot_id(), temporary)

    def write(self, dir: str) -> None:
        """Atomically (a torn marker would read as "not ours"): a temp file, fsync, rename."""
        path = os.path.join(dir, MARKER)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(asdict(self)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def read(cls, dir: str) -> Owner | None:
        """The marker of ``dir``; None if there is none or it is not one of ours."""
        try:
            with open(os.path.join(dir, MARKER), "rb") as f:
                return cls(**json.loads(f.read()))
        except (OSError, ValueError, TypeError):
            return None

    def this_boot(self) -> bool:
        return self.boot == procfs.boot_id()

    def meshd_alive(self) -> bool:
        return self.this_boot() and procfs.alive(self.meshd_pid, self.meshd_start)

    def daemon_alive(self) -> bool:
        return (self.this_boot() and self.daemon_pid is not None and self.daemon_start is not None
                and procfs.alive(self.daemon_pid, self.daemon_start))


#: One control command: (argv, stdin, deadline) -> (exit status, output); ``ControlDaemon._run``.
Runner = Callable[[list[str], "str | None", float], Awaitable[tuple[int, str]]]


async def quit_left(owner: Owner, dir: str, run: Runner, deadlines: Deadlines) -> None:
    """Quit a control daemon left by a dead meshd-mps (``owner``), and its server; nothing of it
    is our child, so each is watched by (pid, start time) until it is gone."""
    daemon = owner.daemon_pid
    servers = {(p.pid, procfs.starttime(p.pid)) for p in processes() if daemon and p.ppid == daemon}
    log.warning(f"mps: control daemon {daemon} in {dir} was left by meshd-mps {owner.meshd_pid}, which is gone;"
                " quitting it before the fresh start", dir=dir, daemon_pid=daemon, servers=sorted(p for p, _ in servers))
    try:
        await run([], "quit\n", deadlines.control_quit)
    except MpsError as e:
        log.error(str(e))
    left = [(daemon, owner.daemon_start)] if daemon and owner.daemon_start and owner.daemon_alive() else []
    left += [(p, t) for p, t in servers if t is not None]
    for kill in (False, True):
        with anyio.move_on_after(deadlines.control_reap):
            while left := [(p, t) for p, t in left if procfs.alive(p, t)]:
                await anyio.sleep(0.01)  # not our children: no pidfd wait without a race on reuse
        if not left or kill:
            break
        for p, _ in left:
            log.error(f"mps: process {p} left by meshd-mps {owner.meshd_pid} did not quit; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    for p, _ in left:
        log.error(f"mps: process {p} left by meshd-mps {owner.meshd_pid} is still there after SIGKILL")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(dir, MARKER))


def left_dirs(tmp: str, but: str | None) -> list[tuple[str, Owner | None]]:
    """The default MPS directories in ``tmp`` that a dead meshd-mps of this user left, with their
    markers (None: a directory without one, whose meshd-mps, named in it, is gone and where no
    control daemon socket was ever made)."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return []
    out: list[tuple[str, Owner | None]] = []
    for n in names:
        d = os.path.join(tmp, n)
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if d == but or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        owner = Owner.read(d)
        if owner is not None:
            if owner.temporary and not owner.meshd_alive():
                out.append((d, owner))
            continue
        pid = n[len(TEMP_PREFIX):].split(".", 1)[0]
        if pid.isdigit() and procfs.starttime(int(pid)) is None and not os.path.exists(os.path.join(d, "pipe", "control")):
            out.append((d, None))
    return out
