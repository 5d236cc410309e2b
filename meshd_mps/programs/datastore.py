"""The programs' data on the host's disk (docs/program-abi.md, "Data"; docs/operations.md, "The
state directory"): what a program's data is restored from after a worker's death, a GPU fault or
a daemon's restart, and what a worker copies it in from.

A directory (the state directory's ``data/``; a temporary one for a ``Programs`` without one) holds:

- ``<sha256>``: each data file as it was loaded, named by its SHA-256 (content-addressed: a
  second load of the same data stores nothing, and what a load names is what it gets).  Written
  while it arrives, a chunk at a time, through ``.in-<random>`` (renamed once whole), so that the
  daemon never holds a file in memory;
- ``programs/<name>``: a program's data as its writes left it, made at its first write (a copy of
  the file, with ``copy_file_range``: no bytes through the daemon's memory), the device's image
  of the whole region.  Each write goes to it first, then to the device, so that it is never
  behind what the program saw.

A file no program holds is removed by ``gc`` once it is older than ``KEEP_S`` (an upload waits
that long for the load that names it).  Every method blocks (disk): call it in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import anyio

from meshd_mps.base.errors import DataNotFound, StateIOError, WriteOutOfRange

#: A file's name in the store: its SHA-256 in hex.
KEY = re.compile(r"[0-9a-f]{64}")
#: How long a data file no program holds is kept (an upload, for the load that names it).
KEEP_S = 600.0
#: The chunk a file is read and written in.
CHUNK = 1 << 20
PROGRAMS = "programs"
INCOMING = ".in-"

_EPOCHS = itertools.count(1)


@dataclass(frozen=True)
class DataSpec:
    """What a program's data is: the file it was loaded with (``key``, its SHA-256; None: none, the
    memory zeroed), that file's ``size``, and the device memory it takes (``alloc``: at least the
    file, or the manifest's ``data_bytes`` if larger)."""

    key: str | None
    size: int
    alloc: int

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "alloc": self.alloc}

    @classmethod
    def from_dict(cls, d: Any) -> DataSpec:
        """A record's ``data`` (its ``written`` aside), checked; ValueError says what is wrong."""
        if not isinstance(d, dict) or set(d) - {"written"} != {"key", "size", "alloc"}:
            raise ValueError(f"data {d!r}: an object of key, size, alloc (and written) expected")
        if not isinstance(d.get("written", False), bool):
            raise ValueError(f"data written {d['written']!r}: true or false expected")
        key, size, alloc = d["key"], d["size"], d["alloc"]
        if key is not None and (not isinstance(key, str) or not KEY.fullmatch(key)):
            raise ValueError(f"data key {key!r}: 64 hex digits (a SHA-256) or null expected")
        for what, v in (("size", size), ("alloc", alloc)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"data {what} {v!r}: a count of bytes expected")
        if size > alloc or alloc == 0:
            raise ValueError(f"data of {size} bytes in {alloc}: at least the file's bytes, and more than 0, expected")
        return cls(key, size, alloc)


@dataclass(eq=False)
class ProgramData:
    """One program's data across its launches, upgrades and restores: ``spec``, its ``writes``
    (counted from its load), whether they are kept in its own file (``written``), and ``epoch``,
    this content's identity in the workers (backend/data.py's tokens).  ``lock``: one write or
    placement of it at a time."""

    spec: DataSpec
    written: bool = False
    writes: int = 0
    epoch: int = field(default_factory=lambda: next(_EPOCHS))
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def token(self) -> tuple[int, int]:
        return self.epoch, self.writes


@dataclass(frozen=True)
class Kept:
    """The data the desired state names: the files (``keys``) and the programs' own files (``names``)."""

    keys: Iterable[str] = ()
    names: Iterable[str] = ()


class DataStore:
    """The data files under ``dir`` (made 0700); ``temporary``: removed by ``remove``."""

    def __init__(self, dir: str, *, temporary: bool = False):
        self.dir = os.path.abspath(dir)
        self.temporary = temporary
        self.programs_dir = os.path.join(self.dir, PROGRAMS)
        try:
            os.makedirs(self.programs_dir, mode=0o700, exist_ok=True)
            os.chmod(self.dir, 0o700)
        except OSError as e:
            raise StateIOError(f"data: {self.dir}: {e.strerror}", file=self.dir, why=e.strerror or str(e)) from e
        for n in os.listdir(self.dir):  # a dead daemon's uploads, never finished
            if n.startswith(INCOMING):
                _unlink(os.path.join(self.dir, n))
        #: The programs that have an own file (known here, so that a load asks the disk nothing).
        self.owners = {n for n in os.listdir(self.programs_dir) if not n.endswith(".tmp")}

    @classmethod
    def temp(cls) -> DataStore:
        return cls(tempfile.mkdtemp(prefix="meshd-mps-data-"), temporary=True)

    def remove(self) -> None:
        """A temporary store's directory removed (at its Programs' close)."""
        if self.temporary:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- files in --------------------------------------------------------------------------------
    def incoming(self) -> Incoming:
        return Incoming(self)

    def ingest(self, src: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes]) -> DataSpec:
        """A file (a path, read as the caller: the library runs as its user), bytes, or a binary
        file object stored; its spec (``alloc``: its size)."""
        inc = self.incoming()
        try:
            if isinstance(src, (bytes, bytearray, memoryview)):
                view = memoryview(src).cast("B")
                for at in range(0, len(view), CHUNK):
                    inc.write(view[at : at + CHUNK])
            elif isinstance(src, (str, os.PathLike)):
                try:
                    with open(src, "rb") as f:
                        _pump(f, inc)
                except OSError as e:
                    raise DataNotFound(f"data {os.fspath(src)}: {e.strerror}", data="", file=os.fspath(src)) from e
            else:
                _pump(src, inc)
            return inc.finish()
        except BaseException:
            inc.abort()
            raise

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key)

    def spec(self, key: str) -> DataSpec:
        """Stored data by its key; DataNotFound if it is not here."""
        if not KEY.fullmatch(key):
            raise DataNotFound(f"data {key[:80]!r}: not a SHA-256 (64 lowercase hex digits)", data=key[:80])
        try:
            size = os.stat(self.path(key)).st_size
        except OSError as e:
            raise DataNotFound(f"data {key}: not held by this daemon ({e.strerror}): send it first (POST /v1/data, or"
                               " meshd-mps load --data FILE)", data=key, file=self.path(key)) from e
        return DataSpec(key, size, size)

    # ---- a program's data ------------------------------------------------------------------------
    def own(self, name: str) -> str:
        return os.path.join(self.programs_dir, name)

    def source(self, name: str, d: ProgramData) -> tuple[str, int]:
        """Where a worker copies the program's data from, and how many bytes: its own file once
        written, else the file it was loaded with ("" and 0 for none: zeroed memory).
        DataNotFound if that file is gone or shorter (its restore fails, that program's alone)."""
        path, want = (self.own(name), d.spec.alloc) if d.written else (
            (self.path(d.spec.key), d.spec.size) if d.spec.key else ("", 0))
        if not path:
            return "", 0
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise DataNotFound(f"program {name}: its data {path} is gone ({e.strerror}): the program cannot be restored"
                               " with it; load it again with its data", data=d.spec.key or "", file=path) from e
        if size < want:
            raise DataNotFound(f"program {name}: its data {path} holds {size} bytes, {want} expected (damaged): load it"
                               " again with its data", data=d.spec.key or "", file=path)
        return path, want

    def write(self, name: str, d: ProgramData, offset: int, data: bytes) -> None:
        """A write kept in the program's own file (made from its loaded data at the first)."""
        if offset < 0 or offset + len(data) > d.spec.alloc:
            raise WriteOutOfRange(f"program {name}: a write of {len(data)} bytes at offset {offset} is past the end of its"
                                  f" {d.spec.alloc} bytes of data", program=name, offset=offset, bytes=len(data),
                                  size=d.spec.alloc)
        own = self.own(name)
        if not d.written:
            src, n = self.source(name, d)
            _copy(src, n, own, d.spec.alloc)
            d.written = True
            self.owners.add(name)
        try:
            fd = os.open(own, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as e:
            raise StateIOError(f"program {name}: its data {own}: {e.strerror}", file=own, why=e.strerror or str(e)) from e

    def forget(self, name: str) -> None:
        """The program's own file removed (an unload, or an upgrade to other data)."""
        self.owners.discard(name)
        _unlink(self.own(name))

    def gc(self, keep: Iterable[str], names: Iterable[str]) -> list[str]:
        """Every data file that no key of ``keep`` names and older than KEEP_S, and every own file
        of a program not in ``names``, removed; their names."""
        keep, names = set(keep), set(names)
        gone: list[str] = []
        now = time.time()
        for n in os.listdir(self.dir):
            p = os.path.join(self.dir, n)
            if KEY.fullmatch(n) and n not in keep:
                try:
                    if now - os.stat(p).st_mtime > KEEP_S:
                        _unlink(p)
                        gone.append(n)
                except OSError:
                    pass
        for n in os.listdir(self.programs_dir):
            if n not in names:
                self.owners.discard(n)
                _unlink(os.path.join(self.programs_dir, n))
                gone.append(f"{PROGRAMS}/{n}")
        return gone


class Incoming:
    """A data file arriving a chunk at a time, hashed as it is written; ``finish`` names it."""

    def __init__(self, store: DataStore):
        self.store = store
        self.tmp = os.path.join(store.dir, INCOMING + secrets.token_hex(8))
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        self.h.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(chunk)

    def finish(self) -> DataSpec:
        os.close(self.fd)
        self.fd = -1
        key = self.h.hexdigest()
        dst = self.store.path(key)
        if os.path.exists(dst):
            _unlink(self.tmp)
            os.utime(dst)  # held again: gc keeps it KEEP_S from now
        else:
            os.replace(self.tmp, dst)
        return DataSpec(key, self.size, self.size)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink(self.tmp)


def _pump(f: IO[bytes], inc: Incoming) -> None:
    while chunk := f.read(CHUNK):
        inc.write(chunk)


def _copy(src: str, n: int, dst: str, size: int) -> None:
    """``dst`` made ``size`` bytes long (zeroes past ``n``), its first ``n`` bytes ``src``'s,
    copied in the kernel (copy_file_range)."""
    tmp = dst + ".tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(out, size)
            if n:
                inp = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    done = 0
                    while done < n:
                        k = os.copy_file_range(inp, out, n - done, done, done)
                        if k == 0:
                            raise OSError(0, f"{src} ended at {done} of {n} bytes")
                        done += k
                finally:
                    os.close(inp)
        finally:
            os.close(out)
        os.replace(tmp, dst)
    except OSError as e:
        _unlink(tmp)
        raise StateIOError(f"data {dst}: {e.strerror}", file=dst, why=e.strerror or str(e)) from e


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
