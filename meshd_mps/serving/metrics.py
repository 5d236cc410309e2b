"""A tiny metrics registry and the Prometheus text exposition format 0.0.4.

No prometheus_client: a family is a name, a help line, a type and a function
that returns its samples when scraped (so most metrics are read from the live
objects, never kept twice); a :class:`Histogram` keeps its own buckets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Labels = Mapping[str, str]
Sample = tuple[Labels, float]
#: What a collector returns: one value (no labels) or (labels, value) pairs.
Collected = float | int | None | Iterable[Sample]


def format_value(v: float) -> str:
    """A sample value as the text format writes it: integers without a point, NaN, +Inf, -Inf."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    for k in labels:
        if not _LABEL.match(k) or k.startswith("__"):
            raise ValueError(f"metrics: bad label name {k!r}")
    return "{" + ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items()) + "}"


@dataclass
class Family:
    name: str
    help: str
    type: str  # counter | gauge | summary | histogram | untyped
    collect: Callable[[], Collected]

    def samples(self) -> list[tuple[str, Labels, float]]:
        got = self.collect()
        if got is None:
            return []
        if isinstance(got, (int, float)):
            return [(self.name, {}, got)]
        return [(self.name, labels, value) for labels, value in got]

    def render(self) -> str:
        lines = [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.type}"]
        for name, labels, value in self.samples():
            lines.append(f"{name}{format_labels(labels)} {format_value(value)}")
        return "\n".join(lines) + "\n"


DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    """A histogram without labels: cumulative buckets, ``_sum`` and ``_count``."""

    name: str
    help: str
    buckets: Sequence[float] = DEFAULT_BUCKETS
    _counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0
    type: str = "histogram"

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError("metrics: histogram buckets must be sorted")
        self._counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        for i, le in enumerate(self.buckets):
            if v <= le:
                self._counts[i] += 1
        self.sum += v
        self.count += 1

    def render(self) -> str:
        lines = [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} histogram"]
        for le, n in zip(self.buckets, self._counts):
            lines.append(f'{self.name}_bucket{{le="{format_value(float(le))}"}} {n}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {format_value(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return "\n".join(lines) + "\n"


class Registry:
    """Families in registration order; ``render()`` is the whole exposition."""

    def __init__(self) -> None:
        self._families: dict[str, Family | Histogram] = {}

    def _add(self, f: Family | Histogram) -> None:
        if not _NAME.match(f.name):
            raise ValueError(f"metrics: bad metric name {f.name!r}")
        if f.name in self._families:
            raise ValueError(f"metrics: {f.name} registered twice")
        self._families[f.name] = f

    def counter(self, name: str, help: str, collect: Callable[[], Collected]) -> Family:
        if not name.endswith("_total"):
            raise ValueError(f"metrics: counter {name} must end in _total")
        f = Family(name, help, "counter", collect)
        self._add(f)
        return f

    def gauge(self, name: str, help: str, collect: Callable[[], Collected]) -> Family:
        f = Family(name, help, "gauge", collect)
        self._add(f)
        return f

    def histogram(self, name: str, help: str, buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        h = Histogram(name, help, tuple(buckets))
        self._add(h)
        return h

    def names(self) -> list[str]:
        return list(self._families)

    def render(self) -> str:
        """The text format: every family, a failing collector skipped with a comment."""
        out = []
        for f in self._families.values():
            try:
                out.append(f.render())
            except Exception as e:  # one broken collector must not hide the others
                out.append(f"# {f.name}: collector failed: {escape_help(f'{type(e).__name__}: {e}')}\n")
        return "".join(out)
