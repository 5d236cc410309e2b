"""The mailbox: one shared 1 MiB that meshd and every worker map, a slot per program.

meshd creates it; a worker opens it by the path passed with ``--mailbox`` and
registers it with the GPU (host-mapped memory), so that a resident kernel and
the host talk through plain loads and stores.  By default it is a memfd, opened
as ``/proc/<meshd pid>/fd/<fd>``: that path dies with meshd.  For live restore
it is a file in shared memory (/dev/shm, named after the state directory;
``create(path)``) instead, which outlives meshd, so that the next meshd maps the
same memory (``open(path)``) while the kernels keep running on it.  Shared
memory, not a file on disk: the GPU registers the mailbox as host memory, and
the H200's driver refused a regular file's pages (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

from meshd_mps.base.errors import MailboxError as MailboxError  # re-exported for the workers
from meshd_mps.protocol import abi, doorbell

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Mailbox:
    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.size = abi.MAILBOX_BYTES
        self.mm = mmap.mmap(fd, self.size)
        #: The mailbox as u32 words (index = byte offset / 4): the ring's hot reads (protocol/ring.py).
        self.words = memoryview(self.mm).cast("I")
        #: Where the map starts in this process (a slot word's doorbell address).
        self.address = doorbell.address(self.mm)
        #: The host rings a slot (``bell``) once it has written its ring or its HALT: set for the
        #: simulated GPU, whose idle kernels wait on the bell (protocol/doorbell.py); a GPU's poll.
        self.doorbell = False

    @classmethod
    def create(cls, path: str | None = None) -> Mailbox:
        """A fresh, zeroed mailbox.  Without ``path`` a memfd, whose fd stays open (and reachable by
        path) until close; with one, the regular file ``path`` (mode 0600, created or truncated;
        never through a symlink), which outlives this process: the live-restore mailbox."""
        if path is None:
            fd = os.memfd_create("meshd-mps-mailbox", os.MFD_CLOEXEC)
            os.ftruncate(fd, abi.MAILBOX_BYTES)
            return cls(fd, f"/proc/{os.getpid()}/fd/{fd}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise MailboxError(f"mailbox {path}: {e.strerror}") from e
        try:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
            os.ftruncate(fd, 0)  # zeroed: what a kernel of an earlier run wrote is gone
            os.ftruncate(fd, abi.MAILBOX_BYTES)
        except OSError as e:
            os.close(fd)
            raise MailboxError(f"mailbox {path}: {e.strerror}") from e
        return cls(fd, os.path.abspath(path))

    @classmethod
    def open(cls, path: str) -> Mailbox:
        """An existing mailbox, its contents as they are (a worker's, or an adopting meshd's)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (0 if path.startswith("/proc/") else os.O_NOFOLLOW))
        except OSError as e:
            raise MailboxError(f"mailbox {path}: {e.strerror}") from e
        st = os.fstat(fd)
        if st.st_uid != os.getuid():  # a name in a shared directory (/dev/shm) that another user made
            os.close(fd)
            raise MailboxError(f"mailbox {path}: owned by uid {st.st_uid}, not ours ({os.getuid()}); refusing it")
        if st.st_size != abi.MAILBOX_BYTES:
            os.close(fd)
            raise MailboxError(f"mailbox {path}: {st.st_size} bytes, expected {abi.MAILBOX_BYTES}")
        return cls(fd, path)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.words.release()
        with contextlib.suppress(BufferError):  # still exported (registered with the GPU): unmapped at exit
            self.mm.close()
        os.close(self.fd)
        self.fd = -1

    # ---- slot words ---------------------------------------------------------------------
    def offset(self, slot: int, off: int) -> int:
        """The byte offset of ``off`` in ``slot``; MailboxError for a slot out of range."""
        if not 0 <= slot < abi.SLOTS:
            raise MailboxError(f"slot {slot} out of range 0..{abi.SLOTS - 1}")
        return slot * abi.SLOT_BYTES + off

    def u32(self, slot: int, off: int) -> int:
        return _U32.unpack_from(self.mm, self.offset(slot, off))[0]

    def set_u32(self, slot: int, off: int, v: int) -> None:
        _U32.pack_into(self.mm, self.offset(slot, off), v)

    def u64(self, slot: int, off: int) -> int:
        return _U64.unpack_from(self.mm, self.offset(slot, off))[0]

    def set_u64(self, slot: int, off: int, v: int) -> None:
        _U64.pack_into(self.mm, self.offset(slot, off), v)

    def reset_slot(self, slot: int) -> None:
        base = self.offset(slot, 0)
        self.mm[base : base + abi.SLOT_BYTES] = bytes(abi.SLOT_BYTES)

    def halt(self, slot: int) -> None:
        self.set_u32(slot, abi.CONTROL, abi.HALT)
        if self.doorbell:
            self.bell(slot)

    def word(self, slot: int, off: int) -> int:
        """The address of the word at ``off`` in ``slot``, in this process (a doorbell's)."""
        return self.address + self.offset(slot, off)

    def bell(self, slot: int) -> None:
        """``slot``'s kernel, if it waits on its doorbell (its REQ_HEAD word), looks at its slot now."""
        doorbell.wake(self.word(slot, abi.REQ_HEAD))

    def run(self, slot: int) -> None:
        self.set_u32(slot, abi.CONTROL, abi.RUN)

    def heartbeat(self, slot: int) -> int:
        return self.u64(slot, abi.HEARTBEAT)
