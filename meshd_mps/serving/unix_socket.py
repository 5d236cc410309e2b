"""The daemon's control socket as a file: its directory checked, the socket bound, and removed.

Bound first, before the backend opens (``server.py``): in a directory only the daemon's user can
write (:func:`check_socket_dir`), created 0600, a stale one replaced, listened on with a backlog
of ``BACKLOG``, so that a client connecting during start-up waits for its answer.  Removed at exit
only if it is still the one this daemon bound (same device and inode).
"""

from __future__ import annotations

import errno
import os
import socket
import stat

import structlog

from meshd_mps.base.deadlines import DEFAULT
from meshd_mps.base.errors import MeshError
from meshd_mps.serving.client import private_dirs

log = structlog.get_logger("meshd_mps")

SUN_PATH_MAX = 107  # AF_UNIX: 108 bytes with the NUL
#: The socket's listen backlog: connections the kernel queues while the loop is busy (a burst of
#: clients).  The kernel caps it at net.core.somaxconn (4096 on Linux 5.4+).  Passed to
#: ``create_server`` too, which listens again with its own default (100) otherwise.
BACKLOG = 1024


class StartError(MeshError):
    """The daemon cannot start (the socket is taken, ...)."""


class ControlSocket:
    """The socket file at ``path``: bound once, removed once (and only if it is still ours)."""

    def __init__(self, path: str):
        self.path = path
        self._id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket bound

    def bind(self) -> socket.socket:
        path = self.path
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise StartError(f"--socket {path}: {len(os.fsencode(path))} bytes, AF_UNIX allows {SUN_PATH_MAX}")
        check_socket_dir(os.path.dirname(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise StartError(f"{path} exists and is not a socket; refusing to replace it")
            if serves(path):
                raise StartError(f"another meshd-mps serves on {path}")
            os.unlink(path)
            log.info(f"replaced the stale socket {path}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise StartError(f"another meshd-mps serves on {path}") from e
            raise StartError(f"{path}: bind: {e.strerror}") from e
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        st = os.stat(path)
        self._id = (st.st_dev, st.st_ino)
        s.listen(BACKLOG)  # a client that connects during start-up waits for the answer
        s.setblocking(False)
        return s

    def remove(self) -> None:
        """The socket file removed if it is the one bound here (another daemon's is left alone)."""
        if self._id is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error(f"{self.path}: not removed: {e.strerror}")
        self._id = None


def check_socket_dir(d: str) -> None:
    """The socket's directory, created (0700) if it is missing, and refused (StartError) unless only
    the daemon's user can write it: a directory owned by the daemon's uid, or by root, with no group
    or other write bit, so that nobody else can remove, rename or replace the socket or plant
    another one in its place.  This holds for every socket (--socket, $MESHD_MPS_SOCKET, the
    defaults), with no exception for sticky directories such as /tmp.  A symlink is followed if it
    is the daemon's user's or root's.  The default directories the daemon makes itself
    (client.private_dirs: /run/meshd-mps for root, /tmp/meshd-mps-$UID) must be its own: owned by
    its uid, and never a symlink (anyone can create that name in /tmp first)."""
    me = os.geteuid()
    own = os.path.abspath(d) in private_dirs(me)
    hint = "put the socket in a directory only you can write (--socket), or remove it and let meshd-mps make it"
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # not a directory (or a dangling symlink): said below
    except OSError as e:
        raise StartError(f"socket directory {d}: cannot create it: {e.strerror}") from e
    try:
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode):
            if own:
                raise StartError(f"socket directory {d} is a symlink; refusing it (the default directory must be a real"
                                 f" one, owned by uid {me}, mode 0700: remove the link and meshd-mps makes it)")
            if st.st_uid not in (me, 0):
                raise StartError(f"socket directory {d} is a symlink owned by uid {st.st_uid}, not by this daemon's uid"
                                 f" {me} or root; refusing it: {hint}")
            st = os.stat(d)
    except FileNotFoundError as e:
        raise StartError(f"socket directory {d}: a dangling symlink; refusing it") from e
    except OSError as e:
        raise StartError(f"socket directory {d}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StartError(f"socket directory {d} is not a directory; refusing it")
    if st.st_uid != me and (own or st.st_uid != 0):
        raise StartError(f"socket directory {d} is owned by uid {st.st_uid}, not by this daemon's uid {me}; refusing it"
                         f" (its owner could replace the socket): {hint}")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002)) if st.st_mode & bit)
        raise StartError(f"socket directory {d} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); refusing it"
                         f" (they could remove or replace the socket): {hint}")


def serves(path: str, within: float = DEFAULT.socket_probe) -> bool:
    """Someone accepts connections on the socket ``path`` (a stale socket refuses them)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(within)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # a full backlog: it is alive
    except OSError as e:
        raise StartError(f"{path}: {e.strerror}; refusing to replace it") from e
    finally:
        s.close()
