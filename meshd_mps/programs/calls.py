"""Requests through a program's ring, and their responses: one (``call``) or many pipelined
(``call_many``).  Each is counted in its program's ``calls`` (meshd_mps/base/callstats.py): its outcome,
its time from the call to the response, its bytes."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshd_mps.base.errors import CallTimeout, NotRunning, NotServing
from meshd_mps.protocol import abi
from meshd_mps.protocol.payloads import Layout
from meshd_mps.protocol.ring import MASK, SPIN, Ring

if TYPE_CHECKING:
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.registry import Registry


class Calls:
    #: After the spin (ring.SPIN), a wait yields to the loop for this long, then sleeps BACKOFF.
    YIELDS = 200e-6
    BACKOFF = 1e-3
    #: A program whose calls take longer (a search over a table) has its waits yield up to 1.5 times
    #: its typical answer (``Program.answer_s``), at most this long: a 1 ms sleep past a 0.2 ms answer
    #: would be most of the call.
    YIELD_MOST = 2e-3
    #: How long ``call_many`` holds the loop between yields while its responses keep coming (s):
    #: a yield each ring.SPIN (20 us) cost ~5 % of its throughput at 8 outstanding against one each
    #: 50 or 100 us (the 2-core CPU machine, uvloop, a process answering; on the H200:
    #: scripts/ring_probes.py hold).  Other tasks wait at most this, plus a response's spin (ring.SPIN).
    HOLD = 50e-6

    def __init__(self, reg: Registry):
        self.reg = reg

    def _ring(self, name: str) -> tuple[Program, int, Ring]:
        """The program, the generation whose ring this is, the ring."""
        p = self.reg.get(name)
        if p.launch.finished():
            e = NotRunning(f"program {name} is not running ({p.state()[0]})", program=name, state=p.state()[0])
            p.calls.failed(e, 0)
            raise e
        if p.ring is None:
            p.ring = self.ring(p)
        return p, p.generation, p.ring

    def ring(self, p: Program) -> Ring:
        """The host's end of ``p``'s ring as its launch runs: its payload sizes and region."""
        layout = p.manifest.layout if p.manifest is not None else Layout()
        return Ring(self.reg.b.mailbox, p.slot, p.name, layout, p.kernel.payloads)

    def check(self, name: str, size: int) -> None:
        """PayloadTooLarge if a request of ``size`` bytes is over the most program ``name`` takes
        (before its body is read: the API's); NotLoaded, NotRunning as a call."""
        self._ring(name)[2].check(size)

    def _current_ring(self, p: Program, generation: int) -> None:
        """A response read from ``p``'s slot is its own only while ``p`` still runs the launch of
        ``generation``: a new launch on the slot (an upgrade, a relaunch) starts the ring again and
        answers other requests; an unload leaves nobody to answer."""
        if not self.reg.current(p, generation):
            raise NotRunning(f"program {p.name} was replaced or unloaded before its response was read",
                             program=p.name, state=p.state()[0])

    async def _serving(self, p: Program, gen: int, ring: Ring, timeout: float,  # noqa: ASYNC109
                       deadline: float) -> None:
        """The kernel polls its ring (its slot's SERVES), or NotServing before anything is posted: a
        request it never reads would hold an entry until its next launch.  The header's ring helpers
        write SERVES at their first poll, which echo's makes before it says RUNNING; a program whose
        first poll comes later is waited for until ``Deadlines.first_poll`` after its start, and one
        started longer ago is refused at once."""
        grace = self.reg.d.first_poll
        while not ring.serves():
            if p.generation != gen or p.launch.finished():
                raise NotRunning(f"program {p.name} ended before answering ({p.state()[1] or p.state()[0]})",
                                 program=p.name, state=p.state()[0])
            now = time.monotonic()
            if now - p.started >= grace:
                raise NotServing(
                    f"program {p.name} does not serve requests: its kernel does not poll its request ring (its slot's"
                    " SERVES is 0). A program serves calls through the ring helpers of mesh_program.h, which mark its"
                    " slot at their first poll (docs/program-abi.md, section 6); one built with an older header does"
                    " not: upgrade it from its source", program=p.name)
            if now >= deadline:
                raise CallTimeout(p.name, timeout)
            await asyncio.sleep(self.BACKOFF)

    async def _answer(self, p: Program, gen: int, ring: Ring, seq: int, timeout: float,  # noqa: ASYNC109
                      deadline: float) -> bytes:
        """The response to ``seq``: a spin of ring.SPIN (the bus answers in ~5 us on the H200),
        then yields to the loop for YIELDS, then BACKOFF sleeps, until ``deadline`` (monotonic)."""
        got = ring.spin(seq, SPIN)
        t0 = time.monotonic()
        yields = max(self.YIELDS, min(self.YIELD_MOST, 1.5 * p.answer_s))
        while got is None:
            if p.generation != gen or p.launch.finished():  # its launch of ``gen`` ended
                raise NotRunning(f"program {p.name} ended before answering ({p.state()[1] or p.state()[0]})",
                                 program=p.name, state=p.state()[0])
            self._current_ring(p, gen)
            now = time.monotonic()
            if now >= deadline:
                raise CallTimeout(p.name, timeout)
            # asyncio.sleep, not anyio's: this is the hot path (anyio's costs its backend lookup).
            await asyncio.sleep(0 if now - t0 < yields else self.BACKOFF)
            got = ring.response(seq)
        self._current_ring(p, gen)
        return got

    async def call(self, name: str, payload: bytes,
                   timeout: float | None = None) -> bytes:  # noqa: ASYNC109 (the one word for a call's deadline)
        """A request through the program's ring, and its response within ``timeout`` (None: the
        call deadline).  The wait gives the loop back once first (other callers post meanwhile,
        while the GPU answers), then spins for at most ring.SPIN, then backs off: nothing is spent
        while nothing is asked.  Spinning at once instead measured no faster on the H200, and slower
        at p99 (docs/runs/ring-and-control-path.md)."""
        timeout = self.reg.d.call if timeout is None else timeout
        t0 = time.perf_counter()
        p, gen, ring = self._ring(name)
        try:
            if not ring.serving:
                await self._serving(p, gen, ring, timeout, time.monotonic() + timeout)
            seq = ring.post(payload)
        except BaseException as e:  # nothing posted
            p.calls.failed(e, 0)
            raise
        try:
            await asyncio.sleep(0)
            got = await self._answer(p, gen, ring, seq, timeout, time.monotonic() + timeout)
        except BaseException as e:
            ring.forget(seq)
            p.calls.failed(e, len(payload))
            raise
        took = time.perf_counter() - t0
        p.calls.answered(len(payload), len(got), took)
        p.answer_s += (took - p.answer_s) / 8  # its typical answer, as the next wait's yields read it
        return got

    async def call_many(self, name: str, payloads: Sequence[bytes], timeout: float | None = None,  # noqa: ASYNC109
                        window: int = abi.RING) -> list[bytes]:
        """Requests through the program's ring, pipelined: up to ``window`` (1..RING) outstanding,
        posted in batches as the ring has room (each batch published by one REQ_HEAD), the
        responses read half a window at a time, so that the program serves the other half
        meanwhile; their responses, in order.  ``timeout`` bounds each response's wait.  The loop
        is given back at least every HOLD (plus a response's spin, ring.SPIN).

        A batch's requests have consecutive sequence numbers; two batches need not: another caller
        (``call``) may post between them while this one gives the loop back.  So each batch's first
        number is kept, and a read never runs past its batch."""
        timeout = self.reg.d.call if timeout is None else timeout
        window = max(1, min(window, abi.RING))
        half = (window + 1) // 2
        t0 = time.perf_counter()
        p, gen, ring = self._ring(name)
        try:
            for x in payloads:  # every one before any is posted
                ring.check(len(x))
            if not ring.serving:
                await self._serving(p, gen, ring, timeout, time.monotonic() + timeout)
        except BaseException as e:  # nothing posted
            p.calls.failed(e, 0, len(payloads))
            raise
        total = len(payloads)
        out: list[bytes] = []
        sent = done = 0
        #: The batches posted and not wholly read, in order: (the first one's sequence number, its
        #: first request's index in ``payloads``, how many).
        batches: deque[tuple[int, int, int]] = deque()
        clock = time.perf_counter
        held = clock()
        try:
            while done < total:
                # Posted in one batch, one REQ_HEAD, as far as the window and the ring's room go
                # (smaller batches measured no faster on the H200).
                k = min(window - (sent - done), total - sent)
                if k > 0:
                    first, k = ring.post_some(payloads, sent, k)
                    if k:
                        batches.append((first, sent, k))
                        sent += k
                if sent == done:  # other callers hold the whole ring
                    raise ring.full()
                # At most half the window's responses are read before the next post: the program
                # serves one half while the host reads the other and refills it (on the 2-core CPU
                # machine 0.9 us a request at 8 outstanding, against 1.3 us reading all of them).
                first, at, k = batches[0]
                seq = (first + done - at) & MASK
                most = min(half, at + k - done)
                if not ring.take(seq, most, out):
                    out.append(await self._answer(p, gen, ring, seq, timeout, time.monotonic() + timeout))
                    ring.take((seq + 1) & MASK, most - 1, out)
                done = len(out)
                if done == at + k:
                    batches.popleft()
                if (now := clock()) - held > self.HOLD:
                    await asyncio.sleep(0)
                    held = now
        except BaseException as e:
            for first, at, k in batches:  # the requests posted and not read: this caller's own
                for i in range(max(len(out), at), at + k):
                    ring.forget((first + i - at) & MASK)
            n = len(out)
            if n:
                p.calls.answered(sum(map(len, payloads[:n])), sum(map(len, out)), (time.perf_counter() - t0) / n, n)
            p.calls.failed(e, sum(map(len, payloads[n:sent])), total - n)
            raise
        if total:  # each request at the batch's time over its count: a pipeline has no time per request
            p.calls.answered(sum(map(len, payloads)), sum(map(len, out)), (time.perf_counter() - t0) / total, total)
        return out

