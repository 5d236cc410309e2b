"""Where a ``fleet.call`` goes: the bench's row (l3) split into its hops, each p50/p99 from the same
run, the variants taken in turns (rounds) so that the shared machine's load falls on all of them.

    python scripts/fleet_call_breakdown.py [-n 300] [--rounds 3] [--replicas 2] [--sim-gpus 1]

A local fleet (fleet/local.py: a Ray cluster of a head and 2 nodes, each node's own ``serve --gpu
sim`` daemon), echo replicas spread over them (the bench's: --replicas 4 --sim-gpus 3); from the
head (the bench's driver, no replica there):
  fleet.call     the whole call (routes cached, the replicas in turn, their call ports, daemons, rings)
  call port      NodeCalls through one replica's agent's call port (TCP, the agent's relay, no Ray)
  fleet via ray  fleet.call with the call ports left out (as where none can be reached: the agents' actor calls)
  agents in turn ``agent.call.remote`` of the two replicas' agents in turn (no route, no retry)
  agent.call     the same, one replica's agent only
  agent.ping     a Ray call of that agent that does nothing (the Ray hop to an async actor)
  echo           the bench's baseline: a bare Ray async actor's echo on that node
  probe.call     an async actor of the script's own on that node making the agent's call
  probe inside   ... that call's time inside that actor (NodeCalls in a Ray actor's loop)
  probe 404      probe.call of a program that is not there (the daemon's HTTP, no ring), and inside
  probe blocking the request on a blocking socket in that actor's loop (no asyncio IO), and inside
  node call      NodeCalls.call from the head, straight to the node's socket (the agent's hop)
  raw http       the same request on a blocking socket, kept alive (the daemon's share)
  ring           inside that: the daemon's own ``ms`` (its ``ps.call``: the ring post and wait)
  http 404       the call endpoint for a program that is not there: the daemon's HTTP, no ring
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from meshd_mps.fleet import Fleet, ProgramSource, ProgramSpec  # noqa: E402
from meshd_mps.fleet.agent import agent_name  # noqa: E402
from meshd_mps.fleet.bench import EXAMPLE, Echo, examples_dir  # noqa: E402
from meshd_mps.fleet.local import LocalFleet  # noqa: E402
from meshd_mps.fleet.nodecalls import NodeCalls  # noqa: E402
from meshd_mps.fleet.spec import CallPort  # noqa: E402


@ray.remote(num_cpus=0)
class Probe:
    """An async actor beside the agent that makes the agent's call (NodeCalls) and times it inside."""

    def __init__(self, socket: str):
        self.calls = NodeCalls(socket, 10.0)
        self.inner: dict[str, list[float]] = {}

    async def call(self, name: str, data: bytes) -> Any:
        t0 = time.perf_counter()
        out = await self.calls.call(name, data)
        self.inner.setdefault(name, []).append(time.perf_counter() - t0)
        if isinstance(out, dict):  # an older agent's answer
            return out
        return out.data if out.ok else out  # as the agent answers

    async def blocking(self, name: str, data: bytes) -> bool:
        """The same request on a blocking socket of this actor's own, in its loop (a probe only)."""
        if not hasattr(self, "raw"):
            self.raw = Raw(self.calls.path, name, {"hex": data.hex()})
        t0 = time.perf_counter()
        status = self.raw.ask()[0]
        self.inner.setdefault("blocking", []).append(time.perf_counter() - t0)
        return status == 200

    async def times(self) -> dict[str, list[float]]:
        return self.inner


def ok(answer: Any) -> bool:
    """A node call's answer is good: the agent's bytes, a NodeAnswer, or (an older agent's) a dict."""
    if isinstance(answer, bytes):
        return True
    return bool(answer["ok"] if isinstance(answer, dict) else answer.ok)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Raw:
    """One kept-alive connection to a daemon, a prepared request, its answer read by its length."""

    def __init__(self, path: str, name: str, body: dict[str, Any]):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        raw = json.dumps(body).encode()
        self.req = (f"POST /v1/programs/{name}/call HTTP/1.1\r\nHost: meshd-mps\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw

    def ask(self) -> tuple[int, dict[str, Any]]:
        self.s.sendall(self.req)
        got = b""
        while b"\r\n\r\n" not in got:
            got += self.s.recv(65536)
        head, _, rest = got.partition(b"\r\n\r\n")
        n = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(rest) < n:
            rest += self.s.recv(65536)
        return int(head.split()[1]), json.loads(rest)


async def measure(local: LocalFleet, n: int, rounds: int, replicas: int) -> dict[str, list[float]]:
    fleet = await Fleet.connect(local.address, state_dir=local.state_dir)
    try:
        source = ProgramSource.read(examples_dir())
        await fleet.deploy(ProgramSpec(name=EXAMPLE, source=source, replicas=replicas, strategy="SPREAD"))
        await fleet.wait(EXAMPLE, running=replicas, timeout=300)
        node = local.nodes[0]
        st = await fleet.status(EXAMPLE)
        running = [r for p in st.programs for r in p.replicas if r.state == "running"]
        r = next(x for x in running if x.node == node.node_id)
        r1 = next(x for x in running if x.node != node.node_id)
        agent = ray.get_actor(agent_name(node.node_id), namespace="meshd-mps")
        agent1 = ray.get_actor(agent_name(str(r1.node)), namespace="meshd-mps")
        here = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        echo = Echo.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
        probe = Probe.options(scheduling_strategy=here).remote(node.socket)  # type: ignore[attr-defined]
        data = b"x" * 16
        direct = NodeCalls(node.socket, 10.0)
        seen = {n.node: n.call_port for n in st.nodes}
        port = (await fleet._routes(EXAMPLE, True)).ports[node.node_id]
        assert str(port) == seen[node.node_id]
        through = NodeCalls("", 10.0, port=CallPort(*port))
        good, missing = Raw(node.socket, r.name, {"hex": data.hex()}), Raw(node.socket, "no-such-program", {"hex": "00"})
        ring: list[float] = []
        turn = [0]

        async def f_call() -> None:
            assert (await fleet.call(EXAMPLE, data)).via == "call-port"

        async def f_ray() -> None:
            fleet.unreachable = {p: float("inf") for p in (await fleet._routes(EXAMPLE, False)).ports.values()}
            try:
                assert (await fleet.call(EXAMPLE, data)).via == "ray"
            finally:
                fleet.unreachable = {}

        async def port_call() -> None:
            assert ok(await through.call(r.name, data))

        async def in_turn() -> None:
            turn[0] ^= 1
            a, name = (agent, r.name) if turn[0] else (agent1, r1.name)
            assert ok(await a.call.remote(name, data, None))

        async def a_call() -> None:
            assert ok(await agent.call.remote(r.name, data, None))

        async def a_ping() -> None:
            await agent.ping.remote()

        async def e_echo() -> None:
            await echo.echo.remote(data)

        async def p_call() -> None:
            assert ok(await probe.call.remote(r.name, data))

        async def p_404() -> None:
            assert not ok(await probe.call.remote("no-such-program", data))

        async def p_blocking() -> None:
            assert await probe.blocking.remote(r.name, data)

        async def node_call() -> None:
            assert ok(await direct.call(r.name, data))

        async def raw_http() -> None:
            status, ans = good.ask()
            assert status == 200
            ring.append(float(ans["ms"]) / 1e3)

        async def http_404() -> None:
            assert missing.ask()[0] == 404

        variants: dict[str, Callable[[], Awaitable[None]]] = {
            "fleet.call": f_call, "call port": port_call, "fleet via ray": f_ray,
            "agents in turn": in_turn, "agent.call": a_call, "agent.ping": a_ping,
            "echo": e_echo, "probe.call": p_call, "probe 404": p_404, "probe blocking": p_blocking,
            "node call": node_call, "raw http": raw_http, "http 404": http_404}
        out: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, f in variants.items():
                for i in range(n + 10):
                    t0 = time.perf_counter()
                    await f()
                    if i >= 10:
                        out[k].append(time.perf_counter() - t0)
        inside = await probe.times.remote()
        out["probe inside"] = inside[r.name]
        out["probe 404 inside"] = inside["no-such-program"]
        out["blocking inside"] = inside["blocking"]
        out["ring"] = ring
        await direct.close()
        await through.close()
        good.s.close()
        missing.s.close()
        ray.kill(echo)
        ray.kill(probe)
        await fleet.remove(EXAMPLE)
        return out
    finally:
        await fleet.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="calls per variant per round (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the variants in turns (default 3)")
    ap.add_argument("--replicas", type=int, default=2, help="echo replicas, spread over the 2 nodes (default 2)")
    ap.add_argument("--sim-gpus", type=int, default=1, help="simulated GPUs per node (default 1)")
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        before = f.read().split()[0]
    local = LocalFleet(2, args.sim_gpus)
    try:
        local.start()
        out = asyncio.run(measure(local, args.n, args.rounds, max(2, args.replicas)))
    finally:
        local.close()
    with open("/proc/loadavg") as f:
        after = f.read().split()[0]
    print(f"{'hop':<15} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}   (load average {before} before, {after} after)")
    for k, xs in out.items():
        print(f"{k:<15} {pct(xs, 0.5) * 1e3:8.3f} {pct(xs, 0.99) * 1e3:8.3f} {statistics.mean(xs) * 1e3:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
