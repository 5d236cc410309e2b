"""No MPS client made by surprise while programs run, counted by the
stand-in MPS daemon (tests/rigs/made.py), never timed: each new client stalls every running program
of its GPU once on the GPU (0.5 ms at 8 clients, 1.6 ms at 44 on an H100).

- an upgrade in steady state makes none: the pool's last worker is its reserve, which no load takes;
- a load beyond the pool makes its client at the load, and its answer, the CLI and the log say so,
  with the estimated stall;
- a start that restores programs makes every worker it needs before it launches any of them;
- an adopting start (live restore) makes none: of a worker left without a context (held after a
  fault's recovery, or a refill's caught by the stop), nor of one the stop caught starting.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from meshd_mps.backend import live_paths
from meshd_mps.mps.clients import stall_estimate_us
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.serving.client import ClientError, program_body
from meshd_mps.supervision import procfs

from ..cases.live_restore import reap_orphans
from ..rigs.backend import example, open_sim
from ..rigs.made import MadeClients
from ..rigs.serve import EXAMPLES, Serve, cli, events
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(150)


def named(name: str) -> tuple[dict, bytes]:
    man, ptx = example("heartbeat")
    return {**man, "name": name}, ptx


async def test_an_upgrade_in_steady_state_makes_no_client(standin_on_path):
    async with await open_sim("mps", pool=2) as b:
        progs, made = Programs(b), MadeClients(b.daemon.dir)
        try:
            for i in range(4):  # the first takes a pooled worker; the pool's last is its reserve
                await progs.load(*named(f"heartbeat-{i}"))
            g = b.isolations[b.devices[0]]
            assert g.reserve() == (1, 1) and len(g.pool) == 1
            for _ in range(3):
                made.mark()
                before = progs.by_name["heartbeat-0"].kernel.pid
                p = await progs.upgrade("heartbeat-0", *named("heartbeat-0"))
                assert made.made() == [], "an upgrade in steady state made an MPS client"
                assert p.kernel.pid != before and p.kernel.module.new_client is None
                assert g.reserve() == (1, 1)  # the old version's worker is the reserve now
            st = b.status()
            assert st["pool_reserve"] == 1 and st["pool_reserve_cap"] == 1
        finally:
            await progs.close()


async def test_a_load_beyond_the_pool_makes_its_client_at_the_load(standin_on_path):
    async with await open_sim("mps", pool=2) as b:
        progs, made = Programs(b), MadeClients(b.daemon.dir)
        try:
            made.mark()
            first = await progs.load(*named("heartbeat-0"))
            assert made.made() == [] and first.kernel.module.new_client is None  # a pooled worker
            second = await progs.load(*named("heartbeat-1"))
            # Made at this load (the pool is down to its reserve), for this program, and said.
            assert made.made() == [second.kernel.pid]
            nc = second.kernel.module.new_client
            assert nc is not None and nc.clients == 3 and nc.stall_us == stall_estimate_us(3)
            assert b.mps.created == 3  # the pool's two, and this one
        finally:
            await progs.close()


def test_a_load_beyond_the_pool_says_so_in_its_answer_the_cli_and_the_log(tmp):
    mps_dir = os.path.join(tmp, "mps")
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "2", "--mps-dir", mps_dir)
    try:
        st = s.wait_ready()
        assert st["pool"]["reserve"] == 1 and st["pool"]["reserve_capacity"] == 1
        assert "new_client" not in s.client.load(program_body(str(EXAMPLES / "heartbeat")))
        made = MadeClients(mps_dir)
        made.mark()
        ans = s.client.load(program_body(str(EXAMPLES / "echo")))
        assert made.made() == [ans["program"]["pid"]]
        assert ans["new_client"] == {"clients": 3, "stall_us_estimate": stall_estimate_us(3)}, ans
        out = cli("load", "--socket", s.sock, str(EXAMPLES / "spin"))
        assert out.returncode == 0, out.stderr
        assert "a new MPS client was made for it" in out.stdout and "(an estimate)" in out.stdout, out.stdout
        said = [e for e in events(s) if e.get("new_client")]
        assert [e["program"] for e in said] == ["echo", "spin"], said
        assert said[0]["new_client"] == ans["new_client"]
        metrics = s.client.metrics()
        assert "meshd_mps_pool_reserve 1" in metrics and "meshd_mps_clients_created_total 4" in metrics
        assert s.client.status()["pool"]["reserve"] == 1
    finally:
        s.kill()


def test_a_restoring_start_makes_every_worker_before_it_launches_any(tmp):
    state, mps_dir = os.path.join(tmp, "state"), os.path.join(tmp, "mps")
    args = ("--pool", "1", "--state-dir", state, "--mps-dir", mps_dir)
    a = Serve(tmp, "mps", os.path.join(tmp, "a.sock"), *args)
    try:
        a.wait_ready()
        for ex in ("heartbeat", "echo", "spin"):
            a.client.load(program_body(str(EXAMPLES / ex)))
        assert a.stop() == 0
    finally:
        a.kill()
    made = MadeClients(mps_dir)
    made.mark()
    b = Serve(tmp, "mps", os.path.join(tmp, "b.sock"), *args)
    try:
        b.wait_ready()
        assert sorted(b.client.status()["state"]["restore"]["restored"]) == ["echo", "heartbeat", "spin"]
        seen = made.since()
        first_run = next(i for i, (what, _) in enumerate(seen) if what == "running")
        late = [pid for what, pid in seen[first_run:] if what == "new"]
        assert not late, f"clients made after the first launch: {late} ({seen})"
        assert len(made.made()) == 4  # the three programs' and the pool's reserve
    finally:
        b.kill()


def _serve_live(tmp: str, name: str, *extra: str) -> Serve:
    s = Serve(tmp, "mps", os.path.join(tmp, f"{name}.sock"), "--pool", "2", "--live-restore", "--orphan-timeout", "5",
              "--state-dir", os.path.join(tmp, "state"), *extra)
    s.wait_ready()
    return s


def _clean_up(b: Serve) -> None:
    for p in b.client.programs():
        b.client.unload(p["name"])
    assert b.stop() == 0  # nothing runs: a full stop


def _full_stop(s: Serve) -> None:
    """After a failure: a live-restore daemon that still runs stopped with nothing loaded, so that it
    leaves nothing behind (a SIGTERM alone would leave its workers, daemon and mailbox running)."""
    if s.proc.poll() is None:
        with contextlib.suppress(ClientError):
            for p in s.client.programs():
                s.client.unload(p["name"])
    s.kill()


async def test_an_adopting_start_makes_no_client_of_a_worker_left_without_one(standin_on_path, tmp):
    """After a fault's recovery a worker started ahead for the killed program (held: imported, no
    context) was left over, waiting; the next daemon adopted it and asked it READY, which made its
    client (the first live restart after a recovery cost 518-543 us on the GPU).  It is retired
    unasked now; the pooled worker, a client already, is adopted into the pool."""
    state = os.path.join(tmp, "state")
    a = await open_sim("mps", pool=1, live=state)
    made = MadeClients(a.daemon.dir)
    try:
        g = a.isolations[a.devices[0]]
        # As a fault's teardown leaves one (MpsIsolation.teardown) when its daemon is killed: a live
        # stop retires the held ones it knows of, so this one is not handed to the isolation.
        held = await g.mps.spawn(None, g.device, hold=True)
        pooled = g.pool.pids()
        made.mark()
    finally:
        await a.detach()
    b = await open_sim("mps", pool=1, live=state)
    try:
        assert made.made() == [], "the adopting start made an MPS client"
        assert b.isolations[b.devices[0]].pool.pids() == pooled and held.pid not in b.sup.live()
        assert b.adoption["adopted"] == sorted([*pooled, held.pid])
    finally:
        await b.close()
    poll(lambda: (reap_orphans(), procfs.starttime(held.pid) is None)[1], 20.0, f"the held worker {held.pid} ended")
    assert made.made() == []


def test_an_adopting_start_while_the_pool_refills_makes_no_client(tmp):
    """The old daemon dies (SIGKILL) just as the pool's paced refill has started a worker: the next
    daemon makes no client, nor does that worker on its own."""
    made = MadeClients(live_paths(os.path.join(tmp, "state")).mps)
    a = _serve_live(tmp, "a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        known = set(a.client.status()["workers"])
        pooled = a.client.status()["pool"]["idle"]
        os.kill(pooled[0], signal.SIGKILL)  # idle: no fault; the pool refills, paced

        def refill_started() -> list[int]:
            return [p.pid for p in procfs.processes() if p.ppid == a.proc.pid and p.pid not in known
                    and p.pid != pooled[0] and "workers" in p.argv]

        (late, *_) = poll(refill_started, 30.0, "the refill's worker started", every=0.002)
        # Stopped at once, so that the daemon's READY (sent once it has imported) cannot make its
        # client before the kill: on a loaded machine this test's poll may see it late.
        os.kill(late, signal.SIGSTOP)
        made.settle()  # a HELLO it wrote before the stop was its old daemon's refill, not its own
        made.mark()
        a.proc.kill()
        a.proc.wait(10)
        os.kill(late, signal.SIGCONT)
    finally:
        _full_stop(a)
    b = _serve_live(tmp, "b")
    try:
        assert b.client.status()["state"]["restore"]["adopted"] == ["heartbeat"]
        assert made.made() == [], (f"a client was made across the restart: {made.since()} (the old daemon's"
                                   f" refill worker: {late}; the new daemon's workers: {b.client.status()['workers']})")
        _clean_up(b)
    finally:
        _full_stop(b)
        reap_orphans()


def test_an_adopting_start_reloads_a_lost_program_on_an_idle_worker(tmp):
    """A program whose worker ended while no daemon ran is reloaded by the next one, beside the
    adopted programs: on the worker the old daemon left idle (the pool's reserve), not on a new
    client; the reserve is refilled after, paced."""
    state = os.path.join(tmp, "state")
    made = MadeClients(live_paths(state).mps)
    a = _serve_live(tmp, "a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        echo = a.client.load(program_body(str(EXAMPLES / "echo")))["program"]  # beyond the pool: its own client
        assert a.stop() == 0
    finally:
        _full_stop(a)
    mb = Mailbox.open(live_paths(state).mailbox)
    try:  # echo's kernel halted through its slot, then its worker ended: nothing faults
        mb.halt(echo["slot"])
        poll(lambda: mb.u32(echo["slot"], abi.STATE) != abi.RUNNING, 20.0, "echo's kernel halted")
    finally:
        mb.close()
    os.kill(echo["pid"], signal.SIGKILL)
    poll(lambda: (reap_orphans(), procfs.starttime(echo["pid"]) is None)[1], 20.0, "echo's worker gone")
    made.mark()
    b = _serve_live(tmp, "b")
    try:
        restore = b.client.status()["state"]["restore"]
        assert restore["adopted"] == ["heartbeat"] and restore["restored"] == ["echo"], restore
        # Before echo's kernel runs again, no client; after it, the reserve's paced refill may have
        # made one already (pool_pace after the restore: a loaded machine asks late).
        seen, pid = made.since(), b.client.program("echo")["pid"]
        assert ("running", pid) in seen, seen
        before = seen[: seen.index(("running", pid))]
        assert [p for what, p in before if what == "new"] == [], f"the adopting start made an MPS client: {seen}"
        assert b.client.call("echo", "back")["data"] == "back"
        poll(lambda: b.client.status()["pool"]["reserve"] == 1, 30.0, "the reserve refilled, paced")
        _clean_up(b)
    finally:
        _full_stop(b)
        reap_orphans()
