"""The bench's output: a ``Row`` per figure (its value beside a baseline from the same run, the
ratio, the target and PASS / MISS, or ERROR), the header that names the machine and the packages,
the text table and the JSON."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from meshd_mps.base import eventloop
from meshd_mps.bench.rig import Bench
from meshd_mps.gpu.compiler import nvjitlink_version


@dataclass
class Row:
    id: str
    name: str
    unit: str = ""
    value: float | None = None
    baseline: float | None = None
    base_name: str = ""
    target: str = "-"
    ok: bool | None = None
    note: str = ""
    error: str = ""
    #: For the plots (bench/plots.py): each series' latency at the quantiles ``QS`` (the row's unit),
    #: the figure's and its baselines'; a figure made of steps, each step's share (the row's unit).
    dist: dict[str, list[float]] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.value is not None and self.baseline else None

    @property
    def result(self) -> str:
        return "ERROR" if self.error else "-" if self.ok is None else "PASS" if self.ok else "MISS"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "result": self.result}


def describe(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def _try(f: Any) -> str:
    try:
        return str(f())
    except Exception as e:
        return f"unknown ({describe(e)})"


def _driver() -> str:
    from cuda.bindings import driver as cu

    v = cu.cuDriverGetVersion()[1]  # no cuInit, no context
    smi = _try(lambda: subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0])
    return f"{smi} (CUDA {v // 1000}.{v % 1000 // 10})"


def header(bench: Bench, argv: list[str]) -> dict[str, str]:
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": bench.device or "unknown (no backend opened)",
            "driver": _try(_driver) if bench.gpu == "cuda" else "none: the simulated GPU (--gpu sim)",
            "cuda-bindings": _try(lambda: metadata.version("cuda-bindings")),
            "nvjitlink": _try(lambda: "{} (library {}.{})".format(metadata.version("nvidia-nvjitlink"), *nvjitlink_version())),
            "nvrtc": _try(lambda: metadata.version("nvidia-cuda-nvrtc")), "python": sys.version.split()[0],
            "loop": eventloop.factory(bench.loop)[0],
            "ring cpu": f"{bench.cpu}" + (f" (CPU {bench.ring_cpu})" if bench.ring_cpu is not None else ""),
            "command": " ".join(["python -m meshd_mps.bench", *argv])}


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return (f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}") + f" {unit}"


def table(h: dict[str, str], rows: list[Row]) -> str:
    out = [f"meshd-mps bench  {h['date']}", *(f"  {k}: {v}" for k, v in h.items() if k != "date"), ""]
    cells = [["row", "figure", "value", "baseline", "ratio", "target", "result", "note"]]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        base = f"{fmt(r.baseline, r.unit)} ({r.base_name})" if r.base_name else fmt(r.baseline, r.unit)
        cells.append([f"({r.id})", r.name, fmt(r.value, r.unit), base, ratio, r.target, r.result, r.error or r.note])
    widths = [max(len(c[i]) for c in cells) for i in range(7)]
    for c in cells:
        out.append("  ".join(x.ljust(w) for x, w in zip(c[:7], widths, strict=True)) + "  " + c[7])
    return "\n".join(out)


#: The quantiles a row's ``dist`` gives each series at (the plots' latency distributions).
QS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)


def quantiles(xs: list[float], scale: float = 1e6) -> list[float]:
    """``xs`` (seconds) at each of ``QS``, times ``scale`` (default: in us), as a row's ``dist`` keeps them."""
    s = sorted(xs)
    return [round(s[min(len(s) - 1, int(q * len(s)))] * scale, 3) for q in QS]


def as_json(h: dict[str, str], rows: list[Row], left: list[int]) -> str:
    """What ``--json`` writes: the header, the rows and the child processes left behind (and the
    quantiles of the rows' ``dist``)."""
    return json.dumps({"header": h, "rows": [r.as_dict() for r in rows], "left_behind": left, "quantiles": list(QS)},
                      indent=1)
