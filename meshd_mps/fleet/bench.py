"""``meshd-mps fleet bench``: what the fleet costs over each node's daemon, each figure beside its
baseline measured in the same run, on a real Ray cluster of simulated-GPU nodes on this machine
(``fleet/local.py``).  Here and not in ``meshd_mps/bench/`` because the bench's
layer (8) is below the fleet's (9): ``meshd-mps bench`` cannot import it.

(l1) 200 replicas placed and running: ``fleet.deploy`` until ``fleet.wait`` sees every one run,
     against the same loads made directly on each node's daemon (its socket, one load after another
     on a node, the nodes at once: as each node's agent loads), the same count per node;  <= 1.3x.
(l2) a node's death, once Ray knows it (its node is not alive in ``ray.nodes()``), until its replicas
     run elsewhere, against loading as many directly on the nodes they went to;  <= 1.3x.
(l3) ``fleet.call`` p50 and p99 from the head (no replica there), against a bare Ray async actor's
     echo on a fleet node;  <= 1.5x at p50.  Both (and the same call on a node's socket) are timed
     in turns of TURN calls, so that the machine's load falls on them alike.
(l4) what the fleet layer holds on a node (its agent actor's process, RSS), beside that node's
     daemon; one controller on the head; no process per program.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meshd_mps.bench.cli import draw, replot
from meshd_mps.bench.measure import pct, vmrss_mib
from meshd_mps.bench.report import Row, as_json, describe, quantiles, table
from meshd_mps.fleet import Fleet, ProgramSource, ProgramSpec
from meshd_mps.fleet.local import LocalFleet, Node
from meshd_mps.fleet.spec import FleetProgram

EXAMPLE = "echo"
#: The longest the bench waits for the fleet to run what it was asked (a deadline; the figure is the
#: time it took).
SETTLE_S = 600.0


def examples_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", EXAMPLE)


# ---- the baselines: each node's daemon, directly ------------------------------------------------------


def direct_loads(counts: dict[Node, int], source: ProgramSource, prefix: str) -> float:
    """Seconds to load ``counts[node]`` copies of ``source`` on each node's daemon, one after another
    on a node, the nodes at once (threads); then every one unloaded again (not timed)."""
    body = {"ptx": source.ptx, "hash": source.hash}

    def one_node(n: Node, k: int) -> None:
        c = n.client()
        for i in range(k):
            c.load({**body, "manifest": {**source.manifest, "name": f"{EXAMPLE}-{prefix}-{i}"}})

    t0 = time.perf_counter()
    _each(counts, one_node)
    took = time.perf_counter() - t0

    def unload(n: Node, k: int) -> None:
        c = n.client()
        for i in range(k):
            c.unload(f"{EXAMPLE}-{prefix}-{i}")

    _each(counts, unload)
    return took


def _each(counts: dict[Node, int], fn: Callable[[Node, int], None]) -> None:
    with ThreadPoolExecutor(max(1, len(counts))) as ex:
        for f in [ex.submit(fn, n, k) for n, k in counts.items() if k]:
            f.result()


@ray.remote(num_cpus=0)
class Echo:
    """The bare Ray async actor of (l3)'s baseline."""

    async def echo(self, data: bytes) -> bytes:
        return data


# ---- the rows -----------------------------------------------------------------------------------------


def per_node(p: FleetProgram) -> collections.Counter[str]:
    """The program's running replicas on each node."""
    return collections.Counter(r.node for r in p.replicas if r.state == "running" and r.node)


ROWS = ("l1", "l2", "l3", "l4")


async def rows(local: LocalFleet, replicas: int, calls: int, only: frozenset[str] = frozenset(ROWS)) -> list[Row]:
    """The rows of ``only`` (every row needs (l1)'s deploy; its baseline is made for (l1) alone)."""
    out: list[Row] = []
    source = ProgramSource.read(examples_dir())
    fleet = await Fleet.connect(local.address, state_dir=local.state_dir)
    try:
        by_id = {n.node_id: n for n in local.nodes}
        even = {n: replicas // len(local.nodes) + (i < replicas % len(local.nodes)) for i, n in enumerate(local.nodes)}
        base = await asyncio.to_thread(direct_loads, even, source, "l1") if "l1" in only else 0.0
        t0 = time.perf_counter()
        await fleet.deploy(ProgramSpec(name=EXAMPLE, source=source, replicas=replicas, strategy="SPREAD"))
        await fleet.wait(EXAMPLE, running=replicas, timeout=SETTLE_S)
        took = time.perf_counter() - t0
        placed = per_node(await fleet.program(EXAMPLE))
        where = ", ".join(f"{by_id[k].name}:{v}" for k, v in sorted(placed.items(), key=lambda kv: by_id[kv[0]].name))
        if "l1" in only:
            out.append(Row("l1", f"{replicas} replicas placed and running ({len(local.nodes)} nodes)", "s", took, base,
                           "direct loads", "<= 1.3x", took <= 1.3 * base, note=f"placed {where}; the baseline "
                           + ", ".join(f"{n.name}:{k}" for n, k in even.items())))
        if "l3" in only:
            out += await call_rows(fleet, local, calls)
        if "l4" in only:
            out.append(memory_row(local))
        if "l2" in only:
            out.append(await node_death_row(fleet, local, source, replicas, placed))
        await fleet.remove(EXAMPLE)
    finally:
        await fleet.close()
    return out


async def call_rows(fleet: Fleet, local: LocalFleet, calls: int) -> list[Row]:
    data = b"x" * 16
    node = local.nodes[0].node_id
    echo = Echo.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()  # type: ignore[attr-defined]

    async def bare() -> None:
        assert await echo.echo.remote(data) == data

    async def via_fleet() -> None:
        assert (await fleet.call(EXAMPLE, data)).data == data

    # Where the time goes: the same calls made on a node's socket (the daemon and the ring, no Ray),
    # to that node's replicas in turn as fleet.call takes them in turn: on the simulated GPU a
    # replica called once in a while is an idle kernel that polls its ring every POLL_S.
    st = await fleet.status(EXAMPLE)
    names = [r.name for p in st.programs for r in p.replicas if r.state == "running" and r.node == node]
    client = local.nodes[0].client()
    turn = itertools.count()

    async def on_socket() -> None:
        name = names[next(turn) % len(names)]
        assert (await asyncio.to_thread(client.call, name, data))["hex"] == data.hex()

    ours, theirs, direct = await timed_in_turns(calls, [via_fleet, bare, on_socket])
    ray.kill(echo)
    p50, b50, d50 = pct(ours, 0.5) * 1e3, pct(theirs, 0.5) * 1e3, pct(direct, 0.5) * 1e3
    p99, b99 = pct(ours, 0.99) * 1e3, pct(theirs, 0.99) * 1e3
    dist = {"fleet.call": quantiles(ours, 1e3), "Ray async actor echo": quantiles(theirs, 1e3),
            "a node's socket": quantiles(direct, 1e3)}
    return [Row("l3", f"fleet.call p50 ({calls} calls, 16 B)", "ms", p50, b50, "Ray async actor echo", "<= 1.5x",
                p50 <= 1.5 * b50, dist=dist),
            Row("l3", f"fleet.call p99 ({calls} calls, 16 B)", "ms", p99, b99, "Ray async actor echo"),
            Row("l3", f"the same calls on a node's socket, p50 ({calls} calls, its {len(names)} replicas in turn)", "ms",
                d50, b50, "Ray async actor echo",
                note="meshd-mps call's path (HTTP, the ring), no Ray: what fleet.call adds is the rest")]


#: (l3)'s calls are timed in turns of this many of each kind, so that a change of the shared
#: machine's load falls on the figure and its baseline alike.
TURN = 50


async def timed_in_turns(n: int, fs: list[Callable[[], Any]], warm: int = 10) -> list[list[float]]:
    """``n`` timed calls of each of ``fs`` (after ``warm`` untimed ones each), TURN of one, then
    TURN of the next, and so on."""
    out: list[list[float]] = [[] for _ in fs]
    for f in fs:
        for _ in range(warm):
            await f()
    while len(out[0]) < n:
        k = min(TURN, n - len(out[0]))
        for f, times in zip(fs, out, strict=True):
            for _ in range(k):
                t0 = time.perf_counter()
                await f()
                times.append(time.perf_counter() - t0)
    return out


def processes(title: str, mark: str) -> list[int]:
    """The pids whose command line starts with ``title`` (Ray names an actor's process ``ray::Class``)
    and whose environment holds ``mark`` (this bench's directory: another cluster on the machine is
    not counted)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if not f.read().startswith(title.encode()):
                        continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read():
                        out.append(int(d))
            except OSError:
                continue
    return out


def memory_row(local: LocalFleet) -> Row:
    agents = processes("ray::NodeAgent", local.dir)
    controllers = processes("ray::FleetController", local.dir)
    agent_mib = sum(vmrss_mib(p) for p in agents) / max(1, len(agents))
    daemon_mib = sum(vmrss_mib(n.proc.pid) for n in local.nodes) / len(local.nodes)
    ctl = sum(vmrss_mib(p) for p in controllers)
    return Row("l4", "the fleet's RSS per node (its agent)", "MiB", agent_mib, daemon_mib, "the node daemon",
               note=f"{len(agents)} agent processes for {len(local.nodes)} nodes, {len(controllers)} controller"
                    f" ({ctl:.0f} MiB), none per program")


async def node_death_row(fleet: Fleet, local: LocalFleet, source: ProgramSource, replicas: int,
                         placed: collections.Counter[str]) -> Row:
    by_id = {n.node_id: n for n in local.nodes}
    dead = by_id[max(placed, key=lambda k: placed[k])]
    lost = placed[dead.node_id]
    await asyncio.to_thread(local.kill_node, dead)
    end = time.monotonic() + SETTLE_S
    while any(n["NodeID"] == dead.node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > end:
            raise TimeoutError(f"Ray did not see node {dead.name} dead within {SETTLE_S:g}s")
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    while True:
        now = per_node(await fleet.program(EXAMPLE))
        if sum(now.values()) >= replicas and dead.node_id not in now:
            break
        if time.monotonic() > end:
            raise TimeoutError(f"{sum(now.values())} of {replicas} replicas running {SETTLE_S:g}s after node {dead.name} died")
        await asyncio.sleep(0.05)
    took = time.perf_counter() - t0
    moved = {by_id[k]: now[k] - placed.get(k, 0) for k in now if now[k] > placed.get(k, 0)}
    base = await asyncio.to_thread(direct_loads, moved, source, "l2")
    return Row("l2", f"a node's {lost} replicas running elsewhere", "s", took, base, "direct loads there", "<= 1.3x",
               took <= 1.3 * base, note="moved to " + ", ".join(f"{n.name}:{k}" for n, k in moved.items()))


# ---- the command ----------------------------------------------------------------------------------------


def header(argv: list[str], nodes: int, sim_gpus: int) -> dict[str, str]:
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": f"{nodes} nodes x {sim_gpus} simulated GPUs (--gpu sim, blink) on one machine",
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "ray": metadata.version("ray"), "python": sys.version.split()[0],
            "command": " ".join(["meshd-mps fleet bench", *argv])}


def simulated(argv: list[str], n: int, json_out: str | None) -> int:
    """``--simulate N``: the rows of fleet/simbench.py, in the same table."""
    from meshd_mps.fleet.simbench import rows as simulated_rows

    if n < 10:
        print(f"meshd-mps fleet bench: --simulate {n}: at least 10 nodes", file=sys.stderr)
        return 2
    try:
        out = simulated_rows(n)
    except Exception as e:  # one ERROR row: the run's failure named
        out = [Row("s", "fleet bench --simulate", error=describe(e))]
    h = header(argv, n, 0)
    h["device"] = f"the controller alone: up to {n} simulated nodes of 48 slots, no Ray (fleet/simulate.py)"
    print(table(h, out))
    if json_out:
        with open(json_out, "w") as f:
            f.write(as_json(h, out, []))
    return 1 if any(r.error for r in out) else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshd-mps fleet bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="fleet nodes (default 4)")
    ap.add_argument("--sim-gpus", type=int, default=3, help="simulated GPUs per node (default 3: 96 slots in blink mode)")
    ap.add_argument("--replicas", type=int, default=200, help="replicas of (l1) and (l2) (default 200)")
    ap.add_argument("--calls", type=int, default=500, help="calls of (l3) (default 500)")
    ap.add_argument("--only", metavar="ROW", action="append", choices=ROWS,
                    help="only this row (again for more: --only l3 --only l4); default every row")
    ap.add_argument("--json", metavar="FILE", help="also write the header and rows as JSON")
    ap.add_argument("--plot", metavar="DIR", help="also draw the figures as SVG plots into DIR (matplotlib: the plot"
                    " extra): (l3)'s call latencies, (l1) and (l2) beside their baselines")
    ap.add_argument("--from", dest="source", metavar="FILE", help="with --plot: draw a run's --json FILE, running nothing")
    ap.add_argument("--simulate", type=int, metavar="N",
                    help="instead: the controller alone at 10, 100, ... N simulated nodes of 48 slots, no Ray"
                         " (rows (s1)-(s6), fleet/simbench.py)")
    args = ap.parse_args(argv)
    if args.source is not None:
        return replot(args.source, args.plot, "meshd-mps fleet bench")
    if args.simulate is not None:
        return simulated(argv, args.simulate, args.json)
    for k in ("nodes", "sim_gpus", "replicas", "calls"):
        if getattr(args, k) < (2 if k == "nodes" else 1):  # (l2) kills a node: another must be left
            print(f"meshd-mps fleet bench: --{k.replace('_', '-')} {getattr(args, k)}: too few", file=sys.stderr)
            return 2
    local = LocalFleet(args.nodes, args.sim_gpus)
    try:
        local.start()
        out = asyncio.run(rows(local, args.replicas, args.calls, frozenset(args.only or ROWS)))
    except Exception as e:  # one ERROR row: the run's failure named, nothing left running
        out = [Row("l", "fleet bench", error=describe(e))]
    finally:
        local.close()
    h = header(argv, args.nodes, args.sim_gpus)
    print(table(h, out))
    report = as_json(h, out, [])
    if args.json:
        with open(args.json, "w") as f:
            f.write(report)
    if args.plot and draw(json.loads(report), args.plot, "meshd-mps fleet bench") != 0:
        return 2
    return 1 if any(r.error for r in out) else 0
