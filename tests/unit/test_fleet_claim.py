"""The fleet's operations pieces that need no cluster: a node daemon's claim (claim.py: one fleet
at a time, what binds, what lapses, two agents at once), the fleet's id in its checkpoint (one
file per namespace), the metrics' exposition and the node and event tables."""

from __future__ import annotations

import json
import os
import threading

import pytest

pytest.importorskip("ray")

from prometheus_client.parser import text_string_to_metric_families

from meshd_mps.fleet import claim
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.metrics import exposition
from meshd_mps.fleet.spec import FleetEvent, FleetProgram, FleetStatus, NodeView, ReplicaView
from meshd_mps.fleet.tables import events_table, node_table

A = claim.FleetId("aaaa0001", "meshd-mps", "10.0.0.1:6379")
B = claim.FleetId("bbbb0002", "other", "10.0.0.2:6379")
LEASE = 60.0


def test_a_claim_is_taken_by_the_first_fleet_and_binds_the_second(tmp_path):
    path = claim.claim_path(str(tmp_path / "s.sock"))
    assert path == str(tmp_path / "s.sock.fleet")
    assert claim.take(path, A, replicas=False, lease=LEASE, now=1000.0) is None, "nobody's: taken"
    assert os.stat(path).st_mode & 0o777 == 0o600
    held = claim.take(path, B, replicas=False, lease=LEASE, now=1001.0)
    assert held is not None and held.fleet == A and held.renewed == 1000.0, "A's, renewed a second ago: binds B"
    assert claim.read(path) == claim.Claim(A, 1000.0), "B's look wrote nothing"
    why = claim.why(held, False, 1001.0)
    assert "fleet aaaa0001 (namespace 'meshd-mps' of the Ray cluster at 10.0.0.1:6379)" in why
    assert "loads and unloads nothing there" in why
    assert claim.take(path, A, replicas=True, lease=LEASE, now=1002.0) is None
    assert claim.read(path) == claim.Claim(A, 1000.0), "renewed lately: not written at every look"
    assert claim.take(path, A, replicas=True, lease=LEASE, now=1030.0) is None, "A renews it"
    assert claim.read(path) == claim.Claim(A, 1030.0)


def test_a_claim_binds_while_its_replicas_run_and_lapses_once_nothing_of_its_fleet_is_there(tmp_path):
    path = claim.claim_path(str(tmp_path / "s.sock"))
    claim.take(path, A, replicas=False, lease=LEASE, now=0.0)
    # A's agent gone (its cluster, or the node left it) for longer than the lease:
    held = claim.take(path, B, replicas=True, lease=LEASE, now=1e6)
    assert held is not None and held.fleet == A, "its replicas run there: still A's"
    assert "runs its replicas" in claim.why(held, True, 1e6)
    assert claim.take(path, B, replicas=False, lease=LEASE, now=LEASE - 1) is not None, "within the lease: A's"
    assert claim.take(path, B, replicas=False, lease=LEASE, now=LEASE + 1) is None, "lapsed: B takes it"
    assert claim.read(path) == claim.Claim(B, LEASE + 1)
    assert claim.take(path, A, replicas=False, lease=LEASE, now=LEASE + 2) is not None, "B's now"


def test_a_daemon_no_fleet_claims_is_not_taken_where_taking_it_would_unload_replicas(tmp_path):
    path = claim.claim_path(str(tmp_path / "s.sock"))
    running = {"echo.fleet-0", "echo.fleet-1", "a.fleet-0", "b.fleet-0", "c.fleet-0"}
    seen = claim.look(path, A, running, {"echo.fleet-0"}, LEASE, now=10.0)
    assert seen is not None and seen[0] is None
    assert "no fleet claims (a.fleet-0, b.fleet-0, c.fleet-0 and 1 more)" in seen[1]
    assert claim.read(path) is None, "not taken"
    assert claim.look(path, A, running, running, LEASE, now=11.0) is None, "all of them its own: taken (adopted)"
    assert claim.read(path) == claim.Claim(A, 11.0)
    seen = claim.look(path, B, running, set(), LEASE, now=12.0)
    assert seen is not None and seen[0] == claim.Claim(A, 11.0) and "runs its replicas" in seen[1]
    assert claim.look(path, A, running, set(), LEASE, now=13.0) is None, "its own claim: it may unload them"


@pytest.mark.parametrize("content", [b"", b"not json", b"[]", b'{"fleet": {"id": 1}, "renewed": 0}', b"x" * 5000])
def test_a_file_that_is_no_claim_is_nobodys(tmp_path, content):
    path = claim.claim_path(str(tmp_path / "s.sock"))
    with open(path, "wb") as f:
        f.write(content)
    assert claim.read(path) is None
    assert claim.take(path, A, replicas=True, lease=LEASE, now=5.0) is None
    with open(path, "rb") as f:
        assert json.loads(f.read()) == claim.Claim(A, 5.0).to_json()


def test_two_agents_at_once_never_both_take_it(tmp_path):
    """Under flock: of many looks at a claim nobody holds, by two fleets at once, one fleet wins
    them all (each look of the loser finds the winner's claim, renewed within the lease)."""
    path = claim.claim_path(str(tmp_path / "s.sock"))
    got: dict[str, list[claim.Claim | None]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def agent(key: str, me: claim.FleetId) -> None:
        start.wait()
        for _ in range(200):
            got[key].append(claim.take(path, me, replicas=False, lease=LEASE))

    threads = [threading.Thread(target=agent, args=("a", A)), threading.Thread(target=agent, args=("b", B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = {k for k, v in got.items() if any(c is None for c in v)}
    assert len(won) == 1, f"both fleets took the claim: {won}"
    loser = ({"a", "b"} - won).pop()
    assert all(c is not None and c.fleet == (A if won == {"a"} else B) for c in got[loser])


def test_the_fleets_id_is_kept_in_its_checkpoint_one_file_per_namespace(tmp_path):
    d = str(tmp_path / "fleet")
    c = Checkpoint(d)
    assert c.load() == {} and len(c.fleet) == 8
    assert c.path.endswith("/fleet.json")
    again = Checkpoint(d)
    again.load()
    assert again.fleet == c.fleet, "the same fleet after a restart"
    other = Checkpoint(d, "tests/other ns")
    assert other.load() == {} and other.fleet != c.fleet
    assert os.path.basename(other.path) == "fleet.tests_other_ns.json"
    c.save({"p": {"x": 1}})
    assert Checkpoint(d, "tests/other ns").load() == {}, "another namespace's programs are not this one's"


def _status() -> FleetStatus:
    n0, n1 = "0" * 56, "1" * 56
    echo = FleetProgram("echo", (ReplicaView("echo", 0, "running", node=n0, node_name="n0", hash="h" * 16),
                                 ReplicaView("echo", 1, "pending", reason="no node has a free slot", node=None)),
                        wanted=2, hash="h" * 16, generation=1, restart="on-failure", strategy="SPREAD")
    nodes = (NodeView(n0, "n0", True, "up", slots=2, replicas=1, call_port="10.0.0.5:41000"),
             NodeView(n1, "n1", True, "up", slots=2, replicas=1, reason="held", claimed_by="bbbb0002"))
    return FleetStatus((echo,), nodes, (FleetEvent(1e9, "moved", "echo: replica 1 moved"),),
                       fleet=A.to_json(), moves=3, node_losses=1, tick_age=0.25)


def test_the_metrics_are_the_status_numbers():
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(exposition(_status()).decode()) for s in f.samples}
    assert got[("meshd_mps_fleet_program_replicas_wanted", (("program", "echo"),))] == 2
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo"), ("state", "running")))] == 1
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo"), ("state", "pending")))] == 1
    assert got[("meshd_mps_fleet_program_replicas", (("program", "echo"), ("state", "failed")))] == 0
    assert got[("meshd_mps_fleet_program_replicas_running", (("program", "echo"),))] == 1
    assert got[("meshd_mps_fleet_node_slots", (("node", "n0"),))] == 2
    assert got[("meshd_mps_fleet_node_replicas", (("node", "n0"),))] == 1
    assert got[("meshd_mps_fleet_node_slots_free", (("node", "n0"),))] == 1
    assert got[("meshd_mps_fleet_node_slots_free", (("node", "n1"),))] == 0, "another fleet's daemon: nothing free"
    assert got[("meshd_mps_fleet_node_claimed_elsewhere", (("node", "n1"),))] == 1
    assert got[("meshd_mps_fleet_moves_total", ())] == 3
    assert got[("meshd_mps_fleet_node_losses_total", ())] == 1
    assert got[("meshd_mps_fleet_tick_age_seconds", ())] == 0.25
    info = (("cluster", A.cluster), ("fleet", A.id), ("namespace", A.namespace))
    assert got[("meshd_mps_fleet_info", info)] == 1


def test_the_node_and_event_tables():
    st = _status()
    lines = node_table(st.nodes).splitlines()
    assert lines[0].split() == ["NODE", "ID", "ALIVE", "AGENT", "SLOTS", "REPLICAS", "FREE", "DAEMON-PID", "CALL-PORT",
                                "REASON"]
    assert lines[1].split() == ["n0", "0" * 12, "yes", "up", "2", "1", "1", "-", "10.0.0.5:41000"]
    assert lines[2].split() == ["n1", "1" * 12, "yes", "up", "2", "1", "0", "-", "-", "held"]
    lines = events_table(st.events).splitlines()
    assert lines[0].split() == ["TIME", "KIND", "MESSAGE"] and lines[1].split()[2:] == ["moved", "echo:", "replica", "1",
                                                                                        "moved"]
    assert events_table(()).splitlines()[1] == "(no events)"
