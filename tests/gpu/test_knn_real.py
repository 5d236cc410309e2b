"""examples/knn on the REAL GPU, both isolation modes: every block of a launch of 2 an SM scanning
its share of a table in the program's data, the answers equal to numpy's exact search to the last
bit on a table of whole numbers (every fp32 sum exact, whatever the order of the adds), batches of 1,
8 and 64 queries, both metrics; rows appended by writes while it runs found by the next query; a
bad request refused with its status; the heartbeat beside it never halted.  The simulated GPU runs
the same (tests/serve/test_knn.py).  Run on the device: `python3 -m pytest tests/gpu/test_knn_real.py -v -rA`.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from meshd_mps.backend import Backend
from meshd_mps.programs import Programs

from ..rigs.backend import example
from ..rigs.gpu import skip_without_real_gpu_and_mps
from ..rigs.serve import EXAMPLES

sys.path.insert(0, str(EXAMPLES / "knn"))
import knn_client as knn
import make_table

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(600)]
ROWS, DIM, SPARE = 200_000, 128, 16


@pytest.fixture(autouse=True)
def gpu_and_mps_here():
    skip_without_real_gpu_and_mps("the knn tests")


@pytest.mark.parametrize("isolation", ["blink", "mps"])
async def test_knn_answers_as_numpy_does(isolation, tmp):
    x = make_table.table(ROWS, DIM, "f16", seed=3, integers=True)
    path = os.path.join(tmp, "table.bin")
    make_table.write(path, x, spare=SPARE)
    rng = np.random.default_rng(4)
    async with await Backend.open(isolation=isolation, gpu="cuda", pool=1) as b:
        ps = Programs(b)
        await ps.load(*example("heartbeat"))
        info = b.info
        assert info is not None
        nodes = 2 * (info.sms_total - 1)  # two an SM, one SM left for the heartbeat beside it
        await ps.load(*example("knn"), nodes=nodes, data=path)
        blinks = b.status().get("blinks", 0)

        async def ask(q: np.ndarray, k: int, metric: str) -> knn.Answer:
            return knn.answer(await ps.call("knn", knn.request(q, k, metric), timeout=30))

        for nq in (1, 8, 64):
            q = rng.integers(-8, 9, size=(nq, DIM)).astype(np.float32)
            for metric in ("ip", "l2"):
                got, want = await ask(q, 10, metric), knn.search(x, q, 10, metric)
                assert got.rows == ROWS
                np.testing.assert_array_equal(got.ids, want.ids, err_msg=f"nq {nq}, {metric}")
                np.testing.assert_array_equal(got.scores, want.scores, err_msg=f"nq {nq}, {metric}")
        # k = 31 over a batch: the most its 262 blocks merge (nodes * k <= 8192)
        q = rng.integers(-8, 9, size=(4, DIM)).astype(np.float32)
        np.testing.assert_array_equal((await ask(q, 31, "ip")).ids, knn.search(x, q, 31).ids)
        # rows appended: found once the header counts them
        new = np.full((1, DIM), 7, np.float16)
        await ps.write("knn", knn.rows_offset(ROWS, DIM, "f16"), new.tobytes())
        await ps.write("knn", knn.ROWS_AT, (ROWS + 1).to_bytes(8, "little"))
        got = await ask(new.astype(np.float32), 1, "l2")
        assert got.rows == ROWS + 1 and got.ids[0, 0] == ROWS and got.scores[0, 0] == 0
        with pytest.raises(knn.Refused) as e:
            await ask(np.zeros((1, DIM), np.float32), 0, "ip")
        assert e.value.status == 3
        assert b.status().get("blinks", 0) == blinks  # a call or a write halts nobody
        # the steps' times, asked for: the same answer, and the GPU's four steps within the call's time
        q = rng.integers(-8, 9, size=(8, DIM)).astype(np.float32)
        got = knn.answer(await ps.call("knn", knn.request(q, 10, times=True), timeout=30))
        np.testing.assert_array_equal(got.ids, knn.search(x, q, 10).ids)
        assert got.times is not None and got.times.scan > 0 and sum(got.times) < 1e9, got.times


#: Every row width the scan takes a different way: 4, 8, 16 and 32 loads of 16 bytes a row (fp16 of 32
#: to 256 numbers, fp32 of 16 to 128), a row count that leaves every block's share uneven.
SHAPES = [("f16", 32), ("f16", 64), ("f16", 256), ("f32", 16), ("f32", 128)]


async def test_knn_answers_as_numpy_does_for_every_row_width(tmp):
    rng = np.random.default_rng(5)
    async with await Backend.open(isolation="mps", gpu="cuda", pool=1) as b:
        ps = Programs(b)
        info = b.info
        assert info is not None
        for dtype, dim in SHAPES:
            x = make_table.table(50_021, dim, dtype, seed=dim, integers=True)
            path = os.path.join(tmp, f"table-{dtype}-{dim}.bin")
            make_table.write(path, x)
            await ps.load(*example("knn"), nodes=2 * info.sms_total, data=path)
            try:
                for nq in (1, 7, min(64, knn.QCAP // dim)):  # as many numbers as a request takes
                    q = rng.integers(-8, 9, size=(nq, dim)).astype(np.float32)
                    for metric in ("ip", "l2"):
                        got = knn.answer(await ps.call("knn", knn.request(q, 10, metric), timeout=30))
                        want = knn.search(x, q, 10, metric)
                        np.testing.assert_array_equal(got.ids, want.ids, err_msg=f"{dtype} {dim}, nq {nq}, {metric}")
                        np.testing.assert_array_equal(got.scores, want.scores, err_msg=f"{dtype} {dim}, nq {nq}")
            finally:
                await ps.unload("knn")
