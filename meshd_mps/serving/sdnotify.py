"""sd_notify(3) without libsystemd: tell the service manager that the daemon is ready, stopping,
or what it is doing, so that ``Type=notify`` units start their dependents only once the socket
serves.

One datagram of ``FIELD=value`` lines to ``$NOTIFY_SOCKET``: a path, or an abstract socket where it
starts with ``@``.  Without ``$NOTIFY_SOCKET`` (not under systemd) nothing is sent; a socket that
is gone or refuses is logged, never raised: the daemon serves whether or not anyone listens.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

from meshd_mps.base.deadlines import DEFAULT

log = structlog.get_logger("meshd_mps")

def notify(*fields: str, environ: Mapping[str, str] = os.environ, within: float = DEFAULT.notify) -> bool:
    """Sends ``fields`` (e.g. ``"READY=1"``, ``"STATUS=serving"``), one per line, a full queue waited
    for ``within`` (``Deadlines.notify``); whether they were sent."""
    addr = environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        target = "\0" + addr[1:]
    elif addr.startswith("/"):
        target = addr
    else:
        log.warning(f"sd_notify: $NOTIFY_SOCKET {addr!r} is neither a path nor an abstract socket (@name); not sent",
                    socket=addr, fields=list(fields))
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(within)
            s.sendto("\n".join(fields).encode(), target)
    except OSError as e:
        log.warning(f"sd_notify: {addr}: {e.strerror or type(e).__name__}; not sent", socket=addr, fields=list(fields))
        return False
    return True
