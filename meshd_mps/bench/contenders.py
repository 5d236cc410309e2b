"""What users run instead of a resident program, for row (v) versus: the same exact top-k over the same
table and queries, per batch, in a process of its own (its CUDA context is its own, apart from the
bench's daemons):

- ``eager``: PyTorch as a user writes it: the queries copied to the GPU, a matmul and ``topk``, the
  answer copied back, synchronised;
- ``graph``: the same work captured once in a CUDA graph and replayed per batch;
- ``once``: examples/knn's own search (``knn_once``, the same code as the resident kernel's)
  launched once per batch through cuda.bindings (cuLaunchKernel, then the copy back, synchronised):
  what residency saves, apart from the kernel's quality;
- ``copy``: the device-to-device copy's bandwidth (bytes read and written a second), the ceiling a
  scan of the table is measured against.

    python -m meshd_mps.bench.contenders SPEC.json  ->  one JSON object on stdout

A contender that cannot run here (no torch, no GPU) says why instead of its figures.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _torch(spec: dict[str, Any], x: np.ndarray, batches: dict[int, np.ndarray], check: np.ndarray) -> dict[str, Any]:
    try:
        import torch
    except ImportError as e:
        return {"skipped": f"no torch ({e})"}
    dev = torch.device("cuda")
    k, reps, warm = spec["k"], spec["reps"], spec["warm"]
    t = torch.from_numpy(x).to(dev)
    out: dict[str, Any] = {"eager": {}, "graph": {}}

    def eager(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        qg = torch.from_numpy(q).to(dev).to(t.dtype)
        v, i = torch.topk(qg @ t.T, k, dim=1)
        return i.cpu().numpy(), v.float().cpu().numpy()

    for nq, q in batches.items():
        out["eager"][nq] = timed(lambda q=q: eager(q), reps, warm)
        static = torch.zeros((nq, x.shape[1]), dtype=t.dtype, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up the capture needs, on a side stream
            for _ in range(3):
                torch.topk(static @ t.T, k, dim=1)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gv, gi = torch.topk(static @ t.T, k, dim=1)
        host = torch.from_numpy(q.astype(x.dtype)).pin_memory()

        def replay(host: Any = host, static: Any = static, g: Any = g, gi: Any = gi, gv: Any = gv) -> None:
            static.copy_(host, non_blocking=True)
            g.replay()
            gi.cpu()
            gv.cpu()

        out["graph"][nq] = timed(replay, reps, warm)
    ids, scores = eager(check)
    out["answer"] = {"ids": ids.tolist(), "scores": scores.tolist()}
    # The copy's bandwidth: 1 GiB device to device, bytes read and written a second.
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    out["copy_gbs"] = 2 * n * 10 / (start.elapsed_time(end) / 1e3) / 1e9
    return out


def _once(spec: dict[str, Any], x: np.ndarray, batches: dict[int, np.ndarray], check: np.ndarray) -> dict[str, Any]:
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return {"skipped": f"no cuda.bindings ({e})"}
    from meshd_mps.gpu.compiler import cuda_to_ptx, ptx_to_cubin

    def ck(r: Any) -> Any:
        err, *vals = r if isinstance(r, tuple) else (r,)
        if int(err):
            raise RuntimeError(f"CUDA error {err}")
        return vals[0] if len(vals) == 1 else vals

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    src = Path(spec["source"]).read_bytes()
    major = ck(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = ck(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    sms = ck(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    ptx = cuda_to_ptx(src, "knn", f"compute_{major}{minor}", [spec["include"]])
    mod = ck(cu.cuModuleLoadData(ptx_to_cubin(ptx, f"sm_{major}{minor}", 248)))
    fn = ck(cu.cuModuleGetFunction(mod, b"knn_once"))
    smem = spec["smem"]
    ck(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    table = ck(cu.cuMemAlloc(x.nbytes))
    ck(cu.cuMemcpyHtoD(table, x.ctypes.data, x.nbytes))
    scratch = ck(cu.cuMemAlloc(spec["scratch"]))
    ck(cu.cuMemsetD8(scratch, 0, spec["scratch"]))
    k, nodes = spec["k"], spec["nodes_per_sm"] * (sms - 1)  # as the resident one is launched
    qcap = max(batches) * x.shape[1] * 4
    qdev, odev = ck(cu.cuMemAlloc(qcap)), ck(cu.cuMemAlloc(16 + max(batches) * k * 8))
    stream = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    code = {np.dtype(np.float16): 1, np.dtype(np.float32): 2}[x.dtype]

    def search(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(q, dtype=np.float32)
        nq = q.shape[0]
        out = np.empty(16 + nq * k * 8, np.uint8)
        ck(cu.cuMemcpyHtoDAsync(qdev, q.ctypes.data, q.nbytes, stream))
        args = [ctypes.c_uint64(int(table)), ctypes.c_uint64(x.shape[0]), ctypes.c_uint32(x.shape[1]),
                ctypes.c_uint32(code), ctypes.c_uint64(int(qdev)), ctypes.c_uint32(nq), ctypes.c_uint32(k),
                ctypes.c_uint32(0), ctypes.c_uint64(int(odev)), ctypes.c_uint64(int(scratch))]
        ptrs = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        ck(cu.cuLaunchKernel(fn, nodes, 1, 1, 256, 1, 1, smem, stream, ctypes.addressof(ptrs), 0))
        ck(cu.cuMemcpyDtoHAsync(out.ctypes.data, odev, out.nbytes, stream))
        ck(cu.cuStreamSynchronize(stream))
        raw = out.tobytes()
        ids = np.frombuffer(raw, np.uint32, nq * k, 16).reshape(nq, k)
        return ids, np.frombuffer(raw, np.float32, nq * k, 16 + nq * k * 4).reshape(nq, k)

    res: dict[str, Any] = {"once": {nq: timed(lambda q=q: search(q), spec["reps"], spec["warm"]) for nq, q in batches.items()}}
    ids, scores = search(check)
    res["answer"] = {"ids": ids.tolist(), "scores": scores.tolist()}
    for p in (table, scratch, qdev, odev):
        cu.cuMemFree(p)
    cu.cuDevicePrimaryCtxRelease(dev)
    return res


def timed(f: Any, reps: int, warm: int) -> list[float]:
    """Seconds each of ``reps`` calls of ``f`` took, after ``warm`` untimed ones."""
    for _ in range(warm):
        f()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    x = np.load(spec["table"], mmap_mode="r")
    x = np.ascontiguousarray(x)
    qs = np.load(spec["queries"])
    batches = {nq: qs[:nq] for nq in spec["batches"]}
    check = np.load(spec["check"])
    out = {"torch": _torch(spec, x, batches, check), "once": _once(spec, x, batches, check)}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
