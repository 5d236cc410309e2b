"""A program's payload region: host memory for the requests and responses that a ring entry's 188
bytes do not hold (docs/program-abi.md, section 6.2).

A program declares in its manifest the most bytes a request and a response may have
(``max_request``, ``max_response``).  A payload of more than ENTRY_PAYLOAD (188) bytes lies in the
program's region, and its ring entry carries its length and its offset there.  The region has an
area per ring entry and direction: entry i's request at ``i * request_stride``, its response at
``RING * request_stride + i * response_stride``.  So a request's area is free exactly when its ring
entry is (protocol/ring.py counts both): the ring's rule is the region's, and no allocator is
needed.  A response may also name its own request's area (an answer made in place, as echo's).

The region is a memfd (``/proc/<pid>/fd/<n>``), or with live restore a file in /dev/shm named
after the live mailbox, the program and its sizes (``live_path``), which outlives the daemon as the
mailbox does.  The daemon maps it and writes the requests there; the program's worker maps it by
path (``Region.open``), registers it with its context as host-mapped memory (as the mailbox), and
writes its device address and layout into the program's slot at each launch (``write_slot``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field

from meshd_mps.base.errors import MailboxError
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox

#: Each area starts at a multiple of this (bytes): whole cache lines and 16-byte vector loads.
ALIGN = 256
#: The most a manifest may declare for a request or a response (the daemon's HTTP bodies stop at
#: 64 MiB too); a region holds RING of each, so at most 1 GiB of host memory, pinned.
MAX_PAYLOAD = 64 << 20


def _stride(n: int) -> int:
    """An area's size for payloads of at most ``n`` bytes: none where a ring entry holds them."""
    return 0 if n <= abi.ENTRY_PAYLOAD else -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """A region's layout, from the manifest's ``max_request`` and ``max_response`` (0: not
    declared, a ring entry's 188 bytes); the rest is computed once (a call's path reads it)."""

    max_request: int = 0
    max_response: int = 0
    #: The most bytes a request and a response may have.
    request_limit: int = field(init=False)
    response_limit: int = field(init=False)
    #: An area's bytes, each direction (0: none, its payloads are inline).
    request_stride: int = field(init=False)
    response_stride: int = field(init=False)
    #: Where the first response area starts.
    responses_at: int = field(init=False)
    #: The region's bytes (0: no region: every payload fits a ring entry): its areas, in whole host
    #: pages (what cuMemHostRegister takes).
    size: int = field(init=False)

    def __post_init__(self) -> None:
        q, r = _stride(self.max_request), _stride(self.max_response)
        areas = abi.RING * (q + r)
        for k, v in (("request_limit", self.max_request or abi.ENTRY_PAYLOAD),
                     ("response_limit", self.max_response or abi.ENTRY_PAYLOAD), ("request_stride", q),
                     ("response_stride", r), ("responses_at", abi.RING * q),
                     ("size", -(-areas // mmap.PAGESIZE) * mmap.PAGESIZE)):
            object.__setattr__(self, k, v)

    def request_at(self, seq: int) -> int:
        """The offset of request ``seq``'s area."""
        return (seq % abi.RING) * self.request_stride

    def response_at(self, seq: int) -> int:
        return self.responses_at + (seq % abi.RING) * self.response_stride

    def response_fits(self, seq: int, n: int, at: int) -> bool:
        """A response to ``seq`` of ``n`` bytes at offset ``at`` lies in one of its own entry's areas
        (its response's, or its request's: an answer made in place) and is no longer than declared."""
        if n > self.response_limit or at < 0:
            return False
        i = seq % abi.RING
        r, q = self.responses_at + i * self.response_stride, i * self.request_stride
        return (r <= at and at + n <= r + self.response_stride) or (q <= at and at + n <= q + self.request_stride)

    def name(self) -> str:
        """The sizes, as a file name says them."""
        return f"{self.max_request}-{self.max_response}"


def live_path(mailbox: str, program: str, layout: Layout) -> str:
    """With live restore, program ``program``'s region: beside the mailbox file (in /dev/shm), named
    after it, the program and its sizes, so that a restored daemon finds it from the program's
    record, and an upgrade to other sizes makes a new one beside the old until the old is unloaded."""
    return f"{live_prefix(mailbox)}{program}.{layout.name()}"


def live_prefix(mailbox: str) -> str:
    """What every region's path beside the live mailbox ``mailbox`` starts with."""
    return f"{mailbox.removesuffix('.mailbox')}.payloads."


class Region:
    """One program's region, mapped: by the daemon (``create``, or ``open`` of a live one it left),
    and by the program's worker (``open`` of the path the PAYLOADS frame names)."""

    def __init__(self, fd: int, path: str, layout: Layout, unlink: bool = False):
        self.fd = fd
        self.path = path
        self.layout = layout
        self.size = layout.size
        self.mm = mmap.mmap(fd, self.size)
        self.unlink = unlink  # a file of ours in /dev/shm: removed at close(forget=True)

    @classmethod
    def create(cls, layout: Layout, path: str | None = None) -> Region:
        """A fresh, zeroed region.  Without ``path`` a memfd (reachable by path while its fd is
        open); with one a new 0600 file there (an old one of that name is replaced: never written
        through, a worker that still maps it keeps its own pages), which outlives this process."""
        if layout.size <= 0:
            raise ValueError("a region of no bytes")
        if path is None:
            try:
                fd = os.memfd_create("meshd-mps-payloads", os.MFD_CLOEXEC)
            except OSError as e:
                raise MailboxError(f"payload region: memfd_create: {e.strerror}") from e
            path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                raise MailboxError(f"payload region {path}: {e.strerror}") from e
        try:
            os.ftruncate(fd, layout.size)
            return cls(fd, path, layout, unlink=not path.startswith("/proc/"))
        except OSError as e:
            os.close(fd)
            raise MailboxError(f"payload region {path}: {e.strerror}") from e

    @classmethod
    def open(cls, path: str, layout: Layout) -> Region:
        """An existing region, as it is: its owner ours and its size the layout's (MailboxError)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (0 if path.startswith("/proc/") else os.O_NOFOLLOW))
        except OSError as e:
            raise MailboxError(f"payload region {path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise MailboxError(f"payload region {path}: owned by uid {st.st_uid}, not ours ({os.getuid()}); refusing it")
            if st.st_size != layout.size:
                raise MailboxError(f"payload region {path}: {st.st_size} bytes, expected {layout.size} (requests of"
                                   f" {layout.max_request}, responses of {layout.max_response} bytes)")
            return cls(fd, path, layout, unlink=not path.startswith("/proc/"))
        except BaseException:
            os.close(fd)
            raise

    def close(self, forget: bool = False) -> None:
        """Unmapped (and with ``forget``, a file of ours removed: nobody maps it again)."""
        if self.fd < 0:
            return
        with contextlib.suppress(BufferError):  # still exported (registered with the GPU): unmapped at exit
            self.mm.close()
        os.close(self.fd)
        self.fd = -1
        if forget and self.unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def write_slot(mailbox: Mailbox, slot: int, dev: int, layout: Layout) -> None:
    """The region's device address and layout in ``slot``'s words (abi.PAYLOADS ..): the worker's,
    at each launch of a module that has a region, before its kernel starts."""
    mailbox.set_u64(slot, abi.PAYLOADS, dev)
    mailbox.set_u32(slot, abi.REQUEST_MAX, layout.request_limit)
    mailbox.set_u32(slot, abi.RESPONSE_MAX, layout.response_limit)
    mailbox.set_u32(slot, abi.REQUEST_STRIDE, layout.request_stride)
    mailbox.set_u32(slot, abi.RESPONSE_STRIDE, layout.response_stride)
