"""What killing one MPS client does to another client's resident kernel, on the real GPU.

tests/gpu/test_faults_real.py found (2026-12-03, H200) that a bystander's heartbeat ended when a
worker was SIGKILLed while its own kernel ran.  This probe separates the cases, each in a fresh
backend with a heartbeat bystander on one worker and echo (resident) on another:

  kill-running   SIGKILL the echo worker while its kernel runs
  kill-idle      halt echo, await its DONE, then SIGKILL its worker (module loaded, no kernel)
  terminate      `terminate_client SERVER PID` of the echo worker while its kernel runs
  eof-running    close the echo worker's stdin while its kernel runs (the worker's exit path)
  daemon-killed  SIGKILL the control daemon: does the server exit, do the kernels stop, do their
                 workers' DONEs ever come (10 s)?

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
from tests.test_backend import example  # noqa: E402

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
            vic.worker.proc.close_stdin()
        elif name == "daemon-killed":
            server = await b.mps.server_pid()
            os.kill(b.daemon.pid, signal.SIGKILL)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if by_run.finished() or not os.path.exists(f"/proc/{server}/stat"):
                    break
            print(f"  after {time.monotonic() - t0:.1f} s: server {server} "
                  f"{'gone' if not os.path.exists(f'/proc/{server}/stat') else 'still there'}")
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
            except BaseException as e:  # noqa: BLE001
                print(f"  victim: {e!r}")
        new = log.read_bytes()[size:].decode(errors="replace") if log.exists() else ""
        print("  server log:\n" + "".join(f"    {line}\n" for line in new.splitlines()[:20]))


async def main() -> None:
    for name in sys.argv[1:] or ["kill-running", "kill-idle", "terminate", "eof-running", "daemon-killed"]:
        try:
            await case(name)
        except BaseException as e:  # noqa: BLE001
            print(f"{name}: {e!r}")


if __name__ == "__main__":
    asyncio.run(main())
