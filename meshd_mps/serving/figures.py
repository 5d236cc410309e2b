"""What ``meshd-mps top`` (and ``fleet top``) shows beside the daemon's answers, worked out from one
look to the next: each program's calls per second and call p50/p99 over the last seconds, its bytes
in and out per second (:class:`Rates`, from the counters and histogram of ``calls``), and the
events read from what changed between two looks (:func:`changes`: loads, unloads, upgrades,
relaunches, failures, state moves, GPU faults, blinks).  Pure (no I/O, no terminal), as tables.py
is, so that it is tested on its own; the quantiles are read as Prometheus reads them
(``callstats.quantile``), so that top and a dashboard agree.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshd_mps.base.callstats import quantile

#: The window the rates and quantiles are taken over (s): long enough for a p99 of a few calls a
#: second, short enough to follow a change within it.
SPAN_S = 10.0

Calls = Mapping[str, Any]  # a program's ``calls`` as the API shows it (callstats.CallStats.as_dict)


@dataclass(frozen=True)
class Figures:
    """One program's calls over the window: per second, and the p50 and p99 of their time (s);
    None where the window holds no call (or only one look)."""

    rate: float | None = None
    p50: float | None = None
    p99: float | None = None
    bytes_in: float | None = None
    bytes_out: float | None = None


def _total(c: Calls) -> int:
    return int(c.get("total", 0))


class Rates:
    """The looks of the last ``span`` seconds, each program's ``calls`` in each: :meth:`of` reads
    one program's :class:`Figures` from the oldest look that still counts it to the newest."""

    def __init__(self, span: float = SPAN_S):
        self.span = span
        self.looks: deque[tuple[float, dict[str, Calls]]] = deque()

    def add(self, calls: Mapping[str, Calls], at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        self.looks.append((at, dict(calls)))
        while len(self.looks) > 2 and at - self.looks[1][0] >= self.span:
            self.looks.popleft()

    def of(self, key: str) -> Figures:
        if not self.looks or key not in self.looks[-1][1]:
            return Figures()
        t1, last = self.looks[-1][0], self.looks[-1][1][key]
        # The oldest look of it since its counters last started (an unload and a load again under
        # the same name start them again): the looks before a count went down are not compared with.
        t0, old = t1, last
        for t, c in reversed(self.looks):
            if key not in c or _total(c[key]) > _total(old):
                break
            t0, old = t, c[key]
        if t0 >= t1:
            return Figures()
        dt = t1 - t0
        new_counts = list(last.get("counts", ()))
        old_counts = list(old.get("counts", ())) or [0] * len(new_counts)
        counts = [max(0, a - b) for a, b in zip(new_counts, old_counts, strict=False)]
        return Figures(rate=(_total(last) - _total(old)) / dt, p50=quantile(0.5, counts), p99=quantile(0.99, counts),
                       bytes_in=(last.get("bytes_in", 0) - old.get("bytes_in", 0)) / dt,
                       bytes_out=(last.get("bytes_out", 0) - old.get("bytes_out", 0)) / dt)

    def merged(self, keys: Iterable[str]) -> Figures:
        """Several programs' figures as one (a fleet program's replicas): rates added, quantiles of
        their histograms added up."""
        keys = list(keys)
        if not self.looks:
            return Figures()
        t1, last = self.looks[-1]
        t0, old = self.looks[0]
        if t0 >= t1:
            return Figures()
        dt = t1 - t0
        counts: list[int] = []
        rate = bin = bout = 0.0
        seen = False
        for k in keys:
            a, b = last.get(k), old.get(k)
            if a is None or b is None or _total(b) > _total(a):
                continue
            seen = True
            rate += (_total(a) - _total(b)) / dt
            bin += (a.get("bytes_in", 0) - b.get("bytes_in", 0)) / dt
            bout += (a.get("bytes_out", 0) - b.get("bytes_out", 0)) / dt
            diff = [max(0, x - y) for x, y in zip(a.get("counts", ()), b.get("counts", ()), strict=False)]
            counts = [x + y for x, y in zip(counts, diff, strict=False)] if counts else diff
        if not seen:
            return Figures()
        return Figures(rate, quantile(0.5, counts), quantile(0.99, counts), bin, bout)


# ---- events: what changed from one look to the next -------------------------------------------


def changes(before: Mapping[str, Any] | None, after: Mapping[str, Any],
            was: Mapping[str, Mapping[str, Any]] | None, now: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What happened between two looks, in words, oldest kind first: ``before``/``after`` are the
    daemon's status, ``was``/``now`` its programs by name (``describe``).  Nothing for the first
    look (``before`` None): the screen shows what is, the events what changed since."""
    if before is None or was is None:
        return []
    out: list[str] = []
    for name in sorted(now.keys() - was.keys()):
        p = now[name]
        out.append(f"loaded {name} on GPU {p.get('device', 0)}, slot {p.get('slot')} ({p.get('state')})")
    for name in sorted(was.keys() - now.keys()):
        out.append(f"unloaded {name}")
    for name in sorted(now.keys() & was.keys()):
        a, b = was[name], now[name]
        if b.get("upgrades", 0) > a.get("upgrades", 0):
            out.append(f"upgraded {name} to {b.get('hash')}")
        if b.get("faults", 0) > a.get("faults", 0):
            out.append(f"{name} failed: {b.get('error') or b.get('state')}")
        if b.get("restarts", 0) > a.get("restarts", 0) and b.get("upgrades", 0) == a.get("upgrades", 0):
            out.append(f"{name} relaunched (restart {b.get('restarts')})")
        elif a.get("state") != b.get("state"):
            out.append(f"{name}: {a.get('state')} -> {b.get('state')}" + (f" ({b['error']})" if b.get("error") else ""))
    seen = {f.get("at") for f in before.get("faults") or []}
    for f in after.get("faults") or []:
        if f.get("at") not in seen:
            kind = "GPU fault" if f.get("gpu_wide") else "fault"
            out.append(f"{kind} on GPU {f.get('device', 0)}: {f.get('faulted') or 'no culprit named'}"
                       f" ({f.get('by') or 'evidence'}); relaunched {', '.join(f.get('relaunched') or []) or 'none'}"
                       f" in {f.get('ms', 0):.0f} ms")
    if after.get("blinks", 0) > before.get("blinks", 0):
        n, ms = after["blinks"] - before.get("blinks", 0), after.get("last_blink_ms")
        out.append(f"{n} blink{'s' if n > 1 else ''}: running programs halted and relaunched"
                   + (f", the last {ms:.1f} ms" if ms is not None else ""))
    return out
