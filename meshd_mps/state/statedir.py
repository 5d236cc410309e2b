"""Where the state lives (``resolve_state_dir``), the directory made and refused unless it is the
daemon's alone (``open_state_dir``), and how a file in it is written whole (``atomic_write``)."""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import tempfile
from collections.abc import Mapping
from typing import ClassVar

import structlog

from meshd_mps.base import defaults
from meshd_mps.base.errors import StateDirRefused, StateIOError

log = structlog.get_logger("meshd_mps")

#: The programs' data (programs/datastore.py): content-addressed files, and each program's own once written.
DATA_DIR = "data"
PTX_DIR = "ptx"
TMP_SUFFIX = ".tmp"
#: Root's default state directory's parent: ``/var/lib/meshd-mps`` (``-sim`` for the simulated GPU).
ROOT_STATE_PARENT = "/var/lib"
ROOT_STATE_DIR = os.path.join(ROOT_STATE_PARENT, defaults.NAME)


class StateDirHeld(StateDirRefused):
    """A state directory that another meshd-mps holds (its lock): ``pid`` and ``socket`` are that
    daemon's, as it wrote them into the lock file (None where not known)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("path", "owner", "why", "pid", "socket")

    def __init__(self, message: str, *, path: str, owner: int, why: str, pid: int | None, socket: str | None):
        super().__init__(message, path=path, owner=owner, why=why)
        self.pid = pid
        self.socket = socket


# ---- where the state lives ----------------------------------------------------------------------


def resolve_state_dir(given: str | None, environ: Mapping[str, str] = os.environ, uid: int | None = None,
                      gpu: str | None = None) -> str:
    """The state directory: ``given`` (``--state-dir``), else systemd's ``$STATE_DIRECTORY`` (the
    first of its colon-separated paths), else ``/var/lib/meshd-mps`` for root, else the XDG state
    directory (``$XDG_STATE_HOME/meshd-mps``, ``~/.local/state/meshd-mps`` by default; a relative
    ``$XDG_STATE_HOME`` is ignored, as the XDG spec says).  For ``gpu="sim"`` the default's name is
    ``meshd-mps-sim`` (defaults.named): what is tried on the simulation is never restored on the
    GPU, nor the other way round.  Nothing is created here."""
    if given:
        return os.path.abspath(given)
    first = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if first:
        return os.path.abspath(first)
    uid = os.getuid() if uid is None else uid
    name = defaults.named(gpu)
    if uid == 0:
        return os.path.join(ROOT_STATE_PARENT, name)
    xdg = environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, name)
    home = environ.get("HOME") or pwd.getpwuid(uid).pw_dir
    return os.path.join(home, ".local", "state", name)


def open_state_dir(path: str, *, uid: int | None = None) -> str:
    """``path`` made (0700) if it is missing, then refused (StateDirRefused, saying why) unless it
    is the daemon's alone: what it holds is loaded back as the programs to run, so whoever else can
    write it could make the daemon run their code.  ``uid``: the daemon's (default the effective
    uid; a parameter so that the refusal of another owner can be tested without root).  The
    absolute path."""
    me = os.geteuid() if uid is None else uid
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700)
        os.chmod(path, 0o700)  # the umask could have taken bits off, never added: this is exact
        log.info(f"state: made the state directory {path}", path=path)
    except FileExistsError:
        pass  # checked below, whatever it is
    except OSError as e:
        raise StateIOError(f"state directory {path}: cannot create it: {e.strerror}", file=path,
                           why=e.strerror or str(e)) from e
    try:
        lst = os.lstat(path)
        try:
            st = os.stat(path)
        except FileNotFoundError as e:
            raise refused(path, lst.st_uid, "it is a dangling symlink",
                          "remove the symlink (the daemon makes the directory), or point it at a directory") from e
    except OSError as e:
        raise StateIOError(f"state directory {path}: {e.strerror}", file=path, why=e.strerror or str(e)) from e
    check_state_dir(path, lst, st, me)
    ptx = os.path.join(path, PTX_DIR)
    try:
        os.makedirs(ptx, mode=0o700, exist_ok=True)
    except OSError as e:
        raise StateIOError(f"state directory {ptx}: cannot create it: {e.strerror}", file=ptx,
                           why=e.strerror or str(e)) from e
    return path


def check_state_dir(path: str, lst: os.stat_result, st: os.stat_result, me: int) -> None:
    """The refusals of :func:`open_state_dir`, on the directory's ``lstat`` and ``stat``: a pure
    function of them, so every branch is tested with the stat results it refuses.  Each one's
    advice is for its own cause."""
    link = stat.S_ISLNK(lst.st_mode)
    via = f" (through the symlink {path} -> {os.path.realpath(path)})" if link else ""
    real = os.path.realpath(path)
    if link and lst.st_uid not in (me, 0):
        raise refused(path, lst.st_uid, f"it is a symlink owned by uid {lst.st_uid}, not by this daemon's uid {me} or root",
                      "remove the symlink, or use another state directory")
    if not stat.S_ISDIR(st.st_mode):
        raise refused(path, st.st_uid, f"it is not a directory{via}",
                      "move it away (the daemon makes the directory), or use another state directory")
    if st.st_uid != me:
        raise refused(path, st.st_uid, f"it is owned by uid {st.st_uid}, not by this daemon's uid {me}{via}",
                      f"run the daemon as uid {st.st_uid}, give it to this one (chown {me} {real}, as root), or use"
                      " another state directory")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002)) if st.st_mode & bit)
        raise refused(path, st.st_uid, f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}){via}",
                      f"chmod 0700 {real}")


def refused(path: str, owner: int, why: str, fix: str) -> StateDirRefused:
    """The refusal of a state directory others could write: ``why``, and ``fix`` for that cause."""
    return StateDirRefused(f"state directory {path}: {why}; refusing it (what it holds is loaded back as the programs"
                           f" to run): {fix}", path=path, owner=owner, why=why)


def held(path: str, owner: int, holder: tuple[int | None, str | None]) -> StateDirHeld:
    """The refusal of a state directory another meshd-mps holds: that daemon named by its ``pid``
    and ``socket`` (as it wrote them into the lock file; None where not known)."""
    pid, sock = holder
    who = ", ".join(w for w in (f"pid {pid}" if pid else "", f"serving on {sock}" if sock else "") if w)
    why = f"another meshd-mps{f' ({who})' if who else ''} holds it"
    return StateDirHeld(f"state directory {path}: {why}, and two daemons would write over each other's state: stop"
                        " that daemon, or use another state directory for this one", path=path, owner=owner, why=why,
                        pid=pid, socket=sock)


# ---- a file written whole ------------------------------------------------------------------------


def atomic_write(dir: str, name: str, data: bytes) -> None:
    """``dir/name`` is the old content or the new one, whole, at every instant, even across a
    crash: a temp file in ``dir``, written and fsynced, renamed over it, then ``dir`` fsynced so
    that the rename itself is durable."""
    path = os.path.join(dir, name)
    try:
        fd, tmp = tempfile.mkstemp(dir=dir, prefix=f".{name}.", suffix=TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise StateIOError(f"state: {path}: not written: {e.strerror or e}", file=path, why=e.strerror or str(e)) from e
