"""meshd-mps's errors: one tree of types with fields, so that a status or a retry is decided by type.

Every error meshd-mps raises on purpose is a :class:`MeshError`.  The branch it sits on says what
kind of failure it is for a caller (a bad request, something not found, a conflict with what runs,
a timeout, a failure of ours); its fields say who and what.  The API maps branches to HTTP statuses
in one table (``serving/status.py``), as supervisord maps its ``Faults``; nothing parses a message.
This package imports nothing else of meshd-mps: the workers and the frame code use it too.  Its
modules are the tree's sections (base: the root and the branches; config, programs, data, processes, fleet);
every type is imported from here, ``meshd_mps.base.errors``.
"""

from __future__ import annotations

from meshd_mps.base.errors.base import (
    BadRequest as BadRequest,
    Conflict as Conflict,
    MeshError as MeshError,
    NotFound as NotFound,
    Timeout as Timeout,
    Unavailable as Unavailable,
)
from meshd_mps.base.errors.config import (
    ConfigError as ConfigError,
    ConfigFileError as ConfigFileError,
    DeviceError as DeviceError,
    NoDriver as NoDriver,
    NotServedHere as NotServedHere,
    StateDirRefused as StateDirRefused,
    StateFileNewer as StateFileNewer,
    StateIOError as StateIOError,
)
from meshd_mps.base.errors.data import (
    DataNotFound as DataNotFound,
    DataTooLarge as DataTooLarge,
    NoData as NoData,
    WriteOutOfRange as WriteOutOfRange,
)
from meshd_mps.base.errors.fleet import (
    AlreadyDeclared as AlreadyDeclared,
    BadSpec as BadSpec,
    CallPortRelay as CallPortRelay,
    CallPortToken as CallPortToken,
    CallRefused as CallRefused,
    FleetError as FleetError,
    FleetTimeout as FleetTimeout,
    FleetUnavailable as FleetUnavailable,
    NoReplica as NoReplica,
    NoSuchProgram as NoSuchProgram,
    NotAReplica as NotAReplica,
    ReplicaLost as ReplicaLost,
    UpgradeFailed as UpgradeFailed,
)
from meshd_mps.base.errors.processes import (
    FrameError as FrameError,
    MailboxError as MailboxError,
    MpsError as MpsError,
    NoContext as NoContext,
    NoReply as NoReply,
    NotAdoptable as NotAdoptable,
    NvmlUnavailable as NvmlUnavailable,
    PeerMismatch as PeerMismatch,
    ProtocolMismatch as ProtocolMismatch,
    RingFull as RingFull,
    SpawnFailed as SpawnFailed,
    StateError as StateError,
    WorkerError as WorkerError,
    WorkerGone as WorkerGone,
    WorkerUnfit as WorkerUnfit,
)
from meshd_mps.base.errors.programs import (
    AbiMismatch as AbiMismatch,
    AlreadyLoaded as AlreadyLoaded,
    BadName as BadName,
    BadResponse as BadResponse,
    BadRestartPolicy as BadRestartPolicy,
    BadRestoreMode as BadRestoreMode,
    CallTimeout as CallTimeout,
    CapacityError as CapacityError,
    ClientLimit as ClientLimit,
    CompileError as CompileError,
    HaltTimeout as HaltTimeout,
    HashMismatch as HashMismatch,
    ImageRefused as ImageRefused,
    LeaseOver as LeaseOver,
    LimitError as LimitError,
    ManifestError as ManifestError,
    NoFreeSlot as NoFreeSlot,
    NotLoaded as NotLoaded,
    NotNative as NotNative,
    NotOurClient as NotOurClient,
    NotRunning as NotRunning,
    NotServing as NotServing,
    NotStarted as NotStarted,
    OldWorker as OldWorker,
    PayloadTooLarge as PayloadTooLarge,
    SlotTaken as SlotTaken,
    StillRunning as StillRunning,
    UpgradeMismatch as UpgradeMismatch,
    WrongMode as WrongMode,
)
