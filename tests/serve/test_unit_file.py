"""The shipped systemd unit (``meshd_mps/data/meshd-mps.service``, printed by ``meshd-mps unit``):
the lines live restore and readiness depend on, and ``systemd-analyze verify`` where it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from meshd_mps.serving.unit import unit_text

from ..rigs.serve import cli


def directives(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def test_the_lines_that_matter():
    d = directives(unit_text("/usr/bin/meshd-mps"))
    assert d["Type"] == "notify" and d["NotifyAccess"] == "main"
    assert d["KillMode"] == "process"  # the workers outlive a stop, for the next instance to adopt
    assert d["StateDirectory"] == "meshd-mps" and d["StateDirectoryMode"] == "0700"
    assert d["Restart"] == "on-failure" and "TimeoutStopSec" in d and "LimitNOFILE" in d
    assert "ExecReload" not in d  # SIGHUP stops meshd-mps
    assert d["ExecStart"].startswith("/usr/bin/meshd-mps serve --isolation mps ")


def test_the_bare_name_without_an_executable(monkeypatch):
    monkeypatch.setattr("meshd_mps.serving.unit.own_executable", lambda: None)
    assert directives(unit_text())["ExecStart"].startswith("meshd-mps serve ")


def test_meshd_mps_unit_prints_it():
    r = cli("unit", "--exec", "/opt/meshd mps/bin/meshd-mps")
    assert r.returncode == 0, r.stderr
    assert directives(r.stdout)["ExecStart"].startswith('"/opt/meshd mps/bin/meshd-mps" serve ')


@pytest.mark.parametrize("exe", ["/bin/x\nExecStartPre=/bin/evil", "relative/meshd-mps", "", '/opt/a"b', "/opt/a\\b"])
def test_an_exec_that_would_break_the_unit_is_refused(exe):
    """systemd wants an absolute path; a line break would start a directive of its own."""
    r = cli("unit", "--exec", exe)
    assert r.returncode == 2 and not r.stdout, r.stdout
    assert r.stderr.startswith(f"meshd-mps: --exec {exe!r}: an absolute path") and "Traceback" not in r.stderr


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed: the unit file is not verified here")
    # verify wants ExecStart='s program to exist: this interpreter stands in for meshd-mps.
    unit = tmp_path / "meshd-mps.service"
    unit.write_text(unit_text(os.path.realpath(sys.executable)))
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    mine = [line for line in (r.stdout + r.stderr).splitlines() if "meshd-mps.service" in line]
    assert r.returncode == 0 and not mine, r.stdout + r.stderr
