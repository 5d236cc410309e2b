"""examples/knn on the simulated GPU, as a user runs it: its table made by make_table.py, loaded
with its data from the CLI, queried from Python and from the CLI (a request of any size through its
payload region), its answers equal to numpy's exact search to the last bit (whole numbers from -8
to 8: every fp32 sum is exact), rows appended by writes while it runs found by the next query, and
every bad request refused with its status.  One blink daemon for the module."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from meshd_mps.serving.client import ClientError

from ..rigs.serve import EXAMPLES, Serve, cli

sys.path.insert(0, str(EXAMPLES / "knn"))
import knn_client as knn
import make_table

pytestmark = pytest.mark.timeout(120)
ROWS, DIM, SPARE, NODES = 3000, 128, 8, 4


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="mknn-")
    s = Serve(d, "blink", os.path.join(d, "s.sock"))
    try:
        s.wait_ready()
        x = make_table.table(ROWS, DIM, "f16", seed=7, integers=True)
        path = os.path.join(d, "table.bin")
        make_table.write(path, x, spare=SPARE)
        r = cli("load", str(EXAMPLES / "knn"), "--data", path, "--nodes", str(NODES), "--socket", s.sock)
        assert r.returncode == 0, r.stderr
        yield s, x, d
    finally:
        s.kill()
        shutil.rmtree(d, ignore_errors=True)


def ask(s: Serve, queries: np.ndarray, k: int, metric: str = "ip") -> knn.Answer:
    return knn.answer(s.client.call_bytes("knn", knn.request(queries, k, metric)))


def test_answers_equal_numpys_exact_search(daemon):
    s, x, _ = daemon
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 9, size=(5, DIM)).astype(np.float32)
    for metric in ("ip", "l2"):
        for k in (1, 10):
            got, want = ask(s, q, k, metric), knn.search(x, q, k, metric)
            assert got.rows == ROWS
            np.testing.assert_array_equal(got.ids, want.ids)
            np.testing.assert_array_equal(got.scores, want.scores)
    # A query of a row's own numbers: that row at L2 distance 0, first.
    got = ask(s, x[42:43].astype(np.float32), 3, "l2")
    assert got.ids[0, 0] == 42 and got.scores[0, 0] == 0


def test_the_cli_carries_a_request_and_its_response_as_files(daemon):
    s, x, d = daemon
    q = x[:2].astype(np.float32)
    req, out = os.path.join(d, "q.bin"), os.path.join(d, "a.bin")
    with open(req, "wb") as f:
        f.write(knn.request(q, 10))  # 1040 bytes: through the payload region
    r = cli("call", "knn", "--in", req, "--out", out, "--socket", s.sock)
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as f:
        got = knn.answer(f.read())
    want = knn.search(x, q, 10)
    np.testing.assert_array_equal(got.ids, want.ids)


def test_rows_appended_while_it_runs_are_found_by_the_next_query(daemon):
    """The rows first, then the header's row count: until the count is written the rows are not
    searched; after it, the next query finds them."""
    s, x, _ = daemon
    new = np.stack([x[7] * 0 + 3, x[9] * 0 - 5]).astype(np.float16)  # rows no other row equals
    s.client.write("knn", knn.rows_offset(ROWS, DIM, "f16"), new.tobytes())
    q = new.astype(np.float32)
    assert ROWS not in ask(s, q[:1], 1, "l2").ids  # not counted yet
    s.client.write("knn", knn.ROWS_AT, (ROWS + 2).to_bytes(8, "little"))
    got = ask(s, q, 1, "l2")
    assert got.rows == ROWS + 2 and got.ids[:, 0].tolist() == [ROWS, ROWS + 1] and got.scores[:, 0].tolist() == [0, 0]
    s.client.write("knn", knn.ROWS_AT, ROWS.to_bytes(8, "little"))  # as it was, for the other tests


def test_a_request_that_asks_for_its_times_gets_the_same_answer_and_four_times(daemon):
    s, x, _ = daemon
    q = x[3:5].astype(np.float32)
    got = knn.answer(s.client.call_bytes("knn", knn.request(q, 10, times=True)))
    plain = knn.answer(s.client.call_bytes("knn", knn.request(q, 10)))
    np.testing.assert_array_equal(got.ids, plain.ids)
    np.testing.assert_array_equal(got.scores, plain.scores)
    assert plain.times is None and got.times is not None
    assert got.times.scan > 0 and all(t >= 0 for t in got.times), got.times


@pytest.mark.parametrize(("request_", "status"), [
    (knn.request(np.zeros((1, DIM)), 10)[:-4], 1),  # a query short of its numbers
    (knn.request(np.zeros((65, 64)), 10), 2),  # more queries than a request takes
    (knn.request(np.zeros((1, DIM)), 0), 3),  # k 0
    (knn.request(np.zeros((1, DIM)), 33), 3),  # k over 32
    (knn.request(np.zeros((1, DIM)), 10)[:8] + (7).to_bytes(4, "little") + bytes(4 + DIM * 4), 4),  # a metric 7
    (knn.request(np.zeros((1, DIM)), 10)[:12] + (2).to_bytes(4, "little") + bytes(DIM * 4), 7),  # a flag unknown
], ids=["size", "nq", "k0", "k33", "metric", "flag"])
def test_a_bad_request_is_refused_with_its_reason(daemon, request_, status):
    s, _x, _ = daemon
    with pytest.raises(knn.Refused) as e:
        knn.answer(s.client.call_bytes("knn", request_))
    assert e.value.status == status and knn.ERRORS[status] in str(e.value)


def test_a_request_over_its_most_is_refused_before_anything_is_posted(daemon):
    s, _x, _ = daemon
    with pytest.raises(ClientError) as e:
        s.client.call_bytes("knn", bytes(32785))
    assert e.value.status == 413 and "32784" in str(e.value), e.value
