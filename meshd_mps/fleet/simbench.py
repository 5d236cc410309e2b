"""``meshd-mps fleet bench --simulate N``: the controller's own cost at the scale the fleet exists
for, measured on the real loop (loop.py) over the simulated cluster of simulate.py (no Ray: the
agents run their shares at once), at 10, 100, ... up to ``N`` nodes of 48 slots each, every slot
filled (48 replicas a node: at 1,000 nodes, 48,000 replicas in 100 programs of 480).

(s1) a tick's controller CPU (observe, plan, act: process time) where every node's report changed
     (one replica of each node restarting on its daemon), at each size;  <= 50 ms at 1,000 nodes,
     and no worse than linear in the nodes (the note gives the cost per node, against the smallest
     size's);
(s2) a tick with nothing changed, against (s1) of the same size;  <= 10 % at the largest size;
(s3) the controller's memory at each size: the RSS of a process of its own, over the same process
     before the fleet was made;
(s4) at the largest size, from the deploy of 10,000 replicas (half the slots, below 209 nodes) to
     all of them running (the real loop's pace, with its ticks and busy ticks; the agents answering
     at once);
(s5) from the loss of a tenth of those nodes to every replica running again elsewhere;
(s6) with every slot filled: ``status()`` (every replica and node), ``status(name)``, ``program(name)``
     and ``routes(name)`` (what ``fleet.call`` asks), each the mean of several.

Anchors: Kubernetes' scalability objectives (5,000 nodes, 150,000 pods) and Ray Serve's
controller, whose per-replica bookkeeping is what limits it.  Each size runs in a process of its
own (``python -m meshd_mps.fleet.simbench SIZE``), so that its memory is its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.bench.measure import vmrss_mib
from meshd_mps.bench.report import Row
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.claim import FleetId
from meshd_mps.fleet.controller import routes, status
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.loop import Reconciler
from meshd_mps.fleet.simulate import SimCluster

SLOTS = 48
PER_PROGRAM = 480
IMAGE = Image({"name": "echo"}, "// simulated", "0" * 16)
#: The longest a simulated fleet takes to run what it was asked (a deadline; the figure is the time).
SETTLE_S = 600.0
#: Ticks averaged for (s1) and (s2), lookups for (s6).
TICKS = 5
LOOKUPS = 20


def sizes(n: int) -> list[int]:
    out = [s for s in (10, 100, 1000, 10000) if s < n]
    return [*out, n]


async def _settle(rec: Reconciler, want: int, names: list[str], tick: bool) -> None:
    """Until ``want`` replicas of ``names`` run: ticks made here (``tick``), or the loop's own."""
    end = time.monotonic() + SETTLE_S
    while sum(rec.view(n).running for n in names) < want:
        if time.monotonic() > end:
            raise TimeoutError(f"{sum(rec.view(n).running for n in names)} of {want} replicas running after {SETTLE_S:g}s")
        if tick:
            await rec.tick()
        await asyncio.sleep(0 if tick else 0.005)  # the agents' answers taken in; or the polling interval


def _fleet(nodes: int, d: Deadlines) -> tuple[SimCluster, Reconciler]:
    cluster = SimCluster(nodes, SLOTS)
    rec = Reconciler(cluster, FleetId("sim", "meshd-mps", "simulated"), d, Checkpoint(tempfile.mkdtemp()), {})
    return cluster, rec


async def one_size(nodes: int, d: Deadlines = DEFAULT) -> dict[str, Any]:
    """(s1)-(s3), and at ``nodes`` (s6): every slot filled, ticks made one by one."""
    base = vmrss_mib(os.getpid())
    cluster, rec = _fleet(nodes, d)
    total = nodes * SLOTS
    names = [f"echo-{i:03d}" for i in range((total + PER_PROGRAM - 1) // PER_PROGRAM)]
    for k, name in enumerate(names):
        await rec.declare(Spec(name, min(PER_PROGRAM, total - k * PER_PROGRAM), "on-failure", "SPREAD", IMAGE))
    await _settle(rec, total, names, tick=True)
    for _ in range(3):  # settled: the last answers and shares taken in
        await rec.tick()
        await asyncio.sleep(0)
    quiet = []
    for _ in range(TICKS):
        t0 = time.process_time()
        await rec.tick()
        quiet.append(time.process_time() - t0)
        await asyncio.sleep(0)
    busy = []
    for k in range(TICKS):
        for a in cluster.agents.values():  # one replica of each node restarting, then running again
            name = next(iter(a.programs))
            a.set_state(name, "restarting" if k % 2 == 0 else "running")
        await asyncio.sleep(0)  # the watches' answers taken in
        t0 = time.process_time()
        await rec.tick()
        busy.append(time.process_time() - t0)
    out: dict[str, Any] = {"nodes": nodes, "replicas": total, "quiet_s": min(quiet), "busy_s": min(busy),
                           "rss_mib": vmrss_mib(os.getpid()) - base, "writes": rec.saver.writes}
    lookups = {"status": lambda: status(rec), "status(name)": lambda: status(rec, names[0]),
               "program(name)": lambda: rec.view(names[0]), "routes(name)": lambda: routes(rec, names[0])}
    for what, fn in lookups.items():
        t0 = time.perf_counter()
        for _ in range(LOOKUPS):
            fn()
        out[what] = (time.perf_counter() - t0) / LOOKUPS
    return out


async def deploy_and_loss(nodes: int, replicas: int, d: Deadlines = DEFAULT) -> dict[str, Any]:
    """(s4) and (s5): the real loop (its own pace), ``replicas`` deployed on ``nodes``, then a tenth
    of the nodes lost."""
    cluster, rec = _fleet(nodes, d)
    task = asyncio.create_task(rec.run())
    try:
        await rec.ticked.wait()
        names = [f"echo-{i:03d}" for i in range((replicas + 499) // 500)]
        t0 = time.perf_counter()
        for k, name in enumerate(names):
            await rec.declare(Spec(name, min(500, replicas - k * 500), "on-failure", "SPREAD", IMAGE))
        await _settle(rec, replicas, names, tick=False)
        deploy = time.perf_counter() - t0
        busiest = sorted(cluster.nodes, key=lambda n: -len(cluster.agents[n].programs))[:max(1, nodes // 10)]
        lost = sum(len(cluster.agents[n].programs) for n in busiest)
        t0 = time.perf_counter()
        cluster.lose(busiest)
        gone = set(busiest)
        end = time.monotonic() + SETTLE_S
        while not all(v.running == v.wanted and not any(r.node in gone for r in v.replicas)
                      for v in (rec.view(n) for n in names)):
            if time.monotonic() > end:
                raise TimeoutError(f"the replicas of {len(gone)} lost nodes not running again after {SETTLE_S:g}s")
            await asyncio.sleep(0.005)  # the polling interval
        return {"deploy_s": deploy, "loss_s": time.perf_counter() - t0, "lost_nodes": len(gone), "moved": lost}
    finally:
        task.cancel()


def _child(args: list[str]) -> dict[str, Any]:
    """One measure in a process of its own (its memory its own)."""
    r = subprocess.run([sys.executable, "-m", "meshd_mps.fleet.simbench", *args], capture_output=True, text=True,
                       timeout=SETTLE_S * 2)
    if r.returncode != 0:
        raise RuntimeError(f"simbench {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}")
    return dict(json.loads(r.stdout))


def rows(n: int) -> list[Row]:
    out: list[Row] = []
    got = [_child(["size", str(s)]) for s in sizes(n)]
    first = got[0]
    for g in got:
        per, per0 = g["busy_s"] / g["nodes"], first["busy_s"] / first["nodes"]
        target = "<= 50 ms" if g["nodes"] >= 1000 else "-"
        ok = g["busy_s"] <= 0.050 if g["nodes"] >= 1000 else None
        out.append(Row("s1", f"a tick, every node's report changed ({g['nodes']} nodes, {g['replicas']} replicas)",
                       "ms", g["busy_s"] * 1e3, target=target, ok=ok,
                       note=f"{per * 1e6:.1f} us a node ({per / per0:.2f}x the {first['nodes']} nodes' per node)"))
    for g in got:  # the target at the largest size: at 10 nodes a tick's fixed cost is more than a tenth of it
        last = g is got[-1]
        out.append(Row("s2", f"a tick, nothing changed ({g['nodes']} nodes)", "ms", g["quiet_s"] * 1e3,
                       g["busy_s"] * 1e3, "a tick, every node changed", "<= 0.1x" if last else "-",
                       g["quiet_s"] <= 0.1 * g["busy_s"] if last else None))
    for g in got:
        out.append(Row("s3", f"the controller's memory ({g['nodes']} nodes, {g['replicas']} replicas)", "MiB",
                       g["rss_mib"], note=f"{g['rss_mib'] * 1024 / g['replicas']:.2f} KiB a replica"))
    big = got[-1]
    count = min(10_000, big["replicas"] // 2)  # room left for a tenth of the nodes' replicas to move
    lost = _child(["deploy", str(big["nodes"]), str(count)])
    out.append(Row("s4", f"deploy of {count} replicas to all running ({big['nodes']} nodes)",
                   "s", lost["deploy_s"], note="the agents answering at once: the controller's own time"))
    out.append(Row("s5", f"{lost['lost_nodes']} nodes lost ({lost['moved']} replicas) to every replica running again",
                   "s", lost["loss_s"]))
    for what in ("status", "status(name)", "program(name)", "routes(name)"):
        out.append(Row("s6", f"{what} at {big['replicas']} replicas", "ms", big[what] * 1e3))
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["size"]:
        print(json.dumps(asyncio.run(one_size(int(argv[1])))))
    elif argv[:1] == ["deploy"]:
        print(json.dumps(asyncio.run(deploy_and_loss(int(argv[1]), int(argv[2])))))
    else:
        print("usage: python -m meshd_mps.fleet.simbench size N | deploy NODES REPLICAS", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
