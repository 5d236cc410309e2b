"""The simulated GPU knows a shipped example by its cubin, the image a load hands the worker, not
by the load's hash of the PTX: echo's PTX with a comment added (a new hash, the same code, the
same cubin: what the fleet's rolling upgrade loads) is loaded and answers as echo, while a user's
counter, and echo's code under a manifest that changes the cubin (32 warps: another register
cap), are still refused.  One ``--gpu sim`` daemon (blink mode), through its client as a user."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from meshd_mps.serving.client import ClientError, program_body

from .rigs.programs import program_dir
from .rigs.serve import EXAMPLES, Serve

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="msc-")
    s = Serve(d, "blink", os.path.join(d, "s.sock"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.kill()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="msc-p-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_echo_with_a_comment_added_runs_as_echo(daemon):
    echo = program_body(str(EXAMPLES / "echo"))
    v2 = {**echo, "ptx": echo["ptx"] + "\n// v2\n"}
    try:
        old = daemon.client.load(echo)["program"]
        daemon.client.unload("echo")
        new = daemon.client.load(v2)["program"]
        assert new["hash"] != old["hash"], (old, new)  # another image to the daemon and the user
        assert daemon.client.call("echo", "hello")["data"] == "hello"
        assert daemon.client.call("echo", "again")["data"] == "again"
    finally:
        daemon.client.unload("echo")


def test_a_users_counter_is_still_refused(daemon, tmp):
    d = program_dir(tmp, "counter")
    with pytest.raises(ClientError) as e:
        daemon.client.load(program_body(str(d)))
    assert e.value.status == 400 and "is not one of the shipped examples" in str(e.value), e.value
    assert all(p["name"] != "counter" for p in daemon.client.programs())


def test_echos_code_under_a_manifest_that_changes_the_cubin_is_refused(daemon, tmp):
    d = program_dir(tmp, "echo32", (EXAMPLES / "echo" / "echo.cu").read_text(), file="echo32.cu", warps=32)
    with pytest.raises(ClientError) as e:
        daemon.client.load(program_body(str(d)))
    assert e.value.status == 400 and "is not one of the shipped examples" in str(e.value), e.value
    assert all(p["name"] != "echo32" for p in daemon.client.programs())
