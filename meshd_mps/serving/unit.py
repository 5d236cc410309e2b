"""``meshd-mps unit``: the systemd unit shipped as package data (``data/meshd-mps.service``:
``Type=notify``, ``KillMode=process``, ``StateDirectory=``), this installation's executable in it."""

from __future__ import annotations

import os
import sys

UNIT = "data/meshd-mps.service"


def unit_text(executable: str | None = None) -> str:
    """The shipped unit file, ``executable`` (default: this installation's meshd-mps, where it is
    found) in ExecStart= instead of the bare name systemd would look up in its own PATH."""
    from importlib.resources import files

    from meshd_mps.base.errors import ConfigError

    if executable is not None and (not os.path.isabs(executable)
                                   or any(not c.isprintable() or c in '"\\' for c in executable)):
        # systemd wants an absolute path in ExecStart=; a line break would end the line there and
        # start another directive, a quote or a backslash would change its quoting.
        raise ConfigError(f"--exec {executable!r}: an absolute path without control characters, quotes or"
                          " backslashes expected")
    text = files("meshd_mps").joinpath(UNIT).read_text(encoding="utf-8")
    exe = executable or own_executable()
    if exe is not None:
        quoted = f'"{exe}"' if any(c.isspace() for c in exe) else exe  # systemd splits ExecStart= at blanks
        text = text.replace("\nExecStart=meshd-mps ", f"\nExecStart={quoted} ")
    return text


def own_executable() -> str | None:
    """The meshd-mps script of this installation: the one running, else the one beside this
    Python (a virtual environment's), else the one on PATH; None if none is found."""
    import shutil

    if os.path.basename(sys.argv[0]) == "meshd-mps" and os.access(sys.argv[0], os.X_OK):
        return os.path.abspath(sys.argv[0])
    beside = os.path.join(os.path.dirname(sys.executable), "meshd-mps")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("meshd-mps")
    return os.path.abspath(found) if found else None
