"""``meshd-mps fleet bench`` runs end to end on a small cluster (2 nodes, 4 replicas): every row has
its figure and its baseline from the same run, none is an ERROR, and nothing of the cluster or the
node daemons is left.  The figures themselves are in docs/benchmarks.md (this machine's load makes
them meaningless here: never asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from .rigs.serve import cli, leftovers

BENCH_S = 300


def test_fleet_bench_smoke(tmp):
    out = f"{tmp}/fleet-bench.json"
    r = cli("fleet", "bench", "--nodes", "2", "--replicas", "4", "--calls", "20", "--json", out, timeout=BENCH_S)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [x["id"] for x in rows] == ["l1", "l3", "l3", "l4", "l2"]
    for x in rows:
        assert not x["error"], x
        assert x["value"] > 0 and x["baseline"] > 0, x
    assert rows[0]["note"].startswith("placed n"), rows[0]
    assert rows[-1]["name"] == "a node's 2 replicas running elsewhere", rows[-1]
    assert not leftovers(["meshd-fleet."]), "a node daemon or worker of the bench left running"


def test_fleet_bench_refuses_too_few_nodes():
    r = cli("fleet", "bench", "--nodes", "1")
    assert r.returncode == 2
    assert r.stderr == "meshd-mps fleet bench: --nodes 1: too few\n"
