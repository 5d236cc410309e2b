"""Program leases (serving/leases.py) on a real ``meshd-mps serve --gpu sim --live-restore``: a
program loaded with ``lease_until`` is unloaded by the daemon once its lease runs out and not
before while it is renewed; a lease run out already is refused; an upgrade keeps the lease; a
daemon restarted with live restore keeps enforcing it (the fleet's ``unique`` replicas rest on it:
docs/fleet.md, "Nothing runs twice").  One daemon for the module; the restart test has its own, and starts
the next on its state dir."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from meshd_mps.serving.client import ClientError, program_body

from ..rigs.serve import EXAMPLES, Serve, reap
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(120)


class Daemon:
    """The module's daemon, on a state dir that outlives it (``restart``)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="mls-")
        self.sock = os.path.join(self.dir, "s.sock")
        self.serve = self.start()

    def start(self) -> Serve:
        s = Serve(self.dir, "blink", self.sock, "--state-dir", os.path.join(self.dir, "state"), "--live-restore")
        s.wait_ready()
        return s

    def restart(self) -> None:
        """SIGTERM with live restore (the programs run on), then the next daemon on the same state dir."""
        assert self.serve.stop() == 0, self.serve.log()
        self.serve = self.start()


    def close(self) -> None:
        """Every program unloaded, the daemon stopped (nothing runs: a full stop), its dir removed."""
        for p in self.serve.client.programs():
            self.serve.client.unload(p["name"])
        self.serve.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    try:
        yield d
    finally:
        d.close()


def body(name: str, **extra) -> dict:
    b = program_body(str(EXAMPLES / "heartbeat"))
    b["manifest"] = {**b["manifest"], "name": name}
    return {**b, **extra}


def names(d: Daemon) -> set[str]:
    return {p["name"] for p in d.serve.client.programs()}


def test_a_lease_not_renewed_unloads_its_program_and_a_renewed_one_runs_on(daemon):
    c = daemon.serve.client
    t0 = time.time()
    c.load(body("heartbeat-kept", lease_until=t0 + 1.5))
    c.load(body("heartbeat-left", lease_until=t0 + 1.5))
    c.load(body("heartbeat-free"))  # no lease: never unloaded by one
    row = c.program("heartbeat-left")
    assert row["lease_until"] == pytest.approx(t0 + 1.5) and c.program("heartbeat-free")["lease_until"] is None
    assert c.status()["leases"]["count"] == 2 and c.status()["leases"]["stop_within"] > 0

    def renewing_until_left_is_gone() -> bool:
        got = c.renew(["heartbeat-kept", "heartbeat-free", "nothing"], time.time() + 1.5)
        assert got["renewed"] == ["heartbeat-kept"] and got["missing"] == ["heartbeat-free", "nothing"], got
        return "heartbeat-left" not in names(daemon)

    poll(renewing_until_left_is_gone, 20, "heartbeat-left unloaded past its lease", every=0.2)
    assert time.time() >= t0 + 1.5, "not before its lease ran out"
    assert {"heartbeat-kept", "heartbeat-free"} <= names(daemon), "the renewed one and the one without a lease run on"
    assert "lease ran out" in daemon.serve.log()
    c.unload("heartbeat-kept")
    c.unload("heartbeat-free")
    assert c.status()["leases"]["count"] == 0, "an unload drops the lease"


def test_a_lease_run_out_already_is_refused_and_an_upgrade_keeps_the_lease(daemon):
    c = daemon.serve.client
    with pytest.raises(ClientError) as e:
        c.load(body("heartbeat-late", lease_until=time.time() - 1))
    assert e.value.status == 409 and e.value.body["program"] == "heartbeat-late", e.value.body
    assert "heartbeat-late" not in names(daemon) and c.status()["leases"]["count"] == 0, "nothing loaded, no lease kept"
    for bad in ({"until": "soon", "programs": []}, {"until": 1e9}, {"until": 1e9, "programs": "x"}, {"x": 1}):
        st, _h, data = c.raw("POST", "/v1/leases", json.dumps(bad).encode())
        assert st == 400, (bad, data)
    until = time.time() + 60
    c.load(body("heartbeat-up", lease_until=until))
    with pytest.raises(ClientError) as e:
        c.upgrade("heartbeat-up", body("heartbeat-up", lease_until=until + 60))
    assert e.value.status == 400 and e.value.body["field"] == "lease_until"
    c.upgrade("heartbeat-up", body("heartbeat-up"))
    assert c.program("heartbeat-up")["lease_until"] == pytest.approx(until)
    c.unload("heartbeat-up")


def test_a_daemon_restarted_with_live_restore_keeps_enforcing_the_leases():
    daemon = Daemon()  # its own: the restart's daemon and the adopted workers end with the test
    workers: list[int] = []
    try:
        restarted(daemon, workers)
    finally:
        daemon.close()
        reap(workers)  # the first daemon's, re-parented to this process (a subreaper) when it stopped


def restarted(daemon: Daemon, workers: list[int]) -> None:
    c = daemon.serve.client
    t0 = time.time()
    c.load(body("heartbeat-gap", lease_until=t0 + 2.0))  # runs out while no daemon runs
    c.load(body("heartbeat-on", lease_until=t0 + 60))
    pid = c.program("heartbeat-on")["pid"]
    workers.extend({p["pid"] for p in c.programs()})
    daemon.restart()
    c = daemon.serve.client
    row = c.program("heartbeat-on")
    assert (row["pid"], row["lease_until"]) == (pid, pytest.approx(t0 + 60)), "adopted, with its lease"
    poll(lambda: "heartbeat-gap" not in names(daemon), 20, "heartbeat-gap unloaded past its lease after the restart")
    assert time.time() >= t0 + 2.0
    c.unload("heartbeat-on")
