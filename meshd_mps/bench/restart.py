"""Rows (j) and (k), meshd-mps itself restarted:

(j) restart: ``meshd-mps serve`` with a state dir and ``heartbeat``, stopped (SIGTERM)
    and started again: the heartbeat's largest beat gap across it (polled through the control API)
    against its idle gap, and the stop to the API answering again against the first start's.
    Restore by reload: the program is halted, loaded and launched again.
(k) live restore: ``serve --live-restore`` with ``heartbeat``, across a restart
    (SIGTERM), an upgrade (a copy of this source tree with a later version started) and a SIGKILL
    followed by a start: the kernel's own largest beat gap (MAX_GAP, read from the mailbox file)
    against its idle MAX_GAP over a window as long as the longest of them (target: within 2x),
    and the stop to the API answering again against (j)'s.  And with ``--pool 2`` and a
    second program, a restart (SIGTERM) while the pool refills (a pooled worker killed, the stop
    sent as the refill's worker starts) and just after a fault's recovery (a program's worker
    killed, the stop sent as the heartbeat beats again): the same gaps (target: within 2x) and the
    MPS clients made from the stop to the API answering (the control daemon's log; target: none);
    not with ``--quick`` (tests/serve/test_no_surprise_clients.py counts those clients on the CPU).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from meshd_mps.backend import live_paths
from meshd_mps.bench.children import our_children, reap_new_children
from meshd_mps.bench.measure import spin
from meshd_mps.bench.report import Row
from meshd_mps.bench.rig import EXAMPLES, SOURCE, Bench
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox


def _beats(c: Any, name: str, within: float, until_after: float = 0.0) -> list[tuple[float, int]]:
    """(monotonic time, heartbeat) of ``name`` polled through the control API for ``within`` s, or
    (``until_after``) until it has advanced twice after that time."""
    out: list[tuple[float, int]] = []
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            hb = c.program(name)["heartbeat"]
        except Exception:  # not loaded again yet
            hb = None
        if hb is not None:
            out.append((time.monotonic(), hb))
            if until_after and sum(1 for t, _ in out if t > until_after) > 2 and out[-1][1] > out[-2][1]:
                break
        time.sleep(0.001)
    return out


def _largest_gap(samples: list[tuple[float, int]]) -> float:
    """The longest time between two samples whose heartbeat changed (a restart resets it)."""
    changes = [t for (t, hb), (_, prev) in zip(samples[1:], samples, strict=False) if hb != prev]
    return max((b - a for a, b in itertools.pairwise(changes)), default=0.0)


#: The longest a bench's ``meshd-mps serve`` may take to answer (its start and restore).
SERVE_S = 120.0


class _Serve:
    """A ``meshd-mps serve`` of the bench's in directory ``d`` (``isolation``, a pool of one), started
    again as often as asked, and timed from its start (or an earlier moment) to its control API
    answering."""

    def __init__(self, d: str, bench: Bench, *extra: str, isolation: str = "mps"):
        self.d, self.sock, self.state = d, os.path.join(d, "s.sock"), os.path.join(d, "state")
        self.argv = [sys.executable, "-m", "meshd_mps", "serve", "--gpu", bench.gpu, "--isolation", isolation, "--pool",
                     "1", "--socket", self.sock, "--state-dir", self.state, "--log-format", "json", *extra]
        self.p: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> float:
        """Started; the seconds until its API answered (``status``, which answers after the restore)."""
        from meshd_mps.serving.client import Client

        t0 = time.monotonic()
        with open(os.path.join(self.d, "serve.log"), "ab") as log:
            self.p = p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        c = Client(self.sock, timeout=5)
        while True:
            if time.monotonic() - t0 > SERVE_S:
                raise RuntimeError(f"serve at {self.sock} did not answer within {SERVE_S:g} s")
            if p.poll() is not None:
                with open(os.path.join(self.d, "serve.log"), errors="replace") as f:
                    tail = f.read()[-600:]
                raise RuntimeError(f"serve exited with {p.returncode}: {tail}")
            try:
                c.status()
                return time.monotonic() - t0
            except Exception:
                time.sleep(0.005)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stopped by ``sig``; SIGKILLed if it has not exited within a minute."""
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def restart_by_reload(bench: Bench) -> tuple[float, float, float, float]:
    """A ``meshd-mps serve`` with a state dir and ``heartbeat`` loaded, stopped (SIGTERM) and started
    again: (idle beat gap, beat gap across the restart, the stop-to-API-answering time, the first
    start's), in seconds, as the control API shows them (polled every ~1 ms)."""
    from meshd_mps.serving.client import Client, program_body

    s = _Serve(tempfile.mkdtemp(prefix="mbr-", dir=bench.base), bench)
    try:
        first = s.start()
        c = Client(s.sock, timeout=60)
        c.load(program_body(str(EXAMPLES / "heartbeat"), arch=c.arch))
        idle = _largest_gap(_beats(c, "heartbeat", 0.3 if bench.quick else 1.0))
        before = _beats(c, "heartbeat", 0.2)
        t_stop = time.monotonic()
        s.stop()
        s.start()
        api = time.monotonic() - t_stop
        after = _beats(Client(s.sock, timeout=60), "heartbeat", 60, until_after=time.monotonic())
        gap = _largest_gap(before + after)
        return idle, gap, api, first
    finally:
        s.stop()
        shutil.rmtree(s.d, ignore_errors=True)


def _gap_since_reset(mb: Mailbox, slot: int, reset: bool) -> int:
    """The kernel's own MAX_GAP (ns); ``reset``: zeroed first (its next beat acknowledges it)."""
    if reset:
        mb.set_u32(slot, abi.GAP_RESET, 1)
        spin(lambda: mb.u32(slot, abi.GAP_RESET) == 0, 10, "the heartbeat to zero MAX_GAP")
        return 0
    n = mb.heartbeat(slot)
    spin(lambda: mb.heartbeat(slot) > n, 10, "the heartbeat's next beat")
    return mb.u64(slot, abi.MAX_GAP)


def _idle_gap(mb: Mailbox, slot: int, window: float) -> float:
    """The kernel's MAX_GAP (s) over ``window`` seconds with nothing happening: the baseline."""
    _gap_since_reset(mb, slot, reset=True)
    time.sleep(window)
    return _gap_since_reset(mb, slot, reset=False) / 1e9


def _next_release(d: str) -> tuple[dict[str, str], str]:
    """A copy of this meshd-mps's source tree with a later version, as an upgrade installs one: the
    environment that runs it, and its version."""
    src = SOURCE
    dst = os.path.join(d, "next")
    for part in ("meshd_mps", "workers"):
        shutil.copytree(src / part, os.path.join(dst, part), ignore=shutil.ignore_patterns("__pycache__"))
    version = "unknown"
    if (src / "pyproject.toml").exists():
        text = (src / "pyproject.toml").read_text()
        m = re.search(r'^version = "([^"]+)"', text, re.M)
        if m:
            version = m.group(1) + ".post1"
            text = text.replace(m.group(0), f'version = "{version}"', 1)
        Path(dst, "pyproject.toml").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([dst, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return env, version


def restart_live(bench: Bench) -> tuple[float, dict[str, tuple[float, float]], str]:
    """``serve --live-restore`` with ``heartbeat`` loaded, stopped and started again three ways
    (SIGTERM; SIGTERM and a later release started; SIGKILL): (the kernel's idle MAX_GAP, and for
    each way its MAX_GAP across it and the stop-to-API-answering time, in seconds; the versions).
    The gaps are the kernel's own (globaltimer), read from the mailbox file: no daemon needed."""
    from meshd_mps.serving.client import Client, program_body

    s = _Serve(tempfile.mkdtemp(prefix="mbl-", dir=bench.base), bench, "--live-restore")
    mb: Mailbox | None = None
    before = our_children()
    try:
        s.start()
        c = Client(s.sock, timeout=60)
        old = c.status()["versions"]["meshd-mps"]
        slot = c.load(program_body(str(EXAMPLES / "heartbeat"), arch=c.arch))["program"]["slot"]
        mb = Mailbox.open(live_paths(s.state).mailbox)
        env, new = _next_release(s.d)
        out: dict[str, tuple[float, float]] = {}
        for how in ("restart", "upgrade", "sigkill"):
            _gap_since_reset(mb, slot, reset=True)
            t0 = time.monotonic()
            s.stop(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
            s.start(env if how == "upgrade" else None)
            api = time.monotonic() - t0
            st = Client(s.sock, timeout=60).status()
            if st["state"]["restore"]["adopted"] != ["heartbeat"]:
                raise RuntimeError(f"{how}: heartbeat not adopted: {st['state']['restore']}")
            time.sleep(0.2)
            out[how] = (_gap_since_reset(mb, slot, reset=False) / 1e9, api)
            if how == "upgrade" and st["versions"]["meshd-mps"] != old:
                new = st["versions"]["meshd-mps"]
        # The baseline: as long a window with nothing happening as the longest of the three.
        idle = _idle_gap(mb, slot, max(a for _, a in out.values()) + 0.2)
        Client(s.sock, timeout=60).unload("heartbeat")
        return idle, out, f"{old} -> {new}"
    finally:
        if mb is not None:
            mb.close()
        s.stop()
        # What the SIGKILLed serve left (its workers, its control daemon) became ours: the bench is a
        # subreaper.  Its successor ended them at the full stop above; reaped here, as init would.
        reap_new_children(before, 10.0)
        shutil.rmtree(s.d, ignore_errors=True)


_NEW_CLIENT = re.compile(r"New client (\d+) connected|NEW CLIENT (\d+) from user")


def _clients_made(mps_dir: str, since: int) -> tuple[set[int], int]:
    """The MPS clients the control daemon's log says were made after its first ``since`` bytes
    (NVIDIA's "NEW CLIENT pid from user", the stand-in's "New client pid connected"), and its size."""
    try:
        with open(os.path.join(mps_dir, "log", "control.log"), "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return set(), since
    return {int(a or b) for a, b in _NEW_CLIENT.findall(text)}, since + len(text.encode())


def _new_worker(ppid: int, known: set[int], within: float) -> int:
    """The first worker process of ``ppid`` not in ``known`` (the pool's refill), polled every ~1 ms."""
    from meshd_mps.supervision import procfs

    end = time.monotonic() + within
    while time.monotonic() < end:
        for p in procfs.processes():
            if p.ppid == ppid and p.pid not in known and "workers" in p.argv:
                return p.pid
        time.sleep(0.001)
    raise RuntimeError(f"no new worker of {ppid} within {within:g} s")


def restart_live_busy(bench: Bench) -> tuple[float, dict[str, tuple[float, int]]]:
    """``serve --live-restore --pool 2`` with ``heartbeat`` and ``echo``: restarted (SIGTERM) as the
    pool refills and just after a fault's recovery; (the kernel's idle MAX_GAP, and for each its
    MAX_GAP across the restart and the MPS clients made from the stop to the API answering)."""
    from meshd_mps.serving.client import Client, program_body

    s = _Serve(tempfile.mkdtemp(prefix="mbq-", dir=bench.base), bench, "--live-restore", "--pool", "2")
    mps_dir = live_paths(s.state).mps
    mb: Mailbox | None = None
    before = our_children()
    try:
        s.start()
        c = Client(s.sock, timeout=60)
        c.load(program_body(str(EXAMPLES / "heartbeat"), arch=c.arch))
        c.load(program_body(str(EXAMPLES / "echo"), arch=c.arch))
        mb = Mailbox.open(live_paths(s.state).mailbox)
        out: dict[str, tuple[float, int]] = {}
        longest = 0.0
        for how in ("refill", "recovery"):
            c = Client(s.sock, timeout=60)
            st = c.status()
            if how == "refill":
                assert s.p is not None
                os.kill(st["pool"]["idle"][0], signal.SIGKILL)  # idle: no fault; the pool refills, paced
                _new_worker(s.p.pid, set(st["workers"]), 30)
            else:
                faults = len(st["faults"])
                os.kill(c.program("echo")["pid"], signal.SIGKILL)  # with its kernel running: a fault of the GPU
                end = time.monotonic() + 60
                while not (len((st := c.status())["faults"]) > faults and st["faults"][-1].get("ms")):
                    if time.monotonic() > end:
                        raise RuntimeError("no fault recovery within 60 s of the kill")
                    time.sleep(0.002)
            slot = c.program("heartbeat")["slot"]
            _gap_since_reset(mb, slot, reset=True)
            _, mark = _clients_made(mps_dir, 0)
            t0 = time.monotonic()
            s.stop(signal.SIGTERM)
            s.start()
            longest = max(longest, time.monotonic() - t0)
            made, _ = _clients_made(mps_dir, mark)
            st = Client(s.sock, timeout=60).status()
            if "heartbeat" not in st["state"]["restore"]["adopted"]:
                raise RuntimeError(f"{how}: heartbeat not adopted: {st['state']['restore']}")
            time.sleep(0.2)
            out[how] = (_gap_since_reset(mb, slot, reset=False) / 1e9, len(made))
        # The baseline once nothing happens: the pool's paced refill after the recovery makes MPS
        # clients, each a stall, so a window with one in it is no idle gap.  Quiet: the pool holds its
        # reserve and the daemon's workers have not changed for a second.
        c = Client(s.sock, timeout=60)
        end, seen, since = time.monotonic() + 60, None, time.monotonic()
        while True:
            st = c.status()
            now, workers = time.monotonic(), sorted(st["workers"])
            if workers != seen:
                seen, since = workers, now
            elif len(st["pool"]["idle"]) >= st["pool"]["reserve_capacity"] and now - since >= 1.0:
                break
            if now > end:
                raise RuntimeError(f"the daemon's workers still changing 60 s after the restarts: {st['pool']}")
            time.sleep(0.05)
        idle = _idle_gap(mb, slot, longest + 0.2)
        for p in c.programs():
            c.unload(p["name"])
        return idle, out
    finally:
        if mb is not None:
            mb.close()
        s.stop()
        reap_new_children(before, 10.0)
        shutil.rmtree(s.d, ignore_errors=True)


async def sec_restart(bench: Bench) -> list[Row]:
    """meshd-mps itself restarted: (j) restore by reload, the program halted and loaded again; (k)
    live restore, the program adopted as it runs (a restart, an upgrade to a later release, a SIGKILL
    and a restart)."""
    idle, gap, api, first = await anyio.to_thread.run_sync(restart_by_reload, bench)
    rows = [
        Row("j", "restart by reload: heartbeat's largest beat gap", "ms", gap * 1e3, idle * 1e3,
            "its idle gap, polled", "-", None,
            "serve stopped (SIGTERM) and started again on its --state-dir: the program halted, then loaded and"
            " launched again on its slot; polled through the control API every ~1 ms"),
        Row("j", "restart by reload: the stop to the API answering again", "ms", api * 1e3, first * 1e3,
            "the first start to its API answering", "-", None,
            "the old daemon's whole stop, the new one's start and the restore (status answers only after it)"),
    ]
    live_idle, live, versions = await anyio.to_thread.run_sync(restart_live, bench)
    what = {"restart": "a restart (SIGTERM, then serve)", "upgrade": f"an upgrade of meshd-mps ({versions})",
            "sigkill": "a SIGKILL, then serve"}
    for how, (g, _) in live.items():
        rows.append(Row("k", f"live restore across {what[how]}: heartbeat's largest beat gap", "us", g * 1e6,
                        live_idle * 1e6, "its idle gap (MAX_GAP, as long a window)", "<= 2x", g <= 2 * live_idle,
                        "the kernel's own MAX_GAP (globaltimer) read from the mailbox file: it beats on while no"
                        " daemon runs; adopted, never halted"))
    for how, (_, a) in live.items():
        rows.append(Row("k", f"live restore across {what[how]}: the stop to the API answering again", "ms", a * 1e3,
                        api * 1e3, "restore by reload's (j)", "-", None,
                        "the new daemon answers once it has adopted the daemon, the workers and the program"))
    if bench.quick:  # three more daemons' starts: past the CPU smoke run's time (the CPU tests count the clients)
        return rows
    busy_idle, busy = await anyio.to_thread.run_sync(restart_live_busy, bench)
    when = {"refill": "while the pool refills (a pooled worker killed; the stop as its replacement starts)",
            "recovery": "just after a fault's recovery (echo's worker killed; the stop as heartbeat beats again)"}
    for how, (g, made) in busy.items():
        rows.append(Row("k", f"live restore, a restart {when[how]}: heartbeat's largest beat gap", "us", g * 1e6,
                        busy_idle * 1e6, "its idle gap (MAX_GAP, as long a window)", "<= 2x",
                        g <= 2 * busy_idle and made == 0,
                        f"--pool 2, heartbeat and echo; {made} MPS clients made from the stop to the API answering"
                        " (the control daemon's log; target none)"))
    return rows
