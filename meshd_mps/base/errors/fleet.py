"""The fleet's errors (meshd_mps/fleet/, on Ray), each on a branch of the tree as well; the one
table (serving/status.py) maps them, with rows of their own only where the branch's status is not
theirs (``BadSpec`` 422, ``CallRefused`` 502)."""

from __future__ import annotations

from typing import Any

from meshd_mps.base.errors.base import BadRequest, Conflict, MeshError, NotFound, Timeout, Unavailable

# ---- the fleet (meshd_mps/fleet/, on Ray) ----------------------------------------------------------


class FleetError(MeshError):
    """What the fleet refuses or cannot do; its subclasses sit on the branches above as well.
    Pickled whole (Ray carries them from the controller to the caller): ``__init__`` would make
    the message again from a message."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[FleetError], args: tuple[Any, ...], state: dict[str, Any]) -> FleetError:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class FleetUnavailable(FleetError, Unavailable):
    """The fleet cannot run here: Ray is not installed (``hint`` says how to get it), or its
    cluster cannot be reached (``hint`` names the address tried)."""

    FIELDS = ("hint",)

    def __init__(self, message: str, *, hint: str):
        super().__init__(message)
        self.hint = hint


class BadSpec(FleetError, BadRequest):
    """A program spec the fleet cannot deploy as given: ``field`` names the field at fault."""

    FIELDS = ("field",)

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


class NoSuchProgram(FleetError, NotFound):
    FIELDS = ("program",)

    def __init__(self, program: str):
        super().__init__(f"no program {program!r} is declared in the fleet")
        self.program = program


class AlreadyDeclared(FleetError, Conflict):
    FIELDS = ("program",)

    def __init__(self, program: str):
        super().__init__(f"program {program!r} is already declared in the fleet (upgrade it instead)")
        self.program = program


class NoReplica(FleetError, Unavailable):
    """A call found no running replica of ``program`` (``tried``: the replicas asked, in order)."""

    FIELDS = ("program", "tried")

    def __init__(self, message: str, *, program: str, tried: list[str]):
        super().__init__(message)
        self.program = program
        self.tried = tried


class ReplicaLost(FleetError, Unavailable):
    """A call whose replica's node (or its agent) died before it answered; not retried elsewhere,
    since the call was not marked idempotent and may have reached the program."""

    FIELDS = ("program", "replica", "node")

    def __init__(self, message: str, *, program: str, replica: str, node: str):
        super().__init__(message)
        self.program = program
        self.replica = replica
        self.node = node


class UpgradeFailed(FleetError, Conflict):
    """A rolling upgrade stopped: ``replica`` refused the new image (its start check, a limit);
    the replicas not reached keep the old image."""

    FIELDS = ("program", "replica", "why")

    def __init__(self, message: str, *, program: str, replica: str, why: str):
        super().__init__(message)
        self.program = program
        self.replica = replica
        self.why = why


class FleetTimeout(FleetError, Timeout):
    """``fleet.wait`` or an upgrade ran past its deadline: ``running`` of ``wanted`` replicas ran."""

    FIELDS = ("program", "running", "wanted")

    def __init__(self, message: str, *, program: str, running: int, wanted: int):
        super().__init__(message)
        self.program = program
        self.running = running
        self.wanted = wanted


class CallRefused(FleetError):
    """A replica's node daemon refused a fleet call: ``status`` is the HTTP status it answered
    (its own error type's, by the node API's table), ``replica`` the replica that refused."""

    FIELDS = ("program", "replica", "status")

    def __init__(self, message: str, *, program: str, replica: str, status: int):
        super().__init__(message)
        self.program = program
        self.replica = replica
        self.status = status


class CallPortToken(FleetError):
    """A request on a node's call port without the token that node's agent gave the fleet (401):
    the port is open on the node's network, and only the fleet's own callers hold its token."""


class NotAReplica(FleetError, NotFound):
    """A call port serves only its node's fleet replicas (``NAME.fleet-N``), never another program
    of the daemon."""

    FIELDS = ("program",)

    def __init__(self, message: str, *, program: str):
        super().__init__(message)
        self.program = program


class CallPortRelay(FleetError, Unavailable):
    """A call port reached no answer of its daemon; ``lost``: the call was sent and may have
    reached the program (the caller sends it again only if it is idempotent)."""

    FIELDS = ("lost",)

    def __init__(self, message: str, *, lost: bool):
        super().__init__(message)
        self.lost = lost
