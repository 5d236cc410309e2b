"""``--loop``: the choice of event loop, and that a worker's pipes behave the same on each.

uvloop is in the test extra so that CI runs its path too; where it is missing the uvloop
cases skip with the reason."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from meshd_mps.base import eventloop
from meshd_mps.base.errors import ConfigError
from meshd_mps.supervision import child

pytestmark = pytest.mark.timeout(60)

LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    eventloop.factory("auto")[0] == "asyncio", reason="uvloop is not installed"))]

# The child lists its open fds, then echoes one line and exits.
FD_CHILD = r"""
import os, sys
fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
sys.stdout.write(" ".join(map(str, fds)) + "\n"); sys.stdout.flush()
sys.stdout.write(sys.stdin.readline()); sys.stdout.flush()
"""


def test_bad_choice_is_a_config_error():
    with pytest.raises(ConfigError, match="loop fast: expected one of auto, uvloop, asyncio"):
        eventloop.factory("fast")


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert eventloop.factory("auto") == ("asyncio", None)
    with pytest.raises(eventloop.LoopError, match=r"uvloop is not installed \(pip install 'meshd-mps\[uvloop\]'\)"):
        eventloop.factory("uvloop")


@pytest.mark.parametrize("choice", LOOPS)
def test_child_pipes_on_each_loop(choice):
    """A child started by child.spawn on this loop: only its stdio is open in it (uvloop's own
    subprocess support leaked more, which kept a daemonized child's pipes open), its echo comes
    back, and its exit is seen and reaped."""

    async def main() -> tuple[str, list[int], bytes, int]:
        name = type(asyncio.get_running_loop()).__module__
        c = await child.spawn([sys.executable, "-c", FD_CHILD], os.environ)
        assert c.stdout is not None and c.stdin is not None
        fds = [int(x) for x in (await asyncio.wait_for(c.stdout.readline(), 20)).split()]
        c.stdin.write(b"ping\n")
        echo = await asyncio.wait_for(c.stdout.readline(), 20)
        rc = await asyncio.wait_for(c.wait(), 20)
        return name, fds, echo, rc

    name, fds, echo, rc = eventloop.run(main, choice)
    assert name.startswith("uvloop" if choice == "uvloop" else "asyncio"), name
    # 0-2 and the fd of the listing itself, nothing else
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, f"fds open in the child: {fds}"
    assert echo == b"ping\n"
    assert rc == 0
