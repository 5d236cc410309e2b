"""The pool tells the truth: a pooled worker that dies while idle is dropped at
once (status, the devices' images and the metrics agree) and replaced, paced."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal

import pytest

from meshd_mps.backend import Backend
from meshd_mps.supervision import procfs

from ..rigs.deadlines import TEST_DEADLINES
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(60)


async def test_a_dead_pooled_worker_is_dropped_at_once_and_replaced(standin_on_path):
    d = dataclasses.replace(TEST_DEADLINES, pool_pace=0.3)
    async with Backend.open(isolation="mps", gpu="sim", pool=2, deadlines=d) as b:
        pool = b.isolations[b.devices[0]].pool
        first = pool.pids()
        assert len(first) == 2
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        # Dropped as soon as its exit is seen, before any load comes to take it.
        await until(lambda: victim not in pool.pids() and victim not in b.sup.live(), what="the dead worker dropped")
        s = b.status()
        assert victim not in s["pool"] and victim not in s["workers"]
        full = await until(lambda: len(pool.pids()) == 2 and pool.pids(), what="the pool refilled")
        assert victim not in full and first[1] in full
        assert sorted(b.status()["pool"]) == sorted(full) and b.device_status(b.devices[0])["images"] == 0


async def test_replacements_are_paced(standin_on_path):
    d = dataclasses.replace(TEST_DEADLINES, pool_pace=0.4)
    async with Backend.open(isolation="mps", gpu="sim", pool=3, deadlines=d) as b:
        pool = b.isolations[b.devices[0]].pool
        old = set(pool.pids())
        for p in old:
            os.kill(p, signal.SIGKILL)
        await until(lambda: len(set(pool.pids()) - old) == 3, within=30.0, what="three replacements")
        # One at a time, at least pool_pace apart (not three new MPS clients at once): when each
        # replacement was spawned, as the kernel dates a process (a tick, 10 ms), not when a poll
        # of the pool first saw it ready (that lags by the poll and the worker's start-up).
        tick = os.sysconf("SC_CLK_TCK")
        times = sorted((procfs.starttime(p) or 0) / tick for p in set(pool.pids()) - old)
        assert all(b1 - a1 >= 0.4 - 1.5 / tick for a1, b1 in itertools.pairwise(times)), times
