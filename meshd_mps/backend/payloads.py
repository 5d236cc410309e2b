"""Each program's payload region as the backend keeps it (protocol/payloads.py): a memfd, or with
live restore a file in /dev/shm beside the live mailbox, which outlives the daemon as the mailbox
does and which the next daemon opens again for a program it adopts; and the files that no program
holds any more, removed (``sweep``), so that nothing of a program is left in /dev/shm once it is gone.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Collection

import structlog

from meshd_mps.protocol.payloads import Layout, Region, live_path, live_prefix

log = structlog.get_logger("meshd_mps")


def region(live_mailbox: str | None, name: str, layout: Layout, existing: bool = False) -> Region | None:
    """Program ``name``'s region for ``layout`` (None where every payload fits a ring entry): a
    memfd, or beside the live mailbox ``live_mailbox`` (live restore) its file, new (an old one of
    that name is replaced) or, ``existing``, the one an earlier daemon left for the program it runs
    on (MailboxError if it is gone or not the layout's)."""
    if layout.size == 0:
        return None
    if live_mailbox is None:
        return Region.create(layout)
    path = live_path(live_mailbox, name, layout)
    return Region.open(path, layout) if existing else Region.create(layout, path)


def sweep(live_mailbox: str, keep: Collection[str] = ()) -> list[str]:
    """Every region file beside the live mailbox ``live_mailbox`` but those of ``keep`` removed (what
    programs that are gone left: halted at a restore, not adopted, or a run without live restore
    after one with it); the paths removed."""
    gone = []
    for path in glob.glob(glob.escape(live_prefix(live_mailbox)) + "*"):
        if path in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    if gone:
        log.info(f"payload regions no program holds removed: {gone}", paths=gone)
    return gone
