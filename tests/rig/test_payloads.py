"""Requests and responses of any size through ``Programs`` on the simulated GPU,
in both isolation modes: a program's manifest declares how large its requests and responses may be,
the host writes a payload over a ring entry's 188 bytes into the program's payload region and the
entry says where; sizes at the boundaries, a payload over the most refused before anything is
posted, ``call_many`` with large ones, a program whose response lies past its region caught and
never read, the region kept through a relaunch, a new one at an upgrade to other sizes, and nothing
left behind.  The layout itself is checked first, without a program."""

from __future__ import annotations

import mmap
import os

import pytest

from meshd_mps.base.errors import BadResponse, PayloadTooLarge
from meshd_mps.programs.program import ProgramState
from meshd_mps.protocol import abi
from meshd_mps.protocol.payloads import ALIGN, Layout

from ..rigs.backend import example, sim_programs
from ..rigs.deadlines import QUICK_RESTARTS
from ..rigs.sim import sim
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(120)

#: What echo's manifest declares (examples/echo/manifest.json).
ECHO_MOST = 65536


def echo(**sizes: int) -> tuple[dict, bytes]:
    m, ptx = example("echo")
    m.update(sizes)
    return m, ptx


def regions_open() -> list[str]:
    """This process's open payload regions: its memfds of that name (protocol/payloads.py)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            continue
        if "meshd-mps-payloads" in link:
            out.append(link)
    return out


@pytest.fixture(params=["blink", "mps"])
async def progs(request, standin_on_path):
    async with sim_programs(request.param, QUICK_RESTARTS) as ps:
        yield ps


def test_the_layout_gives_each_entry_its_own_areas_and_a_response_only_its_own():
    lay = Layout(1000, 5000)
    assert (lay.request_stride, lay.response_stride) == (1024, 5120) and lay.request_stride % ALIGN == 0
    assert lay.size == abi.RING * (1024 + 5120) and lay.responses_at == abi.RING * 1024
    assert Layout(200).size == mmap.PAGESIZE, "whole pages: 8 areas of 256 bytes take one"
    assert [lay.request_at(s) for s in (0, 1, 9)] == [0, 1024, 1024]  # entry seq % RING
    assert lay.response_fits(9, 5000, lay.response_at(9)) and lay.response_fits(9, 1000, lay.request_at(9))  # in place
    assert not lay.response_fits(9, 5001, lay.response_at(9))  # over max_response
    assert not lay.response_fits(9, 300, lay.response_at(2))  # another entry's area
    assert not lay.response_fits(9, 1025, lay.request_at(9))  # past its request's area
    assert not lay.response_fits(9, 200, lay.size - 100)  # past the region
    assert Layout().size == 0 and Layout(188, 188).size == 0 and Layout().request_limit == abi.ENTRY_PAYLOAD
    assert Layout(64).request_limit == 64 and Layout(0, 189).request_stride == 0 and Layout(0, 189).size > 0


async def test_every_size_to_the_most_declared_and_one_more_refused_before_anything_is_posted(progs):
    p = await progs.load(*echo())
    mb, slot = progs.b.mailbox, p.slot
    assert progs.describe(p)["max_request"] == progs.describe(p)["max_response"] == ECHO_MOST
    for n in (0, 1, abi.ENTRY_PAYLOAD, abi.ENTRY_PAYLOAD + 1, 4096, ECHO_MOST - 1, ECHO_MOST):
        x = os.urandom(n)
        assert await progs.call("echo", x) == x, n
    head = mb.u32(slot, abi.REQ_HEAD)
    with pytest.raises(PayloadTooLarge) as e:
        await progs.call("echo", bytes(ECHO_MOST + 1))
    assert (e.value.size, e.value.limit, e.value.program) == (ECHO_MOST + 1, ECHO_MOST, "echo")
    assert f"{ECHO_MOST + 1} bytes is over its most, {ECHO_MOST} bytes" in str(e.value)
    with pytest.raises(PayloadTooLarge):
        await progs.call_many("echo", [b"fine", bytes(ECHO_MOST + 1)])
    assert mb.u32(slot, abi.REQ_HEAD) == head, "a refused request, or its batch, posted nothing"
    # Many at once, large and small in turn, more than the ring holds: each its own area, in order.
    xs = [os.urandom(n) for n in (5, 189, ECHO_MOST, 3000, 188, 0, 70_000 % ECHO_MOST, 1000, ECHO_MOST - 7, 1) * 3]
    assert await progs.call_many("echo", xs) == xs
    assert await progs.call_many("echo", xs, window=3) == xs
    assert await progs.call("echo", b"small again") == b"small again"
    assert regions_open(), "its memfd (and its map's own copy of the fd)"
    await progs.unload("echo")
    assert regions_open() == [], "an unload leaves no region behind"


async def test_a_response_past_its_region_is_refused_and_never_read(progs):
    """echo on script answers every request over 188 bytes with a length or an offset of its own
    choosing: the host reads none of it, says why, and the program serves on."""
    m, _ = echo()
    for wrong, why in (({"answer_bytes": ECHO_MOST + 1}, f"over its manifest's max_response, {ECHO_MOST} bytes"),
                       ({"answer_at": Layout(ECHO_MOST, ECHO_MOST).size - 100}, "not in its own entry's areas")):
        await progs.load(m, sim(kernel="echo", **wrong))
        with pytest.raises(BadResponse) as e:
            await progs.call("echo", bytes(500))
        assert e.value.program == "echo" and e.value.limit == ECHO_MOST and why in str(e.value), str(e.value)
        assert e.value.region == Layout(ECHO_MOST, ECHO_MOST).size
        with pytest.raises(BadResponse):  # one bad response ends call_many; the others' entries are freed
            await progs.call_many("echo", [b"a", bytes(300), b"b"])
        assert await progs.call("echo", b"still serving") == b"still serving"
        assert await progs.call_many("echo", [b"x"] * (2 * abi.RING)) == [b"x"] * (2 * abi.RING)
        await progs.unload("echo")


async def test_the_region_lives_through_a_relaunch_and_an_upgrade_takes_the_new_sizes(progs):
    p = await progs.load(*echo())
    region = p.kernel.payloads
    assert region is not None and region.size == Layout(ECHO_MOST, ECHO_MOST).size
    big = os.urandom(ECHO_MOST)
    # A relaunch: blink, another load halts and relaunches echo in the same context; MPS, its worker
    # retired under it, it comes back on a fresh one (its restart policy), which maps the region again.
    if progs.b.isolation == "blink":
        await progs.load(*example("heartbeat"))
    else:
        progs.b.sup.retire(p.kernel.proc)
        await until(lambda: p.restarts == 1 and p.observe() is ProgramState.RUNNING)
    assert p.kernel.payloads is region and await progs.call("echo", big) == big
    await progs.upgrade("echo", *echo())  # the same sizes: the same region
    assert p.kernel.payloads is region and await progs.call("echo", big) == big
    await progs.upgrade("echo", *echo(max_request=1 << 20, max_response=1 << 20))  # a new one; the old closed
    assert p.kernel.payloads is not region and region.fd == -1
    huge = os.urandom(1 << 20)
    assert await progs.call("echo", huge) == huge and progs.describe(p)["max_request"] == 1 << 20
    region = p.kernel.payloads
    await progs.upgrade("echo", *echo(max_request=64, max_response=0))  # no region: a ring entry's, and less
    assert p.kernel.payloads is None and region is not None and region.fd == -1
    assert await progs.call("echo", bytes(64)) == bytes(64)
    with pytest.raises(PayloadTooLarge) as e:
        await progs.call("echo", bytes(65))
    assert e.value.limit == 64 and "its manifest's max_request is 64" in str(e.value)
