"""The resident examples' device code, as the simulated GPU runs it (workers/sim_gpu.py).

What runs on the GPU, apart from the GPU itself: heartbeat's beat (``mesh_beat_t``) and echo's
loop over the header's warp-wide ring helpers (``mesh_ring_*``), line for line, reading and
writing the real mailbox; sim_gpu.py models the driver and the hardware around them (contexts,
queues, co-residency, sticky errors) and calls ``resident`` in a kernel's thread.  Kept apart so
that the ring's device side can be driven step by step without a worker (tests/rig/test_ring.py).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from meshd_mps.protocol import abi, doorbell
from meshd_mps.protocol.mailbox import Mailbox

#: An image's script: decoded JSON, each value checked, or converted, where it is read.
Script = dict[str, Any]

#: How long a simulated resident kernel sleeps between two polls of its slot: a thread that spun
#: would take a CPU core (and the GIL) from the worker; the H200's kernels poll without pause.  2 ms,
#: not 0.5: each resident program took ~4 % of a core polling, dozens at once in make test on 2
#: cores (test_live_restore, test_restore and test_ring_serving: 57 -> 51 s of CPU).
POLL_S = 0.002
#: While calls flow (within HOT_S of the last request it served), an echo kernel's ring polls every
#: HOT_POLL_S instead: a poll each ~150 us on the 2-core CPU machine (a sleep's own cost included),
#: 6.5 % of a core against 3 % at 0.5 ms and 10 % at 50 us.  At 0.5 ms a request waited ~0.3 ms for
#: the next poll, past the daemon's Calls.YIELDS (0.2 ms) of a call's wait, which then backs off
#: to 1 ms sleeps: most calls paid 1.3 ms for a ring the GPU answers in microseconds
#: (docs/runs/fleet.md, the (l3) call path).  An idle kernel polls at POLL_S.  Only
#: where no doorbell rings (``MeshRing.rung``): a kernel whose slot is rung parks at once.
HOT_POLL_S = 100e-6
HOT_S = 0.02
HOT_NS = int(HOT_S * 1e9)
#: The longest a kernel parked on its doorbell waits before it looks at its slot by itself (a
#: poke lost costs this, never a hang); the poller's looks beat for it meanwhile.
BELL_WAIT_S = 1.0

#: A view of a kernel's memory (its data, its payload region); None where it has none.
View = Callable[[], "memoryview | None"]
#: A kernel's look at its slot while it waits: True when it has something to do (a request, HALT,
#: its context poisoned); else it beats, if its beat is due.
Look = Callable[[], bool]
#: A parked kernel's doorbell, as it waits on it: its slot's words (address, the value its last
#: poll read) that the host writes and then rings, REQ_HEAD and CONTROL: another value at the wait
#: means something came before it (look at once), so no request or HALT is slept through.
Bell = Callable[[], list[tuple[int, int]]]


class Poller:
    """The idle polls of a process's resident kernels, made by one thread.  A kernel thread that
    slept POLL_S between its own polls cost ~1.7 % of a core idle (a thread's wake-up and the GIL
    each time), and 200 of them asked for ~3.4 cores of the 2-core CPU machine before anything
    ran (docs/runs/fleet.md); a GPU's idle kernels cost the host nothing.
    So an idle kernel parks: this thread makes each parked kernel's poll (``Look``: the same reads
    and the same beat on the same timer) every POLL_S, and wakes the kernel only when its look
    finds something to do.  What the mailbox sees is what the kernel's own polls wrote.

    A parked kernel with a doorbell (``Bell``: the host rings its slot once it has posted to it or
    halted it, protocol/doorbell.py) also waits on it, and so sees a request within a thread's
    wake-up, as a GPU's polling kernel sees it at once, not at the next look: a wake through this
    thread took two wake-ups, ~0.45 ms on the 2-core machine, past the daemon's Calls.YIELDS."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held through a round of looks: a kernel unparks between two
        self.parked: dict[object, tuple[Look, threading.Event | None]] = {}  # None: waits on its bell
        self.running = False
        self.poke = ctypes.c_uint32(0)  # changed (and rung) when a look wakes a kernel that waits on its bell
        self.poke_at = ctypes.addressof(self.poke)

    def park(self, look: Look, bell: Bell | None = None) -> None:
        """Until ``look()`` is True (looked at every POLL_S by this process's polling thread), or
        ``bell``'s word is rung (then the caller polls, and parks again if it finds nothing)."""
        key = object()
        woken = None if bell is not None and doorbell.SUPPORTED else threading.Event()
        with self.lock:
            poked = self.poke.value
            self.parked[key] = (look, woken)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="sim kernel polls", daemon=True).start()
        if woken is not None:
            woken.wait()
            return
        assert bell is not None
        doorbell.wait([*((at, v, False) for at, v in bell()), (self.poke_at, poked, True)], BELL_WAIT_S)
        with self.lock:
            self.parked.pop(key, None)

    def wake_all(self) -> None:
        """Every parked kernel woken now, to poll at once: its context was poisoned (a fault, the
        server's termination), which ends a GPU's kernels at once, not at a next poll."""
        with self.lock:
            parked, self.parked = self.parked, {}
            self._wake([woken for _, woken in parked.values()])

    def _wake(self, woken: list[threading.Event | None]) -> None:
        """Under the lock: the kernels of ``woken`` taken out, each woken (its Event, or the poke)."""
        for w in woken:
            if w is not None:
                w.set()
        if None in woken:
            self.poke.value = (self.poke.value + 1) & 0xFFFFFFFF
            doorbell.wake(self.poke_at, private=True)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self.lock:
                if not self.parked:
                    self.running = False  # the next park starts another
                    return
                woken = []
                for key, (look, w) in list(self.parked.items()):
                    try:
                        wake = look()
                    except Exception:  # the kernel's own next poll meets it (a mailbox closed)
                        wake = True
                    if wake:
                        del self.parked[key]
                        woken.append(w)
                self._wake(woken)


#: The process's one poller (a worker's kernels: ``resident``).
POLLER = Poller()


class MeshBeat:
    """``mesh_beat_t`` and ``mesh_beat_at``: one beat at time t, MAX_GAP since the last GAP_RESET;
    and the script's stall (``pause_after`` beats, then none for ``pause_ms``, HALT still seen)."""

    def __init__(self, mb: Mailbox, slot: int, script: Script, poisoned: Callable[[], bool]):
        self.mb, self.slot, self.poisoned = mb, slot, poisoned
        self.n = mb.u64(slot, abi.HEARTBEAT)
        self.last = time.monotonic_ns()
        self.gap = 0
        self.beats = 0
        self.after, self.pause_ms = script.get("pause_after"), script.get("pause_ms", 0)

    @property
    def pausing(self) -> bool:
        """The script's stall is still ahead (its beats, and the stall, stay the kernel's own: a
        stall made by the poller would stall every parked kernel)."""
        return isinstance(self.after, int) and self.beats <= self.after

    def beat(self, t: int, reset: int) -> None:
        mb, slot = self.mb, self.slot
        self.beats += 1
        if isinstance(self.after, int) and self.beats == self.after + 1 and isinstance(self.pause_ms, (int, float)):
            end = time.monotonic() + self.pause_ms / 1e3 if self.pause_ms else float("inf")
            while time.monotonic() < end and mb.u32(slot, abi.CONTROL) != abi.HALT and not self.poisoned():
                time.sleep(0.001)
            t, reset = time.monotonic_ns(), mb.u32(slot, abi.GAP_RESET)
        if reset:
            self.gap = 0
            mb.set_u32(slot, abi.GAP_RESET, 0)
        else:
            self.gap = max(self.gap, t - self.last)
        self.last = t
        self.n = (self.n + 1) & (2**64 - 1)
        mb.set_u64(slot, abi.MAX_GAP, self.gap)
        mb.set_u64(slot, abi.BEAT_TIME, t)
        mb.set_u64(slot, abi.HEARTBEAT, self.n)


class MeshRing:
    """The header's warp-wide ring helpers (``mesh_ring_*``), with their semantics: a poll reads
    REQ_HEAD, CONTROL and GAP_RESET together; HALT ends the wait; every pending request (at most
    RING) is served in one batch, published by one RESP_HEAD; a beat every ``every`` ns, while idle,
    or while busy once it is a whole interval late; an entry is read whole, and a response writes
    the words that hold its length (clamped) and payload.  The one difference: the simulated
    kernel sleeps between polls (HOT_POLL_S while calls flow, POLL_S once idle for HOT_S, parked
    on its process's ``Poller`` where it has one).  Where the host rings its slot (a worker's kernel,
    the mailbox's doorbell on and working) it parks as soon as it finds nothing to do: the bell
    brings the next request, and a dozen hot kernels polling each 100 us took the worker's GIL
    from the one rung (one daemon's calls to its 30 replicas in turn, p50: 1.38 ms with hot polls,
    0.065 ms parked at once on the bell, on the 2-core machine)."""

    def __init__(self, mb: Mailbox, slot: int, beat: MeshBeat, every: int, poller: Poller | None = None,
                 wrong: Script | None = None):
        self.mb, self.slot, self.b, self.every = mb, slot, beat, every
        #: A misbehaving program, on script: every answer over 188 bytes says this length
        #: (``answer_bytes``) at this offset of the region (``answer_at``), for the host's checks.
        self.wrong = {k: v for k, v in (wrong or {}).items() if k in ("answer_bytes", "answer_at") and isinstance(v, int)}
        self.poller = poller  # idle: parked on it (a worker's kernels), else a sleep of POLL_S between polls
        self.base = slot * abi.SLOT_BYTES
        self.next = mb.u32(slot, abi.RESP_HEAD)
        mb.set_u32(slot, abi.SERVES, abi.SERVING)  # mesh_ring_init marks the slot served, before its beat
        beat.beat(time.monotonic_ns(), mb.u32(slot, abi.GAP_RESET))  # mesh_ring_init beats once
        self.due = time.monotonic_ns() + every
        self.hot_until = 0  # monotonic ns: polls at HOT_POLL_S until then (a request was served lately)
        self.rung = poller is not None and mb.doorbell and doorbell.SUPPORTED  # parks at once (no hot polls)
        self.control = abi.RUN  # CONTROL as the last poll read it

    def wait(self, poisoned: Callable[[], bool]) -> int:
        while not poisoned():
            n = self.poll()
            if n is not None:
                return n
            if not self.rung and time.monotonic_ns() < self.hot_until:
                time.sleep(HOT_POLL_S)
            elif self.poller is not None and not self.b.pausing:
                # parked: the process's poller makes the same polls, and wakes it once one finds work
                self.poller.park(lambda: poisoned() or self.poll() is not None, self.bell if self.rung else None)
            else:
                time.sleep(POLL_S)
        return 0

    def bell(self) -> list[tuple[int, int]]:
        """Its doorbell: REQ_HEAD (nothing to do while it is ``next``) and CONTROL as its last poll read it."""
        return [(self.mb.word(self.slot, abi.REQ_HEAD), self.next), (self.mb.word(self.slot, abi.CONTROL), self.control)]

    def poll(self) -> int | None:
        """One poll of the slot (REQ_HEAD, CONTROL and GAP_RESET read together): 0 at HALT, the
        requests pending, or None (nothing to do); the beat made meanwhile on its timer."""
        mb, slot = self.mb, self.slot
        head, control, reset = mb.u32(slot, abi.REQ_HEAD), mb.u32(slot, abi.CONTROL), mb.u32(slot, abi.GAP_RESET)
        if control == abi.HALT:
            return 0
        self.control = control
        t = time.monotonic_ns()
        if t >= self.due and (head == self.next or t >= self.due + self.every):
            self.b.beat(t, reset)
            self.due = t + self.every
        if head != self.next:
            self.hot_until = t + HOT_NS
            return min((head - self.next) & 0xFFFFFFFF, abi.RING)
        return None

    def load(self, seq: int) -> bytes:
        at = self.base + abi.REQ_BASE + (seq % abi.RING) * abi.ENTRY_BYTES
        return bytes(self.mb.mm[at : at + abi.ENTRY_BYTES])

    def store(self, seq: int, entry: bytes, n: int) -> None:
        n = min(n, abi.ENTRY_PAYLOAD)
        at = self.base + abi.RESP_BASE + (seq % abi.RING) * abi.ENTRY_BYTES
        words = 1 + (n + 3) // 4
        self.mb.mm[at : at + 4 * words] = n.to_bytes(4, "little") + entry[4 : 4 * words]

    def store_region(self, seq: int, n: int, at: int) -> None:
        """``mesh_ring_store_region``: the response to ``seq`` is ``n`` bytes at offset ``at`` of the
        payload region (written there already)."""
        at_entry = self.base + abi.RESP_BASE + (seq % abi.RING) * abi.ENTRY_BYTES
        self.mb.mm[at_entry : at_entry + 8] = n.to_bytes(4, "little") + at.to_bytes(4, "little")

    def post(self, n: int) -> None:
        self.next = (self.next + n) & 0xFFFFFFFF
        self.mb.set_u32(self.slot, abi.RESP_HEAD, self.next)


def mesh_entry_len(entry: bytes) -> int:
    """``mesh_entry_len``: the length word, clamped."""
    return min(int.from_bytes(entry[:4], "little"), abi.ENTRY_PAYLOAD)


def mesh_entry_size(entry: bytes) -> int:
    """``mesh_entry_size``: the length word as it is (over 188: the payload is in the region)."""
    return int.from_bytes(entry[:4], "little")


def mesh_entry_offset(entry: bytes) -> int:
    """``mesh_entry_offset``: a payload's offset in the region (word 1, for a size over 188)."""
    return int.from_bytes(entry[4:8], "little")


def echo_turn(r: MeshRing, poisoned: Callable[[], bool]) -> int:
    """One turn of examples/echo/echo.cu's loop, line for line: how many requests it answered
    (0: HALT).  A request over 188 bytes is answered in place: its response names the request's own
    bytes in the region (its length and offset), nothing copied."""
    n = r.wait(poisoned)
    e = [r.load(r.next + k) for k in range(n)]
    for k in range(n):
        size = mesh_entry_size(e[k])
        if size <= abi.ENTRY_PAYLOAD:
            r.store(r.next + k, e[k], size)
        else:
            r.store_region(r.next + k, r.wrong.get("answer_bytes", size), r.wrong.get("answer_at", mesh_entry_offset(e[k])))
    if n:
        r.post(n)
    return n


#: peek's request: the offset (u64) and length (u32) of a range of its data; its response: the data's
#: size (u64), DATA_SEQ as read before the data (u32), the range's byte sum (u32), then its first bytes.
PEEK_REQ = struct.Struct("<QI")
PEEK_HEAD = struct.Struct("<QII")
PEEK_BYTES = abi.ENTRY_PAYLOAD - PEEK_HEAD.size  # 172


def peek_answer(mb: Mailbox, slot: int, data: memoryview | None, req: bytes) -> bytes:
    """examples/peek/peek.cu's answer to one request, line for line: the range clamped to the
    data, DATA_SEQ read (an acquire) before any of the data."""
    off = int.from_bytes(req[0:8], "little") if len(req) >= 8 else 0
    n = int.from_bytes(req[8:12], "little") if len(req) >= 12 else 0
    seq = mb.u32(slot, abi.DATA_SEQ)
    size = 0 if data is None else len(data)
    m = min(n, size - off) if off < size else 0
    part = b"" if data is None or m == 0 else data[off : off + m]
    total = sum(part) & 0xFFFFFFFF if m else 0
    return PEEK_HEAD.pack(size, seq, total) + bytes(part[:PEEK_BYTES])


def peek_turn(r: MeshRing, poisoned: Callable[[], bool], data: View) -> int:
    """One turn of examples/peek/peek.cu's loop: each pending request answered from the data."""
    n = r.wait(poisoned)
    for k in range(n):
        e = r.load(r.next + k)
        out = peek_answer(r.mb, r.slot, data(), e[4 : 4 + mesh_entry_len(e)])
        r.store(r.next + k, len(out).to_bytes(4, "little") + out + bytes(-len(out) % 4), len(out))
    if n:
        r.post(n)
    return n


#: One turn of a serving example's loop over its ring (echo_turn, or peek's, knn's with their memory
#: bound): how many requests it answered, 0 at HALT.
Turn = Callable[[MeshRing, Callable[[], bool]], int]


def resident(mb: Mailbox, slot: int, pause: Script, poisoned: Callable[[], bool], start: bool = True,
             turn: Turn | None = None) -> None:
    """A resident program: beat (and serve the ring) until the host writes HALT.  A stall, on
    script: after ``pause_after`` beats no beat for ``pause_ms`` (0: until HALT), HALT still seen.
    heartbeat beats every poll (``mesh_beat``) and never polls its ring (its slot's SERVES stays 0);
    a serving example (``turn``: echo, peek, knn) serves the ring as the header's warp-wide helpers
    do (``MeshRing``: SERVES before RUNNING) and beats on their timer.  STATE = RUNNING where the
    example's source writes it (``start``: at all).  ``poisoned``: the context's sticky error is set
    (the kernel ends with the rest, unheard)."""
    b = MeshBeat(mb, slot, pause, poisoned)
    ring = MeshRing(mb, slot, b, abi.BEAT_EVERY, POLLER, wrong=pause) if turn is not None else None
    if start:
        mb.set_u32(slot, abi.STATE, abi.RUNNING)
    if ring is not None and turn is not None:
        while turn(ring, poisoned):
            pass
    else:
        def look() -> bool:  # heartbeat's poll, made by the process's poller: a beat each time
            if mb.u32(slot, abi.CONTROL) == abi.HALT or poisoned():
                return True
            b.beat(time.monotonic_ns(), mb.u32(slot, abi.GAP_RESET))
            return False

        while (control := mb.u32(slot, abi.CONTROL)) != abi.HALT and not poisoned():
            b.beat(time.monotonic_ns(), mb.u32(slot, abi.GAP_RESET))
            if b.pausing:
                time.sleep(POLL_S)
            else:  # its bell is its HALT's: heartbeat has no ring, its REQ_HEAD stays as it is
                words = [(mb.word(slot, abi.REQ_HEAD), mb.u32(slot, abi.REQ_HEAD)), (mb.word(slot, abi.CONTROL), control)]
                POLLER.park(look, functools.partial(list, words) if mb.doorbell else None)
    if not poisoned():  # a kernel torn down by the server never gets to say EXITED
        mb.set_u32(slot, abi.STATE, abi.EXITED)
