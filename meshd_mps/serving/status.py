"""The one table from error type to HTTP status, as supervisord maps its ``Faults``.

An error's status is that of the nearest class in its MRO that the table names; an error the
table does not name (a failure of a worker, the MPS daemon, the device, or a bug) is a 500, and
its message says which.  Nothing here reads a message.

The few errors only HTTP has (no such route, a method the route lacks, a body's framing, a head
the parser refused, a request not sent in time) are types here too, on the branches of
``meshd_mps.base.errors``, so that every refusal is answered through this one table.
"""

from __future__ import annotations

from meshd_mps.base import errors as E


class NoRoute(E.NotFound):
    """No route has this path."""


class MethodNotAllowed(E.BadRequest):
    """The route has no such method; ``allowed`` goes into the ``Allow`` header too."""

    FIELDS = ("allowed",)

    def __init__(self, message: str, *, allowed: tuple[str, ...]):
        super().__init__(message)
        self.allowed = allowed


class LengthRequired(E.BadRequest):
    """A body without a Content-Length (chunked): the daemon takes only bodies whose size it can
    refuse before it reads them."""


class EncodingRefused(E.BadRequest):
    """A body with a Content-Encoding other than identity: the daemon's bodies are small JSON, and
    a compressed one would be decoded on the event loop before its size could be refused."""

    FIELDS = ("encoding",)

    def __init__(self, message: str, *, encoding: str):
        super().__init__(message)
        self.encoding = encoding


class ExpectRefused(E.BadRequest):
    """An ``Expect`` header other than ``100-continue``, the one expectation HTTP/1.1 defines."""

    FIELDS = ("expect",)

    def __init__(self, message: str, *, expect: str):
        super().__init__(message)
        self.expect = expect


class BodyTooLarge(E.BadRequest):
    """A body over ``limit`` bytes, refused on its Content-Length before any of it is read."""

    FIELDS = ("size", "limit")

    def __init__(self, message: str, *, size: int, limit: int):
        super().__init__(message)
        self.size = size
        self.limit = limit


class BadBody(E.BadRequest):
    """A body outside its route's schema; ``field`` names the field (None: the body as a whole)."""

    FIELDS = ("field",)

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class HeadRefused(E.BadRequest):
    """A request line or headers that HTTP's parser refused (in the parser's words)."""


class HeadTooLarge(HeadRefused):
    """A request line or a header line over the limit."""


class VersionNotSupported(E.BadRequest):
    """A request of another HTTP than 1.x (the parser takes any ``HTTP/d.d``)."""


class RequestTimeout(E.Timeout):
    """A request whose head or body did not arrive within ``within`` seconds."""

    FIELDS = ("within",)

    def __init__(self, message: str, *, within: float):
        super().__init__(message)
        self.within = within


STATUS: dict[type[BaseException], int] = {
    MethodNotAllowed: 405,
    LengthRequired: 411,
    BodyTooLarge: 413,
    EncodingRefused: 415,
    ExpectRefused: 417,
    HeadTooLarge: 431,
    RequestTimeout: 408,
    VersionNotSupported: 505,
    # ConfigError (ConfigFileError, StateDirRefused, StateFileNewer), ManifestError, BadName, CompileError,
    # LimitError, ImageRefused, BadBody, ...; StateIOError is a failure of ours: 500, not in the table.
    E.BadSpec: 422,  # the fleet's: a spec it cannot deploy (meshd_mps/fleet/spec.py)
    E.CallRefused: 502,  # the fleet's: a node's daemon refused a call (its own status in the error's fields)
    E.BadResponse: 502,  # a program's response the host does not read (past its region): the program's fault
    E.PayloadTooLarge: 413,  # a call's payload over its program's declared size (a ring entry's, undeclared)
    E.CallPortToken: 401,  # the fleet's: a call port's request without its token (fleet/callport.py)
    E.BadRequest: 400,
    E.MailboxError: 400,  # a slot or an entry out of the layout
    E.NotFound: 404,  # NotLoaded, NoRoute
    E.Conflict: 409,  # AlreadyLoaded, CapacityError, ClientLimit, NotStarted, NotRunning, NotServing, HaltTimeout, RingFull, ...
    E.Unavailable: 503,  # starting, shutting down, closed
    E.Timeout: 504,  # CallTimeout
}


def status_of(e: BaseException) -> int:
    for cls in type(e).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def log_level(e: BaseException, loading: bool) -> str | None:
    """How the daemon logs a refusal it answers, by type as the statuses are (None: not at all,
    beyond the debug line of every request).  A failure of ours (5xx): error.  A caller's deadline
    run out (``Timeout``: a call's): info, since nothing of the daemon's failed, and a program that
    stopped answering is the heartbeat's to report (a stall: a warning, once).  A refused load or
    upgrade (``loading``), and a head over the limit: warning, with the reason, once.  Any other
    4xx is a client's bad input: not logged.  A 503 of a daemon starting or stopping is no failure
    either (info); a worker's (``NoContext``) is."""
    if isinstance(e, E.Timeout) or (isinstance(e, E.Unavailable) and not isinstance(e, E.WorkerError)):
        return "info"
    if status_of(e) >= 500:
        return "error"
    if loading or isinstance(e, HeadTooLarge):
        return "warning"
    return None
