"""meshd-mps's errors: one small class per kind, each message says who and what."""

from __future__ import annotations


class MeshError(Exception):
    """Base of every error meshd-mps raises on purpose."""


class NoDriver(MeshError):
    """No NVIDIA driver on this machine (the CUDA driver library is not found)."""


class DeviceError(MeshError):
    """A device query or CUDA driver call failed."""


class ConfigError(MeshError):
    """An option that cannot work here (e.g. --sms over the device's SM count)."""


class CompileError(MeshError):
    """NVRTC or nvJitLink refused the program."""


class ManifestError(MeshError):
    """A program manifest that is malformed or out of range."""


class HashMismatch(MeshError):
    """The image's hash is not the one the caller expected."""


class LimitError(MeshError):
    """A program over the device's limits (threads, shared memory, MPS clients)."""


class WorkerError(MeshError):
    """A worker process failed: it died, hung, lied or broke the frame protocol."""


class MpsError(MeshError):
    """The MPS control daemon or its server misbehaved, or a worker is not its client."""


class CapacityError(LimitError):
    """A load that the GPU cannot run beside what runs already, refused before anything changes:
    ``limit`` names the limit (e.g. ``hardware queues``), ``have`` its value, ``asked`` what the
    load would need.  The API answers 409: the request is fine, the GPU is full."""

    def __init__(self, message: str, *, limit: str, have: int, asked: int):
        super().__init__(message)
        self.limit = limit
        self.have = have
        self.asked = asked


class NotStarted(MeshError):
    """A launched kernel did not write STATE = RUNNING within the start deadline: ``program``,
    ``within`` (seconds) and ``likely`` (the likely reason, in words).  The load was rolled back."""

    def __init__(self, message: str, *, program: str, within: float, likely: str):
        super().__init__(message)
        self.program = program
        self.within = within
        self.likely = likely


class ImageRefused(WorkerError):
    """The GPU's driver refused the image itself at load (not a valid cubin for this GPU, no
    ``mesh_main``): the program's fault, not the worker's, which stays fit.  ``error`` is the
    driver call and its error, as the worker reported it."""

    def __init__(self, message: str, *, error: str):
        super().__init__(message)
        self.error = error
