"""The ``meshd-mps`` command: ``serve``, ``worker`` and the client subcommands."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        # The worker parses its own options; it must start fast and import no supervisor code.
        from workers.main import main as worker_main

        return worker_main(argv[1:])
    ap = argparse.ArgumentParser(prog="meshd-mps", description="Resident CUDA kernels, one MPS client process each.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("worker", help="one MPS client process (started by the daemon, not by hand)")
    args = ap.parse_args(argv)
    ap.error(f"unknown command {args.cmd}")
    return 2
