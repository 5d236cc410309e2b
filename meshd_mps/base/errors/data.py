"""A program's data (device memory it owns: docs/program-abi.md, "Data"): what a load with data, a
write or a restore of one can be refused for."""

from __future__ import annotations

from meshd_mps.base.errors.base import BadRequest, Conflict, NotFound
from meshd_mps.base.errors.programs import CapacityError


class DataTooLarge(CapacityError):
    """A program's data that does not fit the GPU's free memory, refused before anything runs:
    ``asked`` the bytes it needs, ``have`` the bytes free on GPU ``device``."""

    FIELDS = ("limit", "have", "asked", "device", "program")

    def __init__(self, message: str, *, have: int, asked: int, device: int, program: str):
        super().__init__(message, limit="GPU memory", have=have, asked=asked)
        self.device = device
        self.program = program


class WriteOutOfRange(BadRequest):
    """A write past the end of a program's data: ``offset`` and ``bytes`` asked, ``size`` the data's."""

    FIELDS = ("program", "offset", "bytes", "size")

    def __init__(self, message: str, *, program: str, offset: int, bytes: int, size: int):
        super().__init__(message)
        self.program = program
        self.offset = offset
        self.bytes = bytes
        self.size = size


class NoData(Conflict):
    """A write to a program loaded without data."""

    FIELDS = ("program",)

    def __init__(self, program: str):
        super().__init__(f"program {program} has no data to write to: load it with data (meshd-mps load DIR --data FILE, or"
                         " the manifest's data or data_bytes)")
        self.program = program


class DataNotFound(NotFound):
    """Data a load names that this daemon does not hold (``data``: its SHA-256), or a program's data
    whose file is gone from the state directory (``file``, "" for none; a restore of it fails that program alone)."""

    FIELDS = ("data", "file")

    def __init__(self, message: str, *, data: str, file: str = ""):
        super().__init__(message)
        self.data = data
        self.file = file
