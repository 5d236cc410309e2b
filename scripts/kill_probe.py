"""What killing one MPS client does to another client's resident kernel, on the real GPU.

tests/gpu/test_faults_real.py found that a bystander's heartbeat ended when a
worker was SIGKILLed while its own kernel ran.  This probe separates the cases, each in a fresh
backend with a heartbeat bystander on one worker and echo (resident) on another:

  kill-running   SIGKILL the echo worker while its kernel runs
  kill-idle      halt echo, await its DONE, then SIGKILL its worker (module loaded, no kernel)
  terminate      `terminate_client SERVER PID` of the echo worker while its kernel runs
  eof-running    close the echo worker's stdin while its kernel runs (the worker's exit path)
  daemon-killed  SIGKILL the control daemon: does the server exit, do the kernels stop, do their
                 workers' DONEs ever come (10 s)?
  orphan-server  SIGKILL the control daemon with the heartbeat running and one idle pooled worker:
                 the server's state (a zombie is not a live server: an earlier version of this
                 probe took /proc/PID's existence for one), does the pooled worker still load and
                 run, does a fresh worker's context come up, does the halted heartbeat end and
                 its DONE come?

For each: whether the bystander's launch ended (and its DONE), its heartbeats over the next 2 s,
and the server log's new lines.  Run on the GPU machine: ``python3 scripts/kill_probe.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshd_mps.backend import Backend  # noqa: E402
from meshd_mps.protocol import abi  # noqa: E402
from tests.rigs.backend import example  # noqa: E402

BY, VIC = 7, 9


async def beating(b: Backend, slot: int, within: float) -> int:
    n0 = b.mailbox.heartbeat(slot)
    await asyncio.sleep(within)
    return b.mailbox.heartbeat(slot) - n0


async def case(name: str) -> None:
    async with await Backend.open(isolation="mps", gpu="cuda", pool=2) as b:
        log = Path(b.daemon.log_dir) / "server.log"
        by = await b.load(await b.prepare(*example("heartbeat")))
        b.mailbox.reset_slot(BY)
        by_run = await b.launch(by, BY)
        vic = await b.load(await b.prepare(*example("echo")))
        b.mailbox.reset_slot(VIC)
        vic_run = await b.launch(vic, VIC)
        await asyncio.sleep(0.3)
        assert await beating(b, BY, 0.2) > 0 and await beating(b, VIC, 0.2) > 0, "both beat before"
        size = log.stat().st_size if log.exists() else 0
        pid = vic.pid
        t0 = time.monotonic()
        if name == "kill-running":
            os.kill(pid, signal.SIGKILL)
        elif name == "kill-idle":
            b.mailbox.halt(VIC)
            d = await asyncio.wait_for(vic_run.wait(), 5)
            print(f"  echo halted: {d}")
            os.kill(pid, signal.SIGKILL)
        elif name == "terminate":
            server = await b.mps.server_pid()
            print(f"  terminate_client: {await b.daemon.control(f'terminate_client {server} {pid}')!r}")
        elif name == "eof-running":
            vic.proc.close_stdin()
        elif name == "daemon-killed":
            server = await b.mps.server_pid()
            os.kill(b.daemon.pid, signal.SIGKILL)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if by_run.finished() or proc_state(server).startswith(("Z", "gone")):
                    break
            print(f"  after {time.monotonic() - t0:.1f} s: server {server}: "
                  f"{proc_state(server)}")
            for _ in range(100):
                if by_run.finished():
                    break
                await asyncio.sleep(0.1)
        n = await beating(b, BY, 2.0)
        print(f"{name}: bystander beats in the 2 s after: {n}; bystander ended: {by_run.finished()}")
        if by_run.finished():
            print(f"  bystander DONE: {await by_run.wait()}")
        if vic_run.finished():
            try:
                print(f"  victim DONE: {await vic_run.wait()}  ({time.monotonic() - t0:.2f} s)")
            except BaseException as e:
                print(f"  victim: {e!r}")
        new = log.read_bytes()[size:].decode(errors="replace") if log.exists() else ""
        print("  server log:\n" + "".join(f"    {line}\n" for line in new.splitlines()[:20]))


async def orphan_server() -> None:
    async with await Backend.open(isolation="mps", gpu=os.environ.get("PROBE_GPU", "cuda"), pool=2) as b:
        by = await b.load(await b.prepare(*example("heartbeat")))
        b.mailbox.reset_slot(BY)
        by_run = await b.launch(by, BY)
        await asyncio.sleep(0.3)
        server = int(await b.mps.server_pid())
        print(f"orphan-server: pool {b.isolations[0].pool.pids()}, server {server}, bystander {by.pid}")
        t0 = time.monotonic()
        os.kill(b.daemon.pid, signal.SIGKILL)
        await asyncio.sleep(3)
        print(f"  3 s after: server {proc_state(server)}, bystander beats in 1 s: "
              f"{await beating(b, BY, 1.0)}, ended: {by_run.finished()}")
        b.daemon.check_alive = lambda: None  # type: ignore[method-assign]  # see what the GPU does, not meshd's refusal
        for what in ("pooled", "fresh, unverified"):
            try:  # a pooled worker (verified before the kill), then a fresh one (nobody to ask)
                if what != "pooled":
                    async def unchecked(want):
                        print(f"  (the client check of {want} skipped)")
                    b.mps.check_clients = unchecked  # type: ignore[method-assign]
                    for p in b.isolations[0].pool.drain():
                        b.sup.retire(p)
                t1 = time.monotonic()
                img = await b.prepare(*example("spin"))
                k = await b.load(img)
                b.mailbox.reset_slot(VIC)
                d = await asyncio.wait_for((await b.launch(k, VIC)).wait(), 10)
                print(f"  {what} worker {k.pid} (fresh={k.module.fresh}): spin DONE {d}"
                      f" in {(time.monotonic() - t1) * 1e3:.0f} ms")
                await b.unload(k)
            except BaseException as e:
                print(f"  {what} worker: {e!r}")
        b.mailbox.halt(BY)
        try:
            print(f"  bystander halted: DONE {await asyncio.wait_for(by_run.wait(), 10)}")
        except BaseException as e:
            print(f"  bystander halt: {e!r}; STATE {b.mailbox.u32(BY, abi.STATE)} (EXITED={abi.EXITED}),"
                  f" beats in the next 1 s: {await beating(b, BY, 1.0)}")
        await b.unload(by)
        for p in list(b.isolations[0].pool.drain()):
            b.sup.retire(p)
        t2 = time.monotonic()
        while b.sup.children() and time.monotonic() - t2 < 10:
            await asyncio.sleep(0.05)
        print(f"  workers gone; the server: {proc_state(server)} ({time.monotonic() - t0:.1f} s after the kill)")
        log = Path(b.daemon.log_dir) / "server.log"
        print("  server log, last lines:\n" + "".join(f"    {ln}\n" for ln in log.read_text().splitlines()[-12:]))


def proc_state(pid: int) -> str:
    """'R (running)', 'Z (zombie)' (exited, not yet reaped: /proc still lists it), or 'gone'."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


async def main() -> None:
    if sys.argv[1:] == ["orphan-server"]:
        await orphan_server()
        return
    for name in sys.argv[1:] or ["kill-running", "kill-idle", "terminate", "eof-running", "daemon-killed"]:
        try:
            await case(name)
        except BaseException as e:
            print(f"{name}: {e!r}")


if __name__ == "__main__":
    asyncio.run(main())
