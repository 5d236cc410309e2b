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
