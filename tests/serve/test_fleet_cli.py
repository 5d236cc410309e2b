"""``meshd-mps fleet ...`` without a cluster: the command's routing (meshd_mps/cli.py), the one line
it prints where Ray is not installed, its refusals of bad input (one line, exit 2, before any cluster
is asked), ``fleet resources`` from a real node daemon, and what ``status`` and ``--watch`` print.
The round trip against a real Ray cluster is in tests/cluster/test_fleet.py (its last tests, on the module's cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..rigs.serve import EXAMPLES, REPO, cli, env

# ---- routing, and no Ray ---------------------------------------------------------------------------

NO_RAY = "import sys\nsys.modules['ray'] = None  # `import ray` raises ImportError, as where it is not installed\n"


def run_without_ray(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m meshd_mps ARGS`` in a Python where ``import ray`` fails (a sitecustomize on
    PYTHONPATH, imported at start-up, puts None in its place in sys.modules)."""
    site = tmp_path / "noray"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_RAY)
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(site), e["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "meshd_mps", *args], capture_output=True, text=True, env=e, cwd=REPO,
                          timeout=60)


@pytest.mark.parametrize("args", [("status",), ("deploy", str(EXAMPLES / "echo")), ("resources",), ("--help",), ()])
def test_without_ray_one_line_says_how_to_install_it(tmp_path, args):
    r = run_without_ray(tmp_path, "fleet", *args)
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("meshd-mps: the fleet needs Ray"), lines[0]
    assert lines[0].endswith("(pip install 'meshd-mps[fleet]')"), lines[0]


def test_without_ray_the_node_commands_still_work(tmp_path):
    """The node's command line never imports Ray: the same Python runs it as before."""
    r = run_without_ray(tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.startswith("meshd-mps "), r
    r = run_without_ray(tmp_path, "ps", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 1 and r.stderr.startswith("meshd-mps: "), r
    r = run_without_ray(tmp_path, "--help")
    assert r.returncode == 0 and "meshd-mps fleet --help" in r.stdout, r


def test_the_entry_routes_fleet_and_the_rest(monkeypatch):
    """meshd_mps.cli.main: `fleet ...` to the fleet's main with the rest of the line, anything else
    (even a program called fleet further on) to the node's."""
    from meshd_mps import cli as entry
    from meshd_mps.serving import cli as node_cli

    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(node_cli, "main", lambda argv=None: seen.append(("node", argv)) or 0)
    monkeypatch.setattr(entry, "fleet", lambda argv: seen.append(("fleet", argv)) or 0)
    assert entry.main(["fleet", "status", "--json"]) == 0
    assert entry.main(["unload", "fleet"]) == 0
    assert entry.main([]) == 0
    assert seen == [("fleet", ["status", "--json"]), ("node", ["unload", "fleet"]), ("node", [])]


def test_the_console_script_is_the_entry():
    """pyproject's meshd-mps script and python -m meshd_mps go through meshd_mps/cli.py."""
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["scripts"]["meshd-mps"] == "meshd_mps.cli:main"
    extras = project["optional-dependencies"]
    assert extras["fleet"] == ["ray>=2.60,<3; python_version < '3.13'"]
    assert extras["fleet"][0] in extras["test"]


# ---- bad input: one line, exit 2, nothing asked of a cluster ----------------------------------------


@pytest.fixture
def fleet_cli(monkeypatch):
    """The fleet's main, in this process, with a Fleet.connect that fails the test: bad input must be
    refused before any cluster is asked."""
    pytest.importorskip("ray")
    from meshd_mps.fleet import Fleet, cli

    async def no_cluster(*a, **kw):
        raise AssertionError("the cluster was asked: bad input must be refused first")

    monkeypatch.setattr(Fleet, "connect", no_cluster)
    return cli.main


def refused(capsys, fleet_main, *argv: str) -> str:
    """The one line ``fleet_main(argv)`` prints refusing it (exit 2: its return, or argparse's exit)."""
    try:
        rc = fleet_main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_directory(capsys, fleet_cli, tmp_path):
    line = refused(capsys, fleet_cli, "deploy", str(tmp_path / "nope"))
    assert line == f"meshd-mps: {tmp_path / 'nope'}: no such directory"


def test_no_program_named(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy")
    assert line == "meshd-mps: a program directory or --manifest FILE is needed"


@pytest.mark.parametrize("n", ["0", "-1", "1000"])
def test_replicas_out_of_range(capsys, fleet_cli, n):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--replicas", n)
    assert line == f"meshd-mps: replicas {n}: a whole number from 1 to 999"


def test_replicas_not_a_number(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--replicas", "two")
    assert line == "meshd-mps fleet deploy: argument --replicas: invalid int value: 'two'"


def test_unknown_strategy(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--strategy", "RANDOM")
    assert line == "meshd-mps: strategy 'RANDOM': one of SPREAD, PACK, STRICT_SPREAD"


def test_unknown_restart_policy(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--restart", "sometimes")
    assert line.startswith("meshd-mps: ") and "sometimes" in line


def test_a_wrong_hash(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--hash", "0123456789abcdef")
    assert line.startswith("meshd-mps: hash 0123456789abcdef: the image's hash is ")


def test_a_bad_name(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "deploy", str(EXAMPLES / "echo"), "--name", "a/b")
    assert line.startswith("meshd-mps: ") and "a/b" in line


def test_upgrade_of_a_missing_directory(capsys, fleet_cli, tmp_path):
    line = refused(capsys, fleet_cli, "upgrade", "echo", str(tmp_path / "nope"))
    assert line == f"meshd-mps: {tmp_path / 'nope'}: no such directory"


def test_call_with_data_not_hex(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "call", "echo", "zz", "--hex")
    assert line.startswith("meshd-mps: DATA: not hex: ")


def test_no_command(capsys, fleet_cli):
    line = refused(capsys, fleet_cli)
    assert line == "meshd-mps fleet: the following arguments are required: COMMAND"


def test_an_unknown_command(capsys, fleet_cli):
    line = refused(capsys, fleet_cli, "scale", "echo")
    assert line.startswith("meshd-mps fleet: argument COMMAND: invalid choice: 'scale'")


# ---- fleet resources, from a real node daemon ------------------------------------------------------


def test_resources_from_a_node_daemon(serve, tmp):
    """What `ray start --resources` takes: the node's slots from its daemon's own limits (blink: 32
    per GPU), per GPU model, and its name where given."""
    pytest.importorskip("ray")
    s = serve("blink")
    s.wait_ready()
    r = cli("fleet", "resources", "--socket", s.sock, "--node", "gpu-node-1")
    assert r.returncode == 0, r
    res = json.loads(r.stdout)
    assert res["meshd_slot"] == 32.0
    models = [k for k in res if k.startswith("meshd_gpu_")]
    assert len(models) == 1 and res[models[0]] == 32.0
    assert res["meshd_node_gpu_node_1"] == 32.0
    r = cli("fleet", "resources", "--socket", s.sock, "--slots", "5")
    assert r.returncode == 0 and json.loads(r.stdout)["meshd_slot"] == 5.0, r


def test_resources_without_a_daemon(tmp):
    pytest.importorskip("ray")
    r = cli("fleet", "resources", "--socket", os.path.join(tmp, "none.sock"))
    assert r.returncode == 1
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("meshd-mps: "), r.stderr


# ---- what status and --watch print ---------------------------------------------------------------------


def views():
    pytest.importorskip("ray")
    from meshd_mps.fleet import FleetEvent, FleetProgram, FleetStatus, ReplicaView

    def status(reps, events=()):
        prog = FleetProgram(name="echo", replicas=tuple(reps), wanted=len(reps), hash="0" * 16, generation=1,
                            restart="on-failure", strategy="SPREAD")
        return FleetStatus(programs=(prog,), nodes=(), events=tuple(events))

    return ReplicaView, FleetEvent, status


def test_status_table_has_a_row_per_replica():
    from meshd_mps.fleet.tables import status_table

    Replica, _Event, status = views()
    reps = [Replica("echo", 1, "pending", reason="no node has a free slot (1 wanted, 0 free of 32)"),
            Replica("echo", 0, "running", node="a" * 56, node_name="gpu-1", gpu=0, slot=3, pid=123, heartbeat_age=0.2)]
    lines = status_table([r for p in status(reps).programs for r in p.replicas]).splitlines()
    assert lines[0].split() == ["PROGRAM", "REPLICA", "NODE", "GPU", "SLOT", "STATE", "BEAT-AGE", "REASON"]
    assert lines[1].split() == ["echo", "0", "gpu-1", "0", "3", "running", "0.2s"]
    assert lines[2].split()[:8] == ["echo", "1", "-", "-", "-", "pending", "-", "no"]
    assert lines[2].endswith("no node has a free slot (1 wanted, 0 free of 32)")


def test_watch_prints_a_row_for_each_change_only():
    """As kubectl get -w: a replica that changes (not its heartbeat age alone) or goes, and each new event."""
    from meshd_mps.fleet.tables import Watch

    Replica, Event, status = views()
    a = Replica("echo", 0, "running", node_name="gpu-1", gpu=0, slot=3, heartbeat_age=0.1)
    b = Replica("echo", 1, "running", node_name="gpu-2", gpu=0, slot=4, heartbeat_age=0.1)
    w = Watch(status([a, b]))
    assert w.changes(status([a, Replica("echo", 1, "running", node_name="gpu-2", gpu=0, slot=4, heartbeat_age=0.9)])) == ""
    moved = Replica("echo", 1, "starting", node_name="gpu-3", gpu=0, slot=0)
    out = w.changes(status([a, moved], [Event(at=1e9, kind="moved", message="echo[1]: gpu-2 lost, placed on gpu-3")]))
    lines = out.splitlines()
    assert lines[0].endswith("moved: echo[1]: gpu-2 lost, placed on gpu-3")
    assert lines[1].split() == ["echo", "1", "gpu-3", "0", "0", "starting", "-"]
    assert len(lines) == 2
    out = w.changes(status([moved], [Event(at=1e9, kind="moved", message="seen already")]))
    assert out.split() == ["echo", "0", "gpu-1", "0", "3", "gone", "-"]
