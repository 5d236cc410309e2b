"""Each program's calls counted (meshd_mps/base/callstats.py): by outcome, their time in a histogram, their
bytes in and out, through the real load and call path on the simulated GPU; exposed in the metrics
(checked line by line) and in the API's program view; and what ``top`` reads from them from one look
to the next (serving/figures.py: rates, p50/p99 as Prometheus reads them, events)."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshd_mps.base.callstats import BUCKETS, OUTCOMES, CallStats, outcome, quantile
from meshd_mps.base.errors import CallTimeout, NotRunning, NotServing, PayloadTooLarge, RingFull
from meshd_mps.programs import Programs
from meshd_mps.serving.figures import Rates, changes
from meshd_mps.serving.metrics import Metrics

from ..rigs.backend import example, open_sim
from ..rigs.serve import parse_metrics

pytestmark = pytest.mark.timeout(60)


async def test_calls_are_counted_by_outcome_with_their_time_and_bytes():
    async with await open_sim("blink") as b:
        ps = Programs(b)
        try:
            echo = await ps.load(*example("echo"))
            hb = await ps.load(*example("heartbeat"))
            for n in (1, 10, 100):
                assert await ps.call("echo", b"x" * n) == b"x" * n
            assert await ps.call_many("echo", [b"ab"] * 8, window=4) == [b"ab"] * 8
            with pytest.raises(NotServing):  # heartbeat does not poll its ring: nothing posted, 0 bytes
                await ps.call("heartbeat", b"hello")
            with pytest.raises(PayloadTooLarge):  # past echo's max_request (its manifest's)
                await ps.call("echo", b"y" * (echo.manifest.layout.request_limit + 1))
            c = echo.calls
            assert c.outcomes["ok"] == 11 and c.outcomes["too_large"] == 1 and c.total == 12
            assert c.bytes_in == c.bytes_out == 111 + 16  # the refused request was never posted
            assert sum(c.counts) == 11 and 0 < c.seconds < 11 * 5.0
            assert hb.calls.outcomes["not_serving"] == 1 and hb.calls.bytes_in == 0
            await ps.upgrade("echo", *example("echo"))  # one object per program: its calls stay
            assert ps.get("echo").calls is c and c.outcomes["ok"] == 11

            view = ps.describe(echo)["calls"]
            assert view["total"] == 12 and view["outcomes"]["ok"] == 11 and view["bytes_in"] == 127
            assert len(view["counts"]) == len(BUCKETS) + 1 and sum(view["counts"]) == 11
            assert ps.describe(echo)["faults"] == 0 and ps.describe(echo)["data_bytes"] == 0

            m = parse_metrics(Metrics(b, ps, "test", time.monotonic()).exposition().decode())
            assert m['meshd_mps_program_calls_total{outcome="ok",program="echo"}'] == 11
            assert m['meshd_mps_program_calls_total{outcome="not_serving",program="heartbeat"}'] == 1
            assert {k for k in m if k.startswith("meshd_mps_program_calls_total{") and 'program="echo"' in k} == {
                f'meshd_mps_program_calls_total{{outcome="{o}",program="echo"}}' for o in OUTCOMES}
            assert m['meshd_mps_program_call_seconds_count{program="echo"}'] == 11
            assert m['meshd_mps_program_call_seconds_bucket{le="+Inf",program="echo"}'] == 11
            assert m['meshd_mps_program_call_seconds_sum{program="echo"}'] == pytest.approx(c.seconds)
            buckets = [m[f'meshd_mps_program_call_seconds_bucket{{le="{le}",program="echo"}}']
                       for le in ("5e-06", "0.0001", "0.001", "10.0")]
            assert buckets == sorted(buckets)  # cumulative
            assert m['meshd_mps_program_bytes_in_total{program="echo"}'] == 127
            assert m['meshd_mps_program_bytes_out_total{program="echo"}'] == 127
            assert m['meshd_mps_program_data_bytes{program="echo"}'] == 0
            assert m['meshd_mps_program_state{program="echo",state="running"}'] == 1
            assert m['meshd_mps_program_faults_total{program="heartbeat"}'] == 0
            assert m['meshd_mps_program_restarts{program="echo"}'] == 0
            share = m['meshd_mps_device_sm_share{device="0"}']
            assert 0 < share <= 1 and share == pytest.approx(ps.sm_share(0))
        finally:
            await ps.close()


def test_outcomes_are_read_from_the_error_type():
    assert outcome(CallTimeout("echo", 1.0)) == "timeout"
    assert outcome(NotRunning("x", program="echo", state="exited")) == "not_running"
    assert outcome(RingFull("full", program="echo", slot=0, ring=8, given_up=0)) == "ring_full"
    assert outcome(asyncio.CancelledError()) == "cancelled"
    assert outcome(ValueError("anything else")) == "error"
    s = CallStats()
    s.failed(ValueError(), 10, n=3)
    assert s.outcomes["error"] == 3 and s.bytes_in == 10 and sum(s.counts) == 0


def test_quantiles_are_read_as_prometheus_reads_a_histogram():
    counts = [0] * (len(BUCKETS) + 1)
    assert quantile(0.5, counts) is None
    i = BUCKETS.index(1e-4)
    counts[i] = 10  # ten calls in (50 us, 100 us]
    assert quantile(0.5, counts) == pytest.approx(75e-6)  # histogram_quantile's linear interpolation
    assert quantile(1.0, counts) == pytest.approx(1e-4)
    counts[-1] = 90  # past every bound: read as the last bound
    assert quantile(0.99, counts) == BUCKETS[-1]
    assert quantile(0.05, [4, 0, 0], (1.0, 2.0)) == pytest.approx(0.05)  # the first bucket from 0


def test_top_reads_rates_quantiles_and_events_from_one_look_to_the_next():
    def calls(total: int, counts_at: int, n: int, b: int) -> dict:
        counts = [0] * (len(BUCKETS) + 1)
        counts[counts_at] = n
        return {"total": total, "counts": counts, "bytes_in": b, "bytes_out": b}

    r = Rates(span=10)
    r.add({"echo": calls(0, 0, 0, 0)}, at=100.0)
    assert r.of("echo").rate is None  # one look: nothing to compare
    r.add({"echo": calls(50, 4, 50, 500), "hb": calls(0, 0, 0, 0)}, at=105.0)
    f = r.of("echo")
    assert f.rate == pytest.approx(10.0) and f.bytes_in == pytest.approx(100.0)
    assert BUCKETS[3] < f.p50 <= BUCKETS[4] and f.p99 <= BUCKETS[4]
    assert r.of("hb").rate is None and r.of("nobody").rate is None
    r.add({"echo": calls(3, 4, 3, 30)}, at=106.0)  # unloaded and loaded again: its counters started again
    assert r.of("echo").rate is None
    r.add({"echo": calls(13, 4, 13, 130)}, at=116.5)  # the window moved on: the looks at 106 and 116.5
    assert [t for t, _ in r.looks] == [106.0, 116.5] and r.of("echo").rate == pytest.approx(10 / 10.5)
    assert r.merged(["echo", "nobody"]).rate == pytest.approx(10 / 10.5)

    st = {"faults": [], "blinks": 0}
    was = {"echo": {"state": "running", "upgrades": 0, "restarts": 0, "faults": 0},
           "hb": {"state": "running", "upgrades": 0, "restarts": 0, "faults": 0}}
    now = {"echo": {"state": "running", "upgrades": 0, "restarts": 1, "faults": 1, "error": ""},
           "hb": {"state": "stalled", "upgrades": 0, "restarts": 0, "faults": 0, "error": "no heartbeat for 1.2s"},
           "spin": {"state": "running", "device": 0, "slot": 3}}
    fault = {"at": "2026-12-06T00:00:00+00:00", "gpu_wide": True, "faulted": "fault", "by": "own", "device": 0,
             "relaunched": ["echo"], "ms": 312.4}
    assert changes(None, st, None, now) == []  # the first look: nothing changed yet
    got = changes(st, {"faults": [fault], "blinks": 2, "last_blink_ms": 3.25}, was, now)
    assert got == ["loaded spin on GPU 0, slot 3 (running)", "echo failed: running", "echo relaunched (restart 1)",
                   "hb: running -> stalled (no heartbeat for 1.2s)",
                   "GPU fault on GPU 0: fault (own); relaunched echo in 312 ms",
                   "2 blinks: running programs halted and relaunched, the last 3.2 ms"]
    assert changes(st, st, now, {}) == ["unloaded echo", "unloaded hb", "unloaded spin"]
