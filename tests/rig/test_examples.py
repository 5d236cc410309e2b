"""docs/api.md's example runs as written, on the simulated GPU, in both modes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("isolation", ["blink", "mps"])
def test_embed_example_runs(standin_on_path, isolation):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples/embed.py"), "--gpu", "sim", "--isolation", isolation],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "echo says: hello" in r.stdout
    assert "heartbeat ended: ok" in r.stdout
    assert "{" not in r.stdout  # logs went to stderr, not into the host's output
