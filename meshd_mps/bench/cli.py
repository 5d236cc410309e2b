"""``meshd-mps bench`` and ``python -m meshd_mps.bench``: the arguments checked as serve checks its
own (exit 2, the fault named), the sections run, the table printed, the JSON written and the plots
drawn (``--plot DIR``; ``--from FILE``: a kept run's, running nothing); exit 1 on an ERROR row or a
child process left behind."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from meshd_mps.base import defaults, eventloop
from meshd_mps.base.errors import ConfigError
from meshd_mps.base.log import setup_logging
from meshd_mps.bench.children import leftovers
from meshd_mps.bench.report import as_json, header, table
from meshd_mps.bench.rig import Bench
from meshd_mps.bench.runner import SECTIONS, run_bench
from meshd_mps.supervision import cpus


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m meshd_mps.bench", description="meshd-mps's figures, each beside its baseline.")
    ap.add_argument("--gpu", choices=("cuda", "sim"), default="cuda", help="the real GPU (default) or the CPU simulation")
    ap.add_argument("--quick", action="store_true", help="smaller counts (4 workers, fewer samples): a CPU smoke run")
    ap.add_argument("--json", metavar="FILE", help="also write the header and rows as JSON")
    ap.add_argument("--mps-dir", metavar="DIR", help="where the private MPS daemons' directories go (default: a temporary one)")
    ap.add_argument("--loop", choices=eventloop.CHOICES, default="auto",
                    help="the event loop (default auto: uvloop where installed; (b) then runs once more on asyncio)")
    ap.add_argument("--only", metavar="a,b,...", help="run only these sections (letters a-j, m, p and v, or their names,"
                    " e.g. versus; comma-separated)")
    ap.add_argument("--cpu", default="auto", metavar="N|auto|off",
                    help="the host CPU that (f)'s floor and ring spin on (default auto: the fastest floor of a survey)")
    ap.add_argument("--plot", metavar="DIR", help="also draw the figures as SVG plots into DIR (matplotlib: the plot"
                    " extra): latency distributions, stalls, a fault's recovery by step")
    ap.add_argument("--from", dest="source", metavar="FILE",
                    help="with --plot: draw the plots of a run's --json FILE, running nothing")
    args = ap.parse_args(argv)
    if args.source is not None:
        return replot(args.source, args.plot)
    if args.plot:
        from meshd_mps.bench.plots import check

        try:
            check()  # before the run, not after it
        except ConfigError as e:
            print(f"meshd-mps bench: {e}", file=sys.stderr)
            return 2
    if args.cpu not in ("auto", "off"):
        try:  # checked as serve checks --daemon-cpus: (f) and (b) place the bench's process so
            one = cpus.parse(args.cpu, "--cpu")
            if len(one) != 1:
                raise ConfigError(f"--cpu {args.cpu}: one CPU, auto or off")
            cpus.split(one, "--cpu")
        except ConfigError as e:
            print(f"meshd-mps bench: {e}", file=sys.stderr)
            return 2
    os.environ.setdefault(defaults.LOG_LEVEL_ENV, "warning")  # workers inherit it
    setup_logging(component="bench")
    try:
        eventloop.factory(args.loop)
    except eventloop.LoopError as e:
        print(f"meshd-mps bench: {e}", file=sys.stderr)
        return 2
    if args.only and not set(args.only.split(",")) <= {x for sec in SECTIONS for x in sec[:2]}:
        letters = ", ".join(f"{sec[0]} ({sec[1]})" for sec in SECTIONS)
        print(f"meshd-mps bench: --only {args.only}: expected some of the letters (or names) {letters}, comma-separated",
              file=sys.stderr)
        return 2
    bench = Bench(args.gpu, args.quick, args.mps_dir, args.loop, args.cpu)
    try:
        rows = run_bench(bench, args.only)
    finally:
        bench.cleanup()
    left = leftovers()
    h = header(bench, argv)
    print(table(h, rows))
    if left:
        print(f"ERROR: child processes left behind (killed): {left}")
    report = as_json(h, rows, left)
    if args.json:
        Path(args.json).write_text(report)
    if args.plot and draw(json.loads(report), args.plot) != 0:
        return 2
    return 1 if left or any(r.error for r in rows) else 0


def draw(report: dict[str, Any], out: str, prog: str = "meshd-mps bench") -> int:
    """The plots of ``report`` into ``out``, each named; 2 (said why) without matplotlib."""
    from meshd_mps.bench.plots import plot

    try:
        made = plot(report, out)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"plots: {', '.join(str(p) for p in made) or 'none (no row to draw)'}")
    return 0


def replot(source: str, out: str | None, prog: str = "meshd-mps bench") -> int:
    """``--from FILE --plot DIR``: a kept run's plots drawn again; exit 2 for a file that is not one."""
    if out is None:
        print(f"{prog}: --from {source}: with --plot DIR (what to draw it into)", file=sys.stderr)
        return 2
    try:
        report = json.loads(Path(source).read_text())
        if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
            raise ValueError("not a bench's --json output (no rows)")
    except (OSError, ValueError) as e:
        print(f"{prog}: --from {source}: {e}", file=sys.stderr)
        return 2
    return draw(report, out, prog)
