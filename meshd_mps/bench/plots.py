"""The bench's figures as SVG plots (``meshd-mps bench --plot DIR``, the fleet bench's too), drawn
from the rows the run made or the JSON a run wrote (``--from FILE``): one command makes them again
from a kept run, for docs/benchmarks.md.

- ``latency.svg``: each row with a latency distribution (``Row.dist``: the ring's round trips beside
  the floor and the host spin, the ask beside the raw pipe, the fleet's call beside a bare Ray
  echo), each series' quantiles (``report.QS``) on a log axis.
- ``stall.svg``: how long running programs stood still while a program loaded (a), and across a
  restart or an upgrade of meshd-mps with live restore (j, k), each beside its idle baseline.
- ``recovery.svg``: a GPU fault's recovery by step (``Row.parts``, rows (i)), each case's steps
  stacked, its floor marked.
- ``fleet.svg``: the fleet's times (l1, l2) beside their direct baselines.

matplotlib is an optional extra (``pip install 'meshd-mps[plot]'``), imported only here, without
pyplot (no global backend or state: a Figure drawn straight to SVG).  The SVGs are made the same
from the same numbers (no date in them, fixed ids), so that a regenerated plot's diff is its data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from meshd_mps.base.errors import ConfigError
from meshd_mps.bench.report import QS

HINT = "pip install 'meshd-mps[plot]' (matplotlib)"
#: The recovery's steps in order (programs/report.py's RECOVERY_STEPS, after the fault's detection).
STEPS = ("detect", "decide", "teardown", "server_ready", "contexts", "relaunch")

Report = dict[str, Any]  # what --json writes: header, rows, quantiles


def check() -> Any:
    """matplotlib, or ConfigError saying how to install it (asked before a run, not after it)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(f"--plot needs matplotlib, which is not installed: {HINT}") from e
    return matplotlib


def _title(report: Report, what: str) -> str:
    h = report.get("header") or {}
    return f"{what}\n{h.get('device', '?')}, {h.get('date', '?')}"


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    return path


def latency(report: Report, path: Path) -> Path | None:
    rows = [r for r in report["rows"] if r.get("dist") and r["id"] != "v"]  # (v)'s have a plot of their own
    if not rows:
        return None
    from matplotlib.figure import Figure

    qs = report.get("quantiles") or list(QS)
    fig = Figure(figsize=(8, 3.2 * len(rows)), layout="constrained")
    for ax, r in zip(fig.subplots(len(rows), 1, squeeze=False)[:, 0], rows, strict=True):
        for name, values in r["dist"].items():
            ax.plot(values, [100 * q for q in qs], marker="o", markersize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel(r.get("unit") or "")
        ax.set_ylabel("percentile")
        ax.set_title(f"({r['id']}) {r['name'].split(', p50')[0]}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(report, "latency distributions, each beside its baselines"), fontsize=11)
    return _save(fig, path)


def versus(report: Report, path: Path, ids: Collection[str], what: str, keep: Callable[[dict[str, Any]], bool] = lambda r: True,
           ) -> Path | None:
    """A bar per row of ``ids`` and one per baseline, a panel per unit."""
    rows = [r for r in report["rows"] if r["id"] in ids and r.get("value") is not None and r.get("baseline") is not None
            and keep(r)]
    if not rows:
        return None
    from matplotlib.figure import Figure

    units = sorted({r["unit"] for r in rows})
    n = [sum(r["unit"] == u for r in rows) for u in units]
    fig = Figure(figsize=(9, 1.2 + 0.7 * sum(n) + 0.6 * len(units)), layout="constrained")
    axes = fig.subplots(len(units), 1, squeeze=False, height_ratios=n)[:, 0]
    for ax, unit in zip(axes, units, strict=True):
        mine = [r for r in rows if r["unit"] == unit]
        ys = range(len(mine))
        ax.barh([y + 0.2 for y in ys], [r["value"] for r in mine], height=0.4, label="the figure")
        ax.barh([y - 0.2 for y in ys], [r["baseline"] for r in mine], height=0.4, label="its baseline", alpha=0.6)
        ax.set_yticks(list(ys), [f"({r['id']}) {r['name']}\nvs {r.get('base_name') or 'baseline'}" for r in mine],
                      fontsize=7)
        ax.invert_yaxis()
        values = [v for r in mine for v in (r["value"], r["baseline"]) if v > 0]
        if values and max(values) > 20 * min(values):  # figures of several orders side by side
            from matplotlib.ticker import NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(_title(report, what), fontsize=11)
    return _save(fig, path)


def contenders(report: Report, path: Path) -> Path | None:
    """Row (v): each contender's p50 by batch size, grouped by batch (knn resident in-process and
    through its socket, PyTorch eager, its CUDA graph, a launch per batch)."""
    import re

    got: dict[str, dict[int, float]] = {}
    for r in report["rows"]:
        m = re.match(r"versus: (.+?),? batch (\d+), p50$", r["name"]) if r["id"] == "v" else None
        if m and r.get("value") is not None:
            got.setdefault(m.group(1).replace("meshd-mps resident ", "meshd-mps "), {})[int(m.group(2))] = r["value"]
    if not got:
        return None
    from matplotlib.figure import Figure

    batches = sorted({b for v in got.values() for b in v})
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(got)
    for i, (who, by) in enumerate(sorted(got.items())):
        xs = [j + i * width for j, b in enumerate(batches) if b in by]
        ax.bar(xs, [by[b] for b in batches if b in by], width=width, label=who)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("p50 (us)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    fig.suptitle(_title(report, "exact top-10 over 1M x 128 fp16: each contender's p50 by batch"), fontsize=11)
    return _save(fig, path)


def recovery(report: Report, path: Path) -> Path | None:
    rows = [r for r in report["rows"] if r.get("parts")]
    if not rows:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 1.5 + 0.6 * len(rows)), layout="constrained")
    ax = fig.subplots()
    steps = [s for s in STEPS if any(s in r["parts"] for r in rows)]
    steps += sorted({k for r in rows for k in r["parts"]} - set(steps))
    left = [0.0] * len(rows)
    for step in steps:
        widths = [max(0.0, float(r["parts"].get(step, 0.0))) for r in rows]
        ax.barh(range(len(rows)), widths, left=left, label=step)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    floors = [r.get("baseline") for r in rows]
    ax.scatter([f for f in floors if f is not None], [i for i, f in enumerate(floors) if f is not None], marker="|",
               s=300, color="black", label="floor", zorder=3)
    ax.set_yticks(range(len(rows)), [r["name"].removeprefix("recovery: ") for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(rows[0].get("unit") or "ms")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncols=7, loc="upper center", bbox_to_anchor=(0.5, -0.3 if len(rows) < 4 else -0.15))
    fig.suptitle(_title(report, "a fault's recovery, by step: from the fault to every program beating again"),
                 fontsize=11)
    return _save(fig, path)


def plot(report: Report, out: str | os.PathLike[str]) -> list[Path]:
    """Every plot ``report``'s rows make, written into ``out`` (made if need be); their paths.
    ConfigError without matplotlib."""
    mpl = check()
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    made: list[Path | None] = []
    # Fixed ids and text kept as text: the same numbers make the same file.
    with mpl.rc_context({"svg.hashsalt": "meshd-mps", "svg.fonttype": "none"}):
        made.append(latency(report, d / "latency.svg"))
        made.append(versus(report, d / "stall.svg", "ajk", "running programs' stall during loads, restarts and"
                           " upgrades, beside their idle gap", keep=lambda r: "gap" in r["name"] or r["id"] == "a"))
        made.append(recovery(report, d / "recovery.svg"))
        made.append(contenders(report, d / "versus.svg"))
        made.append(versus(report, d / "fleet.svg", ("l1", "l2"), "the fleet's placements and moves, beside the same"
                           " loads made directly on the nodes"))
    return [p for p in made if p is not None]
