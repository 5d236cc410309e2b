"""A program says whether it serves its request ring (the header's ring helpers
mark its slot's SERVES at their first poll), a call to one that does not is refused at once with
that reason (NotServing, 409), never a timeout, and a full ring names the program and says how it
empties, which then works (an upgrade, an unload and load)."""

from __future__ import annotations

import dataclasses
import os
import signal

import anyio
import pytest

from meshd_mps.base.errors import CallTimeout, NotServing, RingFull
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi
from meshd_mps.protocol.ring import Ring
from meshd_mps.serving.client import ClientError, program_body
from meshd_mps.serving.status import status_of

from ..rigs.backend import example, man, sim_programs
from ..rigs.serve import EXAMPLES, assert_clean_exit, cli
from ..rigs.sim import sim
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(120)

#: Longer than any wait for the first poll: a refusal that came from the call's deadline instead
#: would take this long, and the test's own deadline (20 s) fails it first.
LONG_CALL = 60.0


@pytest.fixture(params=["blink", "mps"])
async def progs(request, standin_on_path):
    async with sim_programs(request.param) as ps:
        yield ps


async def test_the_sim_marks_the_slot_as_the_examples_sources_do(progs):
    """echo's ring helpers mark its slot served before it says RUNNING; heartbeat and spin never
    poll a ring (nor does fault, whose kernel faults at once)."""
    mb = progs.b.mailbox
    echo = await progs.load(*example("echo"))
    hb = await progs.load(*example("heartbeat"))
    spin = await progs.load(*example("spin"))
    assert mb.u32(echo.slot, abi.SERVES) == abi.SERVING  # there when the start check saw RUNNING
    assert mb.u32(hb.slot, abi.SERVES) == 0 and mb.u32(spin.slot, abi.SERVES) == 0


async def test_a_call_to_a_program_that_serves_no_requests_is_refused_at_once(progs):
    hb = await progs.load(*example("heartbeat"))
    await progs.load(*example("echo"))
    mb = progs.b.mailbox
    with anyio.fail_after(20):  # the call's own deadline is 60 s: a timeout would fail here
        with pytest.raises(NotServing) as e:
            await progs.call("heartbeat", b"hello", timeout=LONG_CALL)
        with pytest.raises(NotServing):
            await progs.call_many("heartbeat", [b"a", b"b"], timeout=LONG_CALL)
    assert e.value.program == "heartbeat" and status_of(e.value) == 409
    assert "heartbeat does not serve requests" in str(e.value)
    assert mb.u32(hb.slot, abi.REQ_HEAD) == 0  # nothing was posted: no entry is held
    with anyio.fail_after(20):
        for _ in range(abi.RING + 2):  # as often as you like: the ring never fills
            with pytest.raises(NotServing):
                await progs.call("heartbeat", b"again", timeout=LONG_CALL)
        assert await progs.call("echo", b"still answers") == b"still answers"
        assert await progs.call_many("echo", [b"one", b"two"]) == [b"one", b"two"]


async def stuck(progs: Programs, name: str) -> int:
    """A program that polled its ring once and answers nothing: heartbeat's kernel (a script image
    named after echo), its slot marked served as a one-thread server's first ``mesh_take`` marks
    it; its slot."""
    p = await progs.load(man(name), sim(kernel="heartbeat"))
    progs.b.mailbox.set_u32(p.slot, abi.SERVES, abi.SERVING)
    return p.slot


async def fill(progs: Programs, name: str) -> RingFull:
    """Every entry held by a request given up on (a CallTimeout), then the RingFull of the next."""
    for _ in range(abi.RING):
        with pytest.raises(CallTimeout):
            await progs.call(name, b"anyone?", timeout=0.05)
    with pytest.raises(RingFull):
        await progs.call_many(name, [b"also"])
    with pytest.raises(RingFull) as e:
        await progs.call(name, b"one too many")
    return e.value


async def test_a_full_ring_names_the_program_and_how_it_empties(progs):
    """Each request given up on holds its entry, since the host cannot take back one the kernel
    may be reading; the 9th call is RingFull naming the program and the way back, which works: an
    upgrade, or an unload and load (a new launch zeroes the slot)."""
    name = "echo_stuck"
    m, ptx = example("echo")
    m["name"] = name  # echo's image under this name: the sim runs echo's code
    with anyio.fail_after(60):
        slot = await stuck(progs, name)
        err = await fill(progs, name)
    assert (err.program, err.slot, err.ring, err.given_up) == (name, slot, abi.RING, abi.RING) and status_of(err) == 409
    msg = str(err)
    assert msg.startswith(f"program {name} (slot {slot}): request ring full (8 outstanding, 8 of them given up"), msg
    assert "upgrade it, or unload and load it" in msg, msg
    with anyio.fail_after(60):
        await progs.upgrade(name, m, ptx)
        assert await progs.call(name, b"back") == b"back"
        await progs.unload(name)
        await stuck(progs, name)
        await fill(progs, name)
        await progs.unload(name)
        await progs.load(m, ptx)
        assert await progs.call(name, b"empty again") == b"empty again"


async def test_a_program_whose_first_poll_comes_after_running_is_waited_for(progs, monkeypatch):
    """A one-thread server marks its slot at its first ``mesh_take``, which may come after it says
    RUNNING: a call in between waits for the mark (``Deadlines.first_poll``), it is not refused."""
    hb = await progs.load(*example("heartbeat"))
    mb = progs.b.mailbox
    looks: list[bool] = []  # each look of the waiting call at SERVES
    read = Ring.serves

    def serves(ring: Ring) -> bool:
        looks.append(got := read(ring))
        return got

    async def mark_once_waited_for() -> None:
        await until(lambda: len(looks) >= 2, 20, "the call waiting for the first poll")
        mb.set_u32(hb.slot, abi.SERVES, abi.SERVING)  # as mesh_take would; heartbeat still answers none

    monkeypatch.setattr(Ring, "serves", serves)
    # However loaded the machine, the call comes within the wait for the first poll.
    monkeypatch.setattr(progs.reg, "d", dataclasses.replace(progs.reg.d, first_poll=60.0))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(mark_once_waited_for)
            with pytest.raises(CallTimeout):  # posted once marked: then only the call's deadline is left
                await progs.call("heartbeat", b"hello", timeout=2)
    assert looks[0] is False and looks[-1] is True and mb.u32(hb.slot, abi.REQ_HEAD) == 1


def test_the_cli_says_so_at_once(serve):
    """Through the daemon and the CLI: 409 with the program's name, one clear line, no timeout."""
    s = serve("mps", "--pool", "1")
    status = s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "heartbeat")))
    s.client.load(program_body(str(EXAMPLES / "echo")))
    with pytest.raises(ClientError) as e:
        s.client.call("heartbeat", "hello", timeout=LONG_CALL)  # the client's own timeout is 60 s
    assert e.value.status == 409 and e.value.body["program"] == "heartbeat", e.value.body
    r = cli("call", "heartbeat", "hello", "--socket", s.sock, "--timeout", str(LONG_CALL), timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("meshd-mps: program heartbeat does not serve requests: its kernel does not poll"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli("call", "echo", "hello", "--socket", s.sock)
    assert r.returncode == 0 and r.stdout == "hello\n", r.stderr
    assert s.stop(signal.SIGTERM) == 0, s.log()
    assert_clean_exit(s, status["mps_dir"])
    assert not os.path.exists(s.sock)
