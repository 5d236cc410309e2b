"""``python -m meshd_mps.bench --gpu sim --quick``: every row (a)-(k) and (m) with a figure and its
baseline, no ERROR row, and nothing left running afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from xml.etree import ElementTree

import pytest

from meshd_mps.bench import main as bench_main

pytestmark = pytest.mark.timeout(150)


def _procs_mentioning(text: str) -> list[str]:
    """Processes whose command line or environment contains ``text`` (ours are readable)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        for what in ("cmdline", "environ"):
            try:
                with open(f"/proc/{d}/{what}", "rb") as f:
                    if text.encode() in f.read():
                        found.append(f"{d} ({what})")
            except OSError:
                pass
    return found


#: The sections whose every row has a figure and its baseline on the simulated GPU ((k) is (j)'s).
EVERY_ROW = "abcdefghijmp"


def test_bench_sim_quick(standin_on_path, tmp_path):
    mps_dir = tempfile.mkdtemp(prefix="mb-")  # short: MPS's sockets live under it (AF_UNIX: 108 bytes)
    out = tmp_path / "bench.json"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "meshd_mps.bench", "--gpu", "sim", "--quick", "--json", str(out), "--mps-dir", mps_dir,
             "--plot", str(tmp_path / "plots"), "--only", ",".join(EVERY_ROW)],
            # ~30 s alone on 2 cores; make test runs it beside three other xdist workers (~100 s seen on a loaded machine)
            capture_output=True, text=True, timeout=140, env=dict(os.environ),
        )
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
        data = json.loads(out.read_text())
        rows = data["rows"]
        assert not [x for x in rows if x["result"] == "ERROR"], r.stdout
        assert data["left_behind"] == []
        for rid in EVERY_ROW + "k":
            mine = [x for x in rows if x["id"] == rid]
            assert mine, f"no row ({rid})\n{r.stdout}"
            for x in mine:
                assert isinstance(x["value"], (int, float)) and isinstance(x["baseline"], (int, float)), x
                assert x["result"] in ("PASS", "MISS", "-"), x
            assert f"({rid})" in r.stdout
        for x in rows:
            if x["target"] != "-":
                assert x["result"] in ("PASS", "MISS"), x
        # (k): live restore across a restart, an upgrade of meshd-mps (a copy of the tree, a later
        # version) and a SIGKILL, each its beat gap against the idle one
        live = sorted(x["name"].split(": ")[0].split(" (")[0] for x in rows if x["id"] == "k" and x["target"] == "<= 2x")
        assert live == ["live restore across a SIGKILL, then serve", "live restore across a restart",
                        "live restore across an upgrade of meshd-mps"], live
        header = data["header"]
        for k in ("date", "device", "driver", "cuda-bindings", "nvjitlink", "python", "command"):
            assert header.get(k), k
        assert "simulated" in header["device"]
        # (f) placed its spins: the survey picked one of this process's CPUs, named in the floor's note
        cpu = int(header["ring cpu"].removeprefix("auto (CPU ").removesuffix(")"))
        assert cpu in os.sched_getaffinity(0)
        floor = next(x for x in rows if x["name"] == "ring floor: 64 B, p50")
        assert f"on CPU {cpu}, the workers on the others" in floor["note"], floor
        # (b) once more with the loop's CPU its own (serve --daemon-cpus), the target on that row
        placed = [x for x in rows if x["name"] == "ask p99, 4 asking at once, the loop's CPU its own"]
        assert len(placed) == 1 and placed[0]["target"] == "< 1000 us", placed
        assert f"on CPU {max(os.sched_getaffinity(0))} and its 4 workers (and MPS) on the others" in next(
            x for x in rows if x["name"] == "ask p50, 4 asking at once, the loop's CPU its own")["note"]
        # --plot: the plots of this run, drawn from its rows; --from: the same drawn again from its JSON
        plotted(tmp_path / "plots", data)
        assert bench_main(["--from", str(out), "--plot", str(tmp_path / "again")]) == 0
        for name in PLOTS:
            assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "plots" / name).read_bytes(), name
        assert sorted(os.listdir(mps_dir)) == [], "the bench left its daemons' directories"
        assert not _procs_mentioning(mps_dir), f"processes of the bench still there: {_procs_mentioning(mps_dir)}"
    finally:
        shutil.rmtree(mps_dir, ignore_errors=True)


#: The bench's plots (bench/plots.py) of a run of every section; the fleet's, fleet.svg, are its own bench's.
PLOTS = ("latency.svg", "stall.svg", "recovery.svg")


def plotted(d, data: dict) -> None:
    """Each plot an SVG drawing of the run's rows: its series named, its title the run's device."""
    assert sorted(os.listdir(d)) == sorted(PLOTS), os.listdir(d)
    svgs = {name: ElementTree.parse(d / name).getroot() for name in PLOTS}
    assert all(root.tag == "{http://www.w3.org/2000/svg}svg" for root in svgs.values())
    text = {name: " ".join(t for t in root.itertext()) for name, root in svgs.items()}
    device = data["header"]["device"]
    assert all(device in t for t in text.values()), text
    dists = [r["dist"] for r in data["rows"] if r["dist"]]
    # (f)'s and (b)'s, and (b)'s again on asyncio where the bench ran on uvloop
    assert len(dists) >= 2 and all(len(v) == len(data["quantiles"]) for d_ in dists for v in d_.values()), dists
    for series in ("Programs.call 64 B", "floor 64 B", "host spin 64 B", "ask, 1 worker", "raw pipe"):
        assert series in text["latency.svg"], series
    assert "(a) stall: load into a pooled MPS worker" in text["stall.svg"]
    assert "live restore across a restart" in text["stall.svg"]
    steps = [r["parts"] for r in data["rows"] if r["id"] == "i"]
    assert steps and all({"detect", "teardown", "relaunch"} <= set(p) for p in steps), steps
    assert all(s in text["recovery.svg"] for s in ("detect", "teardown", "relaunch", "floor"))


def test_plots_need_a_run_and_matplotlib(tmp_path, capsys):
    """--from without --plot, a file that is no run's, are refused (exit 2, said why)."""
    assert bench_main(["--from", str(tmp_path / "x.json")]) == 2
    assert "with --plot DIR" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("[1, 2]")
    assert bench_main(["--from", str(tmp_path / "x.json"), "--plot", str(tmp_path)]) == 2
    assert "not a bench's --json output" in capsys.readouterr().err


@pytest.mark.parametrize(("cpu", "why"), [("nope", "CPU numbers and ranges"), ("-1", "CPU numbers and ranges"),
                                         ("\u00b2", "CPU numbers and ranges"), ("0,1", "one CPU, auto or off"),
                                         ("4096", "this process may use CPUs"), ("9999", "past any CPU")])
def test_bench_refuses_a_cpu_it_may_not_use(cpu, why, capsys):
    """--cpu N places the bench's process as serve --daemon-cpus N places the daemon, and is
    checked as that is: exit 2 and the fault named, no traceback."""
    from meshd_mps import bench

    assert bench.main(["--gpu", "sim", "--cpu", cpu]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshd-mps bench: --cpu ") and why in err, err


def test_bench_refuses_a_cpu_that_leaves_none_for_the_workers(capsys):
    from meshd_mps import bench

    mine = sorted(os.sched_getaffinity(0))
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {mine[0]})  # a process that may use one CPU only
    try:
        assert bench.main(["--gpu", "sim", "--cpu", str(mine[0])]) == 2
    finally:
        os.sched_setaffinity(0, was)
    assert "that leaves no CPU for the workers" in capsys.readouterr().err
