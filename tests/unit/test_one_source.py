"""One source for each default and for the version: serve's defaults are
state/config.py's table wherever they are read (the Config the daemon runs with, the pool it
sizes, serve --help), and the package's version is meshd_mps/base/version.py's wherever it is shown."""

from __future__ import annotations

import dataclasses

import meshd_mps
from meshd_mps.base.version import version
from meshd_mps.serving import cli, server
from meshd_mps.state import config


def test_the_daemons_config_defaults_are_the_tables(monkeypatch):
    fields = {f.name: f.default for f in dataclasses.fields(server.Config)}
    for key, value in config.SERVE_DEFAULTS.items():
        if key not in ("devices", "daemon_cpus"):  # parsed there (None: every GPU, unplaced), text here
            assert fields[key] == value, key
    monkeypatch.setitem(config.SERVE_DEFAULTS, "loop", "asyncio")  # the table changed: serve --help follows
    serve = cli.parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    words = " ".join(serve.format_help().split())
    assert "the event loop: auto takes uvloop where it is installed (default asyncio)" in words
    assert "one MPS client per program (default blink)" in words and "(default off: a stop halts" in words


def test_the_pool_by_isolation():
    assert config.pool_of("mps", None) == config.POOL_BY_ISOLATION["mps"] == 4
    assert config.pool_of("blink", None) == 0 and config.pool_of("mps", 5) == 5
    assert config.help_defaults()["pool"] == "4 in mps mode, 0 in blink mode"


def test_one_version():
    v = version()
    assert v and v != "unknown"
    assert meshd_mps.__version__ == v
    assert cli.version_line().startswith(f"meshd-mps {v} (frame protocol ")
