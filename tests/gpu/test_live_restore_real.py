"""Live restore on the H200 with NVIDIA's MPS control daemon: the sim's cases
(tests/cases/live_restore.py) run on the real GPU.  What only the GPU can say: that the control
daemon and its server are adopted by their pid file and pidfd, that adopted workers are still
clients of that server, and that no adoption, halt or orphan timeout faults the GPU (a client
exiting with its kernel running would)."""

from __future__ import annotations

import signal

import pytest

from ..cases.live_restore import adopt_case, blink_discard_case, orphan_case, reconcile_case

pytestmark = [pytest.mark.gpu, pytest.mark.mps, pytest.mark.timeout(180), pytest.mark.usefixtures("real_gpu_and_mps")]


@pytest.mark.parametrize("isolation, how", [("mps", signal.SIGTERM), ("mps", signal.SIGKILL), ("blink", signal.SIGKILL)])
def test_the_next_daemon_adopts_every_program_as_it_runs(tmp, isolation, how):
    adopt_case(tmp, isolation, how, gpu="cuda")


def test_with_no_daemon_back_the_workers_halt_their_kernels_and_exit(tmp):
    orphan_case(tmp, gpu="cuda")


def test_reconcile_adopts_what_matches_halts_what_does_not_and_loads_what_is_missing(tmp):
    reconcile_case(tmp, gpu="cuda")


def test_in_blink_mode_a_halted_module_costs_one_blink_and_the_adopted_run_on(tmp):
    blink_discard_case(tmp, gpu="cuda")
