"""The suite's own order (tests/conftest.py): the fleet modules that share a Ray cluster run as
two xdist scopes, the failover tests (they kill nodes and restart the head) one and the others
the other, before every other test; a fleet module with its own cluster, or none, is a scope of
its own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from .conftest import cluster_scope, pytest_collection_modifyitems, shares_cluster

HERE = Path(__file__).resolve().parent


def test_the_fleet_modules_on_a_shared_cluster_are_two_scopes_the_failover_tests_one():
    on_it = ["tests/test_fleet.py::test_a", "tests/test_fleet_failover.py::test_b", "tests/test_fleet_ops.py::test_c"]
    assert all(shares_cluster(n) for n in on_it)
    assert cluster_scope(on_it[0]) == cluster_scope(on_it[2]) != cluster_scope(on_it[1])
    assert None not in {cluster_scope(n) for n in on_it}
    for own in ("tests/test_fleet_bench.py::test_fleet_bench_smoke", "tests/test_fleet_api.py::test_x",
                "tests/test_fleet_cli.py::test_y", "tests/test_serve.py::test_fleet"):
        assert not shares_cluster(own) and cluster_scope(own) is None, own


def test_the_shared_clusters_tests_go_first_and_the_failover_tests_last_of_them():
    ids = ["tests/test_api_input.py::test_a", "tests/test_fleet_failover.py::test_lost", "tests/test_fleet.py::test_x",
           "tests/test_bench.py::test_bench_sim_quick", "tests/test_fleet_ops.py::test_y", "tests/test_fleet.py::test_z",
           "tests/test_fleet_failover.py::test_head"]
    items = [SimpleNamespace(nodeid=n) for n in ids]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/test_fleet.py::test_x", "tests/test_fleet_ops.py::test_y", "tests/test_fleet.py::test_z",
        "tests/test_fleet_failover.py::test_lost", "tests/test_fleet_failover.py::test_head",
        "tests/test_bench.py::test_bench_sim_quick", "tests/test_api_input.py::test_a"]


def test_every_fleet_module_in_a_shared_scope_uses_the_shared_cluster():
    """A module in a shared cluster's scope that does not use the cluster ends it for the modules
    after it (the cluster is closed after the last test that uses it before another), so that the
    next one starts it again; a module that uses it outside the scopes would start one of its own."""
    for path in sorted(HERE.glob("test_fleet*.py")):
        uses = "shared.fleet_rig" in path.read_text()
        assert shares_cluster(f"tests/{path.name}::test_x") == uses, \
            f"{path.name}: {'uses' if uses else 'does not use'} the shared cluster (tests/conftest.py OWN_CLUSTER)"
