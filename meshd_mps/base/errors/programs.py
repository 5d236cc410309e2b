"""Errors of a program's requests (what is asked is wrong) and of its state (what runs does not allow it)."""

from __future__ import annotations

from typing import ClassVar

from meshd_mps.base.errors.base import BadRequest, Conflict, MeshError, NotFound, Timeout

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


class BadRestoreMode(BadRequest):
    """A restore mode that is neither reload nor adopt (``restore.Restore``)."""

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
    ``mesh_main``): the program's fault, not the worker's, which stays fit.  ``driver``: the driver
    call and its error, as the worker reported it (an answer's ``error`` is the message)."""

    FIELDS = ("driver",)

    def __init__(self, message: str, *, driver: str):
        super().__init__(message)
        self.driver = driver


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
    """A request over the most its program declared (its manifest's ``max_request``; 188 bytes, a ring
    entry's, where it declared none): refused before anything is posted.  ``program``: None where
    no program is named (a bare ring's)."""

    FIELDS = ("size", "limit", "program")

    def __init__(self, message: str, *, size: int, limit: int, program: str | None):
        super().__init__(message)
        self.size = size
        self.limit = limit
        self.program = program


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


class LeaseOver(Conflict):
    """A load whose lease (``lease_until``, wall-clock seconds) has already run out: the program
    would be unloaded as soon as it ran (serving/leases.py)."""

    FIELDS = ("program", "until", "now")

    def __init__(self, message: str, *, program: str, until: float, now: float):
        super().__init__(message)
        self.program, self.until, self.now = program, until, now


class NotRunning(Conflict):
    """A call to a program that is not running, or that ended before it answered."""

    FIELDS = ("program", "state")

    def __init__(self, message: str, *, program: str, state: str):
        super().__init__(message)
        self.program, self.state = program, state


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
        self.program, self.within = program, within


class BadResponse(MeshError):
    """A program that wrote a response the host does not read: longer than its manifest's
    ``max_response``, or outside its own entry's areas of its payload region (docs/program-abi.md,
    section 6.2).  The program's fault, not the caller's nor the daemon's: a bad gateway's (502).
    Nothing past the region is read; the response counts as read, and the program runs on."""

    FIELDS = ("program", "size", "offset", "limit", "region")

    def __init__(self, message: str, *, program: str | None, size: int, offset: int, limit: int, region: int):
        super().__init__(message)
        self.program, self.size, self.offset, self.limit, self.region = program, size, offset, limit, region


class OldWorker(Conflict):
    """A program with a payload region loaded into a worker that an older meshd-mps started (adopted
    at a live restore) and that does not speak PAYLOADS (``frames.PAYLOADS_SINCE``): ``version``,
    its protocol's, ``needs``, the first that does."""

    FIELDS = ("program", "pid", "version", "needs")

    def __init__(self, message: str, *, program: str, pid: int, version: int, needs: int):
        super().__init__(message)
        self.program, self.pid, self.version, self.needs = program, pid, version, needs


class NotServing(Conflict):
    """A call to a program whose kernel does not poll its request ring (its slot's SERVES word is
    0): refused before anything is posted, as waiting would only end in a timeout and a held entry."""

    FIELDS = ("program",)

    def __init__(self, message: str, *, program: str):
        super().__init__(message)
        self.program = program
