"""What an operator sees, on the REAL GPU: ``serve --metrics-address`` serves /metrics over TCP with the
GPU's memory from NVML, the part of its resident blocks a program holds, and each call counted
(outcome, latency histogram, bytes); ``meshd-mps top --once`` draws the GPU by its name with its
memory in use; and the ring's fast path with the counting on and off
(``scripts/call_metrics_cost.py --gpu cuda``, its figures printed for docs/benchmarks.md).

Skipped, with the reason printed, where there is no NVIDIA driver or no NVIDIA MPS control (CI).
Run on the device: `python3 -m pytest tests/gpu/test_see_real.py -v -rA -s` (Rich installed: the
``top`` extra, else the top test skips saying so).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import pytest

from meshd_mps.serving.client import program_body

from ..rigs.gpu import mps_processes
from ..rigs.serve import EXAMPLES, REPO, Serve, cli, env, parse_metrics
from ..rigs.waits import poll

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(300)]


def test_metrics_over_tcp_with_the_gpus_memory_and_each_call(real_gpu_and_mps, tmp):
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1", "--metrics-address", "127.0.0.1:0", gpu="cuda")
    try:
        status = s.wait_ready()
        where = status["metrics_address"]
        assert re.fullmatch(r"127\.0\.0\.1:\d+", where), status
        s.client.load(program_body(str(EXAMPLES / "echo")))
        for _ in range(10):
            assert s.client.call("echo", "x" * 64)["data"] == "x" * 64

        def scraped() -> dict[str, float] | None:
            with urllib.request.urlopen(f"http://{where}/metrics", timeout=10) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                m = parse_metrics(r.read().decode())
            return m if 'meshd_mps_device_memory_total_bytes{device="0"}' in m else None  # NVML's first look

        m = poll(scraped, 30.0, "the GPU's memory in the metrics (NVML looks every 2 s)", every=0.5)
        total, used = m['meshd_mps_device_memory_total_bytes{device="0"}'], m['meshd_mps_device_memory_used_bytes{device="0"}']
        print(f"GPU 0 memory: {used / 2**30:.2f} of {total / 2**30:.1f} GiB in use", file=sys.stderr)
        assert total > 8 * 2**30 and 0 < used < total  # our MPS server and its client hold some
        assert 0 < m['meshd_mps_device_sm_share{device="0"}'] <= 1
        assert m['meshd_mps_program_calls_total{outcome="ok",program="echo"}'] == 10
        assert m['meshd_mps_program_call_seconds_count{program="echo"}'] == 10
        assert m['meshd_mps_program_bytes_in_total{program="echo"}'] == 640
        fast = m['meshd_mps_program_call_seconds_bucket{le="0.005",program="echo"}']
        assert fast >= 9, "the ring's round trips (not the HTTP around them) within 5 ms"
        dev = s.client.status()["devices"][0]
        assert dev["memory_total"] == total and dev["sm_share"] > 0, dev
        assert s.stop() == 0
    finally:
        s.kill()
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")


def test_top_once_draws_the_gpu_by_its_name(real_gpu_and_mps, tmp):
    pytest.importorskip("rich", reason="the top extra (pip install 'meshd-mps[top]') is not installed")
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1", gpu="cuda")
    try:
        name = s.wait_ready()["device"]
        s.client.load(program_body(str(EXAMPLES / "heartbeat")))
        poll(lambda: (s.client.status()["devices"][0]["memory_total"] or 0) > 0, 30.0, "NVML's first look")
        r = cli("top", "--once", "--socket", s.sock)
        print(r.stdout, file=sys.stderr)
        assert r.returncode == 0, r.stderr
        assert "heartbeat" in r.stdout and "running" in r.stdout and name.split()[-1] in r.stdout, r.stdout
        assert re.search(r"\d+(\.\d)?[MG]/\d+(\.\d)?G \(\d+%\)", r.stdout), r.stdout  # MEMORY: used/total (%)
        assert s.stop() == 0
    finally:
        s.kill()
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")


def test_counting_calls_costs_the_ring_nothing_measurable(real_gpu_and_mps):
    """Row (f)'s figures with the counting on and off in turns (the script docs/benchmarks.md
    cites); printed for the record, and the counting alone well under a microsecond."""
    e = {**env(), "PATH": os.environ.get("PATH", "")}  # NVIDIA's MPS control, not the stand-in
    r = subprocess.run([sys.executable, "scripts/call_metrics_cost.py", "--gpu", "cuda", "--rounds", "6"],
                       capture_output=True, text=True, env=e, cwd=REPO, timeout=280)
    print(r.stdout, file=sys.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = float(re.search(r"CallStats.answered alone: ([\d.]+) us", r.stdout)[1])  # type: ignore[index]
    assert alone < 1.0, r.stdout
    assert re.search(r"^median  : p50 on [\d.]+ off [\d.]+ ", r.stdout, re.M), r.stdout
    poll(lambda: mps_processes() == [], 30.0, f"no MPS process left: {mps_processes()}")
