"""A ``Backend`` on the simulated GPU: the example programs compiled as the API takes them
(real NVRTC), their heartbeats, a backend opened with the tests' deadlines, a compiler that
also takes a simulated GPU's script as the image, and ``Programs`` on both."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import signal
from collections.abc import AsyncIterator

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.gpu.compiler import Compiler, Prepared, cuda_to_ptx
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

from .deadlines import TEST_DEADLINES

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@functools.cache
def _compiled(name: str) -> tuple[str, bytes]:
    d = EXAMPLES / name
    ptx = cuda_to_ptx((d / f"{name}.cu").read_bytes(), name, include=[str(EXAMPLES / "include")])
    return (d / "manifest.json").read_text(), ptx


def example(name: str) -> tuple[dict, bytes]:
    """examples/NAME's manifest (a fresh dict each time: callers change theirs) and its PTX,
    compiled once per test process (NVRTC: ~0.1 s a program, asked for hundreds of times)."""
    text, ptx = _compiled(name)
    return json.loads(text), ptx


async def beats(b: Backend, slot: int, more_than: int, within: float = 10.0) -> int:
    """Slot ``slot``'s heartbeat once past ``more_than`` (its program runs); fails past ``within``."""
    with anyio.fail_after(within):
        while (n := b.mailbox.heartbeat(slot)) <= more_than:
            await anyio.sleep(0.005)
    return n


async def open_sim(isolation: str = "blink", deadlines=TEST_DEADLINES, **kw) -> Backend:
    """``Backend.open`` on the simulated GPU with the tests' deadlines (use as ``async with await``)."""
    return await Backend.open(isolation=isolation, gpu="sim", deadlines=deadlines, **kw)


def man(name: str) -> dict:
    """The least manifest of a program named ``name`` (for scripted images, ``ScriptCompiler``)."""
    return {"name": name, "backend": "cuda", "warps": 1, "abi": 1}


@contextlib.asynccontextmanager
async def sim_programs(isolation: str, deadlines=TEST_DEADLINES) -> AsyncIterator[Programs]:
    """``Programs`` on a simulated GPU (``open_sim``, a pool of one in MPS mode) whose compiler also
    takes scripts (``ScriptCompiler``); every program closed, then the backend."""
    b = await open_sim(isolation, pool=1, deadlines=deadlines)
    b.compiler = ScriptCompiler(b.infos[b.devices[0]])
    ps = Programs(b)
    try:
        yield ps
    finally:
        await ps.close()
        await b.close()


class ScriptCompiler(Compiler):
    """The compiler, except that a simulated GPU's script (``sim(...)``) given as the PTX is the
    image as it is: so that Programs runs scripted kernels through its real load path."""

    async def prepare(self, manifest, ptx, *args, **kw):  # type: ignore[no-untyped-def]
        if not ptx.startswith(b"MESHSIM1"):
            return await super().prepare(manifest, ptx, *args, **kw)
        m, h, cap = self.check(manifest, ptx, *args, **kw)
        return Prepared(m, h, ptx, 0.0, False, cap, m.threads, self.info.arch)


async def into(out: list, coro) -> None:
    """Await ``coro`` and keep its result (a task's value for the test that started it)."""
    out.append(await coro)


async def kill_in_launch(b: Backend, known: set[int], slot: int, mp: pytest.MonkeyPatch) -> int:
    """SIGKILL the first new worker whose LAUNCH is asked and not answered, once its kernel runs
    (its slot says RUNNING: the kill is then one with the kernel on the GPU); its pid.  The test
    hook that hangs the reply (MESHD_MPS_WORKER_INJECT) is for that worker alone: it is taken
    out of the environment before the kill, so the recovery's fresh workers run clean (on the
    H200 a replacement once started with it and hung the heartbeat's relaunch)."""
    with anyio.fail_after(20):
        while not ((w := next((w for p, w in b.sup.workers.items() if p not in known and w.gen and w.asking), None))
                   and b.mailbox.u32(slot, abi.STATE) == abi.RUNNING):
            await anyio.sleep(0.005)
    mp.delenv("MESHD_MPS_WORKER_INJECT")
    os.kill(w.pid, signal.SIGKILL)
    return w.pid
