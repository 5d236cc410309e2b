"""The host's end of one slot's request ring (docs/program-abi.md, section 6).

The program answers in host memory, so the host learns of a response only by reading RESP_HEAD.
The ring's words are read through a ``memoryview`` of the mailbox cast to u32 (~0.1 us a read
from Python, against ~0.2 us for ``struct``): a request's round trip on the H200 is ~5 us, and
the host's share of it is what this module keeps small.  The host is little-endian (x86-64,
aarch64) and its stores are seen in program order by the GPU (x86-64's TSO): a request's entry
is written before the REQ_HEAD that publishes it.

A response entry is reused by the request RING later, so the host lets at most RING requests be
outstanding *counting the responses not read yet*: a caller that reads its response late (another
task ran first) does not find it overwritten.  A caller that gives up (a deadline, a cancel)
``forget``\\ s its request; its response is then never read, and its entries are free once the
program has answered it (until then the program may still be reading the request).

So a posted request is never taken back while the kernel runs: the program says nothing between
reading REQ_HEAD and writing RESP_HEAD, so the host cannot tell whether it is reading an entry,
and an entry rewritten under it would be read as the old request (or a mix of both) and answered
under a number the host had given to the new caller.  A ring full of requests given up on empties
as the program answers them, or at the slot's next launch (``reset_slot``: an upgrade, an unload
and load), with no kernel reading it.  A program that never polls its ring (SERVES, written by the
header's ring helpers) is refused before anything is posted (``Calls``, ``NotServing``).

A payload over a ring entry's 188 bytes lies in the program's payload region (protocol/payloads.py),
in its entry's own area, with the entry's length and offset words saying where: the area is free
exactly when the entry is, by the same count.  The host writes a request's bytes there before its
entry and REQ_HEAD, and copies a response's out as it reads it, once it has checked that the
program's entry names its own areas within the declared size (``BadResponse`` otherwise: nothing
past the region is read).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from meshd_mps.base.errors import BadResponse, PayloadTooLarge, RingFull
from meshd_mps.protocol import abi
from meshd_mps.protocol.doorbell import wake
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.payloads import Layout, Region

MASK = 0xFFFFFFFF
RING, PAYLOAD = abi.RING, abi.ENTRY_PAYLOAD  # module globals: the hot path's lookups
#: How long a wait spins on RESP_HEAD before it gives the loop back and backs off (seconds): 4x
#: the H200's round trip for 188 B.  A program that answers later than this is not waited for at
#: the bus's speed, and costs the loop at most this per request.
SPIN = 20e-6


def _answered(resp_head: int, seq: int) -> bool:
    """RESP_HEAD is past ``seq`` (modulo 2**32, within half the sequence space)."""
    return (resp_head - seq - 1) & MASK < 0x7FFFFFFF


class Ring:
    """``layout``: the program's payload sizes (its manifest's); ``region``: its payload region,
    where a request or a response over a ring entry's 188 bytes lies (None where the layout needs
    none: then a response's length over 188 is clamped, as program ABI v1 says)."""

    def __init__(self, mailbox: Mailbox, slot: int, program: str | None = None, layout: Layout | None = None,
                 region: Region | None = None):
        layout = layout or Layout()
        base = mailbox.offset(slot, 0)
        self._w = mailbox.words
        self._mm = mailbox.mm
        self.slot = slot
        self.program = program  # whose ring, for RingFull's message (None: a bare slot's)
        if layout.size and region is None:
            raise ValueError(f"slot {slot}: a layout of {layout.size} bytes needs its payload region")
        self.layout = layout
        self.region = region if layout.size else None
        #: The most bytes a request may have, and the most ``post`` writes without a second look (a
        #: ring entry's, or less where the program declared less).
        self.limit = layout.request_limit
        self.inline = min(PAYLOAD, self.limit)
        self._serves = (base + abi.SERVES) >> 2
        self.serving = False  # SERVES seen set: kept, since only the slot's next launch (a new Ring) zeroes it
        self._req_head = (base + abi.REQ_HEAD) >> 2
        self._resp_head = (base + abi.RESP_HEAD) >> 2
        self._req = tuple(base + abi.REQ_BASE + i * abi.ENTRY_BYTES for i in range(abi.RING))
        self._resp = tuple(base + abi.RESP_BASE + i * abi.ENTRY_BYTES for i in range(abi.RING))
        self._unread: deque[int] = deque()  # posted, their responses not read (nor forgotten), in order
        #: The slot's doorbell, rung after each publish (the simulated GPU's: protocol/doorbell.py).
        self._bell = mailbox.word(slot, abi.REQ_HEAD) if mailbox.doorbell else 0
        self._read: set[int] = set()  # of those, read out of order

    def check(self, n: int) -> None:
        """PayloadTooLarge for a request of ``n`` bytes over the most its program takes (nothing is
        posted)."""
        if n > self.limit:
            who = f"program {self.program}" if self.program else f"slot {self.slot}"
            how = (f"its manifest's max_request is {self.layout.max_request}" if self.layout.max_request else
                   f"a ring entry holds {PAYLOAD} and its manifest declares no max_request")
            raise PayloadTooLarge(f"{who}: request of {n} bytes is over its most, {self.limit} bytes ({how})",
                                  size=n, limit=self.limit, program=self.program)

    def serves(self) -> bool:
        """The kernel has polled this ring (its slot's SERVES): it serves requests."""
        if not self.serving:
            self.serving = self._w[self._serves] == abi.SERVING
        return self.serving

    def full(self) -> RingFull:
        """RingFull, naming the program and saying how the ring empties (the module's doc)."""
        w, unread = self._w, self._unread
        head, resp = w[self._req_head], w[self._resp_head]
        waited = {s for s in unread if s not in self._read}  # requests whose callers still wait
        given_up = sum(1 for i in range((head - resp) & MASK) if (resp + i) & MASK not in waited)
        who = f"program {self.program} (slot {self.slot})" if self.program else f"slot {self.slot}"
        why = f", {given_up} of them given up by their callers and not answered yet" if given_up else ""
        return RingFull(
            f"{who}: request ring full ({RING} outstanding{why}). An entry is free again once the program answers"
            " its request (the host never takes back a request the kernel may be reading); a program that answers"
            " none (its heartbeat in ps) keeps its ring full until its next launch empties it: upgrade it, or"
            " unload and load it", program=self.program, slot=self.slot, ring=RING, given_up=given_up)

    def room(self) -> int:
        """How many more requests may be posted now."""
        return RING - self._used(self._w[self._req_head])

    def _used(self, head: int) -> int:
        """The entries taken (0..RING) with REQ_HEAD at ``head``: a request's entry is free once the
        program has answered it (RESP_HEAD is past it) and its response's once the host has read or
        forgotten it (the oldest unread is past it).  Both are counted: a request forgotten before
        its answer (a CallTimeout) leaves its entries to the program until it answers."""
        w, unread = self._w, self._unread
        used = (head - w[self._resp_head]) & MASK
        if unread and (u := (head - unread[0]) & MASK) > used:
            used = u
        return used if used < RING else RING

    def post(self, payload: bytes) -> int:
        """Write the next request and publish it; its sequence number.  PayloadTooLarge, RingFull.
        ``post_many`` of one, written out: this is a call's hot path (a payload over 188 bytes
        goes through ``post_many``)."""
        n = len(payload)
        if n > self.inline:
            return self.post_many((payload,))
        w, unread = self._w, self._unread
        head = w[self._req_head]
        if self._used(head) >= RING:
            raise self.full()
        at = self._req[head % RING]
        w[at >> 2] = n
        self._mm[at + 4 : at + 4 + n] = payload
        unread.append(head)
        w[self._req_head] = (head + 1) & MASK  # published last
        if self._bell:
            wake(self._bell)
        return head

    def post_many(self, payloads: Sequence[bytes], checked: bool = False) -> int:
        """Write requests and publish them all with one REQ_HEAD; the first one's sequence number
        (the others follow it).  Nothing is posted if one is too large or they do not fit.
        ``checked``: every payload's size was checked already."""
        if not checked:
            for p in payloads:
                self.check(len(p))
        if len(payloads) > self.room():
            raise self.full()
        return self._publish(payloads)

    def post_some(self, payloads: Sequence[bytes], start: int, most: int) -> tuple[int, int]:
        """Post as many of ``payloads[start : start + most]`` as the ring has room for, with one
        REQ_HEAD: (the first one's sequence number, how many).  Their sizes were checked already:
        ``call_many``'s refill, which learns the room and posts in one step."""
        head = self._w[self._req_head]
        k = RING - self._used(head)
        if k > most:
            k = most
        if k <= 0:
            return head, 0
        return self._publish(payloads[start : start + k]), k

    def _publish(self, payloads: Sequence[bytes]) -> int:
        """Write requests that fit, then REQ_HEAD past them; the first one's sequence number."""
        w, mm, req, unread = self._w, self._mm, self._req, self._unread
        first = head = w[self._req_head]
        for p in payloads:
            at = req[head % RING]
            n = len(p)
            w[at >> 2] = n
            if n > PAYLOAD:  # in the region, its entry's request area; the entry says where
                region = self.region
                assert region is not None  # a layout that takes it has a region (the constructor's check)
                off = self.layout.request_at(head)
                region.mm[off : off + n] = p
                w[(at >> 2) + 1] = off
            else:
                mm[at + 4 : at + 4 + n] = p
            unread.append(head)
            head = (head + 1) & MASK
        w[self._req_head] = head  # published last
        if self._bell:
            wake(self._bell)
        return first

    def take(self, seq: int, most: int, out: list[bytes]) -> int:
        """The responses to ``seq``, ``seq + 1``, ... that the program has written, at most
        ``most``, appended to ``out`` in order (each then counts as read); how many.  RESP_HEAD is
        read once: a batch the program published together is taken together."""
        w = self._w
        k = (w[self._resp_head] - seq) & MASK  # how many from seq on are answered
        if k >= 0x7FFFFFFF:  # RESP_HEAD is behind seq: seq is not answered (as _answered reads it)
            return 0
        if k > most:
            k = most
        unread = self._unread
        if self._read or not unread or unread[0] != seq or len(unread) < k:
            for i in range(k):
                out.append(self._take((seq + i) & MASK))
            return k
        # In order with nothing read out of it: ``unread`` is seq, seq + 1, ... (_take's usual case,
        # written out for a batch: this is call_many's hot path).
        mm, resp = self._mm, self._resp
        for i in range(k):
            at = resp[(seq + i) % RING]  # 2**32 is a multiple of RING: no mask needed
            n = w[at >> 2]
            unread.popleft()
            out.append(mm[at + 4 : at + 4 + n] if n <= PAYLOAD else self._large((seq + i) & MASK, n, at))
        return k

    def response(self, seq: int) -> bytes | None:
        """The response to request ``seq`` if the program has written it (then it counts as read)."""
        if not _answered(self._w[self._resp_head], seq):
            return None
        return self._take(seq)

    def spin(self, seq: int, budget: float = SPIN) -> bytes | None:
        """The response to ``seq``, busy-waited for at most ``budget`` seconds; None after that.
        ``_answered`` written out in the loop, with the clock read each turn: a tighter poll of
        RESP_HEAD (the clock every 128 turns) measured no faster on the H200 (docs/benchmarks.md;
        scripts/ring_probes.py ring-ab)."""
        w, at = self._w, self._resp_head
        if (w[at] - seq - 1) & MASK >= 0x7FFFFFFF:
            clock = time.perf_counter
            end = clock() + budget
            while (w[at] - seq - 1) & MASK >= 0x7FFFFFFF:
                if clock() > end:
                    return None
        return self._take(seq)

    def forget(self, seq: int) -> None:
        """Request ``seq``'s response will not be read (its caller gave up): its entry is free."""
        if seq in self._unread:
            self._done(seq)

    def _take(self, seq: int) -> bytes:
        at = self._resp[seq % RING]
        n = self._w[at >> 2]
        unread = self._unread
        if unread and unread[0] == seq and not self._read:  # the usual case: in order, nothing read out of it
            unread.popleft()
        elif seq in unread:
            self._done(seq)
        # Read at once, counted as read: nothing is posted meanwhile (one thread, the loop's).
        return self._mm[at + 4 : at + 4 + n] if n <= PAYLOAD else self._large(seq, n, at)

    def _large(self, seq: int, n: int, at: int) -> bytes:
        """A response over a ring entry's 188 bytes: its bytes in the payload region, where its entry
        says (``n`` its length, ``at`` its entry's offset in the mailbox); BadResponse unless it lies
        in its own entry's areas and within the declared size.  Without a region: clamped (ABI v1)."""
        region = self.region
        if region is None:
            return self._mm[at + 4 : at + 4 + PAYLOAD]
        off = self._w[(at >> 2) + 1]
        lay = self.layout
        if not lay.response_fits(seq, n, off):
            who = f"program {self.program}" if self.program else f"slot {self.slot}"
            why = (f"over its manifest's max_response, {lay.response_limit} bytes" if n > lay.response_limit else
                   f"not in its own entry's areas of its {region.size}-byte payload region (its response's at"
                   f" {lay.response_at(seq)}, {lay.response_stride} bytes; its request's at {lay.request_at(seq)},"
                   f" {lay.request_stride} bytes)")
            raise BadResponse(f"{who} wrote a response of {n} bytes at offset {off}: {why}; not read",
                              program=self.program, size=n, offset=off, limit=lay.response_limit, region=region.size)
        return region.mm[off : off + n]

    def _done(self, seq: int) -> None:
        unread = self._unread
        if unread[0] != seq:
            self._read.add(seq)
            return
        unread.popleft()
        while unread and unread[0] in self._read:
            self._read.discard(unread.popleft())
