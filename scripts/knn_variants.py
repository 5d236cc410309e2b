"""examples/knn's kernel, one source against another, on the GPU: each source's ``knn_once`` (the same
search as the resident kernel, launched once a batch, in a plain context of this process: no
meshd-mps, no MPS) over the same table and queries, batches of 1, 8 and 64, p50 and p99 (us) and the
table's bytes a second at the p50, and whether each answer is numpy's.  What a change to the scan
gains, apart from the ring and the host.

    python scripts/knn_variants.py [--rows N] [--reps R] [--dtype f16,f32] SOURCE.cu [SOURCE.cu ...]

The bench's "a launch per batch" contender (meshd_mps/bench/contenders.py) is the timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshd_mps.bench import contenders
from meshd_mps.bench.versus import BATCHES, DIM, NODES_PER_SM, K, _example, same

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--dtype", default="f16,f32")
    a = ap.parse_args()
    make_table, kc = _example("make_table"), _example("knn_client")
    manifest = json.loads((ROOT / "examples" / "knn" / "manifest.json").read_text())
    rng = np.random.default_rng(12)
    qs = rng.integers(-8, 9, size=(max(BATCHES), DIM)).astype(np.float32)
    check = qs[:4]
    batches = {nq: qs[:nq] for nq in BATCHES}
    print(f"N {a.rows}, D {DIM}, k {K}, {a.reps} launches a batch after 20; p50 / p99 us, GB/s at the p50")
    for dtype in a.dtype.split(","):
        x = make_table.table(a.rows, DIM, dtype, seed=11, integers=True)
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


if __name__ == "__main__":
    raise SystemExit(main())
