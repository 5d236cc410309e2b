"""Requests and responses of any size on the REAL GPU: echo's answers made in
place, a program that reads its request from its payload region and writes its response into its
own area (the region registered with its context, its device address in the slot), a program that
writes a response length or offset past its region refused on the host, and the region kept
through a blink's relaunch and an upgrade to other sizes.  The simulated GPU models the same
(tests/rig/test_payloads.py).  Run on the device: `python3 -m pytest tests/gpu -v -rA`."""

from __future__ import annotations

import os
import time

import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import BadResponse, PayloadTooLarge
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi
from meshd_mps.protocol.payloads import Layout

from ..rigs.backend import example
from ..rigs.gpu import skip_without_real_gpu_and_mps

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(300)]

MIB = 1 << 20

#: A program that reads each request over 188 bytes from its payload region and answers with every
#: byte XORed with 0xA5, written into its own response area: the GPU reads and writes the region.
#: With XFORM_LIAR defined it answers instead with the length and offset the request's first two
#: words name (a program that lies about its response, for the host's checks).
XFORM = b"""
#include "mesh_program.h"
MESH_DEFINE_RT_ABI();
MESH_MAIN {
    if (blockIdx.x != 0 || threadIdx.x >= 32)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_payloads_t p;
    mesh_payloads_init(s, &p);
    mesh_ring_t r;
    mesh_ring_init(s, &r, MESH_BEAT_EVERY);
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_RUNNING);
    const unsigned int lane = threadIdx.x & 31u;
    unsigned int n;
    while ((n = mesh_ring_wait(&r)) != 0) {
        for (unsigned int k = 0; k < n; k++) {
            const unsigned int seq = r.next + k;
            mesh_entry_t e = mesh_ring_load(&r, seq);
            const unsigned int size = mesh_entry_size(e);
            if (size <= MESH_ENTRY_PAYLOAD) {
                mesh_ring_store(&r, seq, e, size);
                continue;
            }
            const volatile unsigned char *in = mesh_request_bytes(&r, &p, seq, e);
            volatile unsigned char *out = mesh_response_area(&p, seq);
#ifdef XFORM_LIAR
            const unsigned int len = __ldcv((const unsigned int *)in), at = __ldcv((const unsigned int *)in + 1);
            mesh_ring_store_region(&r, seq, len, at);
#else
            const uint4 *in4 = (const uint4 *)in;
            uint4 *out4 = (uint4 *)out;
            for (unsigned int i = lane; i < size / 16u; i += 32u) {
                uint4 v = __ldcv(in4 + i);
                v.x ^= 0xa5a5a5a5u; v.y ^= 0xa5a5a5a5u; v.z ^= 0xa5a5a5a5u; v.w ^= 0xa5a5a5a5u;
                __stwt(out4 + i, v);
            }
            for (unsigned int i = size / 16u * 16u + lane; i < size; i += 32u)
                out[i] = in[i] ^ 0xa5u;
            mesh_ring_store_region(&r, seq, size, (unsigned int)(out - p.base));
#endif
        }
        mesh_ring_post(&r, n);
    }
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_EXITED);
}
"""


@pytest.fixture(params=["blink", "mps"])
async def progs(request):
    skip_without_real_gpu_and_mps("the payload tests")
    async with await Backend.open(isolation=request.param, gpu="cuda", pool=1) as b:
        ps = Programs(b)
        try:
            yield ps
        finally:
            await ps.close()


def manifest(name: str, most: int) -> dict:
    return {"name": name, "backend": "cuda", "warps": 1, "abi": 1, "max_request": most, "max_response": most}


def xored(x: bytes) -> bytes:
    return bytes(c ^ 0xA5 for c in x)


async def test_payloads_of_any_size_through_the_real_ring(progs):
    b = progs.b
    arch = b.infos[b.devices[0]].compute
    m, ptx = example("echo")
    echo = await progs.load({**m, "max_request": MIB, "max_response": MIB}, ptx)
    assert b.mailbox.u64(echo.slot, abi.PAYLOADS) != 0, "the worker wrote the region's device address"
    for n in (0, 188, 189, 4096, 65537, MIB):
        x = os.urandom(n)
        assert await progs.call("echo", x) == x, n
    xs = [os.urandom(n) for n in (189, MIB, 5, 70_000, 188, MIB - 1, 3, 4096)] * 3
    assert await progs.call_many("echo", xs) == xs
    with pytest.raises(PayloadTooLarge):
        await progs.call("echo", bytes(MIB + 1))
    # The GPU reads the request from the region and writes its answer into its own area.
    await progs.load(manifest("xform", 256 << 10), cuda_to_ptx(XFORM, "xform", arch=arch))
    for n in (189, 1000, 4097, 65536, 256 << 10):
        x = os.urandom(n)
        assert await progs.call("xform", x) == xored(x), n
    xs = [os.urandom(n) for n in range(189, 189 + 20 * 997, 997)]
    assert await progs.call_many("xform", xs) == [xored(x) for x in xs]
    big = [os.urandom(MIB) for _ in range(16)]
    t0 = time.perf_counter()
    assert await progs.call_many("echo", big) == big
    print(f"{b.isolation}: 16 x 1 MiB in and out through echo: {16 * MIB / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


async def test_a_response_past_the_region_is_refused_and_the_region_lives_through_a_relaunch(progs):
    b = progs.b
    most = 64 << 10
    lay = Layout(most, most)
    ptx = cuda_to_ptx(b"#define XFORM_LIAR\n" + XFORM, "liar", arch=b.infos[b.devices[0]].compute)
    liar = await progs.load(manifest("liar", most), ptx)
    for length, at, why in ((most + 1, lay.response_at(0), "over its manifest's max_response"),
                            (1000, lay.size - 100, "not in its own entry's areas"),
                            (1000, lay.response_at(3), "not in its own entry's areas")):
        req = length.to_bytes(4, "little") + at.to_bytes(4, "little") + bytes(300)
        with pytest.raises(BadResponse) as e:
            await progs.call("liar", req)
        assert (e.value.size, e.value.offset) == (length, at) and why in str(e.value), str(e.value)
    assert await progs.call("liar", b"small, inline") == b"small, inline"  # it serves on
    seq = b.mailbox.u32(liar.slot, abi.REQ_HEAD)
    good = await progs.call("liar", (500).to_bytes(4, "little") + lay.response_at(seq).to_bytes(4, "little") + bytes(300))
    assert len(good) == 500, "a length and offset in its own area are read as they are"
    # echo upgraded onto the same region, then to other sizes: a new region the new worker maps.
    m, eptx = example("echo")
    echo = await progs.load(m, eptx)
    x = os.urandom(50_000)
    assert await progs.call("echo", x) == x
    await progs.upgrade("echo", m, eptx)
    assert await progs.call("echo", x[::-1]) == x[::-1]
    await progs.upgrade("echo", {**m, "max_request": MIB, "max_response": MIB}, eptx)
    y = os.urandom(MIB)
    assert await progs.call("echo", y) == y and echo.kernel.payloads is not None
