"""``python -m meshd_mps.bench [--gpu cuda|sim] [--quick] [--json FILE] [--mps-dir DIR] [--cpu N|auto|off]``: one table.

Every figure stands beside a baseline measured in the same run, with the
ratio, the target and PASS / MISS ("-": a figure without a target, shown
for comparison).  The examples are compiled from CUDA C here (NVRTC, then
the backend's nvJitLink); nothing ships as PTX.  Rows, a module
each, whose docstring says what its figures and baselines are:

(a) stall.py, (b) ask.py, (c) done.py, (d) pool.py, (e) load.py, (f) ring.py
(its floor: floor.py), (g) idle.py, (h) limits.py, (i) recovery.py, (j) and
(k) restart.py.

What they share, lower in the package: measure.py (percentiles, bounded
waits, timed repetitions), rig.py (``Bench``: backends, examples, pooled
workers, CPU placement), clients.py (bare clients, the baselines of (d) and
(i)), report.py (``Row``, the header, the table), children.py (the bench's
own child processes).  Above the rows: runner.py (the sections in order) and
cli.py (``main``).  Imports point down that order; none comes back here.

The names scripts and tests use stay importable from ``meshd_mps.bench``.
"""

from __future__ import annotations

from meshd_mps.bench.ask import ANSWER_CHILD, ECHO_CHILD, answering_child, ask_only, raw_pipe, sec_ask
from meshd_mps.bench.cli import main
from meshd_mps.bench.floor import FLOOR_CU, FLOOR_CUDA, FLOOR_HOST, FLOOR_SIM, SWEEP, place_ring, ring_floor
from meshd_mps.bench.measure import ROUNDS, beat, launch_sync, median, pct, spin, timed, until
from meshd_mps.bench.report import Row, header, table
from meshd_mps.bench.rig import EXAMPLES, Bench, echo_loaded, mps_gpu, retire_idle, returning_worker
from meshd_mps.bench.ring import spun_round_trips, throughput
from meshd_mps.bench.runner import SECTIONS, run_all, run_bench

__all__ = [
    "ANSWER_CHILD", "ECHO_CHILD", "EXAMPLES", "FLOOR_CU", "FLOOR_CUDA", "FLOOR_HOST", "FLOOR_SIM", "ROUNDS", "SECTIONS",
    "SWEEP", "Bench", "Row", "answering_child", "ask_only", "beat", "echo_loaded", "header", "launch_sync", "main", "median",
    "mps_gpu", "pct", "place_ring", "raw_pipe", "retire_idle", "returning_worker", "ring_floor", "run_all", "run_bench",
    "sec_ask", "spin", "spun_round_trips", "table", "throughput", "timed", "until",
]
