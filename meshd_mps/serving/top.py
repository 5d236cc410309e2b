"""``meshd-mps top``: one node's daemon, live: per program its state, GPU, worker, heartbeat age,
calls per second, call p50/p99, bytes in and out per second, restarts, faults and data size; per
GPU its programs, pool (or context), the part of its resident blocks in use and its memory (NVML's
figures on the GPU, the simulation's on ``--gpu sim``); the latest events (loads, upgrades,
relaunches, failures, GPU faults, blinks).  Polled from the control API every second
(``GET /v1/status`` and ``/v1/programs``); the figures over the last seconds are figures.py's, the
screen and its keys screen.py's.  ``ps`` stays as it is: a table printed once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

from meshd_mps.serving.client import Client, ClientError
from meshd_mps.serving.figures import Figures, Rates, changes
from meshd_mps.serving.screen import Cell, Frame, Section, need_rich, run, view_of
from meshd_mps.serving.tables import duration

#: A poll's deadline (s): a daemon that does not answer in time is said so on the screen.
LOOK_S = 5.0

PROGRAM_HEAD = ["NAME", "STATE", "GPU", "PID", "BEAT-AGE", "CALLS/S", "P50", "P99", "IN/S", "OUT/S", "RESTARTS",
                "FAULTS", "DATA"]
GPU_HEAD = ["GPU", "NAME", "PROGRAMS", "POOL", "SM-USE", "MEMORY"]


def seconds(s: float | None) -> str:
    """A call's time: 85us, 1.25ms, 2.50s."""
    if s is None:
        return "-"
    return f"{s * 1e6:.0f}us" if s < 1e-3 else f"{s * 1e3:.2f}ms" if s < 1 else f"{s:.2f}s"


def size(n: float | None) -> str:
    """Bytes as 512B, 1.5K, 2.0M, 3.1G (powers of 1024)."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G"):
        if abs(n) < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # pragma: no cover - the loop returns at G


def rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def figure_cells(f: Figures) -> list[Cell]:
    """CALLS/S, P50, P99, IN/S, OUT/S of one program (or replica, or a fleet program)."""
    return [Cell(rate(f.rate), f.rate), Cell(seconds(f.p50), f.p50), Cell(seconds(f.p99), f.p99),
            Cell(size(f.bytes_in), f.bytes_in), Cell(size(f.bytes_out), f.bytes_out)]


def age(v: Any) -> Cell:
    return Cell("-", None) if not isinstance(v, (int, float)) else Cell(duration(float(v)), float(v))


class NodeTop:
    """The frames of one daemon's view, from its answers (:meth:`frame` is pure: tested alone)."""

    def __init__(self, client: Client, where: str):
        self.client, self.where = client, where
        self.rates = Rates()
        self.before: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None
        self.last: Frame | None = None

    def _get(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self.client.status(), self.client.programs()

    async def look(self) -> Frame:
        try:
            status, programs = await asyncio.to_thread(self._get)
        except ClientError as e:
            if self.last is None:
                raise
            return Frame(self.last.header, self.last.sections, error=f"the daemon does not answer: {e}")
        self.last = self.frame(status, programs)
        return self.last

    def frame(self, status: dict[str, Any], programs: list[dict[str, Any]], at: float | None = None) -> Frame:
        by_name = {p["name"]: p for p in programs}
        self.rates.add({n: p.get("calls") or {} for n, p in by_name.items()}, at)
        events = changes(self.before[0] if self.before else None, status, self.before[1] if self.before else None,
                         by_name)
        self.before = (status, by_name)
        stamp = time.strftime("%H:%M:%S")
        stalled = sum(p.get("state") == "stalled" for p in programs)
        header = (f"meshd-mps top  {self.where}  isolation {status.get('isolation')}, gpu {status.get('gpu')},"
                  f" up {duration(float(status.get('uptime_s', 0)))}  {len(programs)} programs"
                  f" ({stalled} stalled), {len(status.get('workers') or [])} workers  {time.strftime('%H:%M:%S')}")
        return Frame(header, [self.programs(programs), self.gpus(status)], [f"{stamp} {e}" for e in events])

    def programs(self, programs: list[dict[str, Any]]) -> Section:
        rows = []
        for p in programs:
            restarts, faults, data = p.get("restarts", 0), p.get("faults", 0), p.get("data_bytes", 0)
            rows.append([Cell(p["name"], p["name"]), Cell(str(p.get("state")), p.get("state")),
                         Cell(str(p.get("device", "-")), p.get("device")), Cell(str(p.get("pid", "-")), p.get("pid")),
                         age(p.get("beat_age_s")), *figure_cells(self.rates.of(p["name"])),
                         Cell(str(restarts), restarts), Cell(str(faults), faults), Cell(size(data), data)])
        return Section("PROGRAMS", PROGRAM_HEAD, rows, right=frozenset(range(4, 13)), empty="(no programs loaded)")

    @staticmethod
    def gpus(status: dict[str, Any]) -> Section:
        rows = []
        for d in status.get("devices") or []:
            if "pool" in d:  # MPS mode: the GPU's idle pooled workers
                pool = f"{len(d['pool'])}/{d.get('pool_cap', 0)} idle"
            else:  # blink mode: its one context and its blinks
                pool = f"context {d.get('context_pid', '-')}, {d.get('blinks', 0)} blinks"
            share = d.get("sm_share")
            used, total = d.get("memory_used"), d.get("memory_total")
            memory = "-" if used is None or not total else f"{size(used)}/{size(total)} ({100 * used / total:.0f}%)"
            rows.append([Cell(str(d.get("device")), d.get("device")), Cell(str(d.get("name")), d.get("name")),
                         Cell(str(d.get("programs", 0)), d.get("programs", 0)), Cell(pool),
                         Cell("-" if share is None else f"{100 * share:.1f}%", share), Cell(memory, used)])
        return Section("GPUS", GPU_HEAD, rows, right=frozenset({2, 4, 5}))


def main(args: argparse.Namespace, socket: Callable[[], str]) -> int:
    """``meshd-mps top``: 0 at ``q``, 1 if no daemon answers at the start, 2 without Rich."""
    from meshd_mps.base.errors import ConfigError

    try:
        need_rich()
        view = view_of(args.sort, args.reverse, args.filter, args.interval, PROGRAM_HEAD)
        client = Client(socket(), timeout=LOOK_S, gpu=args.gpu)
    except (ConfigError, ClientError) as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 2
    top = NodeTop(client, client.socket)
    try:
        return asyncio.run(run(view, top.look, every=args.interval, once=args.once))
    except ClientError as e:  # NoDaemon too: no daemon answers on the socket at the first look
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: as every other command (q is the way out that says 0)
        return 130
