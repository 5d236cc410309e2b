"""examples/knn's kernel, one source against another, on the GPU: each source's ``knn_once`` (the same
search as the resident kernel, launched once a batch, in a plain context of this process: no
meshd-mps, no MPS) over the same table and queries, batches of 1, 8 and 64, p50 and p99 (us) and the
table's bytes a second at the p50, and whether each answer is numpy's.  What a change to the scan
gains, apart from the ring and the host.

With ``--resident``, each source is loaded instead as meshd-mps runs knn (a backend of its own,
``--mode`` blink or mps, on ``--gpu``) and called one batch at a time with knn's times asked for: the
call's p50 and the medians of its steps on the GPU (read, scan, merge, write) and of the rest (the
host's and the bus's), and whether its answer at each batch is numpy's.  What a change to the ring's
side of the kernel gains.

    python scripts/knn_variants.py [--rows N] [--reps R] [--dtype f16,f32] SOURCE.cu [SOURCE.cu ...]
    python scripts/knn_variants.py --resident [--mode blink|mps] [--gpu cuda|sim] ... SOURCE.cu ...

The bench's "a launch per batch" contender (meshd_mps/bench/contenders.py) is the first's timing, the
bench's split of a resident call (meshd_mps/bench/versus.py, ``steps``) the second's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshd_mps.bench import contenders
from meshd_mps.bench.rig import Bench
from meshd_mps.bench.versus import BATCHES, DIM, NODES_PER_SM, K, _example, nodes_for, same, steps
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.programs import Programs

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--dtype", default="f16,f32")
    ap.add_argument("--resident", action="store_true", help="each source resident in meshd-mps, its call split")
    ap.add_argument("--mode", choices=("blink", "mps"), default="mps", help="--resident's isolation")
    ap.add_argument("--gpu", choices=("cuda", "sim"), default="cuda", help="--resident's GPU")
    a = ap.parse_args()
    make_table, kc = _example("make_table"), _example("knn_client")
    manifest = json.loads((ROOT / "examples" / "knn" / "manifest.json").read_text())
    rng = np.random.default_rng(12)
    qs = rng.integers(-8, 9, size=(max(BATCHES), DIM)).astype(np.float32)
    check = qs[:4]
    batches = {nq: qs[:nq] for nq in BATCHES}
    if a.resident:
        print(f"N {a.rows}, D {DIM}, k {K}, resident ({a.mode}, {a.gpu}), {a.reps} calls a batch with the times asked"
              " for; the call's p50, its steps' medians (us)")
    else:
        print(f"N {a.rows}, D {DIM}, k {K}, {a.reps} launches a batch after 20; p50 / p99 us, GB/s at the p50")
    for dtype in a.dtype.split(","):
        x = make_table.table(a.rows, DIM, dtype, seed=11, integers=True)
        if a.resident:
            asyncio.run(resident(a, {src: Path(src).read_bytes() for src in a.sources}, x, qs, manifest, dtype))
            continue
        want = kc.search(x, check, K)
        for src in a.sources:
            spec = {"k": K, "reps": a.reps, "warm": 20, "source": src, "include": str(ROOT / "examples" / "include"),
                    "smem": manifest["smem"], "scratch": manifest["scratch"], "nodes_per_sm": NODES_PER_SM}
            try:
                r = contenders._once(spec, x, batches, check)
            except Exception as e:  # a source that does not build or launch: said, and the next one run
                print(f"{dtype} {src}: {type(e).__name__}: {e}")
                continue
            if "skipped" in r:
                print(f"{dtype} {src}: skipped: {r['skipped']}")
                continue
            ans = r["answer"]
            ok = same(np.array(ans["ids"]), np.array(ans["scores"], np.float32), want.ids, want.scores)
            cells = []
            for nq in BATCHES:
                xs = sorted(r["once"][nq])
                p50, p99 = xs[len(xs) // 2], xs[int(len(xs) * 0.99)]
                cells.append(f"batch {nq}: {p50 * 1e6:.0f} / {p99 * 1e6:.0f} us, {x.nbytes / p50 / 1e9:.0f} GB/s")
            print(f"{dtype} {src}: " + "; ".join(cells) + f"; numpy's answer: {'yes' if ok else 'NO'}")
    return 0


async def resident(a: argparse.Namespace, sources: dict[str, bytes], x: np.ndarray, qs: np.ndarray, manifest: dict,
                   dtype: str) -> None:
    """Each source (its path, its CUDA C) resident in a backend of its own over table ``x``: a line per
    source and batch."""
    make_table, kc = _example("make_table"), _example("knn_client")
    bench = Bench(a.gpu, quick=False, mps_dir=None)
    try:
        path = f"{bench.base}/table-{dtype}.bin"
        make_table.write(path, x)
        for src in a.sources:
            try:
                async with await bench.backend(a.mode, pool=0) as b:
                    assert b.info is not None
                    ptx = await anyio.to_thread.run_sync(functools.partial(
                        cuda_to_ptx, sources[src], "knn", arch=b.info.compute, include=[str(ROOT / "examples" / "include")]))
                    ps = Programs(b)
                    try:
                        await ps.load(manifest, ptx, nodes=nodes_for(b.info.sms_total), data=path)
                        for nq in BATCHES:
                            got = kc.answer(await ps.call("knn", kc.request(qs[:nq], K), timeout=60))
                            want = kc.search(x, qs[:nq], K)
                            ok = same(got.ids, got.scores, want.ids, want.scores)
                            sp = await steps(ps, kc.request(qs[:nq], K, times=True), a.reps, kc)
                            print(f"{dtype} {src} batch {nq}: call {sp['call']:.1f}, read {sp['read']:.1f}, "
                                  f"scan {sp['scan']:.1f}, merge {sp['merge']:.1f}, write {sp['write']:.1f}, "
                                  f"host {sp['host']:.1f}; numpy's answer: {'yes' if ok else 'NO'}", flush=True)
                    finally:
                        await ps.close()
            except Exception as e:  # a source that does not build or load: said, and the next one run
                print(f"{dtype} {src}: {type(e).__name__}: {e}", flush=True)
    finally:
        bench.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
