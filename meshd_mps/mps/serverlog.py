"""The MPS server's log, read for the clients it names as having hit a fatal GPU error.

One server serves every GPU of the host and writes one log (``LOG_DIR/server.log``).  A fault's
recovery needs the culprits of *its* GPU, so the pids read are kept until the recovery of their
GPU takes them; a pid that is none of ours any more (gone from every list) counts for every GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

#: The culprit, as the H200's server logs it: "Client {PID: 968, Context: 1} encountered a fatal
#: GPU error."  (Its "error trigging process N" lines name every client torn down, not the culprit.)
FATAL = re.compile(r"Client \{PID: (\d+)[^}]*\} encountered a fatal GPU error")


class FatalLog:
    """Reads ``path`` from where it was when opened (a fault before this daemon is not ours)."""

    def __init__(self, path: str | None):
        self.path = path
        self._at = self._size()
        self._fatal: set[int] = set()  # read, not yet taken by a recovery

    def _size(self) -> int:
        try:
            return 0 if self.path is None else os.path.getsize(self.path)
        except OSError:
            return 0

    def _read(self) -> None:
        """Whole lines written since the last look (a line being written is read next time)."""
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._at)
                text = f.read()
        except OSError:
            return
        end = text.rfind(b"\n") + 1
        self._at += end
        self._fatal.update(int(m) for m in FATAL.findall(text[:end].decode(errors="replace")))

    def take(self, device: int, device_of: Callable[[int], int | None]) -> list[int]:
        """The logged culprits on GPU ``device`` (``device_of`` maps a pid to its GPU, None for
        one not known), taken: a later look does not see them again."""
        self._read()
        mine = sorted(p for p in self._fatal if device_of(p) in (device, None))
        self._fatal.difference_update(mine)
        return mine
