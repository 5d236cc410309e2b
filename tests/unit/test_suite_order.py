"""The suite's own order (tests/conftest.py): the cluster tests' modules that share a Ray cluster
run as two xdist scopes, the failover tests (they kill nodes and restart the head) one and the
others the other, before every other test; a module with its own cluster, or none, is a scope of
its own; the rest by module file name, whatever their folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ..conftest import cluster_scope, pytest_collection_modifyitems, shares_cluster

TESTS = Path(__file__).resolve().parents[1]


def test_the_fleet_modules_on_a_shared_cluster_are_two_scopes_the_failover_tests_one():
    on_it = ["tests/cluster/test_fleet.py::test_a", "tests/cluster/test_fleet_failover.py::test_b",
             "tests/cluster/test_fleet_ops.py::test_c"]
    assert all(shares_cluster(n) for n in on_it)
    assert cluster_scope(on_it[0]) == cluster_scope(on_it[2]) != cluster_scope(on_it[1])
    assert None not in {cluster_scope(n) for n in on_it}
    for own in ("tests/cluster/test_fleet_bench.py::test_fleet_bench_smoke", "tests/rig/test_fleet_api.py::test_x",
                "tests/serve/test_fleet_cli.py::test_y", "tests/serve/test_serve.py::test_fleet"):
        assert not shares_cluster(own) and cluster_scope(own) is None, own


def test_the_shared_clusters_tests_go_first_and_the_failover_tests_last_of_them():
    ids = ["tests/serve/test_api_input.py::test_a", "tests/cluster/test_fleet_failover.py::test_lost",
           "tests/cluster/test_fleet.py::test_x", "tests/serve/test_bench.py::test_bench_sim_quick",
           "tests/cluster/test_fleet_ops.py::test_y", "tests/cluster/test_fleet.py::test_z",
           "tests/cluster/test_fleet_failover.py::test_head"]
    items = [SimpleNamespace(nodeid=n) for n in ids]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/cluster/test_fleet.py::test_x", "tests/cluster/test_fleet_ops.py::test_y",
        "tests/cluster/test_fleet.py::test_z", "tests/cluster/test_fleet_failover.py::test_lost",
        "tests/cluster/test_fleet_failover.py::test_head", "tests/serve/test_bench.py::test_bench_sim_quick",
        "tests/serve/test_api_input.py::test_a"]


def test_the_rest_go_by_module_name_whatever_their_folder():
    """The folders by level change no module's place in the run: the modules after LONGEST_FIRST's
    go by file name (tests/gpu/ first), as when they were all in tests/, each one's tests together."""
    ids = ["tests/unit/test_wire.py::test_a", "tests/gpu/test_x_real.py::test_b", "tests/rig/test_ask_more.py::test_c",
           "tests/serve/test_api_input.py::test_d", "tests/unit/test_ask.py::test_e", "tests/unit/test_wire.py::test_f"]
    items = [SimpleNamespace(nodeid=n) for n in ids]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/gpu/test_x_real.py::test_b", "tests/serve/test_api_input.py::test_d", "tests/unit/test_ask.py::test_e",
        "tests/rig/test_ask_more.py::test_c", "tests/unit/test_wire.py::test_a", "tests/unit/test_wire.py::test_f"]


def test_every_module_in_a_shared_scope_uses_the_shared_cluster():
    """A module in a shared cluster's scope that does not use the cluster ends it for the modules
    after it (the cluster is closed after the last test that uses it before another), so that the
    next one starts it again; a module that uses it outside the scopes would start one of its own."""
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue  # names the fixture, uses no cluster
        uses = "shared.fleet_rig" in path.read_text()
        rel = path.relative_to(TESTS.parent).as_posix()
        assert shares_cluster(f"{rel}::test_x") == uses, \
            f"{rel}: {'uses' if uses else 'does not use'} the shared cluster (tests/conftest.py OWN_CLUSTER)"
