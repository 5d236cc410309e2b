"""The worker's start: what must happen before anything else is imported, then its loop.

The worker parses its own options; it must start fast and import no supervisor code.  It logs
through workers/wlog.py, not structlog, whose import was 78 of a worker's ~180 ms start; and
should anything import structlog after all, rich and better_exceptions stay out (structlog.dev
imports them where installed, for console tracebacks the worker never prints: on the H200 host
that was 85 of the 134 ms a worker spent importing, docs/benchmarks.md, row d).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import cast


def run(argv: list[str] | None = None) -> int:
    """The worker with ``argv`` (default: this process's arguments), its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    for name in ("rich", "better_exceptions"):
        cast(dict[str, ModuleType | None], sys.modules).setdefault(name, None)  # None: an import of it fails
    from workers import pipes, warm

    if not {"-h", "--help"} & set(argv):  # --help prints to the caller's stdout: no frames follow, no GPU
        pipes.take()  # first: the frame pipes out of reach of the driver and of stray prints
        # The CUDA context is created while the worker imports the rest.  Not for --help: the
        # process would exit with that thread still in cuda-bindings' import, whose ldconfig child
        # is then orphaned (to meshd-mps, a subreaper, or to whoever ran the help).
        warm.start(argv)
    from workers.main import main as worker_main

    return worker_main(argv)
