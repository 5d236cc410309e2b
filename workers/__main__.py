"""``python -m workers``: the worker process, started straight (supervision/argv.py), importing no
part of the daemon's command line or serving layer; ``meshd-mps worker`` runs the same."""

from workers.start import run

raise SystemExit(run())
