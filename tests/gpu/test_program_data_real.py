"""A program's data on the REAL GPU (docs/program-abi.md, "Data"), in both isolation modes: a table
of 1 GiB placed in device memory (cuMemAllocAsync, copied in through a pinned buffer) and read by
examples/peek, whose sums over ranges of it equal the host's; writes while it runs, seen through
DATA_SEQ, never halting a resident neighbour (heartbeat's MAX_GAP stays small and no blink is
counted); the data kept across an upgrade; data too big for the GPU refused before anything runs.
The simulated GPU runs the same (tests/rig/test_program_data.py).  Run on the device:
`python3 -m pytest tests/gpu/test_program_data_real.py -v -rA`.
"""

from __future__ import annotations

import os
import struct

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import DataTooLarge
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

from ..rigs.backend import example
from ..rigs.gpu import skip_without_real_gpu_and_mps

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(600)]

HEAD = struct.Struct("<QII")
GiB = 1 << 30


@pytest.fixture(autouse=True)
def gpu_and_mps_here():
    skip_without_real_gpu_and_mps("the program data tests")


def table(path: str, n: int) -> None:
    """A file of ``n`` bytes whose byte i is ``byte_at(i)``: a pattern of 1 MiB (7 * 2^20 and 2^20 /
    4096 are both multiples of 256), written a MiB at a time."""
    pattern = bytes(byte_at(i) for i in range(1 << 20))
    with open(path, "wb") as f:
        for _ in range(0, n, 1 << 20):
            f.write(pattern)


def byte_at(i: int) -> int:
    return ((i * 7) + (i // 4096)) & 0xFF


async def peek(ps: Programs, offset: int, n: int) -> tuple[int, int, int, bytes]:
    got = await ps.call("peek", struct.pack("<QI", offset, n), timeout=30)
    size, seq, total = HEAD.unpack_from(got)
    return size, seq, total, got[HEAD.size :]


@pytest.mark.parametrize("isolation", ["blink", "mps"])
async def test_a_1_gib_table_is_read_and_written_while_a_neighbour_runs(isolation, tmp):
    path = os.path.join(tmp, "table.bin")
    table(path, GiB)
    async with await Backend.open(isolation=isolation, gpu="cuda", pool=1) as b:
        ps = Programs(b)
        hb = await ps.load(*example("heartbeat"))
        blinks = b.status().get("blinks", 0)
        m, ptx = example("peek")
        p = await ps.load(m, ptx, data=path)
        assert p.data is not None and p.data.spec.alloc == GiB
        for off in (0, 12345, GiB // 2 + 77, GiB - 100):
            n = min(1 << 16, GiB - off)
            size, seq, total, first = await peek(ps, off, n)
            assert size == GiB and seq == 0
            assert total == sum(byte_at(off + i) for i in range(n)) & 0xFFFFFFFF
            assert first == bytes(byte_at(off + i) for i in range(min(n, 172)))
        # Writes while it runs: seen after DATA_SEQ counts them; the heartbeat never stalls for them.
        b.mailbox.set_u32(hb.slot, abi.GAP_RESET, 1)
        with anyio.fail_after(5):
            while b.mailbox.u32(hb.slot, abi.GAP_RESET):
                await anyio.sleep(0.001)
        for k in range(1, 21):
            w = await ps.write("peek", GiB - 4096 * k, bytes([k]) * 4096)
            assert w.seq == k
            assert (await peek(ps, GiB - 4096 * k, 8))[1::2] == (k, bytes([k]) * 8)
        await ps.write("peek", 0, os.urandom(32 << 20))  # a large one too, in frames of 32 MiB
        assert b.mailbox.u64(hb.slot, abi.MAX_GAP) < 50_000_000, "a write stalled a resident neighbour"
        assert b.status().get("blinks", 0) == blinks + (1 if isolation == "blink" else 0)  # peek's own load only
        # An upgrade keeps the data and its writes.
        await ps.upgrade("peek", m, ptx)
        assert (await peek(ps, GiB - 4096, 4))[3] == bytes([1]) * 4
        # Data past the GPU's free memory: refused, naming the sizes, before anything runs.
        free = (await b.free_memory(p.device) or (0, 0))[1]
        with pytest.raises(DataTooLarge) as e:
            await ps.load({**m, "name": "huge", "data_bytes": free + GiB}, ptx)
        assert e.value.asked == free + GiB and "huge" not in ps.by_name
        await ps.close()
