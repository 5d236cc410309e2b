"""Native clients: a CUDA process that is not one of our workers joins our
MPS server with the environment ``meshd-mps native`` prints, is registered by pid, counted, and
dropped when it exits.  End to end on the stand-in MPS daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshd_mps.serving.client import ClientError

from ..rigs.serve import REPO, Serve, cli, env
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(120)

#: A "CUDA process" of the user's: on the stand-in, context creation is connect_client.
NATIVE = ("import os, sys\n"
          "from meshd_mps.standin import connect_client\n"
          "s = connect_client(os.environ['CUDA_MPS_PIPE_DIRECTORY'], os.getpid())\n"
          "print('joined' if s else 'plain', flush=True)\n"
          "sys.stdin.read()\n")


def test_a_native_client_joins_is_counted_and_is_dropped_at_its_exit(tmp):
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1")
    try:
        s.wait_ready()
        got = s.client.native()
        assert got["clients"] == [] and set(got["env"]) == {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
        out = cli("native", "--socket", s.sock)
        assert out.returncode == 0 and f"export CUDA_MPS_PIPE_DIRECTORY={got['env']['CUDA_MPS_PIPE_DIRECTORY']}" in out.stdout
        e = {**env(), **got["env"]}
        p = subprocess.Popen([sys.executable, "-c", NATIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=e, cwd=REPO)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "joined"
            ans = s.client.native(add=p.pid)
            assert ans["native"] == p.pid and ans["clients"] == [p.pid]
            assert p.pid in s.client.status()["clients"]
            with pytest.raises(ClientError, match=r"\b409\b|not registered"):
                s.client.native(add=1)  # pid 1 is no client of our server
            for pid in (0, 2 ** 70):  # no process has it: a 400, not a 409
                with pytest.raises(ClientError, match=f"field 'pid' {pid}: a process id is 1 to 4194304") as ei:
                    s.client.native(add=pid)
                assert ei.value.status == 400
            with pytest.raises(ClientError, match="a process id \\(1 to 4194304\\) expected"):
                s.client.native(drop=2 ** 30)
            assert s.client.native()["clients"] == [p.pid]
        finally:
            p.communicate("", timeout=30)  # it exits: its stand-in connection closes
        poll(lambda: s.client.native()["clients"] == [], 30.0, "the exited native client dropped")
        with pytest.raises(ClientError, match="not a native client of ours"):
            s.client.native(drop=p.pid)
        assert s.stop() == 0, s.log()[-4000:]
    finally:
        s.kill()


def test_native_clients_need_mps_mode(tmp):
    s = Serve(tmp, "blink", os.path.join(tmp, "s.sock"))
    try:
        s.wait_ready()
        with pytest.raises(ClientError, match=r"native clients join our MPS server; this backend's isolation is blink"):
            s.client.native()
    finally:
        s.kill()

