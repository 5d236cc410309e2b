"""``meshd-mps fleet bench`` runs end to end on a small cluster (2 nodes, 4 replicas): every row has
its figure and its baseline from the same run, none is an ERROR, and nothing of the cluster or the
node daemons is left.  The figures themselves are in docs/benchmarks.md (this machine's load makes
them meaningless here: never asserted)."""

from __future__ import annotations

import json
import os
from xml.etree import ElementTree

import pytest

pytest.importorskip("ray")

from ..rigs.fleet import reap_orphans
from ..rigs.serve import cli, leftovers
from ..rigs.waits import poll

BENCH_S = 300


@pytest.fixture(autouse=True)
def no_child_left():
    """Replaces conftest's check: (l2) kills a node's raylet, whose children this process (a
    subreaper) inherits when they exit; the test reaps them and checks instead that no process of the
    bench is left (its directory, meshd-fleet.*, is in every one's command line or environment)."""
    yield


def test_fleet_bench_smoke(tmp):
    out = f"{tmp}/fleet-bench.json"
    r = cli("fleet", "bench", "--nodes", "2", "--replicas", "4", "--calls", "20", "--json", out, "--plot", f"{tmp}/plots",
            timeout=BENCH_S)
    assert r.returncode == 0, r.stdout + r.stderr
    # --plot: (l3)'s call latencies beside their baselines, (l1) and (l2) beside theirs
    assert sorted(os.listdir(f"{tmp}/plots")) == ["fleet.svg", "latency.svg"]
    drawn = " ".join(ElementTree.parse(f"{tmp}/plots/latency.svg").getroot().itertext())
    assert all(s in drawn for s in ("fleet.call", "Ray async actor echo", "a node's socket")), drawn
    drawn = " ".join(ElementTree.parse(f"{tmp}/plots/fleet.svg").getroot().itertext())
    assert "(l1) 4 replicas placed and running" in drawn and "(l2) a node's 2 replicas running elsewhere" in drawn
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [x["id"] for x in rows] == ["l1", "l3", "l3", "l3", "l4", "l2"]
    for x in rows:
        assert not x["error"], x
        assert x["value"] > 0 and x["baseline"] > 0, x
    assert rows[0]["note"].startswith("placed n"), rows[0]
    assert rows[-1]["name"] == "a node's 2 replicas running elsewhere", rows[-1]
    assert rows[4]["note"].startswith("2 agent processes for 2 nodes, 1 controller"), rows[4]
    poll(lambda: (reap_orphans(), not leftovers(["meshd-fleet."]))[1], 30.0,
         lambda: f"no process of the bench's cluster or daemons left: {leftovers(['meshd-fleet.'])}")


def test_fleet_bench_refuses_too_few_nodes():
    r = cli("fleet", "bench", "--nodes", "1")
    assert r.returncode == 2
    assert r.stderr == "meshd-mps fleet bench: --nodes 1: too few\n"
