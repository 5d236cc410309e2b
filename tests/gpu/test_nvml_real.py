"""NVML against the REAL driver: a context outside our server is seen and called foreign; our
MPS server and its clients are ours.

Skipped, with the reason printed, where there is no NVIDIA driver (CI).  Run on the device:
`python3 -m pytest tests/gpu/test_nvml_real.py -v -rA -s`.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import pytest
from structlog.testing import capture_logs

from meshd_mps.base.errors import NoDriver, NvmlUnavailable
from meshd_mps.gpu.nvml import ComputeMode, DeviceView, Nvml
from meshd_mps.mps.control import PIPE_ENV
from meshd_mps.neighbours import NeighbourWatch, classify

from ..rigs.waits import poll

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

#: A bare CUDA context on GPU 0 (primary context, 1 MiB allocated); prints its pid, holds the
#: context until stdin closes.
CONTEXT = """
import os, sys
from cuda.bindings import driver as cu
def ck(r):
    err, *v = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        sys.exit(f"context: {err}")
    return v[0] if v else None
ck(cu.cuInit(0))
dev = ck(cu.cuDeviceGet(0))
ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
ck(cu.cuCtxSetCurrent(ctx))
ck(cu.cuMemAlloc(1 << 20))
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def skip(reason: str) -> None:
    print(f"skipping the NVML tests: {reason}", file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture
def nvml() -> Iterator[Nvml]:
    from meshd_mps.gpu.device import query_device

    try:
        query_device()
    except NoDriver as e:
        skip(str(e))
    try:
        nv = Nvml.open()
    except NvmlUnavailable as e:
        skip(e.why)
    with nv:
        yield nv


def view_when(nv: Nvml, holds: Callable[[DeviceView], bool], what: str, within: float = 30.0) -> DeviceView:
    """GPU 0's view once ``holds`` is true of it; fails naming ``what`` (and the last view) past ``within`` seconds."""
    seen: list[DeviceView] = []

    def looked() -> DeviceView | None:
        seen[:] = [nv.view(0)]
        return seen[0] if holds(seen[0]) else None

    return poll(looked, within, lambda: f"NVML: {what}; it shows {seen[-1] if seen else None}", every=0.05)


def test_a_bare_context_is_listed_and_foreign(nvml):
    v = nvml.view(0)
    print(f"GPU 0 as NVML shows it: {v}", file=sys.stderr)
    assert v.compute_mode in (ComputeMode.DEFAULT, ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.PROHIBITED)
    if v.compute_mode is ComputeMode.PROHIBITED:
        skip("GPU 0 is in compute mode PROHIBITED: no context can be made")
    if v.compute_mode is ComputeMode.EXCLUSIVE_PROCESS and v.processes:
        skip(f"GPU 0 is EXCLUSIVE_PROCESS and taken: {v.processes}")
    nowhere = tempfile.mkdtemp(prefix="meshd-nvml-")  # no MPS daemon there: the child is a plain context
    env = {**os.environ, PIPE_ENV: nowhere}
    child = subprocess.Popen([sys.executable, "-c", CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env, text=True)
    assert child.stdout is not None and child.stdin is not None
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready, "the context child said nothing within 60 s"
        pid = int(child.stdout.readline())
        assert pid == child.pid
        watch = NeighbourWatch("mps")
        with capture_logs() as logs:
            seen = view_when(nvml, lambda v: pid in {p.pid for p in v.processes}, f"process {pid}")
            n = classify(seen, ours=set(), server=set(), native=set())
            watch.observe(n)
            [p] = [p for p in n.foreign if p.pid == pid]
            assert p.kind == "compute" and not p.mps
            assert p.name.startswith("python"), p
            assert p.used_bytes is None or p.used_bytes >= 1 << 20
            child.stdin.close()
            assert child.wait(timeout=30) == 0
            gone = view_when(nvml, lambda v: pid not in {p.pid for p in v.processes}, f"process {pid} gone")
            watch.observe(classify(gone, ours=set(), server=set(), native=set()))
        said = [(e["log_level"], e.get("pid")) for e in logs if e.get("pid") == pid]
        assert said == [("warning", pid), ("info", pid)], logs
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        child.stdin.close()  # our ends of its pipes (a ResourceWarning otherwise, an error here)
        child.stdout.close()
        shutil.rmtree(nowhere, ignore_errors=True)


async def test_our_server_and_its_clients_are_ours(nvml):
    """Under MPS, NVML lists our pooled workers (as MPS clients) and our server: none foreign."""
    if shutil.which("nvidia-cuda-mps-control") is None or "standin" in (shutil.which("nvidia-cuda-mps-control") or ""):
        skip("NVIDIA's nvidia-cuda-mps-control is not on PATH")
    from meshd_mps.backend import Backend

    async with await Backend.open(isolation="mps", gpu="cuda", pool=2) as b:
        assert b.mps is not None and b.mps.server is not None
        workers, server = set(b.sup.workers), {int(b.mps.server)}
        v = view_when(nvml, lambda v: (workers | server) <= {p.pid for p in v.processes},
                      f"workers {workers} and server {server}")
        n = classify(v, ours=workers, server=server, native=set())
        print(f"GPU 0 under our MPS server: {n}", file=sys.stderr)
        assert {p.pid for p in n.ours} == workers and all(p.mps for p in n.ours)
        assert [p.pid for p in n.server] == sorted(server) and not n.server[0].mps
        assert n.server[0].name == "nvidia-cuda-mps-server"  # NVML's name: /proc's is cut at 15 characters
        assert n.foreign == (), f"another process is on GPU 0: {n.foreign}"
