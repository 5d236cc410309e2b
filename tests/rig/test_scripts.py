"""The measurement scripts that docs/benchmarks.md cites run, on the simulated GPU and the stand-in
MPS daemon: a figure in the docs is only worth its command if the command still runs.  (Their
figures mean nothing here; each run is checked for the table it prints.)  Both had rotted before
this test: ask_breakdown's worker when the frame pipes moved (workers/pipes.py), ask-cpu when
bench.place_ring changed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from ..rigs.serve import REPO as ROOT

#: ring_probes.py's probes (ring-ab, ~15 s here, is left out) and a line each prints per round.
PROBES = {
    "ask": r"^as-is +p50 +\d+ p90 +\d+ p99 +\d+ us; per ask user",
    "ask-cpu": r"^alone +p50 +\d+ p90 +\d+ p99 +\d+ us; per ask user",
    "hold": r"^0 a yield every 100 us: 1 outstanding +\d+ k/s, 8 +\d+ k/s",
    "modes": r"^0 floor 64 B [\d.]+/[\d.]+ \| echo's host spin, 64 B: MPS worker",
    "mps-floor": r"^0 floor, a plain context: 0 B [\d.]+/[\d.]+",
}


def run(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stdout


def test_ring_probes_run(standin_on_path):
    """Every probe but ring-ab, in one process (one interpreter's start, not five), on uvloop (CI installs it)."""
    out = run("scripts/ring_probes.py", *PROBES, "--gpu", "sim", "--loop", "uvloop")
    assert re.search(r"^loop: uvloop ", out, re.M), out[:2000]
    parts = dict(re.findall(r"^== (\S+)\n(.*?)(?=^== |\Z)", out, re.M | re.S))
    assert sorted(parts) == sorted(PROBES), out[-2000:]
    for probe, line in PROBES.items():
        assert re.search(line, parts[probe], re.M), (probe, parts[probe][-2000:])


def test_ask_breakdown_worker_runs():
    """WorkerProc.ask to a real worker process on its frame pipes (the bench's row (b), split)."""
    out = run("scripts/ask_breakdown.py", "--gpu", "sim", "--only", "worker", "-n", "50")
    assert re.search(r"^worker p50 [\d.]+ us p99 [\d.]+ us$", out, re.M), out


def test_knn_variants_says_why_a_source_cannot_run_here():
    """scripts/knn_variants.py needs CUDA: without it, each source's line says why, and the rest run."""
    out = run("scripts/knn_variants.py", "--rows", "1000", "--reps", "2", "examples/knn/knn.cu")
    assert out.startswith("N 1000, D 128, k 10, 2 launches a batch"), out
    for dtype in ("f16", "f32"):
        assert re.search(rf"^{dtype} examples/knn/knn.cu: \w+(Error|NotFound\w*): ", out, re.M), out


def test_knn_variants_resident_splits_each_call(tmp_path):
    """--resident loads each source as meshd-mps runs knn and splits its calls; on the simulated GPU,
    knn's own source runs (the simulation knows its cubin) and another is refused, saying why (a
    source of a few lines: its compile is the test's cheapest)."""
    other = tmp_path / "variant.cu"
    other.write_text('#include "mesh_program.h"\nMESH_DEFINE_RT_ABI();\nMESH_DEFINE_SCRATCH();\nMESH_DEFINE_DATA();\n'
                     'extern "C" __global__ void mesh_main(unsigned long long mailbox, unsigned int slot) {}\n')
    out = run("scripts/knn_variants.py", "--resident", "--gpu", "sim", "--mode", "blink", "--rows", "500", "--reps", "2",
              "--dtype", "f16", "examples/knn/knn.cu", str(other))
    assert out.startswith("N 500, D 128, k 10, resident (blink, sim), 2 calls a batch"), out
    for nq in (1, 8, 64):
        assert re.search(rf"^f16 examples/knn/knn.cu batch {nq}: call [\d.]+, read [\d.]+, scan [\d.]+, merge [\d.]+, "
                         r"write [\d.]+, host -?[\d.]+; numpy's answer: yes$", out, re.M), out
    assert re.search(rf"^f16 {re.escape(str(other))}: ImageRefused: .*not one of the shipped examples", out, re.M), out
