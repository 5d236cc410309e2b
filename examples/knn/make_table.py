"""Writes a table for examples/knn: `rows` vectors of `dim` numbers (fp16 or fp32) from a seed.

    python examples/knn/make_table.py TABLE --rows 100000 --dim 128 [--dtype f16|f32] [--seed 0]
                                      [--integers] [--spare ROWS]

The file is the 64-byte header knn.cu reads (u32 magic "KNN1", u32 dtype 1 = fp16 / 2 = fp32,
u32 dim, u32 0, u64 rows, 40 bytes 0), then the rows, row after row.  ``--integers``: whole numbers
from -8 to 8, which every sum of the search holds exactly in fp32, so that any two exact searches
(the GPU's, the simulated GPU's, numpy's) agree to the last bit: the tests use them.  ``--spare
ROWS``: that many zero rows more after the table (the file is that much longer, and sparse on
disk), room for rows appended while the program runs (``meshd-mps write``), which the header's
``rows`` does not count until they are written.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from knn_client import DTYPES, header  # a sibling module: examples/knn/knn_client.py


def table(rows: int, dim: int, dtype: str = "f16", seed: int = 0, integers: bool = False) -> np.ndarray:
    """The table's rows, as knn.cu reads them."""
    rng = np.random.default_rng(seed)
    if integers:
        x = rng.integers(-8, 9, size=(rows, dim)).astype(np.float32)
    else:
        x = rng.standard_normal((rows, dim), dtype=np.float32)
    return x.astype(DTYPES[dtype])


def write(path: str, x: np.ndarray, spare: int = 0) -> int:
    """``x`` written as a table at ``path`` with ``spare`` zero rows after it; the file's size."""
    with open(path, "wb") as f:
        f.write(header(x))
        x.tofile(f)
        size = f.tell() + spare * x.shape[1] * x.itemsize
        f.truncate(size)
    return size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", metavar="TABLE")
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--integers", action="store_true", help="whole numbers from -8 to 8 (exact sums)")
    ap.add_argument("--spare", type=int, default=0, metavar="ROWS", help="zero rows of room after the table")
    a = ap.parse_args(argv)
    x = table(a.rows, a.dim, a.dtype, a.seed, a.integers)
    size = write(a.path, x, a.spare)
    print(f"{a.path}: {a.rows} rows of {a.dim} {a.dtype}, {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
