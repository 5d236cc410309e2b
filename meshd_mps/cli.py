"""The ``meshd-mps`` command's entry (the console script, and ``python -m meshd_mps``): ``fleet ...``
goes to the fleet's command line (``meshd_mps/fleet/cli.py``), everything else to the node's
(``meshd_mps/serving/cli.py``).

It sits above both layers so that no import points up: the node's command line knows nothing of the
fleet, and a node without Ray never imports it.  Nothing is imported before the choice is made, so
``worker`` still starts as fast as ``python -m workers``.
"""

from __future__ import annotations

import os
import sys

#: The exit status of a command whose reader went away (``meshd-mps check DIR | head -1``): a shell's
#: for a process ended by SIGPIPE, as a Unix tool that does not catch it ends.
CUT_SHORT = 128 + 13


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # its stdout is its frame pipe, which it handles itself
        return _command(argv)
    try:
        rc = _command(argv)
        sys.stdout.flush()  # inside the try: a reader gone shows at the last write, often this one
        return rc
    except BrokenPipeError:
        # The reader took what it wanted: the rest of the output goes nowhere, and nothing more is said
        # (Python would print a traceback, then fail again flushing stdout at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CUT_SHORT


def _command(argv: list[str]) -> int:
    if argv[:1] == ["fleet"]:
        return fleet(argv[1:])
    from meshd_mps.serving.cli import main as node_main

    return node_main(argv)


def fleet(argv: list[str]) -> int:
    """``meshd-mps fleet ...``; without Ray installed, one line saying how to get it, exit 2 (as a
    usage error: nothing was tried)."""
    from meshd_mps.base.errors import FleetUnavailable

    try:
        from meshd_mps.fleet.cli import main as fleet_main
    except FleetUnavailable as e:
        print(f"meshd-mps: {e} ({e.hint})", file=sys.stderr)
        return 2
    return fleet_main(argv)
