"""Shared fixtures (the rigs themselves are in tests/rigs/): the stand-in MPS daemon on PATH, a rig
of daemon + supervisor + simulated workers (``mps_rig``), daemons of ``meshd-mps serve``, the check that no test
leaves a child process behind, and (``no_leaks``, used by every fault test) that none leaves an fd
or a temporary file."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Generator
from typing import Any

import pytest

from meshd_mps import standin
from meshd_mps.mps.control import become_subreaper
from meshd_mps.state.statedir import resolve_state_dir

from .rigs.deadlines import TEST_DEADLINES
from .rigs.mps import MpsRig
from .rigs.procs import Resources, children, describe, wait_gone
from .rigs.serve import Serve
from .rigs.sim import sim

# Kept here for the test modules that import them from conftest; their home is tests/rigs/.
__all__ = ["TEST_DEADLINES", "sim"]

# The control daemon is re-parented to us; tests reap it as meshd does.
become_subreaper()

# This session's own temporary directory (for us and, through TMPDIR, every process we start):
# the leak checks count the meshd* entries in it, and a second test run on the same machine
# (its own directory) can neither add to them nor be blamed for them.  Searchable by others
# (0711, not listable) so that the other-uid test's connection is refused by the socket's own
# mode and not by a directory on the way.  Short: AF_UNIX paths stop at 108 bytes.  Each
# pytest-xdist worker (a process started by the run's first, which sets TMPDIR to its own) makes
# its own beside the first's, not inside it: TMPDIR_BASE is the temporary directory before ours.
TMPDIR_BASE = os.environ.setdefault("MESHD_TESTS_TMPDIR_BASE", tempfile.gettempdir())
SESSION_TMP = tempfile.mkdtemp(prefix="meshd-tests.", dir=TMPDIR_BASE)
os.chmod(SESSION_TMP, 0o711)
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP
# meshd-mps serve keeps its desired state in $XDG_STATE_HOME/meshd-mps by default: never the user's own.
os.environ["XDG_STATE_HOME"] = os.path.join(SESSION_TMP, "xdg-state")
os.environ.pop("STATE_DIRECTORY", None)
atexit.register(shutil.rmtree, SESSION_TMP, ignore_errors=True)
# The examples' compiled images (gpu/examples.py) are kept in the user's cache directory: the run
# keeps its own, made by its first process, shared by its workers and every daemon they start (one
# compile for the run, not one per daemon), and removed at its end.
if "MESHD_TESTS_CACHE" not in os.environ:
    os.environ["MESHD_TESTS_CACHE"] = tempfile.mkdtemp(prefix="meshd-cache.", dir=TMPDIR_BASE)
    atexit.register(shutil.rmtree, os.environ["MESHD_TESTS_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["MESHD_TESTS_CACHE"]
#: Root's default state directories, which $XDG_STATE_HOME does not move (state/statedir.py, and
#: the fleet's checkpoint beside them): a daemon a test starts as root without --state-dir would
#: make them (CI runs as root), and a refused start leaves them made.  None may appear in a run.
ROOT_DEFAULTS = tuple(resolve_state_dir(None, {}, uid=0, gpu=g) + end for g in ("cuda", "sim") for end in ("", "-fleet"))
ROOT_DEFAULTS_BEFORE = {p for p in ROOT_DEFAULTS if os.path.lexists(p)}


@pytest.fixture(autouse=True)
def no_child_left():
    """After every test: no child process of ours, running or zombie (checked, not assumed)."""
    before = children()
    yield
    rigs = sys.modules.get(f"{__package__}.rigs.fleet")  # the shared cluster's, when one runs
    left = wait_gone(children() - before - (rigs.held() if rigs is not None else set()), within=5.0)
    assert not left, f"child processes left behind: {describe(left)}"


@pytest.fixture
def no_leaks():
    """Around a fault test: the same open fds (/proc/self/fd) and the same meshd* temporary
    entries after it as before.  Counted within the test: its backend and rig are closed when its
    body returns, and the event loop (set up after this, torn down before) is closed too."""
    before = Resources.now()
    yield
    leaked = Resources.now().leaks_since(before)
    assert not leaked, f"the test leaked: {leaked}"


@pytest.fixture
def tmp():
    """A short temporary directory, removed after the test: a daemon's socket and its MPS pipes live
    under it, and AF_UNIX paths stop at 108 bytes."""
    d = tempfile.mkdtemp(prefix="mt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def standin_on_path(monkeypatch):
    """The explicit stand-in for nvidia-cuda-mps-control, first on PATH (CI has no GPU)."""
    # This interpreter's bin next: the stand-in runs under the first python3 on PATH.
    path = [standin.BIN_DIR, os.path.dirname(sys.executable), os.environ.get("PATH", "")]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    return standin.BIN_DIR


@pytest.fixture
def mps_rig(standin_on_path):
    """Rig(...) as an async context manager: GPU 0's MpsIsolation, on a fresh stand-in daemon."""
    return lambda **kw: MpsRig(**kw)


@pytest.fixture
def serve(tmp):
    """serve(isolation, *extra, sock=None): a ``meshd-mps serve`` started in ``tmp`` (stopped after the test)."""
    started: list[Serve] = []

    def start(isolation: str, *extra: str, sock: str | None = None) -> Serve:
        s = Serve(tmp, isolation, sock or os.path.join(tmp, "s.sock"), *extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


#: The tests that take longest (seconds, one at a time on 2 loaded cores), by node id
#: prefix.  make test runs the suite on pytest-xdist workers that each take the next module when
#: they are free (``--dist loadscope``, in this order: ``OneClusterScope`` keeps it): these modules
#: go first, longest first, so that none of them starts last and is run alone at the end while the
#: other workers idle.  Only the order changes (a name that is no longer a test's does nothing).
#: The fleet modules on the shared clusters (``cluster_scope``) come before all of them.
LONGEST_FIRST = (
    "tests/serve/test_bench.py::test_bench_sim_quick",  # 77
    "tests/cluster/test_fleet_bench.py::test_fleet_bench_smoke",  # 27 (its own cluster of 2 nodes, one killed)
    "tests/serve/test_bench_versus.py::",  # 17 (knn in both modes, through a socket, and over fp32)
    "tests/rig/test_scripts.py::test_ring_probes_run",  # 33
    "tests/serve/test_prometheus.py::test_every_panel_and_alert_on_a_real_prometheus",  # 15 (two daemons and a Prometheus)
    "tests/serve/test_live_restore.py::test_reconcile_",  # 18
    "tests/serve/test_serve.py::test_serve_end_to_end",  # 13 + 8
    "tests/serve/test_top.py::",  # 10 (top in tmux, beside a daemon)
    "tests/rig/test_soak.py::",  # 13
    "tests/serve/test_restore.py::",  # 12 + 8 + 6
    "tests/serve/test_live_restore.py::",  # 11 + 11 + 11 + 10 + 4
    "tests/serve/test_devices.py::test_serve_devices_end_to_end",  # 7
    "tests/rig/test_restart.py::test_a_program_that_keeps_faulting_the_gpu_is_a_crash_loop",  # 7
    "tests/rig/test_workers.py::test_a_fault_stays_with_its_worker",  # 7 + 6 + 4 + ...
    "tests/serve/test_native_clients.py::",  # 7 + 3
    "tests/rig/test_limits.py::test_mps_programs_are_the_clients_less_the_pool",  # 7
    "tests/serve/test_neighbours_serve.py::",  # 6 + 5
    "tests/rig/test_lifecycle_races.py::",  # 6 + 4 + ...
    "tests/serve/test_config.py::test_serve_",  # 5 + 5
    "tests/serve/test_hard_deaths.py::",  # 5 + 4 + 3 + ...
    "tests/serve/test_readme_walk.py::",  # 10 + 10 (make serve, then the CLI, in both modes)
    "tests/serve/test_first_hour_cli.py::",  # three daemons in turn, and more
    "tests/serve/test_no_surprise_clients.py::",  # live restarts
    "tests/rig/test_recovery_speed.py::",  # faults in both modes
)

#: The cluster tests (tests/cluster/) run on a Ray cluster a module does not start for itself
#: (tests/rigs/fleet.py ``fleet_rig``): two xdist scopes, the first of all, each on a worker of its own
#: with its own cluster, side by side.  ``CLUSTER_LAST`` (it kills nodes and restarts the head) is
#: one; the other modules, which leave the cluster as they found it, share the other, one after
#: another.  One scope for all of them was one worker's ~190 s on 2 loaded cores: the whole run's
#: length.  Not the modules in ``OWN_CLUSTER``: the bench's smoke starts its own (``meshd-mps fleet
#: bench``); it is a scope of its own, run beside.  A module of no cluster left in a shared scope
#: ends the cluster before it (``pytest_runtest_teardown``): the next module starts another, ~18 s
#: more (test_suite_order.py checks every module's place).
SHARED_CLUSTER = "tests/cluster/"
CLUSTER_LAST = "tests/cluster/test_fleet_failover.py::"
OWN_CLUSTER = ("tests/cluster/test_fleet_bench.py::",)


def shares_cluster(nodeid: str) -> bool:
    return nodeid.startswith(SHARED_CLUSTER) and not nodeid.startswith(OWN_CLUSTER)


def cluster_scope(nodeid: str) -> str | None:
    """The xdist scope of a test on a cluster shared by modules (None: it is not on one)."""
    if not shares_cluster(nodeid):
        return None
    return CLUSTER_LAST if nodeid.startswith(CLUSTER_LAST) else SHARED_CLUSTER


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared cluster's modules first (``CLUSTER_LAST`` last of them), then LONGEST_FIRST's
    tests in its order, then the others by module file name (a module's own tests, and the shared
    cluster's, in the order collected)."""

    def rank(item: pytest.Item) -> tuple[int, bool, bool, str]:
        # Past the shared cluster's, by the module's file name (tests/gpu/ first) within a rank, as
        # when every module was in tests/ itself: the folders by level change no module's place.
        module = item.nodeid.split("::")[0]
        by_name = (not module.startswith("tests/gpu/"), module.rsplit("/", 1)[-1])
        if shares_cluster(item.nodeid):
            return (-1, item.nodeid.startswith(CLUSTER_LAST), False, "")
        return (next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST)), False,
                *by_name)

    items.sort(key=rank)  # stable: a module's tests keep the order collected


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with the fleet modules on a shared cluster as two scopes."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneClusterScope(LoadScopeScheduling):
        """A module is a scope, as in loadscope, but the modules sharing a cluster are one; the scopes
        go out in the order collected (LONGEST_FIRST's), not xdist's largest-first."""

        def _split_scope(self, nodeid: str) -> str:
            return cluster_scope(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False  # read by the scheduler's first schedule(), ours alone
    return OneClusterScope(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the last test on the shared cluster (the next one on this worker is not on it), the
    cluster closed: not left idle, its Ray processes and daemons gone before the other tests."""
    yield
    rigs = sys.modules.get(f"{__package__}.rigs.fleet")  # imported by the modules that use it: Ray is optional
    if rigs is not None and rigs.uses_shared(item) and not rigs.uses_shared(nextitem):
        rigs.close_shared()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per reason a test was skipped, with the count and the folders (``-rs`` repeats a long
    reason for every test: the GPU tests' "no NVIDIA driver" forty times over)."""
    by: dict[str, tuple[int, set[str]]] = {}
    for r in terminalreporter.stats.get("skipped", []):
        path, _line, reason = r.longrepr if isinstance(r.longrepr, tuple) else ("?", 0, str(r.longrepr))
        reason = reason.removeprefix("Skipped: ")
        n, where = by.get(reason, (0, set()))
        by[reason] = (n + 1, where | {os.path.dirname(os.path.relpath(path)) or "."})
    if by:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, (n, where) in sorted(by.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.line(f"{n} skipped ({', '.join(sorted(where))}): {reason}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session cut short (-x, Ctrl-C) leaves no cluster running either.  And no state directory
    of root's defaults that was not there before it (``ROOT_DEFAULTS``): one found is a failure of
    the run, named, and removed."""
    rigs = sys.modules.get(f"{__package__}.rigs.fleet")
    if rigs is not None:
        rigs.close_shared()
    made = [p for p in ROOT_DEFAULTS if os.path.lexists(p) and p not in ROOT_DEFAULTS_BEFORE]
    if made and not hasattr(session.config, "workerinput"):  # once, in the run's first process
        sys.stderr.write(f"\nthe run made root's default state directories (a serve without --state-dir): {made}\n")
        for p in made:
            shutil.rmtree(p, ignore_errors=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
