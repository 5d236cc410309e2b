"""Errors of the configuration, the machine and the state directory."""

from __future__ import annotations

from typing import ClassVar

from meshd_mps.base.errors.base import BadRequest, MeshError

# ---- configuration and the machine ----------------------------------------------------------


class ConfigError(BadRequest):
    """An option that cannot work here (e.g. --sms over the device's SM count)."""


class NoDriver(MeshError):
    """No NVIDIA driver here (its library is not found: ``why``): said with how to try without one."""

    def __init__(self, why: str):
        super().__init__(f'no NVIDIA driver: {why}; to try meshd-mps without a GPU, use the simulated one: gpu="sim"')


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

    FIELDS: ClassVar[tuple[str, ...]] = ("path", "owner", "why")

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
