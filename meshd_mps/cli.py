"""The ``meshd-mps`` command's entry (the console script, and ``python -m meshd_mps``): ``fleet ...``
goes to the fleet's command line (``meshd_mps/fleet/cli.py``), everything else to the node's
(``meshd_mps/serving/cli.py``).

It sits above both layers so that no import points up: the node's command line knows nothing of the
fleet, and a node without Ray never imports it.  Nothing is imported before the choice is made, so
``worker`` still starts as fast as ``python -m workers``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fleet"]:
        return fleet(argv[1:])
    from meshd_mps.serving.cli import main as node_main

    return node_main(argv)


def fleet(argv: list[str]) -> int:
    """``meshd-mps fleet ...``; without Ray installed, one line saying how to get it, exit 2 (as a
    usage error: nothing was tried)."""
    from meshd_mps.errors import FleetUnavailable

    try:
        from meshd_mps.fleet.cli import main as fleet_main
    except FleetUnavailable as e:
        print(f"meshd-mps: {e} ({e.hint})", file=sys.stderr)
        return 2
    return fleet_main(argv)
