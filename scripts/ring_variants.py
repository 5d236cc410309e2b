"""What each choice of the ring's device side costs, on the GPU, in one table.

    python scripts/ring_variants.py [-n 20000] [--sm | --trace SECONDS] [--variants floor,helpers,...]

Every variant is one warp of a kernel in a plain context (no meshd-mps, no MPS) polling a request
word of host-mapped memory; the host writes the payload (untimed), then the request word, and
spins on the response word, as the bench's floor row does.  p50 / p99 in us, 0 B and 64 B:

  floor        the bench's floor kernel: a fence after the poll, after the copy, after the head
  no-tail      the same without the fence after the response head
  acq-rel      ld.acquire.sys for the poll, st.release.sys for the head, no fences
  helpers      mesh_program.h's mesh_ring_wait / load / store / post, as echo uses them
               (CONTROL, GAP_RESET and REQ_HEAD in one poll; a beat every 100 us)
  helpers-nobeat  the same, never beating (the beat's share of the tail)
  helpers-fences  the helpers with MESH_RING_FENCES: fences instead of the acquire poll and the
               release of RESP_HEAD (what the header once did)
  mailbox      helpers on meshd-mps's own mailbox (a memfd, cuMemHostRegister'ed as a worker does)
               instead of cuMemHostAlloc's memory: the memory's share
  mailbox-Ring the same, the host's side meshd-mps's Ring.post and Ring.spin (the host spin path of
               the bench's row f, less MPS): the host Python's share

With --sm, instead: the floor's kernel on a spread of SMs, 64 B: as block k of one block per SM,
the others returning at once, for every third k; each block's SM (%smid) and p50/p99, fastest first
(docs/runs/ring-and-control-path.md: two groups of latency that followed the order of measurement,
not the SM).

With --trace S, instead: the floor's kernel, 64 B, for S seconds in blocks of 500 requests, each
block's start (ms) and p50: whether, and how often, the machine's round trip changes state.  Run
under `taskset -c CPU` it says whether the host CPU the spin runs on decides it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshd_mps.gpu.compiler import cuda_to_ptx  # noqa: E402
from meshd_mps.protocol.mailbox import Mailbox  # noqa: E402
from meshd_mps.protocol.ring import Ring  # noqa: E402

BARE = r"""
#define POLL(p) (*(p))
extern "C" __global__ void v(volatile unsigned int *m, unsigned int words, unsigned long long arg) {
    const unsigned int lane = threadIdx.x;
#if SM
    if (blockIdx.x != (unsigned int)arg)  /* --sm: only block `arg` serves; it says its SM in word 18 */
        return;
    if (lane == 0) {
        unsigned int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        m[18] = smid;
        __threadfence_system();
    }
#endif
    unsigned int seen = 0;
    for (;;) {
        unsigned int r;
#if ACQ
        asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(r) : "l"(m + 16) : "memory");
#else
        r = m[16];
#endif
        if (r == seen)
            continue;
        if (r == 0xffffffffu)
            return;
#if !ACQ
        __threadfence_system();
#endif
        const unsigned int a = lane < words ? m[33 + lane] : 0u, b = lane + 32u < words ? m[65 + lane] : 0u;
        if (lane < words)
            m[417 + lane] = a;
        if (lane + 32u < words)
            m[449 + lane] = b;
#if ACQ
        __syncwarp();
        if (lane == 0)
            asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(m + 17), "r"(r) : "memory");
#else
        __threadfence_system();
        if (lane == 0)
            m[17] = r;
#if TAIL
        __threadfence_system();
#endif
#endif
        seen = r;
    }
}
"""
HELPERS = r"""
#include "mesh_program.h"
extern "C" __global__ void v(volatile unsigned int *m, unsigned int words, unsigned long long every) {
    mesh_slot_t s = (mesh_slot_t)m;
    mesh_ring_t r;
    mesh_ring_init(s, &r, every);
    unsigned int n;
    while ((n = mesh_ring_wait(&r)) != 0) {
        mesh_entry_t e = mesh_ring_load(&r, r.next);
        mesh_ring_store(&r, r.next, e, mesh_entry_len(e));
        mesh_ring_post(&r, 1);
    }
}
"""
# The word layout both share: REQ_HEAD word 16 (offset 64), RESP_HEAD 17, the request entry at
# offset 128 (length word 32, payload from 33), the response entry at 1664 (length 416, payload 417).
FLOOR_DEFS = "#define ACQ 0\n#define TAIL 1\n"
VARIANTS = {
    "floor": (BARE, FLOOR_DEFS, 0),
    "no-tail": (BARE, "#define ACQ 0\n#define TAIL 0\n", 0),
    "acq-rel": (BARE, "#define ACQ 1\n#define TAIL 0\n", 0),
    "helpers": (HELPERS, "", 100_000),
    "helpers-nobeat": (HELPERS, "", 1 << 62),
    "helpers-fences": (HELPERS, "#define MESH_RING_FENCES 1\n", 100_000),
    "mailbox": (HELPERS, "", 100_000),
    "mailbox-Ring": (HELPERS, "", 100_000),
}


def ck(r):
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        raise SystemExit(f"ring_variants: {err}")
    return v[0] if len(v) == 1 else v


def p50_p99(lat: list[int]) -> tuple[float, float]:
    """us, the first tenth (the warm-up) left out."""
    lat = sorted(lat[len(lat) // 10 :])
    return lat[len(lat) // 2] / 1e3, lat[int(len(lat) * 0.99)] / 1e3


def trips(w: ctypes.Array, size: int, n: int, ring: bool) -> list[int]:
    """n requests to a kernel polling REQ_HEAD (word 16): each payload written untimed, then the
    head, then a spin on RESP_HEAD (word 17); ns each.  ``ring``: request i in entry i % 8 (the
    helpers), else entry 0 (the bare kernels)."""
    pc, words, lat = time.perf_counter_ns, (size + 3) // 4, []
    for i in range(1, n + 1):
        e = 32 + ((i - 1) % 8) * 48 if ring else 32
        w[e] = size
        for k in range(words):
            w[e + 1 + k] = i + k
        t0 = pc()
        w[16] = i
        while w[17] != i:
            pass
        lat.append(pc() - t0)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--sm", action="store_true", help="the floor's kernel on a spread of SMs instead")
    ap.add_argument("--trace", type=float, default=0.0, help="the floor's block p50s over this many seconds instead")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which variants, comma-separated")
    args = ap.parse_args()
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        raise SystemExit(f"ring_variants: no variant {', '.join(sorted(unknown))} (there are {', '.join(VARIANTS)})")
    n = args.n
    from cuda.bindings import driver as cu

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ck(cu.cuCtxSetCurrent(ck(cu.cuDevicePrimaryCtxRetain(dev))))
    A = cu.CUdevice_attribute
    cc = f"compute_{ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))}" \
         f"{ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))}"
    host = ck(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
    alloc = ctypes.c_uint64(int(ck(cu.cuMemHostGetDevicePointer(host, 0))))
    stream = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def launch(fn: object, dptr: ctypes.c_uint64, words: int, arg: int, blocks: int = 1) -> None:
        a, b = ctypes.c_uint32(words), ctypes.c_uint64(arg)
        params = (ctypes.c_void_p * 3)(ctypes.addressof(dptr), ctypes.addressof(a), ctypes.addressof(b))
        ck(cu.cuLaunchKernel(fn, blocks, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(params), 0))

    def kernel(src: str, name: str) -> object:
        return ck(cu.cuModuleGetFunction(ck(cu.cuModuleLoadData(cuda_to_ptx(src.encode(), name, arch=cc) + b"\0")), b"v"))

    if args.sm:
        sms = ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        fn = kernel("#define SM 1\n" + FLOOR_DEFS + BARE, "floor_sm")
        w, rows = (ctypes.c_uint32 * 1024).from_address(int(host)), []
        for target in range(0, sms, 3):
            ctypes.memset(int(host), 0, 4096)
            w[18] = 0xFFFFFFFF
            launch(fn, alloc, 16, target, blocks=sms)
            while w[18] == 0xFFFFFFFF:  # the serving block has started
                pass
            lat = trips(w, 64, n, ring=False)
            w[16] = 0xFFFFFFFF
            ck(cu.cuStreamSynchronize(stream))
            rows.append((*p50_p99(lat), target, w[18]))
        for p50, p99, target, smid in sorted(rows):
            print(f"block {target:3} on SM {smid:3}: 64 B p50 {p50:.2f} p99 {p99:.2f} us", flush=True)
        return

    if args.trace:
        fn = kernel(FLOOR_DEFS + BARE, "floor_trace")
        w = (ctypes.c_uint32 * 1024).from_address(int(host))
        ctypes.memset(int(host), 0, 4096)
        launch(fn, alloc, 16, 0)
        t0, blocks = time.perf_counter(), []
        while (t := time.perf_counter() - t0) < args.trace:
            lat = sorted(trips(w, 64, 500, ring=False))
            blocks.append((t * 1e3, lat[len(lat) // 2] / 1e3))
        w[16] = 0xFFFFFFFF
        ck(cu.cuStreamSynchronize(stream))
        print(f"{len(blocks)} blocks of 500 requests, 64 B p50 (us) at their start (ms):", flush=True)
        print(" ".join(f"{t:.0f}:{p:.2f}" for t, p in blocks), flush=True)
        return

    mb = Mailbox.create()
    anchor = (ctypes.c_char * mb.size).from_buffer(mb.mm)
    ck(cu.cuMemHostRegister(ctypes.addressof(anchor), mb.size,
                            cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE))
    registered = ctypes.c_uint64(int(ck(cu.cuMemHostGetDevicePointer(ctypes.addressof(anchor), 0))))
    pc = time.perf_counter_ns
    print(f"{'variant':16} {'0 B p50':>8} {'p99':>6} {'64 B p50':>9} {'p99':>6}  (us, {n} requests each)")
    for name in chosen:
        src, defs, every = VARIANTS[name]
        fn = kernel(defs + src, name.replace("-", "_"))
        row: list[float] = []
        on_mailbox = name.startswith("mailbox")
        at = ctypes.addressof(anchor) if on_mailbox else int(host)
        w = (ctypes.c_uint32 * 1024).from_address(at)
        ring = src is HELPERS  # request seq i - 1 sits in entry (i - 1) % 8; the bare kernels use entry 0
        for size in (0, 64):
            words = (size + 3) // 4
            ctypes.memset(at, 0, 4096)
            launch(fn, registered if on_mailbox else alloc, words, every)
            if name == "mailbox-Ring":  # the whole request through Ring: its payload written inside the timing
                r, lat = Ring(mb, 0), []
                wants = [bytes((i + k) & 0xFF for k in range(size)) for i in range(17)]  # a stale entry shows
                for i in range(n):
                    want = wants[i % 17]
                    t0 = pc()
                    got = r.spin(r.post(want), 5.0)
                    lat.append(pc() - t0)
                    if got != want:
                        raise SystemExit(f"{name}: response {i} is not its request")
            else:
                lat = trips(w, size, n, ring)
            if ring:
                w[0] = 1  # CONTROL = HALT
            else:
                w[16] = 0xFFFFFFFF
            ck(cu.cuStreamSynchronize(stream))
            out = 416 + ((n - 1) % 8) * 48 if ring else 416
            if name != "mailbox-Ring" and any(w[out + 1 + k] != n + k for k in range(words)):
                print(f"{name}: {size} B payload came back wrong", file=sys.stderr)
            row += p50_p99(lat)
        print(f"{name:16} {row[0]:8.2f} {row[1]:6.2f} {row[2]:9.2f} {row[3]:6.2f}", flush=True)


if __name__ == "__main__":
    main()
