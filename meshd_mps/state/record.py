"""A program's record in the desired state: what it takes to run it again as it ran."""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from meshd_mps.base.errors import BadName
from meshd_mps.base.names import check_name
from meshd_mps.base.restart import DEFAULT as DEFAULT_RESTART, Policy
from meshd_mps.base.restore import DEFAULT as DEFAULT_RESTORE, Restore
from meshd_mps.programs.datastore import DataSpec

#: A program's restart policies (``restart.Policy``), by name.
RESTART = tuple(p.value for p in Policy)
#: A program's restore modes (``restore.Restore``), by name.
RESTORE = tuple(r.value for r in Restore)

_HASH = re.compile(r"[0-9a-f]{16}")
_KEY = re.compile(r"[0-9a-f]{64}")


# ---- a program's record -------------------------------------------------------------------------


def ptx_key(ptx: bytes) -> str:
    """The PTX's name in ``ptx/``: its SHA-256, in hex."""
    return hashlib.sha256(ptx).hexdigest()


@dataclass(frozen=True)
class ProgramRecord:
    """What it takes to run a program again as it ran: its manifest and PTX (by ``ptx_key``), the
    mailbox ``slot`` it had, its ``nodes``, its GPU (``device``), its ``restart`` policy
    (``RESTART``), its image ``hash`` (16 hex digits), when it was recorded (wall time, for
    people: nothing orders by it) and its ``restore`` mode (``RESTORE``).  A ``reload`` record is
    written without ``restore``, as records were before it (and a record without it reads as
    ``reload``): an older meshd-mps reads the state of programs loaded as it loaded them."""

    name: str
    manifest: dict[str, Any]
    ptx_key: str
    slot: int
    nodes: int
    device: int
    restart: str
    hash: str
    recorded_at: float
    restore: str = DEFAULT_RESTORE.value
    #: Its data (programs/datastore.py ``DataSpec.as_dict``): written only for a program that has some.
    data: dict[str, Any] | None = None

    @classmethod
    def of(cls, name: str, manifest: Mapping[str, Any], ptx: bytes, *, slot: int, nodes: int, device: int,
           hash: int | str, restart: str = DEFAULT_RESTART.value,
           restore: str = DEFAULT_RESTORE.value, data: dict[str, Any] | None = None) -> ProgramRecord:
        """The record of a program just loaded: ``ptx_key`` computed from ``ptx``, ``hash`` as
        ``Program.hash`` (an int) or its 16 hex digits, recorded now; checked."""
        h = f"{hash:016x}" if isinstance(hash, int) else hash
        return cls(name=name, manifest=dict(manifest), ptx_key=ptx_key(ptx), slot=slot, nodes=nodes, device=device,
                   restart=restart, hash=h, recorded_at=time.time(), restore=restore, data=data).check()

    def check(self) -> ProgramRecord:
        """Itself, or ValueError naming the field that is wrong."""
        try:
            check_name(self.name, "name")
        except BadName as e:
            raise ValueError(str(e)) from e
        if not isinstance(self.manifest, dict):
            raise ValueError(f"manifest: a JSON object expected, got {type(self.manifest).__name__}")
        if not isinstance(self.ptx_key, str) or not _KEY.fullmatch(self.ptx_key):
            raise ValueError(f"ptx_key {self.ptx_key!r}: 64 hex digits expected (a SHA-256)")
        for k, lo in (("slot", 0), ("nodes", 1), ("device", 0)):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{k} {v!r}: an integer, {lo} or more, expected")
        if self.restart not in RESTART:
            raise ValueError(f"restart {self.restart!r}: one of {', '.join(RESTART)} expected")
        if self.restore not in RESTORE:
            raise ValueError(f"restore {self.restore!r}: one of {', '.join(RESTORE)} expected")
        if not isinstance(self.hash, str) or not _HASH.fullmatch(self.hash):
            raise ValueError(f"hash {self.hash!r}: 16 lowercase hex digits expected")
        if self.data is not None:
            DataSpec.from_dict(self.data)  # ValueError naming what is wrong
        t = self.recorded_at
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"recorded_at {t!r}: a time in seconds expected")
        return self

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.restore == DEFAULT_RESTORE.value:
            del out["restore"]  # as records were before it: see the class's doc
        if self.data is None:
            del out["data"]  # likewise
        return out

    @classmethod
    def from_json(cls, obj: object) -> ProgramRecord:
        """A record read back, checked; ValueError says what is wrong with it."""
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON object expected, got {type(obj).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in obj and k not in _OPTIONAL]
        if missing:
            raise ValueError(f"field {missing[0]!r} is missing")
        extra = sorted(set(obj) - set(names))
        if extra:
            raise ValueError(f"unknown field {extra[0]!r}")
        return cls(**{k: obj[k] for k in names if k in obj}).check()


#: Fields a record may lack (their defaults): those added after the schema's first records.
_OPTIONAL = frozenset({"restore", "data"})
