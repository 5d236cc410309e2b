"""``python -m meshd_mps.bench --gpu sim --quick --only versus``: row (v) on the simulated GPU, in a
module of its own so that the test runs beside test_bench.py's whole quick bench, not after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)


def test_versus_runs_every_contender_it_can_and_says_why_not_the_others(standin_on_path, tmp_path):
    """Row (v) on the simulated GPU (N = 100,000): knn resident in both modes in-process, and through
    an MPS daemon's socket (--quick takes one mode's), each answer numpy's, fp16 and fp32; where a
    call's time goes; the GPU's contenders (PyTorch, a launch per batch) and NVML skipped with their
    reason; nothing left."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "meshd_mps.bench", "--gpu", "sim", "--quick", "--json", str(out),
                        "--only", "versus"], capture_output=True, text=True, timeout=140, env=dict(os.environ))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    data = json.loads(out.read_text())
    rows = {x["name"]: x for x in data["rows"]}
    assert data["left_behind"] == [] and all(x["id"] == "v" and x["result"] != "ERROR" for x in rows.values()), r.stdout
    for mode in ("blink", "mps"):
        assert rows[f"versus: meshd-mps ({mode})'s answer is numpy's"]["result"] == "PASS"
        for nq in (1, 8, 64):
            for how in ("in-process", "through its socket") if mode == "mps" else ("in-process",):
                x = rows[f"versus: meshd-mps resident ({mode}, {how}), batch {nq}, p50"]
                assert isinstance(x["value"], float) and x["value"] > 0, x
    for who in ("PyTorch eager and its CUDA graph", "a launch per batch"):
        assert rows[f"versus: {who}"]["note"].startswith("skipped: the simulated GPU"), rows[f"versus: {who}"]
    # where a call's time goes: knn's own steps and the host's rest, within the call
    for name in ("versus: where a resident call's time goes (mps), batch 64",
                 "versus fp32: where a resident call's time goes (mps), batch 1"):
        x = rows[name]
        assert set(x["parts"]) == {"host", "read", "scan", "merge", "write"} and x["parts"]["scan"] > 0, x
        assert sum(x["parts"].values()) == pytest.approx(x["value"], rel=0.5), x
    # the fp32 table: answered as numpy does; NVML's idle cost said to be out of reach, with its reason
    assert rows["versus fp32: meshd-mps (mps)'s answer is numpy's"]["result"] == "PASS"
    assert rows["versus fp32: meshd-mps resident (mps, in-process), batch 64, p50"]["value"] > 0
    assert rows["versus: an idle resident knn's cost (mps)"]["note"].startswith("skipped: NvmlUnavailable"), rows
