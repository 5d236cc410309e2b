"""The request ring, both ends: the host's ``Ring`` (meshd_mps/protocol/ring.py) and the simulated
GPU's copy of the header's warp-wide helpers (``mesh_ring_*``: workers/sim_kernels.py ``MeshRing``), driven
step by step on a mailbox of the test's own, then ``Programs.call`` / ``call_many`` on the sim.

The device side is called directly (no worker, no thread): a wait, the loads, the stores and one
post are what one turn of examples/echo/echo.cu does, so what the H200 is promised is checked
without timing: a batch served in one RESP_HEAD, lengths clamped, HALT ending the wait, the beat
on its timer.  No assertion here is about time.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from meshd_mps.base.errors import CallTimeout, NotRunning, PayloadTooLarge, RingFull
from meshd_mps.programs import Programs
from meshd_mps.programs.calls import Calls
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.ring import Ring
from workers.sim_kernels import MeshBeat, MeshRing, echo_turn

from ..rigs.backend import example, sim_programs

pytestmark = pytest.mark.timeout(90)
SLOT = 3


@pytest.fixture
def mb():
    m = Mailbox.create()
    yield m
    m.close()


def device(mb: Mailbox, every: int = abi.BEAT_EVERY) -> MeshRing:
    return MeshRing(mb, SLOT, MeshBeat(mb, SLOT, {}, lambda: False), every)


def serve(r: MeshRing) -> int:
    """One turn of echo on the simulated GPU: the pending requests, all answered, one RESP_HEAD."""
    return echo_turn(r, lambda: False)


def test_take_gets_every_response_there_in_order_and_no_more(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    first = host.post_many([b"a", b"b", b"c"])
    out: list[bytes] = []
    assert host.take(first, 3, out) == 0 and out == []  # none answered: RESP_HEAD behind the first
    assert serve(dev) == 3
    assert host.take(first, 2, out) == 2 and out == [b"a", b"b"]  # at most `most`
    assert host.take(first + 2, 5, out) == 1 and out == [b"a", b"b", b"c"]  # only what is there
    assert host.room() == abi.RING  # every one taken counts as read
    seq = host.post(b"d")
    assert host.take(seq, 1, out) == 0
    serve(dev)
    assert host.take(seq, 1, out) == 1 and out[-1] == b"d"


def test_post_some_posts_what_fits_and_take_keeps_order_around_a_forgotten_request(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    msgs = [bytes([k]) * 10 for k in range(abi.RING + 3)]
    assert host.post(b"held") == 0  # another caller's request, outstanding
    first, k = host.post_some(msgs, 2, 100)
    assert (first, k) == (1, abi.RING - 1)  # only the room, from msgs[2] on
    assert host.post_some(msgs, 0, 1) == (abi.RING, 0)  # full: nothing posted, REQ_HEAD untouched
    serve(dev)
    host.forget(2)  # a caller of the middle gave up: the in-order fast path must not be taken
    out: list[bytes] = []
    assert host.take(1, 1, out) == 1 and out == [msgs[2]]
    assert host.take(3, abi.RING, out) == abi.RING - 3 and out == msgs[2:3] + msgs[4 : abi.RING + 1]
    assert host.room() == 0  # "held" (seq 0) is answered but not read: the entries after it wait for it
    assert host.response(0) == b"held" and host.room() == abi.RING


def test_a_request_and_its_response(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    seq = host.post(b"hello")
    assert seq == 0 and host.response(seq) is None  # not answered yet
    assert serve(dev) == 1
    assert mb.u32(SLOT, abi.RESP_HEAD) == 1
    assert host.response(seq) == b"hello"
    assert host.room() == abi.RING


def test_every_pending_request_is_served_in_one_batch(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    msgs = [bytes([k]) * (k * 20) for k in range(abi.RING)]
    first = host.post_many(msgs)
    assert mb.u32(SLOT, abi.REQ_HEAD) == abi.RING and host.room() == 0
    assert serve(dev) == abi.RING  # one wait sees all eight, one post publishes them
    assert mb.u32(SLOT, abi.RESP_HEAD) == abi.RING
    assert [host.response(first + k) for k in range(abi.RING)] == msgs


def test_a_length_no_entry_holds_is_answered_in_place_and_the_host_reads_no_further(mb):
    """Over 188 bytes a payload lies in the program's region: echo answers with the request's own
    length and offset words.  A ring without a region (its program declared none, so its host never
    posts one) reads such a response clamped to its entry; the device writes only the words it needs."""
    host, dev = Ring(mb, SLOT), device(mb)
    resp = SLOT * abi.SLOT_BYTES + abi.RESP_BASE
    mb.mm[resp : resp + abi.RING * abi.ENTRY_BYTES] = b"\xee" * (abi.RING * abi.ENTRY_BYTES)
    seq = host.post(b"x" * 10)
    mb.set_u32(SLOT, abi.REQ_BASE, 1000)  # a length no entry holds
    serve(dev)
    assert mb.u32(SLOT, abi.RESP_BASE) == 1000 and mb.mm[resp + 4 : resp + 8] == b"xxxx"  # length, "offset": as asked
    assert mb.mm[resp + 8 : resp + abi.ENTRY_BYTES] == b"\xee" * (abi.ENTRY_BYTES - 8)  # nothing else written
    assert host.response(seq) == mb.mm[resp + 4 : resp + 4 + abi.ENTRY_PAYLOAD]  # clamped: never past the entry
    seq = host.post(b"abcde")  # 5 bytes: the length word and two payload words
    serve(dev)
    at = resp + abi.ENTRY_BYTES
    assert mb.mm[at + 12 : at + abi.ENTRY_BYTES] == b"\xee" * (abi.ENTRY_BYTES - 12)  # past them: untouched
    assert host.response(seq) == b"abcde"


def test_halt_ends_the_wait_before_pending_requests(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    host.post(b"late")
    mb.halt(SLOT)
    assert dev.wait(lambda: False) == 0
    assert mb.u32(SLOT, abi.RESP_HEAD) == 0


def test_the_beat_is_on_a_timer_not_every_poll(mb):
    host, dev = Ring(mb, SLOT), device(mb, every=10**15)  # one interval: longer than the test
    assert mb.heartbeat(SLOT) == 1  # the ring's start beats once
    host.post(b"a")
    serve(dev)
    assert mb.heartbeat(SLOT) == 1
    for i in range(3):
        host.post(bytes([i]))
        serve(dev)
    assert mb.heartbeat(SLOT) == 1  # not due again
    dev.due = 0  # due, and a request pending: busy, so not until a whole interval late
    host.post(b"b")
    serve(dev)
    assert mb.heartbeat(SLOT) == 1
    dev.due = 0
    dev.every = 0  # a whole interval late: a busy program beats too
    host.post(b"c")
    serve(dev)
    assert mb.heartbeat(SLOT) == 2


def test_the_beat_honours_gap_reset(mb):
    dev = device(mb, every=0)
    mb.set_u64(SLOT, abi.MAX_GAP, 12345)
    mb.set_u32(SLOT, abi.GAP_RESET, 1)
    Ring(mb, SLOT).post(b"x")
    serve(dev)
    assert mb.u32(SLOT, abi.GAP_RESET) == 0 and mb.u64(SLOT, abi.MAX_GAP) == 0


def test_a_relaunched_program_continues_the_ring(mb):
    host = Ring(mb, SLOT)
    host.post(b"one")
    serve(device(mb))
    host.response(0)
    host.post(b"two")  # pending while the program is halted and launched again (a blink)
    assert serve(device(mb)) == 1  # the new kernel starts at RESP_HEAD, not 0
    assert host.response(1) == b"two"


def test_an_unread_response_keeps_its_entry(mb):
    """A response is not overwritten before its caller reads it: RING outstanding counts the
    responses not read yet, not only the requests not answered."""
    host, dev = Ring(mb, SLOT), device(mb)
    first = host.post_many([b"slow reader"] + [b"x"] * (abi.RING - 1))
    serve(dev)
    for k in range(1, abi.RING):
        assert host.response(first + k) == b"x"  # read out of order; the first is not
    assert host.room() == 0
    with pytest.raises(RingFull):
        host.post(b"would reuse the first entry")
    assert host.response(first) == b"slow reader"
    assert host.room() == abi.RING


def test_forget_frees_an_entry_and_its_late_response_is_not_read(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    seq = host.post(b"abandoned")
    host.forget(seq)
    assert host.room() == abi.RING - 1  # the program has not answered it yet: still outstanding
    serve(dev)
    assert host.room() == abi.RING
    nxt = host.post(b"next")
    serve(dev)
    assert host.response(nxt) == b"next"


def test_a_request_forgotten_before_its_answer_keeps_its_entry_while_others_are_unread(mb):
    """The oldest request given up (a CallTimeout) before the program read it, later ones still
    outstanding: its entry stays taken until the program answers it.  Once the room
    was counted from the oldest unread request alone: a 9th request overwrote the forgotten one
    before the program had read it (the program then served the 9th twice)."""
    host, dev = Ring(mb, SLOT), device(mb)
    seqs = [host.post(b"req %d" % i) for i in range(abi.RING)]
    host.forget(seqs[0])
    assert host.room() == 0
    with pytest.raises(RingFull):
        host.post(b"one too many")
    with pytest.raises(RingFull):
        host.post_many([b"one too many"])
    assert host.post_some([b"one too many"], 0, 1)[1] == 0
    assert serve(dev) == abi.RING  # all 8 read and answered, the forgotten one's own request too
    assert host.room() == 1  # its entries free now; the 7 others' responses are not read yet
    assert [host.response(s) for s in seqs[1:]] == [b"req %d" % i for i in range(1, abi.RING)]
    assert host.room() == abi.RING


def test_payload_limits(mb):
    host = Ring(mb, SLOT)
    host.post(b"y" * abi.ENTRY_PAYLOAD)
    with pytest.raises(PayloadTooLarge) as e:
        host.post_many([b"ok", b"z" * (abi.ENTRY_PAYLOAD + 1)])
    assert e.value.size == abi.ENTRY_PAYLOAD + 1
    assert mb.u32(SLOT, abi.REQ_HEAD) == 1  # nothing of the refused batch was posted


def test_sequence_numbers_wrap(mb):
    mb.set_u32(SLOT, abi.REQ_HEAD, 0xFFFFFFFE)
    mb.set_u32(SLOT, abi.RESP_HEAD, 0xFFFFFFFE)
    host, dev = Ring(mb, SLOT), device(mb)
    first = host.post_many([b"a", b"b", b"c", b"d"])
    assert first == 0xFFFFFFFE and mb.u32(SLOT, abi.REQ_HEAD) == 2
    assert host.response(first) is None
    assert serve(dev) == 4
    assert [host.response(s) for s in (0xFFFFFFFE, 0xFFFFFFFF, 0, 1)] == [b"a", b"b", b"c", b"d"]


# ---- Programs on the simulated GPU -----------------------------------------------------------


@pytest.fixture
async def progs(standin_on_path):
    async with sim_programs("mps") as ps:
        yield ps


async def test_call_many_answers_in_order_and_concurrent_callers_share_the_ring(progs):
    await progs.load(*example("echo"))
    msgs = [f"request {i}".encode() * (i % 7) for i in range(3 * abi.RING + 5)]
    with anyio.fail_after(60):
        assert await progs.call_many("echo", msgs) == msgs
        assert await progs.call_many("echo", msgs[:5], window=1) == msgs[:5]
        for window in (2, 3, 5):  # read half a window at a time, however the window divides
            assert await progs.call_many("echo", msgs, window=window) == msgs
        got: dict[int, bytes] = {}

        async def caller(i: int) -> None:
            got[i] = await progs.call("echo", f"caller {i}".encode())

        async with anyio.create_task_group() as tg:
            for i in range(abi.RING):
                tg.start_soon(caller, i)
    assert got == {i: f"caller {i}".encode() for i in range(abi.RING)}
    assert progs.get("echo").ring is not None and progs.get("echo").ring.room() == abi.RING  # type: ignore[union-attr]


@pytest.mark.parametrize("window", [2, 4, 5])
async def test_a_call_posted_between_two_batches_of_call_many_keeps_its_own_response(progs, monkeypatch, window):
    """call_many gives the loop back between its batches (every HOLD; 0 here, so at every one),
    and a ``call`` may post then: the next batch's numbers follow the call's, not the batch
    before.  Once call_many took request i's number for ``base + i``: it returned
    the call's response as one of its own, shifted the rest by one, and left an entry unread."""
    monkeypatch.setattr(Calls, "HOLD", 0.0)
    await progs.load(*example("echo"))
    mb, slot = progs.b.mailbox, progs.get("echo").slot
    start = mb.u32(slot, abi.REQ_HEAD)
    msgs = [f"many {i}".encode() for i in range(3 * window)]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            many: list[bytes] = []

            async def pipelined() -> None:
                many.extend(await progs.call_many("echo", msgs, window=window))

            tg.start_soon(pipelined)
            while mb.u32(slot, abi.REQ_HEAD) == start:  # call_many's first batch is not posted yet
                await anyio.lowlevel.checkpoint()
            assert mb.u32(slot, abi.REQ_HEAD) == (start + window) & 0xFFFFFFFF  # only it: the call comes next
            one = await progs.call("echo", b"the call's own")
    assert one == b"the call's own" and many == msgs
    ring = progs.get("echo").ring
    assert ring is not None and ring.room() == abi.RING  # every response read


async def polled_once(progs: Programs) -> None:
    """heartbeat, its slot marked served as a one-thread server's first ``mesh_take`` marks it: a
    program that polled its ring once and answers nothing.  (Unmarked, as heartbeat's own code
    leaves it, a call is refused before anything is posted: NotServing, tests/serve/test_ring_serving.py.)"""
    p = await progs.load(*example("heartbeat"))
    progs.b.mailbox.set_u32(p.slot, abi.SERVES, abi.SERVING)


async def test_a_call_that_times_out_gives_its_entry_back(progs):
    await polled_once(progs)  # beats, never answers the ring
    with anyio.fail_after(30):
        with pytest.raises(CallTimeout) as e:
            await progs.call("heartbeat", b"anyone?", timeout=0.05)
        assert e.value.program == "heartbeat"
        with pytest.raises(CallTimeout):
            await progs.call_many("heartbeat", [b"a", b"b"], timeout=0.05)
    ring = progs.get("heartbeat").ring
    assert ring is not None and ring.room() == abi.RING - 3  # unanswered, but none waited for


async def test_a_call_in_flight_when_its_program_is_unloaded(progs):
    await polled_once(progs)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                with pytest.raises(NotRunning, match="ended before answering"):
                    await progs.call("heartbeat", b"anyone?", timeout=20)

            tg.start_soon(call)
            await anyio.sleep(0.01)  # let the call post and start waiting; the unload ends it either way
            await progs.unload("heartbeat")
