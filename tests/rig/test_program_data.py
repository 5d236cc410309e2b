"""A program's data (docs/program-abi.md, "Data") through ``Programs`` on the simulated GPU, in both
isolation modes: loaded with it (bytes, a file), read by the program (examples/peek), written while
it runs and seen through DATA_SEQ, kept across a relaunch, an upgrade, a worker's death and a GPU
fault; refused where it does not fit or a write is past its end."""

from __future__ import annotations

import os
import signal
import struct

import anyio
import pytest

from meshd_mps.base.errors import DataNotFound, DataTooLarge, NoData, WriteOutOfRange
from meshd_mps.gpu.device import SIM_MEMORY_ENV
from meshd_mps.programs import Programs
from meshd_mps.programs.data import DataRef
from meshd_mps.protocol import abi

from ..rigs.backend import example, open_sim

pytestmark = pytest.mark.timeout(90)

HEAD = struct.Struct("<QII")  # peek's answer: size, DATA_SEQ, sum


def ask(offset: int, n: int) -> bytes:
    return struct.pack("<QI", offset, n)


async def peek(ps: Programs, name: str, offset: int, n: int) -> tuple[int, int, int, bytes]:
    got = await ps.call(name, ask(offset, n), timeout=10)
    size, seq, total = HEAD.unpack_from(got)
    return size, seq, total, got[HEAD.size :]


async def until(ps: Programs, name: str, offset: int, want: bytes, within: float = 15.0) -> tuple[int, int, int, bytes]:
    """peek's answer once its bytes at ``offset`` are ``want`` (a relaunch on its way answers late)."""
    with anyio.fail_after(within):
        while True:
            try:
                got = await peek(ps, name, offset, len(want))
                if got[3] == want:
                    return got
            except Exception:  # not serving yet: a relaunch under way
                pass
            await anyio.sleep(0.05)


@pytest.mark.parametrize("isolation", ["blink", "mps"])
async def test_data_is_read_written_and_kept_across_relaunches_upgrades_and_deaths(isolation, tmp, standin_on_path):
    table = bytes(range(256)) * 64  # 16 KiB
    async with await open_sim(isolation, pool=1) as b:
        ps = Programs(b, restart="always")
        m, ptx = example("peek")
        p = await ps.load(m, ptx, data=table)
        assert p.data is not None and p.data.spec.alloc == len(table)
        size, seq, total, first = await peek(ps, "peek", 100, 20)
        assert (size, seq, total, first) == (len(table), 0, sum(table[100:120]), table[100:120])
        assert ps.describe(p)["data_bytes"] == len(table)

        # A write while it runs, seen once DATA_SEQ counts it; past the end, refused, naming both sizes.
        w = await ps.write("peek", 4096, b"\xff" * 8)
        assert w.seq == 1 and b.mailbox.u32(p.slot, abi.DATA_SEQ) == 1
        now = table[4090:4096] + b"\xff" * 8 + table[4104:4106]
        assert (await peek(ps, "peek", 4090, 16))[1:] == (1, sum(now), now)
        with pytest.raises(WriteOutOfRange) as e:
            await ps.write("peek", len(table) - 2, b"abcd")
        assert (e.value.offset, e.value.bytes, e.value.size) == (len(table) - 2, 4, len(table))
        assert "past the end of its 16384 bytes" in str(e.value)

        # An upgrade to the same program keeps the data and its write; in MPS mode in a new worker.
        pid = p.kernel.pid
        await ps.upgrade("peek", m, ptx)
        assert (await peek(ps, "peek", 4096, 8))[3] == b"\xff" * 8
        assert (p.kernel.pid != pid) == (isolation == "mps")

        # Its worker killed (MPS: its own; blink: the context): relaunched with its data and writes.
        os.kill(p.kernel.pid, signal.SIGKILL)
        await anyio.sleep(0.3)
        got = await until(ps, "peek", 4096, b"\xff" * 8)
        assert got[0] == len(table) and p.kernel.pid != pid

        # A GPU fault (another program's): every program of the GPU torn down and brought back, with its data.
        blinks = b.status().get("blinks", 0)
        await ps.write("peek", 0, b"fault")
        if isolation == "blink":
            assert b.status().get("blinks", 0) == blinks, "a write blinked the context"
        await ps.load(*example("fault"), restart="never")
        with anyio.fail_after(30):
            while not (ps.faults and ps.faults[-1].ms > 0):
                await anyio.sleep(0.02)
        assert "peek" in ps.faults[-1].relaunched or isolation == "blink"
        assert (await until(ps, "peek", 0, b"fault"))[0] == len(table)
        await ps.unload("fault")

        # An upgrade to other data: the new data, the old writes gone with the old data.
        other = b"\x07" * 1000
        await ps.upgrade("peek", m, ptx, data=other)
        assert (await peek(ps, "peek", 0, 10))[0::3] == (1000, b"\x07" * 10)
        await ps.unload("peek")
        await ps.close()


async def test_data_that_does_not_fit_is_refused_before_anything_runs(tmp, standin_on_path, monkeypatch):
    monkeypatch.setenv(SIM_MEMORY_ENV, str(1 << 20))
    async with await open_sim("blink") as b:
        ps = Programs(b)
        m, ptx = example("peek")
        with pytest.raises(DataTooLarge) as e:
            await ps.load(m, ptx, data=bytes(2 << 20))
        assert (e.value.asked, e.value.have, e.value.device) == (2 << 20, 1 << 20, 0) and not ps.by_name
        assert "needs 2097152 bytes" in str(e.value) and "1048576 of 1048576 bytes free" in str(e.value)
        # The manifest's data_bytes alone: zeroed memory it owns, counted as used.
        p = await ps.load({**m, "data_bytes": 600 << 10}, ptx)
        assert (await peek(ps, "peek", 0, 4))[0::3] == (600 << 10, bytes(4))
        with pytest.raises(DataTooLarge):
            await ps.load({**m, "name": "peek2"}, ptx, data=bytes(500 << 10))
        e2 = await ps.load({**example("echo")[0]}, example("echo")[1])
        with pytest.raises(NoData):
            await ps.write(e2.name, 0, b"x")
        with pytest.raises(DataNotFound):
            await ps.load({**m, "name": "peek3"}, ptx, data=DataRef("0" * 64))
        assert p.name in ps.by_name
        await ps.close()
