"""A pooled worker that starts is no image: after an idle pooled worker is
killed, ``status`` counts ``devices[].images`` as the programs' images alone while its replacement
starts, not the replacement too."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal

import anyio
import pytest

from meshd_mps.backend import Backend
from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.supervision.proc import WorkerProc

from ..rigs.deadlines import TEST_DEADLINES

pytestmark = pytest.mark.timeout(60)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def heartbeat() -> tuple[dict, bytes]:
    d = EXAMPLES / "heartbeat"
    man = json.loads((d / "manifest.json").read_text())
    return man, cuda_to_ptx((d / "heartbeat.cu").read_bytes(), "heartbeat", include=[str(EXAMPLES / "include")])


async def test_a_starting_pool_worker_is_no_image(standin_on_path, monkeypatch):
    async with Backend.open(isolation="mps", gpu="sim", pool=3, deadlines=TEST_DEADLINES) as b:
        d = b.devices[0]
        iso = b.isolations[d]
        man, ptx = heartbeat()
        kernels = [await b.load(await b.prepare(man, ptx)) for _ in range(2)]
        assert b.device_status(d)["images"] == 2
        idle = iso.pool.pids()
        assert len(idle) == 1, idle  # the two loads took two of the three pooled workers

        # The replacement is held between its start (a live worker of the GPU, READY answered) and
        # its entry into the pool: the window in which it was counted as an image.
        inside, release, full = asyncio.Event(), asyncio.Event(), asyncio.Event()
        check, add = b.mps.check_clients, iso.pool.add
        seen: list[list[int]] = []

        async def held(want):
            seen.append(list(want))
            inside.set()
            await release.wait()
            await check(want)

        def added(w: WorkerProc) -> None:
            add(w)
            if len(iso.pool) == iso.pool.cap:
                full.set()

        monkeypatch.setattr(b.mps, "check_clients", held)
        monkeypatch.setattr(iso.pool, "add", added)
        os.kill(idle[0], signal.SIGKILL)
        with anyio.fail_after(20):
            await inside.wait()
        new = seen[0][0]
        s = b.status()
        assert new in s["workers"] and new not in s["pool"] and idle[0] not in s["workers"]
        assert s["devices"][0]["images"] == 2, s["devices"][0]
        release.set()
        with anyio.fail_after(30):
            await full.wait()
        assert new in iso.pool.pids() and b.device_status(d)["images"] == 2
        for k in kernels:
            await b.unload(k)
        assert b.device_status(d)["images"] == 0
