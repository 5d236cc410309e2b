"""``python -m meshd_mps``: the ``meshd-mps`` command (``meshd_mps/cli.py``); ``worker`` goes straight
to the worker's own start (as ``python -m workers`` does), before anything of the command line is
imported."""

import sys

if sys.argv[1:2] == ["worker"]:
    from workers.start import run

    raise SystemExit(run(sys.argv[2:]))

from meshd_mps.cli import main  # after the worker's dispatch, which must not import it

raise SystemExit(main())
