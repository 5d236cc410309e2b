"""The programs a see-it test runs beside the daemon (tmux, prometheus, promtool): found on PATH, else
installed by scripts/test-tools.sh (Debian's packages, as root; ``make test`` starts it as the suite
starts, and a test that comes first waits for it), else the test skips saying why."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .serve import REPO

SCRIPT = REPO / "scripts" / "test-tools.sh"
#: The install's deadline (s): Debian's prometheus and tmux, ~23 MB, and the package lists if stale.
INSTALL_S = 240.0
#: The script's exit status for "cannot install here" (not root, no apt-get): a skip, not a failure.
CANNOT = 3


def need(*tools: str) -> dict[str, str]:
    """Each of ``tools``' path, installing them where they are missing (a failed install as root is
    a failure of the test, not a skip: CI must run it)."""
    if any(shutil.which(t) is None for t in tools):
        r = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=INSTALL_S)
        if r.returncode == CANNOT:
            pytest.skip(r.stderr.strip())
        assert r.returncode == 0, f"scripts/test-tools.sh failed ({r.returncode}):\n{r.stderr[-3000:]}"
    paths = {t: shutil.which(t) for t in tools}
    assert all(paths.values()), f"installed, yet not on PATH: {paths}"
    return {t: p for t, p in paths.items() if p}
