"""The package's version, read in one place (``meshd_mps.__version__``, ``meshd-mps --version``,
the daemon's status and metrics all ask here).

The installed distribution's metadata; in a source tree that is not installed, pyproject.toml's
version with ``+source``; else ``unknown``.  Read when first asked, not at import: the worker
starts through the CLI, and importlib.metadata's scan costs it tens of milliseconds.
"""

from __future__ import annotations

import functools
from pathlib import Path

DISTRIBUTION = "meshd-mps"


@functools.cache
def version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"]) + "+source"
    except (OSError, KeyError, ValueError):
        return "unknown"
