"""What the real-GPU tests (tests/gpu) share: the MPS processes on the machine, the heartbeat's
largest gap while something runs, and the check that NVIDIA's own MPS control is there (the
``real_gpu_and_mps`` fixture of tests/gpu/conftest.py)."""

from __future__ import annotations

import os
import shutil
import sys

import anyio
import pytest

from meshd_mps import standin
from meshd_mps.backend import Backend
from meshd_mps.base.errors import NoDriver
from meshd_mps.protocol import abi

from .backend import beats


def skip_without_real_gpu_and_mps(what: str) -> None:
    """Skip (the reason printed) without a driver or without NVIDIA's own MPS control on PATH."""
    from meshd_mps.gpu.device import query_device

    try:
        query_device()  # cuInit: the driver's fds are open before no_leaks counts
    except NoDriver as e:
        print(f"skipping {what}: {e}", file=sys.stderr)
        pytest.skip(str(e))
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    if os.path.realpath(control).startswith(os.path.realpath(standin.BIN_DIR) + os.sep):
        pytest.skip("nvidia-cuda-mps-control on PATH is meshd-mps's stand-in, not NVIDIA's")


def mps_processes() -> list[str]:
    """MPS control daemons and servers on the machine (by the program run, argv[0]: a shell
    whose command line merely mentions them is not one)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
                with open(f"/proc/{d}/stat") as f:
                    comm = f.read().rsplit(")", 1)[0].split("(", 1)[1]
            except OSError:
                continue
            if os.path.basename(argv[0]).startswith("nvidia-cuda-mps") or (argv == [""] and comm.startswith("nvidia-cuda-mps")):
                # A process in its exit (or a zombie) has no command line left: known by its name.
                out.append(f"{d}: {' '.join(argv) if argv != [''] else f'[{comm}, exiting]'}")
    return out


async def gap_while(b: Backend, slot: int, work) -> tuple[float, object]:
    """The heartbeat's largest gap (us) while ``work`` runs (the program's own %globaltimer)."""
    b.mailbox.set_u32(slot, abi.GAP_RESET, 1)
    with anyio.fail_after(10):
        while b.mailbox.u32(slot, abi.GAP_RESET):
            await anyio.sleep(0.001)
    out = await work()
    n = b.mailbox.heartbeat(slot)
    await beats(b, slot, n + 2)
    return b.mailbox.u64(slot, abi.MAX_GAP) / 1e3, out
