"""A program's data in the CUDA worker itself, frame by frame (no daemon): DATA places a 256 MiB
file in device memory beside a resident heartbeat of the same context (blink mode's case: one
context), peek reads it through mesh_data, WRITE changes it while peek runs, DATA_SEQ tells it,
and nothing of it stalls the heartbeat; DATA of 0 bytes frees it.  Run on the device:
`python3 -m pytest tests/gpu/test_data_worker_real.py -v -rA`.
"""

from __future__ import annotations

import os
import struct
import time

import pytest

from meshd_mps.base.errors import NoDriver
from meshd_mps.gpu.compiler import Manifest, cuda_to_ptx, ptx_to_cubin, reg_cap
from meshd_mps.gpu.device import query_device
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import DataReq, Load, Op, WriteReq
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.ring import Ring

from ..rigs.waits import poll
from ..rigs.worker import ROOT, Worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

N = 256 << 20


def cubin(name: str, info) -> tuple[Manifest, bytes]:
    d = ROOT / "examples" / name
    m = Manifest.parse((d / "manifest.json").read_bytes())
    ptx = cuda_to_ptx((d / f"{name}.cu").read_bytes(), name, info.compute, [str(d)])
    return m, ptx_to_cubin(ptx, info.arch, reg_cap(info, m.warps))


def test_data_placed_read_written_and_freed_beside_a_resident_kernel(tmp_path):
    try:
        info = query_device()
    except NoDriver as e:
        pytest.skip(str(e))
    path = tmp_path / "table.bin"
    block = bytes(range(256)) * 4096  # 1 MiB: byte i is i % 256
    with open(path, "wb") as f:
        for _ in range(N >> 20):
            f.write(block)
    mb = Mailbox.create()
    w = Worker(mb, "cuda", "--queues", "8")
    try:
        w.ready()
        hm, hc = cubin("heartbeat", info)
        pm, pc = cubin("peek", info)
        w.load(Load(1, hm.threads, 0, 0, "heartbeat", hc))
        w.load(Load(2, pm.threads, 0, 0, "peek", pc))  # before any kernel runs: a module load in one context waits for them
        w.launch(1, 1, 0)
        poll(lambda: mb.heartbeat(0) > 100, 10, "the heartbeat beats")
        mb.set_u32(0, abi.GAP_RESET, 1)
        poll(lambda: mb.u32(0, abi.GAP_RESET) == 0, 10, "MAX_GAP reset")
        t0 = time.monotonic()
        ok, payload = w.ask(Op.DATA, DataReq(1, N + 4096, N, str(path)).encode(), Op.DATA)
        assert ok, frames.reply_text(payload)
        dev, alloc = frames.data_placed(payload)
        print(f"DATA of {N >> 20} MiB in {time.monotonic() - t0:.3f} s, at {dev:#x}")
        assert dev and alloc == N + 4096
        w.launch(2, 1, 1)
        poll(lambda: mb.u32(1, abi.STATE) == abi.RUNNING, 10, "peek runs")
        ring = Ring(mb, 1)

        def peek(off: int, n: int) -> tuple[int, int, int, bytes]:
            seq = ring.post(struct.pack("<QI", off, n))
            got = poll(lambda: ring.response(seq), 10, "peek's answer")
            size, dseq, total = struct.unpack_from("<QII", got)
            return size, dseq, total, got[16:]

        for off in (0, 12345, N - 200, N + 100):
            n = 4096
            want = bytes((off + i) % 256 for i in range(n)) if off + n <= N else \
                bytes((off + i) % 256 if off + i < N else 0 for i in range(min(n, N + 4096 - off)))
            size, dseq, total, first = peek(off, n)
            assert (size, dseq, total, first) == (N + 4096, 0, sum(want), want[:172])
        ok, payload = w.ask(Op.WRITE, WriteReq(1, 100, b"\xee" * 64).encode(), Op.WRITE)
        assert ok, frames.reply_text(payload)
        mb.set_u32(1, abi.DATA_SEQ, 1)
        assert peek(96, 8)[1::2] == (1, bytes([96, 97, 98, 99]) + b"\xee" * 4)
        big = os.urandom(40 << 20)  # over a staging half: several chunks
        ok, payload = w.ask(Op.WRITE, WriteReq(1, 1 << 20, big).encode(), Op.WRITE)
        assert ok, frames.reply_text(payload)
        assert peek((1 << 20) + (20 << 20), 100)[3] == big[20 << 20 : (20 << 20) + 100]
        ok, payload = w.ask(Op.WRITE, WriteReq(1, N, b"x" * 8192).encode(), Op.WRITE)
        assert not ok and "past slot 1's" in frames.reply_text(payload)
        gap = mb.u64(0, abi.MAX_GAP)
        print(f"heartbeat MAX_GAP through the data's placement and writes: {gap / 1e3:.1f} us")
        assert gap < 50_000_000, "a data step waited for the resident kernel"
        mb.halt(1)
        assert w.done(2, 1).ok
        ok, payload = w.ask(Op.DATA, DataReq(1, 0).encode(), Op.DATA)  # the heartbeat still runs
        assert ok, frames.reply_text(payload)
        mb.halt(0)
        assert w.done(1, 1).ok
        assert w.quit() == 0
    finally:
        w.close()
        mb.close()
