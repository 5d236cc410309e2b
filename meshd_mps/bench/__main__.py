"""``python -m meshd_mps.bench``: the bench's command line (``meshd-mps bench`` is the same)."""

from meshd_mps.bench.cli import main

raise SystemExit(main())
