"""The CUDA worker on a real GPU: ``python -m meshd_mps worker --gpu cuda`` spoken to frame by frame.

No supervisor and no MPS: the test process creates the mailbox, starts
workers with raw pipes (tests/rigs/worker.py, the sim tests' rig too), and
checks what the examples do in the mailbox.  The
examples are compiled here, from CUDA C, with this machine's NVRTC and
nvJitLink (PTX from a newer NVRTC would be refused by an older nvJitLink).
Skipped, with the reason, where there is no NVIDIA driver.

The tests of one worker run in file order on a module-scoped worker; fault
runs last, in its own worker, since it poisons its context.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from meshd_mps.base.errors import NoDriver
from meshd_mps.gpu.compiler import Manifest, cuda_to_ptx, ptx_to_cubin, reg_cap
from meshd_mps.gpu.device import DeviceInfo, query_device
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import Load, Loaded, Op
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.ring import Ring

from ..rigs.waits import poll
from ..rigs.worker import ROOT, Worker

pytestmark = pytest.mark.gpu

EXAMPLES = ["heartbeat", "echo", "spin", "fault"]

# A test-only program: no mesh_rt_abi (rt_abi 0), scratch through mesh_scratch, 64 KiB of
# dynamic shared memory (over the 48 KiB default, so the worker must opt in), 2 warps.
PROBE = rb"""
#include "mesh_program.h"
MESH_DEFINE_SCRATCH();
extern __shared__ unsigned char smem[];
MESH_MAIN {
    mesh_slot_t s = mesh_slot(mailbox, slot);
    unsigned n;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
        smem[i] = (unsigned char)i;
    __syncthreads();
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    unsigned sum = 0;
    for (unsigned i = 0; i < n; i++)
        sum += smem[i];
    unsigned long long *scr = (unsigned long long *)mesh_scratch;
    unsigned long long was = scr ? scr[1] + 7 : 0;
    if (scr)
        scr[0] = 0x1234;
    *mesh_u64(s, MESH_USER_BASE) = mesh_scratch;
    *mesh_u64(s, MESH_USER_BASE + 8) = scr ? scr[0] + was : 0;
    *mesh_u32(s, MESH_USER_BASE + 16) = sum;
    *mesh_u32(s, MESH_USER_BASE + 20) = blockDim.x;
    *mesh_u32(s, MESH_USER_BASE + 24) = n;
    __threadfence_system();
}
"""
PROBE_MANIFEST = {"name": "probe", "backend": "cuda", "warps": 2, "abi": 1, "smem": 65536, "scratch": 4096}


@pytest.fixture(scope="module")
def info() -> DeviceInfo:
    try:
        got = query_device()
    except NoDriver as e:
        print(f"skipping the GPU tests: {e}", file=sys.stderr)
        pytest.skip(str(e))
    print(f"GPU: {got}", file=sys.stderr)
    return got


class Image:
    def __init__(self, info: DeviceInfo, name: str, source: bytes, manifest: bytes | dict):
        self.manifest = Manifest.parse(manifest)
        t0 = time.perf_counter()
        ptx = cuda_to_ptx(source, name, arch=info.compute)
        self.cubin = ptx_to_cubin(ptx, info.arch, reg_cap(info, self.manifest.warps))
        self.ms = (time.perf_counter() - t0) * 1e3

    def load(self, module: int) -> Load:
        m = self.manifest
        return Load(module, m.threads, m.smem, m.scratch, m.name, self.cubin)


@pytest.fixture(scope="module")
def images(info: DeviceInfo) -> dict[str, Image]:
    out = {}
    for n in EXAMPLES:
        d = ROOT / "examples" / n
        out[n] = Image(info, n, (d / f"{n}.cu").read_bytes(), (d / "manifest.json").read_bytes())
    out["probe"] = Image(info, "probe", PROBE, PROBE_MANIFEST)
    print("compile ms:", {k: round(v.ms, 1) for k, v in out.items()}, file=sys.stderr)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def mailbox():
    mb = Mailbox.create()
    yield mb
    mb.close()


def halt_all(mb: Mailbox) -> None:
    for s in range(8):
        mb.halt(s)


@pytest.fixture(scope="module")
def worker(info: DeviceInfo, mailbox: Mailbox):
    w = Worker(mailbox, "cuda")
    yield w
    halt_all(mailbox)
    w.close()


# Modules of the module-scoped worker; slots are the same numbers minus one.
HB, ECHO, SPIN, PROBE_ID = 1, 2, 3, 4
LOADED: dict[int, Loaded] = {}


def test_ready(worker: Worker) -> None:
    assert worker.ready() == worker.p.pid


def test_bad_cubin_is_a_loaded_error(worker: Worker) -> None:
    junk = b"\x7fELF\x02\x01\x01" + bytes(57) + b"\xff" * 4096  # an ELF header that says nothing
    msg = worker.load_error(Load(99, 32, 0, 0, "junk", junk), word=frames.REFUSED)
    print("bad cubin:", msg, file=sys.stderr)
    assert msg.startswith("cuModuleLoadData: CUDA_ERROR_"), msg
    assert "(" in msg  # the driver's description follows the name


def test_a_cubin_without_mesh_main_is_refused(worker: Worker, info: DeviceInfo) -> None:
    """The driver's own words, which the simulation repeats (workers/sim_gpu.py, NO_ENTRY)."""
    d = ROOT / "examples" / "heartbeat"
    ptx = cuda_to_ptx((d / "heartbeat.cu").read_bytes(), "heartbeat", arch=info.compute)
    cubin = ptx_to_cubin(ptx.replace(b"mesh_main", b"mesh_other"), info.arch, reg_cap(info, 1))
    msg = worker.load_error(Load(98, 32, 0, 0, "heartbeat", cubin), word=frames.NO_ENTRY)
    assert msg == "cuModuleGetFunction(mesh_main): CUDA_ERROR_NOT_FOUND (named symbol not found)", msg


def test_load_every_program(worker: Worker, images: dict[str, Image], info: DeviceInfo) -> None:
    for module, name in [(HB, "heartbeat"), (ECHO, "echo"), (SPIN, "spin"), (PROBE_ID, "probe")]:
        got = worker.load(images[name].load(module))
        print(name, got, file=sys.stderr)
        assert got.regs > 0 and got.per_sm > 0 and got.sms == info.sms_total and got.dev != 0, (name, got)
        assert got.rt_abi == (0 if name == "probe" else abi.RT_ABI), (name, got)
        assert got.scratch == (4096 if name == "probe" else 0)
        LOADED[module] = got
    assert len({g.dev for g in LOADED.values()}) == 1


def test_a_loaded_module_id_is_refused(worker: Worker, images: dict[str, Image]) -> None:
    assert "already loaded" in worker.load_error(images["echo"].load(HB))


def test_probe_scratch_and_big_smem(worker: Worker, mailbox: Mailbox) -> None:
    slot = PROBE_ID - 1
    mailbox.reset_slot(slot)
    worker.launch(PROBE_ID, 1, slot, nodes=2)
    d = worker.done(PROBE_ID, 1)
    assert d.ok, d.message
    scratch = mailbox.u64(slot, abi.USER_BASE)
    assert scratch != 0
    assert mailbox.u64(slot, abi.USER_BASE + 8) == 0x1234 + 7  # the scratch was zeroed
    assert mailbox.u32(slot, abi.USER_BASE + 24) == 65536
    assert mailbox.u32(slot, abi.USER_BASE + 16) == 256 * (255 * 256 // 2)
    assert mailbox.u32(slot, abi.USER_BASE + 20) == 64


def test_unload_and_load_again(worker: Worker, images: dict[str, Image]) -> None:
    worker.unload(PROBE_ID)
    again = worker.load(images["probe"].load(PROBE_ID))  # the id is free again
    assert again.scratch == 4096 and again.regs == LOADED[PROBE_ID].regs


def test_heartbeat_beats(worker: Worker, mailbox: Mailbox) -> None:
    slot = HB - 1
    mailbox.reset_slot(slot)
    worker.launch(HB, 1, slot)
    poll(lambda: mailbox.heartbeat(slot) > 0, 10.0, "the first beat", 0.001)
    assert mailbox.u32(slot, abi.STATE) == abi.RUNNING
    a = mailbox.heartbeat(slot)
    time.sleep(0.05)
    b = mailbox.heartbeat(slot)
    assert b > a, (a, b)
    t = mailbox.u64(slot, abi.BEAT_TIME)
    assert t > 0 and mailbox.u64(slot, abi.MAX_GAP) > 0
    mailbox.set_u32(slot, abi.GAP_RESET, 1)
    poll(lambda: mailbox.u32(slot, abi.GAP_RESET) == 0, 10.0, "GAP_RESET cleared", 0.001)
    time.sleep(0.02)
    gap = mailbox.u64(slot, abi.MAX_GAP)
    print(f"heartbeat: {b - a} beats in 50 ms, max gap {gap / 1e3:.1f} us", file=sys.stderr)
    assert gap < 50_000_000
    # Waiting for the resident kernel spins no CPU (blocking-sync event, blocking-sync context).
    c0, t0 = cpu_seconds(worker.p.pid), time.monotonic()
    time.sleep(0.5)
    share = (cpu_seconds(worker.p.pid) - c0) / (time.monotonic() - t0)
    print(f"worker CPU while its kernel runs: {share * 100:.1f}% of a core", file=sys.stderr)
    assert share < 0.2, share
    assert (HB, 1) not in worker.dones


def answered(ring: Ring, seq: int) -> list[bytes] | None:
    """The response, boxed (an empty one is an answer too), or None."""
    got = ring.response(seq)
    return None if got is None else [got]


def test_echo_answers_the_ring(worker: Worker, mailbox: Mailbox) -> None:
    slot = ECHO - 1
    mailbox.reset_slot(slot)
    worker.launch(ECHO, 1, slot)
    poll(lambda: mailbox.u32(slot, abi.STATE) == abi.RUNNING, 10.0, "echo running", 0.001)
    ring = Ring(mailbox, slot)
    for i in range(abi.RING * 2 + 3):  # round the ring twice, every length from 0 up
        msg = bytes((i + j) & 0xFF for j in range(i * 9))[: abi.ENTRY_PAYLOAD]
        seq = ring.post(msg)
        assert seq == i
        got = poll(partial(answered, ring, seq), 5, f"the response to request {i}", 0.001)
        assert got == [msg]
    # Pipelined: the whole ring posted at once (one REQ_HEAD), answered in order.
    msgs = [bytes([k]) * (abi.ENTRY_PAYLOAD - k) for k in range(abi.RING)]
    first = ring.post_many(msgs)
    for k, msg in enumerate(msgs):
        assert poll(partial(answered, ring, first + k), 5, f"the response to {first + k}", 0.001) == [msg]
    assert mailbox.heartbeat(slot) > 0


def test_spin_runs_its_time(worker: Worker, mailbox: Mailbox) -> None:
    slot = SPIN - 1
    mailbox.reset_slot(slot)
    mailbox.set_u32(slot, abi.USER_BASE, 300)
    t0 = time.monotonic()
    worker.launch(SPIN, 1, slot)
    d = worker.done(SPIN, 1, timeout=10)
    took = time.monotonic() - t0
    assert d.ok, d.message
    print(f"spin 300 ms: DONE after {took * 1e3:.1f} ms", file=sys.stderr)
    assert 0.29 <= took < 2.0, took
    assert mailbox.u32(slot, abi.STATE) == abi.EXITED
    # 0 means 100 ms
    mailbox.reset_slot(slot)
    t0 = time.monotonic()
    worker.launch(SPIN, 2, slot)
    assert worker.done(SPIN, 2).ok
    took = time.monotonic() - t0
    assert 0.095 <= took < 1.5, took


def test_halt_ends_the_residents(worker: Worker, mailbox: Mailbox) -> None:
    for module in (HB, ECHO):
        slot = module - 1
        assert (module, 1) not in worker.dones
        t0 = time.monotonic()
        mailbox.halt(slot)
        d = worker.done(module, 1, timeout=5)
        print(f"module {module}: DONE {(time.monotonic() - t0) * 1e3:.2f} ms after HALT", file=sys.stderr)
        assert d.ok and d.message == "", d
        assert mailbox.u32(slot, abi.STATE) == abi.EXITED


def test_relaunch_after_halt_and_quit(worker: Worker, mailbox: Mailbox) -> None:
    slot = HB - 1
    mailbox.run(slot)
    before = mailbox.heartbeat(slot)
    worker.launch(HB, 2, slot)
    poll(lambda: mailbox.heartbeat(slot) > before, 10.0, "beats again", 0.001)
    mailbox.halt(slot)
    assert worker.done(HB, 2).ok
    for m in (HB, ECHO, SPIN, PROBE_ID):
        worker.unload(m)
    assert worker.quit() == 0


@pytest.mark.parametrize("sms, want", [(16, 16), (12, 16)])
def test_green_context(info: DeviceInfo, images: dict[str, Image], mailbox: Mailbox, sms: int, want: int) -> None:
    w = Worker(mailbox, "cuda", "--sms", str(sms))
    slot = 10
    try:
        w.ready()
        got = w.load(images["heartbeat"].load(1))
        print(f"--sms {sms}: {got}", file=sys.stderr)
        assert got.sms == want and got.regs > 0 and got.rt_abi == abi.RT_ABI
        mailbox.reset_slot(slot)
        w.launch(1, 1, slot)
        poll(lambda: mailbox.heartbeat(slot) > 0, 10.0, "a beat in the green context", 0.001)
        mailbox.halt(slot)
        d = w.done(1, 1)
        assert d.ok, d.message
        assert w.quit() == 0
    finally:
        mailbox.halt(slot)
        w.kill()


def test_sms_over_the_device(info: DeviceInfo, mailbox: Mailbox) -> None:
    w = Worker(mailbox, "cuda", "--sms", str(info.sms_total + 1))
    try:
        ok, payload = w.ask(Op.READY, b"", Op.READY)
        assert not ok
        assert f"sms {info.sms_total + 1}: the device has {info.sms_total}" in frames.reply_text(payload)
        assert w.quit() == 0
    finally:
        w.kill()


def test_32_queues_hold_32_residents_through_churn(
    info: DeviceInfo, images: dict[str, Image], mailbox: Mailbox
) -> None:
    """``--queues 32``: 32 heartbeats beat at once; a 33rd module finds no queue (with 8 queues and
    a stream made per module, a 9th module's kernel never started, nor, once that module was
    unloaded, the next one's: H200); after a blink's churn (all halted, two unloaded,
    two others loaded, all launched again) the new ones take the freed queues and all 32 beat."""
    w = Worker(mailbox, "cuda", "--queues", "32")
    hb = images["heartbeat"]
    slot = {m: 100 + m for m in [*range(1, 33), 40, 41]}  # the module-scoped tests use slots under 32
    try:
        w.ready()
        for m in range(1, 33):
            w.load(hb.load(m))
        assert "all 32 hardware work queues of this context hold a module" in w.load_error(hb.load(33))

        def launch_all(mods: list[int], gen: int) -> None:
            for m in mods:
                mailbox.reset_slot(slot[m])
                w.launch(m, gen, slot[m])
            before = {m: mailbox.heartbeat(slot[m]) for m in mods}
            poll(lambda: all(mailbox.heartbeat(slot[m]) > before[m] + 10 for m in mods), 10.0, f"modules {mods} beating", 0.001)

        mods = list(range(1, 33))
        launch_all(mods, 1)
        for m in mods:
            mailbox.halt(slot[m])
        for m in mods:
            assert w.done(m, 1).ok
        for m in (3, 17):
            w.unload(m)
        for m in (40, 41):
            w.load(hb.load(m))
        mods = [m for m in mods if m not in (3, 17)] + [40, 41]
        launch_all(mods, 2)
        for m in mods:
            mailbox.halt(slot[m])
        for m in mods:
            assert w.done(m, 2).ok
        for m in mods:
            w.unload(m)
        assert w.quit() == 0
    finally:
        for s in slot.values():
            mailbox.halt(s)
        w.kill()


def test_fault_is_an_illegal_address(info: DeviceInfo, images: dict[str, Image], mailbox: Mailbox) -> None:
    """Last, and in a worker of its own: the fault poisons its context."""
    w = Worker(mailbox, "cuda")
    slot = 20
    try:
        w.ready()
        got = w.load(images["fault"].load(7))
        assert got.regs > 0
        mailbox.reset_slot(slot)
        w.launch(7, 1, slot)
        d = w.done(7, 1, timeout=20)
        print(f"fault: {d}", file=sys.stderr)
        assert not d.ok
        assert d.message.startswith("CUDA_ERROR_ILLEGAL_ADDRESS: "), d.message
        # STATE may still read EXITED: the faulting store is posted and the kernel runs on.
        assert mailbox.u32(slot, abi.STATE) in (abi.RUNNING, abi.EXITED)
        assert w.quit() == 0
    finally:
        w.kill()
