"""The desired state on disk: which programs meshd-mps was asked to run, with what, so that a
restarted daemon can run them again.  Restoring them is serve's; this module only keeps
the records, and keeps them whole.

The state directory (``resolve_state_dir``; made and checked by ``open_state_dir``) holds:

- ``programs.a.json`` and ``programs.b.json``: two generations of the program records.  Each file
  carries a schema version, a generation counter and a SHA-256 over its own content.  A write goes,
  through a temp file in the same directory (write, fsync, ``os.replace``, fsync the directory),
  over the file that does *not* hold the newest good generation, so at every instant the newest
  good state is untouched on disk: a crash mid-write leaves a stray temp file (removed at the
  next open), a torn or corrupt file is skipped (and logged) and the other generation is loaded.
- ``ptx/<sha256>.ptx``: each program's PTX, content-addressed (so an upgrade back to an image
  already stored writes nothing), written before the record that names it and checked against its
  name when loaded.  A PTX file that neither generation names is removed (``gc``).
- ``lock``: held (flock) by the one :class:`Store` open on the directory, so two daemons never
  write over each other's state; it says who holds it (``{"pid": ..., "socket": ...}``), so that
  another daemon refused the directory can name that one.
- ``history.json``: what a live restore carries over besides the records (each program's launch
  time and restarts, the recent fault reports): ``history.py``.

Where the directory is and how it is checked, and how a file in it is written whole, is
``statedir.py``; a program's record is ``record.py``.

Everything here blocks (reads, fsyncs): from the event loop, call it through
``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import structlog

from meshd_mps.base.errors import StateFileNewer, StateIOError
from meshd_mps.state.history import History, read_history, write_history

# Re-exported (``X as X``): the store's names, as they were before statedir.py and record.py.
from meshd_mps.state.record import RESTART as RESTART, ProgramRecord as ProgramRecord, ptx_key as ptx_key
from meshd_mps.state.statedir import (
    PTX_DIR as PTX_DIR,
    ROOT_STATE_DIR as ROOT_STATE_DIR,
    TMP_SUFFIX as TMP_SUFFIX,
    atomic_write,
    check_state_dir as check_state_dir,
    held,
    open_state_dir as open_state_dir,
    resolve_state_dir as resolve_state_dir,
)

log = structlog.get_logger("meshd_mps")

#: The state file's schema; a file of a higher one is refused (StateFileNewer), never overwritten.  A
#: record's field added with a default that is left out when it holds it (``restore``: record.py)
#: keeps the schema: older records read as they are, and an older meshd-mps reads the default ones.
SCHEMA = 1
#: The two generations' files: a write replaces the one that does not hold the newest good state.
SLOTS = ("programs.a.json", "programs.b.json")
LOCK = "lock"


# ---- the store -----------------------------------------------------------------------------------


class _Skip(Exception):
    """A state file that is not used (torn, corrupt, of an older schema): why, in words."""


def _holder(data: bytes) -> tuple[int | None, str | None]:
    """The pid and socket a lock file names (None for what it does not say, and for a pid that is
    not running: the file of a daemon gone, under the lock of one that wrote nothing)."""
    try:
        got = json.loads(data)
    except ValueError:
        return None, None
    if not isinstance(got, dict):
        return None, None
    pid, sock = got.get("pid"), got.get("socket")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and os.path.exists(f"/proc/{pid}") else None
    return pid, sock if isinstance(sock, str) and pid is not None else None


class Store:
    """The program records of one state directory (already checked by :func:`open_state_dir`),
    loaded at construction from the newest good generation.

    ``programs()`` are the records that can be used; ``skipped`` maps each record that cannot (its
    PTX missing or corrupt, the record malformed) to why, and ``skipped_files`` each state file
    passed over to why; both are logged.  A skipped record is kept as it was (its JSON, and its PTX
    file however damaged) and written back by every later write, so that a repaired PTX brings the
    program back at the next start; only a ``record`` or ``forget`` of its name replaces it."""

    def __init__(self, dir: str, *, lock: bool = True, socket: str | None = None):
        """``socket``: the holder's control socket, written into the lock file with its pid."""
        self.dir = os.path.abspath(dir)
        self.ptx_dir = os.path.join(self.dir, PTX_DIR)
        self.skipped: dict[str, str] = {}
        self._unusable: dict[str, Any] = {}  # the skipped records as they were, written back as they are
        self.skipped_files: dict[str, str] = {}
        self.generation = 0
        self._slot: int | None = None  # which of SLOTS holds the newest good generation
        self._records: dict[str, ProgramRecord] = {}
        self._prev_keys: set[str] = set()  # the PTX the other (older) good generation names: kept by gc
        self._lock_fd = self._lock(socket) if lock else None
        try:
            os.makedirs(self.ptx_dir, mode=0o700, exist_ok=True)
            self._sweep_temps()
            self._load()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, given: str | None = None, *, environ: Mapping[str, str] = os.environ,
             gpu: str | None = None, socket: str | None = None) -> Store:
        """The store of ``--state-dir`` (``given``) or the default of a daemon on ``gpu``: resolved,
        made, checked, loaded; ``socket``: the daemon's, for another daemon refused the directory to name."""
        return cls(open_state_dir(resolve_state_dir(given, environ, gpu=gpu)), socket=socket)

    def close(self) -> None:
        """Releases the directory's lock (the records stay on disk)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reading ------------------------------------------------------------------------------
    def programs(self) -> dict[str, ProgramRecord]:
        """The usable records by name (a copy)."""
        return dict(self._records)

    def ptx(self, rec: ProgramRecord) -> bytes:
        """The record's PTX, checked against its name; StateIOError if it is gone or changed."""
        path = self._ptx_path(rec.ptx_key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise StateIOError(f"state: program {rec.name}: {path}: {e.strerror}", file=path, why=e.strerror or str(e)) from e
        if ptx_key(data) != rec.ptx_key:
            raise StateIOError(f"state: program {rec.name}: {path}: its SHA-256 is not its name (corrupt)", file=path,
                               why="sha256 mismatch")
        return data

    # ---- writing ------------------------------------------------------------------------------
    def record(self, rec: ProgramRecord, ptx: bytes) -> None:
        """Keeps ``rec`` (replacing the record of that name) and its PTX, durably, before it returns.
        ValueError if ``rec`` is malformed or ``rec.ptx_key`` is not ``ptx_key(ptx)`` (the caller's
        bug); StateIOError if the disk refuses."""
        rec.check()
        if ptx_key(ptx) != rec.ptx_key:
            raise ValueError(f"program {rec.name}: ptx_key {rec.ptx_key} is not the PTX's SHA-256 {ptx_key(ptx)}")
        old = self._records.get(rec.name)
        if old is not None and replace(old, recorded_at=rec.recorded_at) == rec:
            return  # kept already, as it is (a restore's reload): no write, and its time stays when it was kept
        self._write_ptx(rec.ptx_key, ptx)
        self._unusable.pop(rec.name, None)  # a good record in its place
        self.skipped.pop(rec.name, None)
        self._write({**self._records, rec.name: rec})
        self.gc()

    def forget(self, name: str) -> bool:
        """Drops the record of ``name`` (an unload), durably, a skipped one too; False if there was none."""
        if name not in self._records and name not in self._unusable:
            return False
        self._unusable.pop(name, None)
        self.skipped.pop(name, None)
        self._write({k: v for k, v in self._records.items() if k != name})
        self.gc()
        return True

    def gc(self) -> list[str]:
        """Removes each PTX file that neither the newest nor the previous generation names (the
        previous one's are kept: a fallback to it must find them), and stray temp files; the
        names removed."""
        keep = {r.ptx_key for r in self._records.values()} | self._prev_keys | {
            o["ptx_key"] for o in self._unusable.values() if isinstance(o, dict) and isinstance(o.get("ptx_key"), str)}
        removed: list[str] = []
        try:
            names = os.listdir(self.ptx_dir)
        except OSError as e:
            log.warning(f"state: {self.ptx_dir}: not collected: {e.strerror}", path=self.ptx_dir)
            return removed
        for n in names:
            stem, ext = os.path.splitext(n)
            if (ext == ".ptx" and stem not in keep) or n.endswith(TMP_SUFFIX):
                try:
                    os.unlink(os.path.join(self.ptx_dir, n))
                    removed.append(n)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning(f"state: {n}: not removed: {e.strerror}", path=os.path.join(self.ptx_dir, n))
        if removed:
            log.debug(f"state: removed {len(removed)} PTX files no record names", files=removed)
        return removed

    # ---- what a live restore carries over (history.py) -----------------------------------------
    def history(self) -> History:
        """The programs' launches and the fault reports the last daemon kept."""
        return read_history(self.dir)

    def keep_history(self, h: History) -> None:
        """``h`` kept, whole, before it returns; StateIOError if the disk refuses."""
        write_history(self.dir, h)

    # ---- the files ----------------------------------------------------------------------------
    def _lock(self, socket: str | None) -> int:
        """The directory's lock taken, and who holds it written into it; StateDirHeld naming the
        daemon that holds it already."""
        path = os.path.join(self.dir, LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StateIOError(f"state: {path}: {e.strerror}", file=path, why=e.strerror or str(e)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            try:
                holder = _holder(os.read(fd, 4096))
            finally:
                os.close(fd)
            raise held(self.dir, os.stat(self.dir).st_uid, holder) from e
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "socket": socket}).encode() + b"\n", 0)
        except OSError as e:  # only the words of another daemon's refusal lack it
            log.warning(f"state: {path}: who holds it not written: {e.strerror}", file=path)
        return fd

    def _sweep_temps(self) -> None:
        """A temp file is what a crash between its write and its rename leaves: never a state."""
        for d in (self.dir, self.ptx_dir):
            for n in os.listdir(d):
                if n.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(d, n))
                    log.info(f"state: removed {n}, left by a write that did not finish", file=os.path.join(d, n))

    def _load(self) -> None:
        good: list[tuple[int, int, dict[str, Any], str]] = []  # generation, slot, programs, path
        for i, name in enumerate(SLOTS):
            path = os.path.join(self.dir, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            except OSError as e:
                self._skip_file(path, f"unreadable: {e.strerror}")
                continue
            try:
                gen, programs = _decode(path, data)
            except _Skip as e:
                self._skip_file(path, str(e))
                continue
            good.append((gen, i, programs, path))
        if not good:
            if self.skipped_files:
                log.warning(f"state: no readable state file in {self.dir}; starting with no programs", dir=self.dir)
            return
        good.sort(reverse=True)
        gen, self._slot, programs, path = good[0]
        self.generation = max(g[0] for g in good)
        if len(good) > 1:
            self._prev_keys = {r["ptx_key"] for r in good[1][2].values() if isinstance(r, dict)
                               and isinstance(r.get("ptx_key"), str)}
        if self.skipped_files:
            log.warning(f"state: loaded generation {gen} from {path}, the newest readable one", file=path, generation=gen)
        for name, obj in programs.items():
            try:
                rec = ProgramRecord.from_json(obj)
                if rec.name != name:
                    raise ValueError(f"recorded under {name!r} but named {rec.name!r}")
            except ValueError as e:
                self._skip(name, f"malformed record: {e}", obj)
                continue
            why = self._ptx_problem(rec.ptx_key)
            if why is not None:
                self._skip(name, why, obj)
                continue
            self._records[name] = rec
        log.info(f"state: {len(self._records)} programs recorded in {path} (generation {gen})", file=path, generation=gen,
                 programs=sorted(self._records), skipped=sorted(self.skipped))

    def _ptx_problem(self, key: str) -> str | None:
        path = self._ptx_path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return f"its PTX {path} is missing"
        except OSError as e:
            return f"its PTX {path} is unreadable: {e.strerror}"
        if ptx_key(data) != key:
            return f"its PTX {path} is corrupt (its SHA-256 is not its name)"
        return None

    def _skip_file(self, path: str, why: str) -> None:
        self.skipped_files[os.path.basename(path)] = why
        log.warning(f"state: {path}: skipped: {why}", file=path, why=why)

    def _skip(self, name: str, why: str, obj: Any) -> None:
        self.skipped[name] = why
        self._unusable[name] = obj
        log.warning(f"state: program {name}: cannot be restored: {why}", program=name, why=why)

    def _ptx_path(self, key: str) -> str:
        return os.path.join(self.ptx_dir, f"{key}.ptx")

    def _write_ptx(self, key: str, ptx: bytes) -> None:
        if self._ptx_problem(key) is None:
            return  # content-addressed: already there, and whole
        atomic_write(self.ptx_dir, f"{key}.ptx", ptx)

    def _write(self, records: dict[str, ProgramRecord]) -> None:
        gen = self.generation + 1
        slot = 0 if self._slot is None else 1 - self._slot
        body: dict[str, Any] = {"schema": SCHEMA, "generation": gen, "written_at": time.time(),
                                "programs": {**self._unusable, **{n: records[n].to_json() for n in sorted(records)}}}
        body["checksum"] = _checksum(body)
        atomic_write(self.dir, SLOTS[slot], json.dumps(body, indent=1, sort_keys=True).encode() + b"\n")
        self._prev_keys = {r.ptx_key for r in self._records.values()}
        self._records = dict(records)
        self.generation, self._slot = gen, slot


def _checksum(body: Mapping[str, Any]) -> str:
    """SHA-256 over the canonical JSON of everything in the file but the checksum itself."""
    canon = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _decode(path: str, data: bytes) -> tuple[int, dict[str, Any]]:
    """A state file's generation and programs; _Skip says why it is not used, StateFileNewer
    refuses a newer schema."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Skip(f"not JSON (torn?): {e}") from e
    if not isinstance(obj, dict):
        raise _Skip(f"a JSON object expected, got {type(obj).__name__}")
    schema = obj.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Skip(f"no schema version (schema {schema!r})")
    if schema > SCHEMA:
        raise StateFileNewer(f"state file {path}: schema {schema}, written by a newer meshd-mps; this one reads schema"
                             f" {SCHEMA}: refusing to start over it (run the newer meshd-mps, or use another state directory)",
                             file=path, schema=schema, supported=SCHEMA)
    if schema != SCHEMA:
        raise _Skip(f"schema {schema}, this meshd-mps reads schema {SCHEMA}")
    if obj.get("checksum") != _checksum(obj):
        raise _Skip("its checksum does not match its content (corrupt)")
    gen, programs = obj.get("generation"), obj.get("programs")
    if isinstance(gen, bool) or not isinstance(gen, int) or gen < 1:
        raise _Skip(f"generation {gen!r}: a positive integer expected")
    if not isinstance(programs, dict):
        raise _Skip("no programs object")
    return gen, programs
