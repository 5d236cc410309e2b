"""Shared fixtures: the stand-in MPS daemon on PATH, a rig of daemon + supervisor
+ simulated workers, the check that no test leaves a child process behind, and
(``no_leaks``, used by every fault test) that none leaves an fd or a temporary file."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile

import pytest

from meshd_mps.deadlines import Deadlines
from meshd_mps.isolation.mps import Mps, MpsIsolation
from meshd_mps.mps import standin
from meshd_mps.mps.control import ControlDaemon, become_subreaper
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.supervisor import Supervisor

from .procs import Resources, children, describe, wait_gone

# The control daemon is re-parented to us; tests reap it as meshd does.
become_subreaper()

# This session's own temporary directory (for us and, through TMPDIR, every process we start):
# the leak checks count the meshd* entries in it, and a second test run on the same machine
# (its own directory) can neither add to them nor be blamed for them.  Searchable by others
# (0711, not listable) so that the other-uid test's connection is refused by the socket's own
# mode and not by a directory on the way.  Short: AF_UNIX paths stop at 108 bytes.
SESSION_TMP = tempfile.mkdtemp(prefix="meshd-tests.")
os.chmod(SESSION_TMP, 0o711)
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP
# meshd-mps serve keeps its desired state in $XDG_STATE_HOME/meshd-mps by default: never the user's own.
os.environ["XDG_STATE_HOME"] = os.path.join(SESSION_TMP, "xdg-state")
os.environ.pop("STATE_DIRECTORY", None)
atexit.register(shutil.rmtree, SESSION_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_child_left():
    """After every test: no child process of ours, running or zombie (checked, not assumed)."""
    before = children()
    yield
    left = wait_gone(children() - before, within=5.0)
    assert not left, f"child processes left behind: {describe(left)}"


@pytest.fixture
def no_leaks():
    """Around a fault test: the same open fds (/proc/self/fd) and the same meshd* temporary
    entries after it as before.  Counted within the test: its backend and rig are closed when its
    body returns, and the event loop (set up after this, torn down before) is closed too."""
    before = Resources.now()
    yield
    leaked = Resources.now().leaks_since(before)
    assert not leaked, f"the test leaked: {leaked}"


@pytest.fixture
def tmp():
    """A short temporary directory, removed after the test: a daemon's socket and its MPS pipes live
    under it, and AF_UNIX paths stop at 108 bytes."""
    d = tempfile.mkdtemp(prefix="mt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def standin_on_path(monkeypatch):
    """The explicit stand-in for nvidia-cuda-mps-control, first on PATH (CI has no GPU)."""
    # This interpreter's bin next: the stand-in runs under the first python3 on PATH.
    path = [standin.BIN_DIR, os.path.dirname(sys.executable), os.environ.get("PATH", "")]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    return standin.BIN_DIR


def sim(**script) -> bytes:
    """An image for the simulated GPU: what its kernel and the worker do."""
    return b"MESHSIM1" + json.dumps(script).encode()


#: Short retire deadlines keep hang tests quick; replies keep the seed's.
TEST_DEADLINES = Deadlines(retire_quit=1.0, retire_kill=2.0)


class Rig:
    """MPS mode's host-wide part on a fresh stand-in daemon, and GPU ``devices[0]``'s isolation
    (as ``async with``), its pool empty: each test prewarms what it needs."""

    def __init__(self, deadlines=TEST_DEADLINES, pool_cap=4, max_clients=48, sms=0, devices=(0,)):
        self.mailbox = Mailbox.create()
        # A short path: MPS's sockets live in it and AF_UNIX paths stop at 108 bytes.
        self.daemon = ControlDaemon(tempfile.mkdtemp(prefix="meshd-test-"), temporary=True)
        self.sup = Supervisor(deadlines)
        self.mps = Mps(self.daemon, self.sup, self.mailbox.path, sms, "sim", pool_cap, max_clients)
        self.devices = devices

    async def __aenter__(self) -> MpsIsolation:
        await self.mps.start()
        await self.sup.start()
        for d in self.devices:
            self.mps.add(d)
        return self.mps.gpus[self.devices[0]]

    async def __aexit__(self, *exc) -> None:
        try:
            for g in self.mps.gpus.values():
                await g.close()
            await self.sup.close()
        finally:
            await self.mps.close()
            self.mailbox.close()


@pytest.fixture
def rig(standin_on_path):
    """Rig(...) as an async context manager: GPU 0's MpsIsolation, on a fresh stand-in daemon."""
    return lambda **kw: Rig(**kw)
