"""``meshd-mps fleet top`` as a person sees it, in a real terminal (tmux), on the fleet tests' shared
Ray cluster (tests/rigs/fleet.py: a head and 3 nodes of simulated-GPU daemons): the programs, their
replicas and the nodes, the calls through the fleet counted per replica (their node daemons' figures)
and added up per program; and the same per-replica figures in ``fleet metrics``' exposition."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd_mps.fleet import FleetStatus, ProgramSpec
from meshd_mps.fleet.metrics import exposition
from meshd_mps.fleet.top import NODE_HEAD, PROGRAM_HEAD, REPLICA_HEAD

from ..rigs import fleet as shared
from ..rigs.fleet import NAMESPACE
from ..rigs.serve import cli
from ..rigs.terminal import Tmux
from ..rigs.tools import need

fleet_rig, fleet, echo = shared.fleet_rig, shared.fleet, shared.echo  # tests/rigs/fleet.py
UP_S = 60.0

pytestmark = pytest.mark.timeout(240)


async def until_true(cond, within: float, what: str):
    """``await cond()`` until it returns something truthy, within ``within`` s; its value."""
    deadline = time.monotonic() + within
    while not (got := await cond()):
        assert time.monotonic() < deadline, f"not within {within:g}s: {what}"
        await asyncio.sleep(0.1)  # the polling interval
    return got


def table(screen: str, head: list[str]) -> list[dict[str, str]]:
    """The rows under ``head`` (each cell one word; a last REASON cell may be several, or none)."""
    lines = screen.splitlines()
    at = next((i for i, line in enumerate(lines) if line.split()[:3] == head[:3]), None)
    rows: list[dict[str, str]] = []
    for line in lines[at + 1:] if at is not None else []:
        cells = line.split()
        if len(cells) < len(head) - 1:
            break
        rows.append(dict(zip(head, [*cells[:len(head) - 1], " ".join(cells[len(head) - 1:])], strict=True)))
    return rows


@pytest.fixture
def term(tmp):
    t = Tmux(need("tmux")["tmux"], tmp)
    yield t
    t.close()


async def test_fleet_top_shows_programs_replicas_nodes_and_their_calls(fleet_rig, fleet, echo, term):
    await fleet.deploy(ProgramSpec("echo", echo, replicas=2))
    await fleet.wait("echo", running=2, timeout=UP_S)
    term.start([sys.executable, "-m", "meshd_mps", "fleet", "top", "--address", fleet_rig.cluster.address,
                "--namespace", NAMESPACE])
    term.wait_for(lambda t: [r["PROGRAM"] for r in table(t, PROGRAM_HEAD)] == ["echo"]
                  and sorted(r["NODE"] for r in table(t, NODE_HEAD)) == ["n0", "n1", "n2"]
                  and [r["STATE"] for r in table(t, REPLICA_HEAD)] == ["running", "running"],
                  "echo, its 2 replicas running and the 3 nodes", within=UP_S)
    row = table(term.screen(), PROGRAM_HEAD)[0]
    assert (row["WANTED"], row["RUNNING"], row["PENDING"]) == ("2", "2", "0"), row

    for _ in range(30):  # calls through the fleet: counted by the replicas' daemons, shown per replica and added up
        assert (await fleet.call("echo", b"ping")).data == b"ping"
    screen = term.wait_for(lambda t: table(t, PROGRAM_HEAD)[0]["CALLS/S"] not in ("-", "0.0")
                           and table(t, PROGRAM_HEAD)[0]["P99"] != "-", "echo's calls per second and p99", within=UP_S)
    assert any(r["CALLS/S"] not in ("-", "0.0") for r in table(screen, REPLICA_HEAD)), screen

    term.keys("/", "n", "o", "n", "e", "Enter")  # a filter that matches no program: the replicas go too
    term.wait_for(lambda t: not table(t, REPLICA_HEAD) and "(none match the filter)" in t and len(table(t, NODE_HEAD)) == 3,
                  "no program, no replica, every node")
    term.keys("q")
    term.wait_for(lambda t: "exited 0" in t, "fleet top ended by q, with status 0")

    async def counted() -> FleetStatus | None:  # the controller's view as of its next look after the calls
        st = await fleet.status()
        return st if sum((r.calls or {}).get("total", 0) for r in st.programs[0].replicas) == 30 else None

    st = await until_true(counted, UP_S, "the 30 calls in the replicas' figures")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(exposition(st).decode()) for s in f.samples}
    ok = {k: v for k, v in got.items() if k[0] == "meshd_mps_fleet_replica_calls_total" and ("outcome", "ok") in k[1]}
    assert sum(ok.values()) == 30 and len(ok) == 2, ok
    for r in st.programs[0].replicas:
        labels = (("node", r.node_name), ("program", "echo"), ("replica", str(r.index)))
        assert got[("meshd_mps_fleet_replica_state", tuple(sorted({*labels, ("state", "running")})))] == 1
        assert got[("meshd_mps_fleet_replica_call_seconds_count", labels)] == r.calls["outcomes"]["ok"]
        assert got[("meshd_mps_fleet_replica_bytes_in_total", labels)] == 4 * r.calls["outcomes"]["ok"]


def test_fleet_top_refuses_what_cannot_work():
    """Refused before the cluster is asked anything (exit 2, one line)."""
    r = cli("fleet", "top", "--sort", "colour", "--address", "127.0.0.1:1")
    assert r.returncode == 2 and r.stderr.startswith("meshd-mps: top --sort colour: one of program, wanted,"), r.stderr
