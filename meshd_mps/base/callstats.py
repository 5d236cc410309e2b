"""What a program's calls did: their count by outcome, a latency histogram and the bytes in and
out, kept per program by ``programs/calls.py`` and read by the metrics, ``ps --json``, ``meshd-mps
top`` and the fleet's views.

Recording is a handful of integer adds and one ``bisect`` per call (or per pipelined batch), so
that the ring's fast path pays nothing measurable for it (docs/benchmarks.md, "Call metrics").
The histogram is Prometheus' own shape: fixed upper bounds (``BUCKETS``, seconds), a count per
bucket, their sum; :func:`quantile` reads a quantile from it as Prometheus' ``histogram_quantile``
does, so that ``top`` and a dashboard agree.  Pure (no I/O, nothing above the errors), so that
the client side (``top``, the fleet) reads the figures without importing the daemon.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from meshd_mps.base.errors import CallTimeout, NotRunning, NotServing, PayloadTooLarge, RingFull

#: The latency histogram's upper bounds (seconds): a call through the ring is ~5-20 us on the GPU,
#: ~0.1 ms on the simulated one, a call over the API a millisecond or so; the call deadline is 5 s.
BUCKETS: tuple[float, ...] = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                              0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: A call's outcomes, each counted: answered, or refused or failed by its error's type.
OUTCOMES = ("ok", "timeout", "not_running", "not_serving", "ring_full", "too_large", "cancelled", "error")
_BY_TYPE: tuple[tuple[type[BaseException], str], ...] = (
    (CallTimeout, "timeout"), (NotRunning, "not_running"), (NotServing, "not_serving"), (RingFull, "ring_full"),
    (PayloadTooLarge, "too_large"), (asyncio.CancelledError, "cancelled"))


def outcome(e: BaseException) -> str:
    """The outcome a call that raised ``e`` is counted under (by type, never by message)."""
    return next((name for kind, name in _BY_TYPE if isinstance(e, kind)), "error")


class CallStats:
    """One program's calls since it was loaded (kept across its upgrades and relaunches: one object
    per program, as the Program is).  ``counts[i]``: calls that took at most ``BUCKETS[i]`` and more
    than the bound before; the last one, more than every bound."""

    __slots__ = ("bytes_in", "bytes_out", "counts", "ok", "refused", "seconds")

    def __init__(self) -> None:
        self.ok = 0  # calls answered (apart from the others: the hot path's one add)
        self.refused: dict[str, int] = dict.fromkeys(OUTCOMES[1:], 0)  # the others, by outcome
        self.counts: list[int] = [0] * (len(BUCKETS) + 1)
        self.seconds = 0.0  # the histogram's sum
        self.bytes_in = 0  # requests' payloads, into the program
        self.bytes_out = 0  # responses' payloads, out of it

    def answered(self, sent: int, got: int, seconds: float, n: int = 1) -> None:
        """``n`` calls answered: ``sent`` and ``got`` bytes in all, each in ``seconds`` (a pipelined
        batch: its time over its count)."""
        self.ok += n
        self.counts[bisect_left(BUCKETS, seconds)] += n
        self.seconds += seconds * n
        self.bytes_in += sent
        self.bytes_out += got

    def failed(self, e: BaseException, sent: int, n: int = 1) -> None:
        """``n`` calls that raised ``e``; ``sent``: the bytes of the requests posted (0: none was)."""
        self.refused[outcome(e)] += n
        self.bytes_in += sent

    @property
    def outcomes(self) -> dict[str, int]:
        """Every outcome's count, ``ok`` first."""
        return {"ok": self.ok, **self.refused}

    @property
    def total(self) -> int:
        return self.ok + sum(self.refused.values())

    def as_dict(self) -> dict[str, Any]:
        """As the API shows it (``calls`` of a program): plain JSON; ``counts`` by ``BUCKETS``
        (docs/api.md), which are not repeated for every program."""
        return {"total": self.total, "outcomes": self.outcomes, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "counts": list(self.counts), "seconds": round(self.seconds, 9)}


def quantile(q: float, counts: Sequence[float], bounds: Sequence[float] = BUCKETS) -> float | None:
    """The ``q`` quantile (0..1) of a histogram's per-bucket ``counts`` (the last: past every bound),
    interpolated linearly within its bucket as Prometheus' ``histogram_quantile`` does (the first
    bucket from 0; one past every bound reads as the last bound).  None for no observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * max(0.0, rank - seen) / c
        seen += c
    return bounds[-1]
