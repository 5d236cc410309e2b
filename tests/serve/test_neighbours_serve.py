"""``serve`` names a process outside our server, end to end on the simulated
NVML: in status, in the metrics and once in the log, and again once it is gone."""

from __future__ import annotations

import json
import os

import pytest

from ..rigs.serve import Serve, env, parse_metrics
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("isolation", ["mps", "blink"])
def test_a_foreign_process_is_named_in_status_metrics_and_log(tmp, monkeypatch, isolation):
    view = os.path.join(tmp, "nvml.json")
    foreign = {"pid": 424242, "name": "python", "used_bytes": 1 << 30}
    with open(view, "w") as f:
        json.dump({"0": {"compute_mode": "default", "processes": [foreign]}}, f)
    e = env()
    e["MESHD_MPS_SIM_NVML"] = view
    monkeypatch.setattr("tests.rigs.serve.env", lambda: e)
    s = Serve(tmp, isolation, os.path.join(tmp, "s.sock"), *(["--pool", "1"] if isolation == "mps" else []))
    try:
        s.wait_ready()

        def seen():
            n = s.client.status().get("neighbours")
            return n if n and n[0]["foreign"] else None

        n = poll(seen, 30.0, "the foreign process in status")
        assert n[0]["device"] == 0 and n[0]["compute_mode"] == "default"
        assert [(p["pid"], p["name"], p["used_bytes"]) for p in n[0]["foreign"]] == [(424242, "python", 1 << 30)]
        assert parse_metrics(s.client.metrics())['meshd_mps_device_foreign_processes{device="0"}'] == 1
        with open(view, "w") as f:
            json.dump({"0": {"compute_mode": "default", "processes": []}}, f)
        poll(lambda: s.client.status()["neighbours"][0]["foreign"] == [], 30.0, "the foreign process gone")
        assert s.stop() == 0, s.log()[-4000:]
        msgs = [json.loads(line).get("msg", "") for line in s.log().splitlines() if line.startswith("{")]
        came = [m for m in msgs if "process 424242 (python) has a context" in m]
        went = [m for m in msgs if "process 424242 (python), which had a context" in m and m.endswith("is gone")]
        assert len(came) == 1 and len(went) == 1, msgs
    finally:
        s.kill()
