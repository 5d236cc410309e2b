"""The one table from error type to HTTP status, as supervisord maps its ``Faults``.

An error's status is that of the nearest class in its MRO that the table names; an error the
table does not name (a failure of a worker, the MPS daemon, the device, or a bug) is a 500, and
its message says which.  Nothing here reads a message.
"""

from __future__ import annotations

from meshd_mps import errors as E

STATUS: dict[type[BaseException], int] = {
    E.BadRequest: 400,  # ConfigError, ManifestError, BadName, CompileError, LimitError, ImageRefused, ...
    E.MailboxError: 400,  # a slot or an entry out of the layout
    E.NotFound: 404,  # NotLoaded
    E.Conflict: 409,  # AlreadyLoaded, CapacityError, ClientLimit, NotStarted, NotRunning, HaltTimeout, RingFull, ...
    E.Unavailable: 503,  # starting, shutting down, closed
    E.Timeout: 504,  # CallTimeout
}


def status_of(e: BaseException) -> int:
    for cls in type(e).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500
