"""The worker's log lines (workers/wlog.py) are the daemon's (meshd_mps/base/log.py): the same keys and
values in JSON, the same console line, the same level filter; and a worker imports no structlog."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import structlog

from meshd_mps.base.log import setup_logging
from meshd_mps.state.program_files import program_body
from workers import wlog

from ..rigs.serve import EXAMPLES


def _structlog_line(capsys, as_json: bool) -> str:
    """The line meshd_mps.base.log writes; structlog's configuration (which holds this test's captured
    stderr) is put back after, for the tests that run next in this process."""
    was, config = structlog.is_configured(), structlog.get_config()
    setup_logging("worker", json=as_json)
    structlog.contextvars.bind_contextvars(pid=5, device=0)
    try:
        structlog.get_logger("x").warning("module loaded", program="echo", module=0, ms=0.53, slots=[1, 2])
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.configure(**config) if was else structlog.reset_defaults()
    return capsys.readouterr().err


def _wlog_line(capsys, monkeypatch, as_json: bool) -> str:
    monkeypatch.setattr(wlog, "_bound", {})
    monkeypatch.setattr(wlog, "_state", dict(wlog._state))
    wlog.setup("worker", as_json=as_json)
    wlog.bind(pid=5, device=0)
    wlog.log.warning("module loaded", program="echo", module=0, ms=0.53, slots=[1, 2])
    return capsys.readouterr().err


def _no_time(line: str) -> str:
    return line.split(" ", 1)[1]  # the console line's timestamp, the one field that differs


def test_json_lines_are_the_daemons(capsys, monkeypatch):
    theirs, ours = json.loads(_structlog_line(capsys, True)), json.loads(_wlog_line(capsys, monkeypatch, True))
    assert theirs.pop("timestamp")[:4] == ours.pop("timestamp")[:4]  # (structlog's contextvars come in hash order)
    assert ours == theirs == {"program": "echo", "module": 0, "ms": 0.53, "slots": [1, 2], "pid": 5, "device": 0,
                              "level": "warning", "msg": "module loaded", "component": "worker"}


def test_console_lines_are_the_daemons(capsys, monkeypatch):
    assert _no_time(_wlog_line(capsys, monkeypatch, False)) == _no_time(_structlog_line(capsys, False))


@pytest.mark.parametrize(("level", "shown"), [("warning", False), ("debug", True)])
def test_the_level_filters_as_the_daemons(capsys, monkeypatch, level, shown):
    monkeypatch.setenv("MESHD_MPS_LOG_LEVEL", level)
    monkeypatch.setattr(wlog, "_state", dict(wlog._state))
    wlog.setup("worker", as_json=True)
    wlog.log.info("said")
    assert ("said" in capsys.readouterr().err) is shown


def test_a_worker_imports_no_structlog():
    code = "import sys, workers.start, workers.main, workers.sim_gpu; print('structlog' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize(("told", "is_json"), [("console", False), ("json", True)])
def test_a_worker_writes_in_the_format_its_daemon_chose(capsys, monkeypatch, told, is_json):
    monkeypatch.setenv("MESHD_MPS_LOG_FORMAT", told)
    monkeypatch.setattr(wlog, "_state", dict(wlog._state))
    wlog.setup("worker")
    wlog.log.warning("module loaded", program="echo")
    assert capsys.readouterr().err.startswith("{") is is_json


def test_serve_in_console_format_is_one_format(serve, standin_on_path):
    """``serve --log-format console`` with its stderr a file: the workers' lines are console lines
    too, in the same stream (they were JSON, deciding by their own isatty)."""
    s = serve("mps", "--log-format", "console", "--pool", "1")
    s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "echo")))
    assert s.stop() == 0, s.log()[-4000:]
    lines = [ln for ln in s.log().splitlines() if ln.strip()]
    assert any("component=worker" in ln for ln in lines), lines[-20:]
    assert not [ln for ln in lines if ln.lstrip().startswith("{")], lines[-20:]
