"""examples/knn as the simulated GPU runs it: its request's checks in the same order with the same
refusals, and the same exact answer, in numpy (its scores in fp32, as the GPU's, the squared distance
through the dot product; the order by score, then by row id), read from and written to the same
places (its data, its ring entry or its payload region).  What the GPU's blocks do together (the
scan's shares, the merge) is one computation here."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import numpy as np

from meshd_mps.protocol import abi

from .sim_kernels import MeshRing, View, mesh_entry_offset, mesh_entry_size

MAGIC, F16, F32, HEADER = 0x314E4E4B, 1, 2, 64
IP, L2 = 0, 1
E_SIZE, E_NQ, E_K, E_METRIC, E_TABLE, E_ROOM, E_FLAGS = 1, 2, 3, 4, 5, 6, 7
TIMES = 1  # the request's flag: the response ends with its steps' times (ns)
NQ_MAX, K_MAX, QCAP, MERGE = 64, 32, 8192, 64 * 128
REQ = struct.Struct("<IIII")
OUT = struct.Struct("<IIII")


def table(data: memoryview | None) -> tuple[int, np.ndarray | None]:
    """The table knn.cu finds in its data: (0, rows) or (E_TABLE, None)."""
    if data is None or len(data) < HEADER:
        return E_TABLE, None
    magic, dtype, dim, _ = struct.unpack_from("<IIII", data)
    (rows,) = struct.unpack_from("<Q", data, 16)
    esize = 2 if dtype == F16 else 4 if dtype == F32 else 0
    chunks = dim * esize // 16 if esize else 0
    if magic != MAGIC or not esize or dim * esize % 16 or not 4 <= chunks <= 32 or chunks & (chunks - 1):
        return E_TABLE, None
    rows = min(rows, (len(data) - HEADER) // (dim * esize))
    return 0, np.frombuffer(data, np.float16 if dtype == F16 else np.float32, rows * dim, HEADER).reshape(rows, dim)


#: The table's rows as fp32, by slot, kept while the same data holds them unwritten (a conversion of
#: the whole table each request would be most of a simulated request's time).
_F32: dict[int, tuple[tuple[int, int, int, int], np.ndarray]] = {}


def rows32(slot: int, data: memoryview, t: np.ndarray, seq: int) -> np.ndarray:
    key = (id(data.obj), seq, t.shape[0], t.dtype.itemsize)
    got = _F32.get(slot)
    if got is None or got[0] != key:
        got = _F32[slot] = (key, t.astype(np.float32))
    return got[1]


def best(key: np.ndarray, k: int) -> np.ndarray:
    """The rows of the k largest keys, the larger first, equal keys by row id (the smaller first)."""
    if k < len(key):
        kth = np.partition(key, len(key) - k)[len(key) - k]
        cand = np.flatnonzero(key >= kth)
    else:
        cand = np.arange(len(key))
    return cand[np.lexsort((cand, -key[cand]))][:k]


def answer(req: bytes, data: memoryview | None, nodes: int, room: int, slot: int = -1, seq: int = 0) -> bytes:
    """knn.cu's answer to one request: the response's bytes (its first word, the status).  ``slot``
    and ``seq`` (its DATA_SEQ) name the data, for the fp32 rows kept between requests.  With the TIMES
    flag the response ends with its steps' times, as knn.cu's: here numpy's (the read, the scores and
    each query's selection as the scan, no merge: one computation, the response's packing)."""
    t0 = time.perf_counter_ns()
    size = len(req)
    nq, k, metric, flags = REQ.unpack_from(req) if size >= 16 else (0, 0, 0, 0)
    status, t = table(data)
    if size < 16:
        status = E_SIZE
    elif status == 0:
        assert t is not None
        dim = t.shape[1]
        if nq == 0 or nq > NQ_MAX or nq * dim > QCAP:
            status = E_NQ
        elif size != 16 + nq * dim * 4:
            status = E_SIZE
        elif k == 0 or k > K_MAX or nodes * k > MERGE:
            status = E_K
        elif metric not in (IP, L2):
            status = E_METRIC
        elif flags & ~TIMES:
            status = E_FLAGS
        elif 16 + nq * k * 8 + (16 if flags & TIMES else 0) > room:
            status = E_ROOM
    if status:
        return OUT.pack(status, nq, k, 0)
    assert t is not None and data is not None
    rows, dim = t.shape
    q = np.frombuffer(req, np.float32, nq * dim, 16).reshape(nq, dim)
    k = min(k, rows)
    x = rows32(slot, data, t, seq)
    t1 = time.perf_counter_ns()
    dots = x @ q.T  # (rows, nq), fp32
    if metric == IP:
        scores = dots
    else:
        scores = (x * x).sum(1, dtype=np.float32)[:, None] - 2 * dots + (q * q).sum(1, dtype=np.float32)[None, :]
    ids = np.empty((nq, k), np.uint32)
    out = np.empty((nq, k), np.float32)
    for i in range(nq):
        s = scores[:, i]
        ids[i] = best(s if metric == IP else -s, k)
        out[i] = s[ids[i]]
    t2 = time.perf_counter_ns()
    body = OUT.pack(0, nq, k, rows & 0xFFFFFFFF) + ids.tobytes() + out.tobytes()
    if flags & TIMES:
        body += struct.pack("<IIII", t1 - t0, t2 - t1, 0, time.perf_counter_ns() - t2)
    return body


def knn_turn(r: MeshRing, poisoned: Callable[[], bool], data: View, region: View, nodes: int) -> int:
    """One turn of knn.cu's loop: the next request (one a turn, as block 0 takes them) answered; 0 at HALT."""
    if r.wait(poisoned) == 0:
        return 0
    mb, slot, seq = r.mb, r.slot, r.next
    e = r.load(seq)
    size = mesh_entry_size(e)
    reg = region()
    if size <= abi.ENTRY_PAYLOAD:
        req = e[4 : 4 + size]
    else:
        at = mesh_entry_offset(e)
        req = b"" if reg is None else bytes(reg[at : at + size])
    room = mb.u32(slot, abi.RESPONSE_MAX) if reg is not None else 0  # knn.cu answers in its region only
    out = answer(req, data(), nodes, room, slot, mb.u32(slot, abi.DATA_SEQ))
    if len(out) <= abi.ENTRY_PAYLOAD:
        r.store(seq, len(out).to_bytes(4, "little") + out + bytes(-len(out) % 4), len(out))
    else:
        assert reg is not None  # a response past the entry was checked to fit the region's area
        at = abi.RING * mb.u32(slot, abi.REQUEST_STRIDE) + (seq % abi.RING) * mb.u32(slot, abi.RESPONSE_STRIDE)
        reg[at : at + len(out)] = out
        r.store_region(seq, len(out), at)
    r.post(1)
    return 1
