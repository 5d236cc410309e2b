"""On the REAL GPU: the header's ring helpers mark the slot served (SERVES), the
warp-wide ones before RUNNING (echo), the one-thread ``mesh_take`` at its first poll; a program
that never polls (heartbeat) is refused at once.  The simulated GPU models the same
(tests/serve/test_ring_serving.py).  Run on the device: `python3 -m pytest tests/gpu -v -rA`.
"""

from __future__ import annotations

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.base.errors import NotServing
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

from ..rigs.backend import example
from ..rigs.gpu import skip_without_real_gpu_and_mps

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(300)]

#: A one-thread server (docs/program-abi.md, section 6): its first ``mesh_take`` after RUNNING.
ONE_THREAD = b"""
#include "mesh_program.h"
MESH_DEFINE_RT_ABI();
MESH_MAIN {
    if (threadIdx.x || blockIdx.x) return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_set_state(s, MESH_RUNNING);
    unsigned seq, len;
    while (!mesh_halted(s)) {
        if (mesh_take(s, &seq)) {
            const volatile unsigned char *req = mesh_request(s, seq, &len);
            volatile unsigned char *resp = mesh_response(s, seq);
            for (unsigned i = 0; i < len; i++) resp[i] = req[i];
            mesh_post(s, seq, len);
        }
    }
    mesh_set_state(s, MESH_EXITED);
}
"""


@pytest.fixture(autouse=True)
def gpu_and_mps_here():
    skip_without_real_gpu_and_mps("the ring-serving tests")


@pytest.mark.parametrize("isolation", ["blink", "mps"])
async def test_the_real_header_marks_the_slot(isolation):
    async with await Backend.open(isolation=isolation, gpu="cuda", pool=1) as b:
        progs = Programs(b)
        mb = b.mailbox
        echo = await progs.load(*example("echo"))
        hb = await progs.load(*example("heartbeat"))
        assert mb.u32(echo.slot, abi.SERVES) == abi.SERVING  # mesh_ring_init, before RUNNING
        assert mb.u32(hb.slot, abi.SERVES) == 0
        with anyio.fail_after(20), pytest.raises(NotServing) as e:
            await progs.call("heartbeat", b"hello", timeout=60)
        assert e.value.program == "heartbeat" and mb.u32(hb.slot, abi.REQ_HEAD) == 0
        assert await progs.call("echo", b"real GPU") == b"real GPU"
        ptx = cuda_to_ptx(ONE_THREAD, "one", arch=b.infos[b.devices[0]].compute)
        one = await progs.load({"name": "one", "backend": "cuda", "warps": 1, "abi": 1}, ptx)
        assert await progs.call("one", b"one thread") == b"one thread"  # its first mesh_take marked the slot
        assert mb.u32(one.slot, abi.SERVES) == abi.SERVING
        await progs.close()
