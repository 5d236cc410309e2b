"""examples/knn's wire format, and the exact search it must agree with, in numpy.

A request (knn.cu): u32 nq, u32 k, u32 metric (0: inner product, larger is nearer; 1: squared L2
distance, smaller is nearer), u32 0, then the nq queries, fp32.  A response: u32 status, u32 nq, u32
k, u32 rows searched, then nq * k u32 row ids, then nq * k fp32 scores, each query's best first,
equal scores by row id.  Used by the example's README, the tutorial, the tests and the bench.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

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
          6: "the response does not fit the program's max_response"}


class Answer(NamedTuple):
    ids: np.ndarray  # (nq, k) uint32
    scores: np.ndarray  # (nq, k) float32
    rows: int  # the rows searched


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


def request(queries: np.ndarray, k: int, metric: str = "ip") -> bytes:
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    return struct.pack("<IIII", q.shape[0], k, METRICS[metric], 0) + q.tobytes()


def answer(data: bytes) -> Answer:
    status, nq, k, rows = struct.unpack_from("<IIII", data)
    if status:
        raise Refused(status)
    n = nq * k
    ids = np.frombuffer(data, np.uint32, n, 16).reshape(nq, k)
    scores = np.frombuffer(data, np.float32, n, 16 + 4 * n).reshape(nq, k)
    return Answer(ids, scores, rows)


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
