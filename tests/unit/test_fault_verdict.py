"""faults.py without processes: evidence in, verdict out (the H200 cases of docs/reliability.md)."""

from __future__ import annotations

from meshd_mps.base import faults
from meshd_mps.base.faults import Stray, Suspect, name_culprit

ILLEGAL = "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"
TORN = "worker {}: exited while its kernel ran"


def running(name: str, pid: int, at: float = 0.0, **kw) -> Suspect:
    return Suspect(name, pid, failed_at=at, error=TORN.format(pid) if at else "", **kw)


def test_the_program_that_ran_to_its_end_and_failed_is_the_culprit_even_when_the_log_names_another():
    # H200: the server named an innocent one run in two; the STATE word does not lie.
    fault = Suspect("fault", 11, failed_at=1.00, ended=True, error=ILLEGAL, kernel_error=ILLEGAL)
    hb, echo = running("heartbeat", 12, 1.01), running("echo", 13, 1.02)
    v = name_culprit([fault, hb, echo], fault, fatal_pids=[12], strays=[], at=1.0, window=2.0)
    assert (v.culprit, v.pid, v.by, v.why) == ("fault", 11, "ended", ILLEGAL)
    assert [q.name for q in v.lost] == ["heartbeat", "echo"] and v.program is fault and v.stray is None


def test_a_worker_killed_from_outside_is_the_culprit_by_how_it_died():
    died = Suspect("echo", 21, failed_at=1.0, died=True, error="worker 21 exited while its kernel ran")
    hb = running("heartbeat", 22, 1.1)
    v = name_culprit([hb, died], hb, fatal_pids=[22], strays=[], at=1.1, window=2.0)
    assert (v.culprit, v.by, v.why) == ("echo", "died", "worker 21 exited while its kernel ran")


def test_a_stray_worker_in_a_loads_launch_makes_every_program_innocent():
    hb, echo = running("heartbeat", 31, 5.0), running("echo", 32, 5.0)
    stray = Stray(33, "victim", at=4.9)
    v = name_culprit([hb, echo], hb, fatal_pids=[], strays=[stray], at=5.0, window=2.0)
    assert (v.culprit, v.pid, v.by, v.program, v.stray) == ("victim", 33, "stray", None, stray)
    assert v.why == "worker 33 exited while its kernel ran" and {q.name for q in v.lost} == {"heartbeat", "echo"}


def test_a_stray_outside_the_window_is_not_taken():
    hb, echo = running("heartbeat", 31, 5.0), running("echo", 32, 5.1)
    v = name_culprit([hb, echo], hb, fatal_pids=[32], strays=[Stray(33, None, at=1.0)], at=5.0, window=2.0)
    assert (v.culprit, v.by) == ("echo", "server log")


def test_with_no_other_evidence_the_first_program_seen_failing_is_taken():
    a, b = running("a", 41, 2.5), running("b", 42, 2.1)
    v = name_culprit([a, b], a, fatal_pids=[], strays=[], at=2.5, window=2.0)
    assert (v.culprit, v.by) == ("b", "first failure")


def test_two_that_ended_is_not_evidence_and_the_log_decides():
    a = Suspect("a", 51, 1.0, ended=True, error=ILLEGAL, kernel_error=ILLEGAL)
    b = Suspect("b", 52, 1.0, ended=True, error=ILLEGAL)
    v = name_culprit([a, b], a, fatal_pids=[52], strays=[], at=1.0, window=2.0)
    assert (v.culprit, v.by) == ("b", "server log") and v.why == ILLEGAL  # the first failure's CUDA error


def test_the_fault_text_prefers_a_dead_workers_account_then_a_cuda_error():
    first = Suspect("x", 1, 1.0, error="worker 1 exited", kernel_error=ILLEGAL)
    assert faults.fault_text(Suspect("y", 2, died=True, error="worker 2 exited while its kernel ran"), first) == \
        "worker 2 exited while its kernel ran"
    assert faults.fault_text(Suspect("y", 2, error="worker 2 exited"), first) == ILLEGAL
    assert faults.fault_text(Suspect("y", 2), Suspect("x", 1)) == "fatal GPU error"
    # H200 (test_faults_real.py, while-running): echo's worker, killed from outside,
    # exited only after the recovery had taken echo over, so echo had no error of its own; the
    # innocent heartbeat's CUDA error is not the fault's text.
    assert faults.fault_text(Suspect("echo", 2, died=True), first) == "worker 2 exited while its kernel ran"
    assert faults.fault_text(Suspect("echo", 2, died=True, kernel_error="CUDA_ERROR_LAUNCH_FAILED"), first) == \
        "CUDA_ERROR_LAUNCH_FAILED"


def test_gpu_fault_or_own_failure():
    p = Suspect("p", 1, failed_at=10.0)
    near, far = Suspect("q", 2, failed_at=11.5), Suspect("r", 3, failed_at=13.0)
    assert faults.failed_together(p, [near, far, Suspect("s", 4)], window=2.0) == [near]
    assert faults.is_gpu_fault([], [near]) and faults.is_gpu_fault([7], [])
    assert not faults.is_gpu_fault([], faults.failed_together(p, [far], window=2.0))


def test_died_on_its_own():
    assert faults.died_on_its_own(-9, exited_running=False, ended_by_us=False)  # an outside SIGKILL
    assert not faults.died_on_its_own(-9, exited_running=False, ended_by_us=True)  # our retire's kill
    assert faults.died_on_its_own(0, exited_running=True, ended_by_us=False)  # exited with its kernel launched
    assert not faults.died_on_its_own(0, exited_running=False, ended_by_us=False)
    assert not faults.died_on_its_own(None, exited_running=False, ended_by_us=False)
