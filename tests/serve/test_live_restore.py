"""Live restore, end to end on the simulated GPU and the stand-in
MPS daemon: ``serve --live-restore`` leaves its programs running when it stops (SIGTERM) or dies
(SIGKILL), and the next ``serve`` with the same state dir adopts them: the same worker pids, the
heartbeat counted on (never reset, and beating while no daemon ran); what does not match the
desired state is halted, what is missing is loaded; a worker of another protocol version is
halted through the mailbox and told to QUIT; with no daemon back within ``--orphan-timeout`` the
workers halt their own kernels and exit, and a start without live restore ends what is left."""

from __future__ import annotations

import signal

import pytest

from ..cases.live_restore import adopt_case, blink_discard_case, orphan_case, reconcile_case

pytestmark = pytest.mark.timeout(150)


# Blink after a SIGTERM: test_in_blink_mode_a_halted_module_costs_one_blink_and_the_adopted_run_on.
@pytest.mark.parametrize("isolation, how", [("mps", signal.SIGTERM), ("mps", signal.SIGKILL), ("blink", signal.SIGKILL)])
def test_the_next_daemon_adopts_every_program_as_it_runs(tmp, isolation, how):
    adopt_case(tmp, isolation, how)


def test_with_no_daemon_back_the_workers_halt_their_kernels_and_exit(tmp):
    orphan_case(tmp)


def test_reconcile_adopts_what_matches_halts_what_does_not_and_loads_what_is_missing(tmp):
    reconcile_case(tmp)


def test_in_blink_mode_a_halted_module_costs_one_blink_and_the_adopted_run_on(tmp):
    blink_discard_case(tmp)
