"""The simulated GPU's ring poll (workers/sim_kernels.py ``MeshRing.wait``): while calls flow it
polls every HOT_POLL_S, once idle for HOT_S it polls every POLL_S again, as before (an idle poll made a request wait ~0.3 ms,
where the GPU answers in microseconds).  The pauses
are read from the kernel's own sleeps and its clock is the test's (no assertion about time); the
ring's semantics (every request served, HALT ends the wait, the beat on its timer) stay those of
tests/rig/test_ring.py, checked here again while the kernel is hot."""

from __future__ import annotations

import threading

import pytest

from meshd_mps.protocol import abi, doorbell
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.ring import Ring
from workers import sim_kernels
from workers.sim_kernels import HOT_POLL_S, HOT_S, POLL_S, MeshBeat, MeshRing, echo_turn

from ..rigs.waits import poll

SLOT = 5


@pytest.fixture
def mb():
    m = Mailbox.create()
    yield m
    m.close()


class Clock:
    """The kernel's clock and sleep, the test's: each sleep is recorded and moves the clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.now = 10**12
        self.slept: list[float] = []
        monkeypatch.setattr(sim_kernels.time, "monotonic_ns", lambda: self.now)
        monkeypatch.setattr(sim_kernels.time, "sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += int(s * 1e9)


def polls(n: int):
    """A ``poisoned`` for ``MeshRing.wait`` that ends the wait after ``n`` polls."""
    left = [n]

    def poisoned() -> bool:
        left[0] -= 1
        return left[0] < 0

    return poisoned


def device(mb: Mailbox) -> MeshRing:
    return MeshRing(mb, SLOT, MeshBeat(mb, SLOT, {}, lambda: False), abi.BEAT_EVERY)


def test_an_idle_kernel_polls_at_poll_s(mb, monkeypatch):
    clock = Clock(monkeypatch)
    dev = device(mb)
    assert dev.wait(polls(5)) == 0
    assert clock.slept == [POLL_S] * 5


def test_after_a_request_the_kernel_polls_fast_until_idle_for_hot_s(mb, monkeypatch):
    clock = Clock(monkeypatch)
    host, dev = Ring(mb, SLOT), device(mb)
    seq = host.post(b"first")
    assert echo_turn(dev, lambda: False) == 1 and host.response(seq) == b"first"
    assert clock.slept == []  # the request was there at the first poll
    fast = int(HOT_S / HOT_POLL_S)
    assert dev.wait(polls(fast + 10)) == 0  # no request: hot for HOT_S, then idle
    assert set(clock.slept[: fast - 1]) == {HOT_POLL_S}
    assert clock.slept[-5:] == [POLL_S] * 5
    assert sum(s for s in clock.slept if s == HOT_POLL_S) == pytest.approx(HOT_S, rel=0.01)


def test_a_hot_kernel_serves_every_request_and_each_request_keeps_it_hot(mb, monkeypatch):
    clock = Clock(monkeypatch)
    host, dev = Ring(mb, SLOT), device(mb)
    sent = [bytes([k]) * (k % abi.ENTRY_PAYLOAD + 1) for k in range(3 * abi.RING + 1)]
    got: list[bytes | None] = []
    for k, x in enumerate(sent):
        if k % 3 == 2:  # the kernel polled meanwhile and found nothing
            assert dev.wait(polls(3)) == 0
        seq = host.post(x)
        assert echo_turn(dev, lambda: False) == 1
        got.append(host.response(seq))
        clock.now += int(HOT_S * 1e9 * 0.9)  # the next request comes within HOT_S of this one
        dev.wait(polls(1))
        assert clock.slept[-1] == HOT_POLL_S
    assert got == sent
    assert mb.u32(SLOT, abi.RESP_HEAD) == len(sent)


def test_halt_ends_a_hot_wait(mb, monkeypatch):
    clock = Clock(monkeypatch)
    host, dev = Ring(mb, SLOT), device(mb)
    host.post(b"a")
    echo_turn(dev, lambda: False)
    host.post(b"late")
    mb.halt(SLOT)
    assert dev.wait(lambda: False) == 0  # HALT first, the pending request not served
    assert mb.u32(SLOT, abi.RESP_HEAD) == 1 and clock.slept == []


def test_the_beat_stays_on_its_timer_while_hot(mb, monkeypatch):
    clock = Clock(monkeypatch)
    host, dev = Ring(mb, SLOT), device(mb)
    before = mb.heartbeat(SLOT)
    host.post(b"a")
    echo_turn(dev, lambda: False)
    assert mb.heartbeat(SLOT) == before  # not due: a hot poll does not beat
    dev.wait(polls(int(abi.BEAT_EVERY / 1e9 / HOT_POLL_S) + 2))  # a whole interval of polls
    assert mb.heartbeat(SLOT) > before and clock.slept


def test_idle_kernels_park_on_one_polling_thread_that_beats_for_them_and_wakes_each_for_its_own_work(mb):
    """A worker's idle kernels (``resident``) park on the process's ``Poller``: one thread polls
    them all every POLL_S (30 idle kernels: 4.4 % of a core, against 23.6 % when each slept between
    polls of its own, on the 2-core machine), beats for them on their timers, and wakes a
    kernel for a request to it, its HALT, or its context poisoned; the others stay parked."""
    poller = sim_kernels.Poller()
    slots = (1, 2, 3)
    host = {s: Ring(mb, s) for s in slots}
    dev = {s: MeshRing(mb, s, MeshBeat(mb, s, {}, lambda: False), abi.BEAT_EVERY, poller) for s in slots}
    poisoned = threading.Event()
    served = {s: 0 for s in slots}

    def kernel(s: int) -> None:
        while n := echo_turn(dev[s], poisoned.is_set):
            served[s] += n

    def pollers() -> int:
        return [t.name for t in threading.enumerate()].count("sim kernel polls")

    before = pollers()  # another poller's (the process's own, a sim of another test) may be there
    threads = {s: threading.Thread(target=kernel, args=(s,), daemon=True) for s in slots}
    for t in threads.values():
        t.start()
    try:
        poll(lambda: len(poller.parked) == 3, what="every idle kernel parked")
        assert pollers() <= before + 1, "one polling thread for the three"
        beats = {s: mb.heartbeat(s) for s in slots}
        poll(lambda: all(mb.heartbeat(s) > beats[s] + 2 for s in slots), what="beats made for the parked kernels")

        seq = host[1].post(b"to one")
        assert poll(lambda: host[1].response(seq), what="the request answered") == b"to one"
        poll(lambda: served == {1: 1, 2: 0, 3: 0}, what=lambda: f"served once, by its own kernel: {served}")
        poll(lambda: len(poller.parked) == 3, what="the woken kernel parked again, once idle")

        mb.halt(2)
        threads[2].join(20)
        assert not threads[2].is_alive(), "HALT woke its kernel, which ended"
        assert {t for t in threads if threads[t].is_alive()} == {1, 3} and len(poller.parked) == 2

        poisoned.set()
        for s in (1, 3):
            threads[s].join(20)
            assert not threads[s].is_alive(), f"kernel {s}: its context poisoned, it ended"
        poll(lambda: not poller.running, what="the polling thread gone with nothing parked")
    finally:
        poisoned.set()


def test_a_poisoned_context_wakes_its_parked_kernels_at_once(mb, monkeypatch):
    """``Poller.wake_all`` (the simulated GPU's sticky error): every parked kernel polls now and
    ends, as a GPU's kernels end with their context, not at the poller's next look (a minute
    away here)."""
    monkeypatch.setattr(sim_kernels, "POLL_S", 60.0)
    poller = sim_kernels.Poller()
    poisoned = threading.Event()
    dev = MeshRing(mb, 1, MeshBeat(mb, 1, {}, lambda: False), abi.BEAT_EVERY, poller)
    t = threading.Thread(target=lambda: echo_turn(dev, poisoned.is_set), daemon=True)
    t.start()
    try:
        poll(lambda: len(poller.parked) == 1, what="the idle kernel parked")
        poisoned.set()
        poller.wake_all()
        t.join(20)
        assert not t.is_alive() and poller.parked == {}
    finally:
        poisoned.set()


# ---- the doorbell (protocol/doorbell.py): a parked kernel looked at when its slot is rung ----------

needs_bell = pytest.mark.skipif(not doorbell.SUPPORTED, reason="no futex_waitv here (Linux 5.16+, x86_64 or aarch64):"
                                " the simulated kernels are looked at every POLL_S only")


@pytest.fixture
def rung(mb, monkeypatch):
    """The mailbox with its doorbell on (the backend's with --gpu sim), a poller of its own whose
    looks are a minute apart, kernels that look by themselves once a minute: what a test sees
    within its deadline came by the bell."""
    monkeypatch.setattr(sim_kernels, "POLL_S", 60.0)
    monkeypatch.setattr(sim_kernels, "BELL_WAIT_S", 60.0)
    mb.doorbell = True
    return sim_kernels.Poller()


def parked_kernel(mb: Mailbox, slot: int, poller: sim_kernels.Poller, poisoned: threading.Event) -> threading.Thread:
    dev = MeshRing(mb, slot, MeshBeat(mb, slot, {}, lambda: False), abi.BEAT_EVERY, poller)
    t = threading.Thread(target=lambda: [None for _ in iter(lambda: echo_turn(dev, poisoned.is_set), 0)], daemon=True)
    t.start()
    return t


@needs_bell
def test_a_request_to_a_parked_kernel_rings_it_awake(mb, rung):
    """The host's post rings the slot: the idle kernel answers now, as a GPU's polling kernel
    does, not at its poller's next look (a minute away here; 2 ms in a worker)."""
    poisoned = threading.Event()
    parked_kernel(mb, 1, rung, poisoned)
    try:
        poll(lambda: len(rung.parked) == 1, what="the idle kernel parked")
        host = Ring(mb, 1)
        for x in (b"one", b"two"):  # and parked again between the two
            seq = host.post(x)
            assert poll(lambda s=seq: host.response(s), what="the request answered") == x
            poll(lambda: len(rung.parked) == 1, what="the kernel parked again, once idle")
        seqs = host.post_many([b"a", b"b", b"c"])  # call_many's publish rings too
        assert [poll(lambda s=s: host.response(s), what="a batch answered") for s in range(seqs, seqs + 3)] == [b"a", b"b", b"c"]
    finally:
        poisoned.set()
        rung.wake_all()


@needs_bell
def test_a_halt_rings_the_parked_kernel_which_ends(mb, rung):
    """Rung or not yet waiting: a HALT written between the kernel's last poll and its wait is not
    slept through, since the kernel waits on CONTROL as its poll read it, beside REQ_HEAD."""
    poisoned = threading.Event()
    t = parked_kernel(mb, 2, rung, poisoned)
    try:
        poll(lambda: len(rung.parked) == 1, what="the idle kernel parked")
        mb.halt(2)
        t.join(20)
        assert not t.is_alive() and rung.parked == {}
        assert mb.u32(2, abi.STATE) == 0  # ended by HALT (resident() writes EXITED; the bare ring does not)
    finally:
        poisoned.set()
        rung.wake_all()


@needs_bell
def test_a_look_that_finds_work_wakes_a_kernel_waiting_on_its_bell(mb, monkeypatch):
    """A HALT written without its bell (or a bell lost): the poller's next look finds it and pokes
    the kernel, which ends; the request of another kernel, posted without a bell, is answered the
    same way."""
    monkeypatch.setattr(sim_kernels, "BELL_WAIT_S", 60.0)
    mb.doorbell = True
    poller, poisoned = sim_kernels.Poller(), threading.Event()
    t = parked_kernel(mb, 2, poller, poisoned)
    parked_kernel(mb, 3, poller, poisoned)
    try:
        poll(lambda: len(poller.parked) == 2, what="the idle kernels parked")
        mb.set_u32(2, abi.CONTROL, abi.HALT)  # no bell
        t.join(20)
        assert not t.is_alive(), "the look found HALT and woke its kernel"
        mb.doorbell = False
        host = Ring(mb, 3)  # posts without a bell
        seq = host.post(b"unrung")
        assert poll(lambda: host.response(seq), what="the request found by a look") == b"unrung"
    finally:
        poisoned.set()
        poller.wake_all()


def test_a_kernel_waits_on_its_request_head_and_its_control_as_its_last_poll_read_them(mb):
    host, dev = Ring(mb, SLOT), device(mb)
    host.post(b"one")
    assert echo_turn(dev, lambda: False) == 1 and dev.poll() is None
    mb.run(SLOT)
    assert dev.poll() is None
    assert dev.bell() == [(mb.word(SLOT, abi.REQ_HEAD), 1), (mb.word(SLOT, abi.CONTROL), abi.RUN)]
    assert mb.word(SLOT, abi.CONTROL) == mb.address + SLOT * abi.SLOT_BYTES + abi.CONTROL


def test_without_the_doorbell_nothing_rings_and_the_look_finds_the_request(mb):
    """A GPU's mailbox (doorbell off): the ring is written as before and nobody is rung; the
    parked kernel's request is found at its poller's next look (POLL_S)."""
    assert not mb.doorbell and Ring(mb, 1)._bell == 0
    poller, poisoned = sim_kernels.Poller(), threading.Event()
    parked_kernel(mb, 1, poller, poisoned)
    try:
        poll(lambda: len(poller.parked) == 1, what="the idle kernel parked")
        host = Ring(mb, 1)
        seq = host.post(b"found")
        assert poll(lambda: host.response(seq), what="the request answered at a look") == b"found"
    finally:
        poisoned.set()
        poller.wake_all()


@needs_bell
def test_a_wait_on_a_word_that_changed_already_returns_at_once(mb):
    """futex_waitv compares each word with the value meant as nothing to do: a request published
    before the poller began to wait is not slept through."""
    mb.set_u32(1, abi.REQ_HEAD, 7)
    done = threading.Event()
    word = mb.word(1, abi.REQ_HEAD)
    threading.Thread(target=lambda: (doorbell.wait([(word, 6, False)], 60.0), done.set()), daemon=True).start()
    assert done.wait(20), "a word holding another value than expected: no wait"


def test_the_mailbox_closes_after_its_address_was_taken():
    """``doorbell.address`` exports the map only while it reads it: close unmaps it."""
    m = Mailbox.create()
    assert m.address == doorbell.address(m.mm)
    m.close()
    assert m.mm.closed
