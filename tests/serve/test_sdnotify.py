"""sd_notify (``serving/sdnotify.py``) to a real AF_UNIX datagram socket: a path and an abstract one;
nothing without $NOTIFY_SOCKET; a gone socket logged, never raised.  And serve says READY=1 once
it serves and STOPPING=1 when it stops."""

from __future__ import annotations

import os
import signal
import socket

import pytest
from structlog.testing import capture_logs

from meshd_mps.serving.sdnotify import notify

from ..rigs.serve import Serve


@pytest.fixture
def receiver(tmp):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = os.path.join(tmp, "notify")
    s.bind(path)
    s.settimeout(30)  # a bound on the wait, never a pause: recv returns as soon as the datagram is there
    yield s, path
    s.close()


def test_to_a_path(receiver):
    s, path = receiver
    assert notify("READY=1", "STATUS=serving", environ={"NOTIFY_SOCKET": path})
    assert s.recv(4096) == b"READY=1\nSTATUS=serving"


def test_to_an_abstract_socket():
    name = f"meshd-mps-test-{os.getpid()}-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(30)
        assert notify("STOPPING=1", environ={"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"STOPPING=1"


def test_unset_is_a_no_op():
    assert notify("READY=1", environ={}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": ""}) is False


def test_a_gone_or_odd_socket_is_logged_not_raised(tmp_path):
    gone = str(tmp_path / "gone")
    with capture_logs() as logs:
        assert notify("READY=1", environ={"NOTIFY_SOCKET": gone}) is False
        assert notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert [e["log_level"] for e in logs] == ["warning", "warning"]
    assert logs[0]["socket"] == gone and logs[0]["fields"] == ["READY=1"]


def test_serve_notifies_ready_and_stopping(receiver, tmp, monkeypatch):
    s, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    sock = os.path.join(tmp, "s.sock")
    d = Serve(tmp, "blink", sock)
    try:
        ready = s.recv(4096).decode()  # sent once the socket serves
        assert ready.splitlines() == ["READY=1", f"STATUS=serving on {sock}"]
        d.wait_ready()
        assert d.stop(signal.SIGTERM) == 0
        assert s.recv(4096).decode().splitlines() == ["STOPPING=1", "STATUS=shutting down on SIGTERM"]
    finally:
        d.kill()
