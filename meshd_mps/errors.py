"""meshd-mps's errors: one tree of types with fields, so that a status or a retry is decided by type.

Every error meshd-mps raises on purpose is a :class:`MeshError`.  The branch it sits on says what
kind of failure it is for a caller (a bad request, something not found, a conflict with what runs,
a timeout, a failure of ours); its fields say who and what.  The API maps branches to HTTP statuses
in one table (``serving/errors.py``), as supervisord maps its ``Faults``; nothing parses a message.
This module imports nothing of meshd-mps: the workers and the frame code use it too.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self


class MeshError(Exception):
    """Base of every error meshd-mps raises on purpose.  ``FIELDS`` names the attributes that an
    API answer carries beside the message."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS}

    def prefixed(self, what: str, form: str = "{what}: {message}") -> Self:
        """The same error (type and fields), its message put in what it happened in ("load: worker
        7 exited", or with ``form="{what} ({message})"`` "echo (worker 7 exited)"); raise it
        ``from`` the original to keep the cause."""
        e = type(self).__new__(type(self))  # not copy.copy: that calls __init__ without the fields
        e.__dict__.update(self.__dict__)
        e.args = (form.format(what=what, message=self), *self.args[1:])
        return e


# ---- the branches ---------------------------------------------------------------------------


class BadRequest(MeshError):
    """The request itself is wrong (a field, a manifest, a program the GPU cannot run at all):
    sent again unchanged, it fails again.  Nothing was changed."""


class NotFound(MeshError):
    """What the request names does not exist here."""


class Conflict(MeshError):
    """The request is fine, but what runs now does not allow it (the name is taken, the GPU is
    full, the program is not running).  Nothing was changed."""


class Timeout(MeshError):
    """A wait ran past its deadline (``deadlines.py``)."""


class Unavailable(MeshError):
    """The daemon cannot serve this now (starting, shutting down)."""


# ---- configuration and the machine ----------------------------------------------------------


class ConfigError(BadRequest):
    """An option that cannot work here (e.g. --sms over the device's SM count)."""


class NoDriver(MeshError):
    """No NVIDIA driver on this machine (the CUDA driver library is not found)."""


class DeviceError(MeshError):
    """A device query or CUDA driver call failed."""


class NotServedHere(BadRequest):
    """A GPU ordinal that this daemon does not drive."""

    FIELDS = ("device", "devices")

    def __init__(self, message: str, *, device: object, devices: tuple[int, ...]):
        super().__init__(message)
        self.device = device
        self.devices = devices


class ConfigFileError(ConfigError):
    """A ``--config`` file that cannot be used: ``file``, ``line`` (1-based; None where the file
    could not be read at all) and ``key`` (dotted, e.g. ``serve.pool``, ``program.echo.dir``;
    empty for the file as a whole) say where, so the operator goes straight to it."""

    FIELDS = ("file", "line", "key")

    def __init__(self, message: str, *, file: str, line: int | None, key: str):
        super().__init__(message)
        self.file = file
        self.line = line
        self.key = key


class StateDirRefused(ConfigError):
    """A state directory that others could write (its owner is another user, or its group or other
    users may write it, or it is a symlink to such), or that another meshd-mps holds: what it holds
    is loaded back as desired state, so it must be the daemon's alone.  ``owner`` is its uid,
    ``why`` the reason in words."""

    FIELDS = ("path", "owner", "why")

    def __init__(self, message: str, *, path: str, owner: int, why: str):
        super().__init__(message)
        self.path = path
        self.owner = owner
        self.why = why


class StateFileNewer(ConfigError):
    """A state file written by a newer meshd-mps (its ``schema`` over ``supported``): refused
    rather than skipped, since falling back to an older file and writing over it would lose the
    newer daemon's state."""

    FIELDS = ("file", "schema", "supported")

    def __init__(self, message: str, *, file: str, schema: int, supported: int):
        super().__init__(message)
        self.file = file
        self.schema = schema
        self.supported = supported


class StateIOError(MeshError):
    """The state directory could not be read or written (``file``, ``why``): a failure of the
    machine's, not the request's."""

    FIELDS = ("file", "why")

    def __init__(self, message: str, *, file: str, why: str):
        super().__init__(message)
        self.file = file
        self.why = why


# ---- programs: requests -----------------------------------------------------------------------


class CompileError(BadRequest):
    """NVRTC or nvJitLink refused the program."""


class ManifestError(BadRequest):
    """A program manifest that is malformed or out of range."""


class BadName(ManifestError):
    """A program name outside the name rule (``programs.check_name``)."""

    FIELDS = ("name",)

    def __init__(self, message: str, *, name: str):
        super().__init__(message)
        self.name = name


class BadRestartPolicy(BadRequest):
    """A restart policy that is none of on-failure, always, never (``restart.Policy``)."""

    FIELDS = ("value",)

    def __init__(self, message: str, *, value: str):
        super().__init__(message)
        self.value = value


class HashMismatch(BadRequest):
    """The image's hash is not the one the caller expected."""


class LimitError(BadRequest):
    """A program over the device's own limits (threads, shared memory, grid), whatever else runs."""


class ImageRefused(BadRequest):
    """The GPU's driver refused the image itself at load (not a valid cubin for this GPU, no
    ``mesh_main``): the program's fault, not the worker's, which stays fit.  ``error`` is the
    driver call and its error, as the worker reported it."""

    FIELDS = ("error",)

    def __init__(self, message: str, *, error: str):
        super().__init__(message)
        self.error = error


class AbiMismatch(BadRequest):
    """The module's ``mesh_rt_abi`` is not the program ABI this meshd-mps speaks."""

    FIELDS = ("program", "abi", "expected")

    def __init__(self, message: str, *, program: str, abi: int, expected: int):
        super().__init__(message)
        self.program = program
        self.abi = abi
        self.expected = expected


class UpgradeMismatch(BadRequest):
    """An upgrade that would change what an upgrade keeps: the name, the slot's nodes, the GPU."""

    FIELDS = ("program", "field")

    def __init__(self, message: str, *, program: str, field: str):
        super().__init__(message)
        self.program = program
        self.field = field


class PayloadTooLarge(BadRequest):
    """A request over what one ring entry holds."""

    FIELDS = ("size", "limit")

    def __init__(self, message: str, *, size: int, limit: int):
        super().__init__(message)
        self.size = size
        self.limit = limit


# ---- programs: state ----------------------------------------------------------------------------


class NotLoaded(NotFound):
    FIELDS = ("program",)

    def __init__(self, program: str):
        super().__init__(f"program {program!r} is not loaded")
        self.program = program


class NotNative(NotFound):
    FIELDS = ("pid",)

    def __init__(self, pid: int):
        super().__init__(f"process {pid} is not a native client of ours")
        self.pid = pid


class AlreadyLoaded(Conflict):
    FIELDS = ("program",)

    def __init__(self, program: str):
        super().__init__(f"program {program!r} is already loaded (upgrade it instead)")
        self.program = program


class NoFreeSlot(Conflict):
    FIELDS = ("slots",)

    def __init__(self, slots: int):
        super().__init__(f"no free mailbox slot: all {slots} are in use")
        self.slots = slots


class SlotTaken(Conflict):
    """The mailbox slot asked for (a restore's) is out of range or held by another program."""

    FIELDS = ("slot", "by")

    def __init__(self, slot: int, by: str | None):
        held = f"held by program {by!r}" if by else "not a slot of the mailbox"
        super().__init__(f"mailbox slot {slot}: {held}")
        self.slot = slot
        self.by = by


class NotRunning(Conflict):
    """A call to a program that is not running, or that ended before it answered."""

    FIELDS = ("program", "state")

    def __init__(self, message: str, *, program: str, state: str):
        super().__init__(message)
        self.program = program
        self.state = state


class StillRunning(Conflict):
    """A module unloaded while its kernel still runs (halt it first)."""

    FIELDS = ("program",)

    def __init__(self, message: str, *, program: str):
        super().__init__(message)
        self.program = program


class NotOurClient(Conflict):
    """A process registered as a native client that is not a client of our MPS server (it was not
    started with our pipe directory, or has not created its context yet)."""

    FIELDS = ("pid",)

    def __init__(self, message: str, *, pid: int):
        super().__init__(message)
        self.pid = pid


class WrongMode(Conflict):
    """What only the other isolation mode does (e.g. native MPS clients in blink mode)."""

    FIELDS = ("isolation",)

    def __init__(self, message: str, *, isolation: str):
        super().__init__(message)
        self.isolation = isolation


class CapacityError(Conflict):
    """A load that the GPU cannot run beside what runs already, refused before anything changes:
    ``limit`` names the limit (e.g. ``hardware queues``), ``have`` its value, ``asked`` what the
    load would need.  The request is fine, the GPU is full."""

    FIELDS: ClassVar[tuple[str, ...]] = ("limit", "have", "asked")

    def __init__(self, message: str, *, limit: str, have: int, asked: int):
        super().__init__(message)
        self.limit = limit
        self.have = have
        self.asked = asked


class ClientLimit(CapacityError):
    """The MPS server of a GPU has every client it takes: no new worker there."""

    FIELDS = ("limit", "have", "asked", "device")

    def __init__(self, message: str, *, have: int, asked: int, device: int):
        super().__init__(message, limit="MPS clients", have=have, asked=asked)
        self.device = device


class NotStarted(Conflict):
    """A launched kernel did not write STATE = RUNNING within the start deadline: ``program``,
    ``within`` (seconds) and ``likely`` (the likely reason, in words).  The load was rolled back."""

    FIELDS = ("program", "within", "likely")

    def __init__(self, message: str, *, program: str, within: float, likely: str):
        super().__init__(message)
        self.program = program
        self.within = within
        self.likely = likely


class HaltTimeout(Conflict):
    """A program that did not return within the halt deadline after HALT: the module change that
    needed it halted was refused (a blink) or its worker retired (MPS)."""

    FIELDS = ("programs", "within")

    def __init__(self, message: str, *, programs: tuple[str, ...], within: float):
        super().__init__(message)
        self.programs = programs
        self.within = within


class CallTimeout(Timeout):
    """A program that got a request and did not answer within the call's deadline."""

    FIELDS = ("program", "within")

    def __init__(self, program: str, within: float):
        super().__init__(f"program {program}: no response in {within:g}s")
        self.program = program
        self.within = within


# ---- the mailbox and the frame protocol ------------------------------------------------------


class MailboxError(MeshError):
    """The mailbox cannot be opened, or a slot or entry out of its layout."""


class RingFull(Conflict, MailboxError):
    FIELDS = ("slot", "ring")

    def __init__(self, slot: int, ring: int):
        super().__init__(f"slot {slot}: request ring full ({ring} outstanding)")
        self.slot = slot
        self.ring = ring


class FrameError(MeshError):
    """A frame that breaks the protocol (docs/protocol.md): its sender is not to be trusted again."""


# ---- workers and MPS ------------------------------------------------------------------------------


class WorkerError(MeshError):
    """A worker process failed: it died, hung, lied or broke the frame protocol.  ``pid`` is the
    worker's (0 where no process was started)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("pid",)

    def __init__(self, message: str, *, pid: int = 0):
        super().__init__(message)
        self.pid = pid


class WorkerGone(WorkerError):
    """The worker's process exited (or closed its pipes): a pooled one that died while idle is
    replaced by the next one, since nothing was asked of it yet."""


class NoContext(WorkerError, Unavailable):
    """The worker is up but got no GPU context (its READY failed): the MPS server refused the
    client, e.g. while it tears a fault's clients down.  A held worker may ask again."""


class WorkerUnfit(WorkerError):
    """The worker broke the protocol or missed a deadline: never asked again, retired."""


class NoReply(WorkerUnfit):
    FIELDS = ("pid", "within")

    def __init__(self, message: str, *, pid: int, within: float):
        super().__init__(message, pid=pid)
        self.within = within


class SpawnFailed(WorkerError):
    """The worker's program could not be started at all."""


class ProtocolMismatch(WorkerError):
    """A worker (met through its socket, to be adopted) that speaks another version of the frame
    protocol (``frames.PROTOCOL_VERSION``): ``theirs`` and ``ours``.  It was left as it runs."""

    FIELDS = ("pid", "theirs", "ours")

    def __init__(self, pid: int, theirs: int, ours: int):
        super().__init__(f"worker {pid}: frame protocol version {theirs}, this meshd-mps speaks {ours}; not adopted",
                         pid=pid)
        self.theirs = theirs
        self.ours = ours


class PeerMismatch(WorkerUnfit):
    """A worker socket whose process (SO_PEERCRED's pid) is not the one its HELLO names: whoever
    listens there is not the worker it claims to be, and is never asked."""

    FIELDS = ("pid", "claimed")

    def __init__(self, message: str, *, pid: int, claimed: int):
        super().__init__(message, pid=pid)
        self.claimed = claimed


class MpsError(MeshError):
    """The MPS control daemon or its server misbehaved, or a worker is not its client."""


class NotAdoptable(MpsError):
    """No control daemon to adopt in ``dir``: ``why`` says what was missing (its pid file, a live
    process with the marker's start time, a dead owner, an answer)."""

    FIELDS = ("dir", "why")

    def __init__(self, message: str, *, dir: str, why: str):
        super().__init__(message)
        self.dir = dir
        self.why = why


class StateError(MeshError):
    """A lifecycle move its state table does not allow: a bug of meshd-mps, never the caller's."""

    FIELDS = ("what", "frm", "to")

    def __init__(self, message: str, *, what: str, frm: str, to: str):
        super().__init__(message)
        self.what = what
        self.frm = frm
        self.to = to


class NvmlUnavailable(DeviceError):
    """NVML (nvidia-ml-py over libnvidia-ml.so.1) cannot be opened here: ``why`` says what is
    missing (the package, the library, the kernel driver, the permission).  The daemon still runs
    its programs; it only cannot see the processes beside them (``gpu/nvml.py``)."""

    FIELDS = ("why",)

    def __init__(self, message: str, *, why: str):
        super().__init__(message)
        self.why = why


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
