"""examples/knn's wire format, and the exact search it must agree with, in numpy.

A request (knn.cu): u32 nq, u32 k, u32 metric (0: inner product, larger is nearer; 1: squared L2
distance, smaller is nearer), u32 flags (1: the steps' times asked for, else 0), then the nq queries,
fp32.  A response: u32 status, u32 nq, u32 k, u32 rows searched, then nq * k u32 row ids, then nq * k
fp32 scores, each query's best first, equal scores by row id; where the times were asked for, four
u32 after them: the nanoseconds the GPU took to read the request, to scan, to merge and to write.
Used by the example's README, the tutorial, the tests and the bench.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

MAGIC = 0x314E4E4B  # "KNN1"
DTYPES = {"f16": np.float16, "f32": np.float32}
CODES = {"f16": 1, "f32": 2}
HEADER = 64
METRICS = {"ip": 0, "l2": 1}
#: What knn.cu takes: queries a request, neighbours a query, query numbers a request.
NQ_MAX, K_MAX, QCAP = 64, 32, 8192
#: knn.cu's refusals (the response's status).
ERRORS = {1: "the request's length is not 16 + nq * dim * 4", 2: f"nq is 0, over {NQ_MAX}, or nq * dim over {QCAP}",
          3: f"k is 0, over {K_MAX}, or nodes * k over 8192", 4: "the metric is neither 0 (ip) nor 1 (l2)",
          5: "the program's data holds no table it takes (dtype f16 or f32, dim a power of two of 16..512 bytes)",
          6: "the response does not fit the program's max_response", 7: "a flag knn does not know (1: times)"}
#: The request's flag that asks for the steps' times.
TIMES = 1


class Times(NamedTuple):
    """Where a request's time went on the GPU (ns, its global timer): the request read (its queries
    copied in, every block told), the scan, the merge of the blocks' bests, the response written."""

    read: int
    scan: int
    merge: int
    write: int


class Answer(NamedTuple):
    ids: np.ndarray  # (nq, k) uint32
    scores: np.ndarray  # (nq, k) float32
    rows: int  # the rows searched
    times: Times | None = None  # where the request asked for them


class Refused(Exception):
    def __init__(self, status: int):
        super().__init__(f"knn refused the request: {ERRORS.get(status, f'status {status}')}")
        self.status = status


def header(x: np.ndarray) -> bytes:
    """The table's 64-byte header for rows ``x``."""
    code = {np.dtype(np.float16): 1, np.dtype(np.float32): 2}[x.dtype]
    return struct.pack("<IIIIQ", MAGIC, code, x.shape[1], 0, x.shape[0]).ljust(HEADER, b"\0")


def rows_offset(row: int, dim: int, dtype: str) -> int:
    """Where row ``row`` starts in the table's data (for a write that appends rows)."""
    return HEADER + row * dim * np.dtype(DTYPES[dtype]).itemsize


#: Where the header's row count is: a write of 8 bytes there makes appended rows searched.
ROWS_AT = 16


def request(queries: np.ndarray, k: int, metric: str = "ip", times: bool = False) -> bytes:
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    return struct.pack("<IIII", q.shape[0], k, METRICS[metric], TIMES if times else 0) + q.tobytes()


def answer(data: bytes) -> Answer:
    status, nq, k, rows = struct.unpack_from("<IIII", data)
    if status:
        raise Refused(status)
    n = nq * k
    ids = np.frombuffer(data, np.uint32, n, 16).reshape(nq, k)
    scores = np.frombuffer(data, np.float32, n, 16 + 4 * n).reshape(nq, k)
    times = Times(*struct.unpack_from("<IIII", data, 16 + 8 * n)) if len(data) >= 16 + 8 * n + 16 else None
    return Answer(ids, scores, rows, times)


def search(x: np.ndarray, queries: np.ndarray, k: int, metric: str = "ip") -> Answer:
    """The exact answer, in float64: each query's k nearest rows, the best first, equal scores by
    row id (the smaller first)."""
    q = np.atleast_2d(queries).astype(np.float64)
    t = x.astype(np.float64)
    if metric == "ip":
        s = q @ t.T
        key = s
    else:
        s = (q * q).sum(1)[:, None] - 2 * (q @ t.T) + (t * t).sum(1)[None, :]
        key = -s
    k = min(k, x.shape[0])
    ids = np.empty((q.shape[0], k), np.uint32)
    for i in range(q.shape[0]):
        order = np.lexsort((np.arange(x.shape[0]), -key[i]))[:k]
        ids[i] = order
    scores = np.take_along_axis(s, ids.astype(np.int64), 1).astype(np.float32)
    return Answer(ids, scores, x.shape[0])


# ---- the command line: a request from a table's rows, an answer shown, rows appended -----------


def read_table(path: str) -> np.ndarray:
    """The rows a table file (make_table.py's) holds, as its header counts them."""
    with open(path, "rb") as f:
        magic, code, dim, _, rows = struct.unpack("<IIIIQ", f.read(24))
    if magic != MAGIC:
        raise SystemExit(f"{path}: not a knn table (no KNN1 header)")
    dtype = np.float16 if code == 1 else np.float32
    return np.fromfile(path, dtype, rows * dim, offset=HEADER).reshape(rows, dim)


def _client(args: Any) -> Any:
    from meshd_mps.serving.client import Client

    return Client(args.socket, gpu=args.gpu)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="knn_client.py", description="examples/knn's requests, answers and rows")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("request", help="a request of the table's rows ROWS as queries, to a file (or stdout)")
    p.add_argument("table")
    p.add_argument("--rows", default="0", help="the rows to ask about, comma-separated (default 0)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--metric", choices=sorted(METRICS), default="ip")
    p.add_argument("--out", help="the file to write (default stdout)")
    p = sub.add_parser("show", help="an answer file (meshd-mps call --out) as a table")
    p.add_argument("answer")
    p = sub.add_parser("append", help="rows of one value appended to the running program's table")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    p.add_argument("--value", type=float, required=True)
    p.add_argument("--count", type=int, default=1)
    for p in sub.choices.values():
        p.add_argument("--name", default="knn", help="the program (default knn)")
        p.add_argument("--socket")
        p.add_argument("--gpu", choices=("cuda", "sim"))
    args = ap.parse_args(argv)
    if args.cmd == "request":
        x = read_table(args.table)
        data = request(x[[int(r) for r in args.rows.split(",")]].astype(np.float32), args.k, args.metric)
        if args.out:
            with open(args.out, "wb") as f:
                f.write(data)
        else:
            import sys

            sys.stdout.buffer.write(data)
    elif args.cmd == "show":
        with open(args.answer, "rb") as f:
            a = answer(f.read())
        for i in range(a.ids.shape[0]):
            print(f"query {i}: " + ", ".join(f"{r} ({s:g})" for r, s in zip(a.ids[i].tolist(), a.scores[i].tolist(),
                                                                              strict=True)))
        print(f"({a.rows} rows searched)")
    else:  # append: the rows first, then the count that makes them searched
        c = _client(args)
        rows = answer(c.call_bytes(args.name, request(np.zeros((1, args.dim), np.float32), 1))).rows
        new = np.full((args.count, args.dim), args.value, DTYPES[args.dtype])
        c.write(args.name, rows_offset(rows, args.dim, args.dtype), new.tobytes())
        c.write(args.name, ROWS_AT, (rows + args.count).to_bytes(8, "little"))
        print(f"{args.count} rows appended as rows {rows}..{rows + args.count - 1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
