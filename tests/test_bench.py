"""``python -m meshd_mps.bench --gpu sim --quick``: every row (a)-(h) with a figure and its
baseline, no ERROR row, and nothing left running afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.timeout(150)


def _procs_mentioning(text: str) -> list[str]:
    """Processes whose command line or environment contains ``text`` (ours are readable)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        for what in ("cmdline", "environ"):
            try:
                with open(f"/proc/{d}/{what}", "rb") as f:
                    if text.encode() in f.read():
                        found.append(f"{d} ({what})")
            except OSError:
                pass
    return found


def test_bench_sim_quick(standin_on_path, tmp_path):
    mps_dir = tempfile.mkdtemp(prefix="mb-")  # short: MPS's sockets live under it (AF_UNIX: 108 bytes)
    out = tmp_path / "bench.json"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "meshd_mps.bench", "--gpu", "sim", "--quick", "--json", str(out), "--mps-dir", mps_dir],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
        data = json.loads(out.read_text())
        rows = data["rows"]
        assert not [x for x in rows if x["result"] == "ERROR"], r.stdout
        assert data["left_behind"] == []
        for rid in "abcdefghij":
            mine = [x for x in rows if x["id"] == rid]
            assert mine, f"no row ({rid})\n{r.stdout}"
            for x in mine:
                assert isinstance(x["value"], (int, float)) and isinstance(x["baseline"], (int, float)), x
                assert x["result"] in ("PASS", "MISS", "-"), x
            assert f"({rid})" in r.stdout
        for x in rows:
            if x["target"] != "-":
                assert x["result"] in ("PASS", "MISS"), x
        header = data["header"]
        for k in ("date", "device", "driver", "cuda-bindings", "nvjitlink", "python", "command"):
            assert header.get(k), k
        assert "simulated" in header["device"]
        assert sorted(os.listdir(mps_dir)) == [], "the bench left its daemons' directories"
        assert not _procs_mentioning(mps_dir), f"processes of the bench still there: {_procs_mentioning(mps_dir)}"
    finally:
        shutil.rmtree(mps_dir, ignore_errors=True)
