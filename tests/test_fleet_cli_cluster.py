"""``meshd-mps fleet`` against a real Ray cluster (tests/rigs/fleet.py: a head and 2 nodes on this
machine, each with its own ``meshd-mps serve --gpu sim`` daemon): the round trip a user makes, each
command a process of its own, as from a shell (deploy, status, call, remove), its output checked
against what each node's daemon runs (``meshd-mps ps`` there)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray")

from meshd_mps.fleet.spec import replica_name

from .rigs.fleet import FleetRig
from .rigs.serve import EXAMPLES, REPO, cli, env

#: Each command connects to the cluster and leaves it: a few seconds of Ray's start each.
CLI_S = 120


@pytest.fixture(scope="module")
def rig():
    r = FleetRig(nodes=2, slots=2)
    try:
        yield r
    finally:
        r.close()


def fleet(rig: FleetRig, *args: str):
    return cli("fleet", *args, "--address", rig.cluster.address, timeout=CLI_S)


def test_deploy_status_call_remove(rig):
    r = fleet(rig, "deploy", str(EXAMPLES / "echo"), "--replicas", "2", "--strategy", "STRICT_SPREAD", "--wait")
    assert r.returncode == 0, r
    assert r.stdout == "echo deployed: 2 replicas, STRICT_SPREAD, every one running\n"

    r = fleet(rig, "status", "echo", "--json")
    assert r.returncode == 0, r
    (prog,) = json.loads(r.stdout)["programs"]
    reps = sorted(prog["replicas"], key=lambda x: x["index"])
    assert [x["state"] for x in reps] == ["running", "running"]
    by_name = {n.name: n for n in rig.nodes.values()}
    assert {x["node_name"] for x in reps} == set(by_name), "STRICT_SPREAD: one replica on each node"
    for x in reps:  # what the fleet says is what each node's daemon runs
        ps = by_name[x["node_name"]].ps()
        assert ps[replica_name("echo", x["index"])]["pid"] == x["pid"]
        assert ps[replica_name("echo", x["index"])]["slot"] == x["slot"]

    r = fleet(rig, "status")
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PROGRAM", "REPLICA", "NODE", "GPU", "SLOT", "STATE", "BEAT-AGE", "REASON"]
    rows = sorted(line.split()[:6] for line in lines[1:])
    assert rows == sorted(["echo", str(x["index"]), x["node_name"], str(x["gpu"]), str(x["slot"]), "running"]
                          for x in reps)

    r = fleet(rig, "call", "echo", "hello fleet")
    assert r.returncode == 0, r
    assert r.stdout == "hello fleet\n"
    assert r.stderr.startswith("# echo[") and " on node n" in r.stderr, r.stderr

    r = fleet(rig, "remove", "echo")
    assert r.returncode == 0 and r.stdout == "echo removed\n", r
    r = fleet(rig, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["programs"] == [], r


def test_removing_a_program_not_declared(rig):
    r = fleet(rig, "remove", "nothing-here")
    assert (r.returncode, r.stdout) == (1, ""), r
    assert r.stderr == "meshd-mps: no program 'nothing-here' is declared in the fleet\n"


def test_calling_a_program_not_declared(rig):
    r = fleet(rig, "call", "nothing-here", "x")
    assert (r.returncode, r.stdout) == (1, ""), r
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("meshd-mps: "), r.stderr
    assert "nothing-here" in r.stderr, r.stderr


def test_status_watch_prints_each_change(rig):
    """``status --watch``: the table, then a row each time a replica changes (as kubectl get -w),
    until Ctrl-C (exit 130)."""
    argv = [sys.executable, "-m", "meshd_mps", "fleet", "status", "--watch", "--address", rig.cluster.address]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO) as watch:
        out, err = watch.stdout, watch.stderr
        assert out is not None and err is not None
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True)
        reader.start()

        def until_row(pred, what: str) -> None:
            end = time.monotonic() + CLI_S
            seen: list[str] = []
            while time.monotonic() < end:
                try:
                    line = lines.get(timeout=1)  # the reader's next line, or a look at whether it still runs
                except queue.Empty:
                    assert watch.poll() is None, f"status --watch exited {watch.returncode}"
                    continue
                seen.append(line)
                if pred(line.split()):
                    return
            raise AssertionError(f"status --watch printed no {what} within {CLI_S}s: {seen}")

        try:
            until_row(lambda w: w[:1] == ["PROGRAM"], "header")
            # the simulation runs an example by its name: echo-*
            r = fleet(rig, "deploy", str(EXAMPLES / "echo"), "--name", "echo-watched", "--wait")
            assert r.returncode == 0, r
            until_row(lambda w: w[:1] == ["echo-watched"] and w[5:6] == ["running"], "running row")
            r = fleet(rig, "remove", "echo-watched")
            assert r.returncode == 0, r
            until_row(lambda w: w[:1] == ["echo-watched"] and w[5:6] == ["gone"], "gone row")
        finally:
            watch.send_signal(signal.SIGINT)
            rc = watch.wait(CLI_S)
            reader.join(CLI_S)
        assert rc == 130, err.read()
