"""Desired state across restarts of ``meshd-mps serve``, end to end on
the simulated GPU: every successful load, upgrade and unload is recorded in the state dir, and the
next start loads the recorded programs again on their slots before it answers; a program that no
longer loads is reported and skipped; programs declared in the config file are loaded when the
state lacks them, or its record of them cannot be used."""

from __future__ import annotations

import glob
import os

import pytest

from meshd_mps.serving.client import program_body
from meshd_mps.state.store import Store

from ..rigs.serve import EXAMPLES, Serve, cli

pytestmark = pytest.mark.timeout(120)


def serve(tmp: str, state: str, *extra: str, name: str = "s") -> Serve:
    s = Serve(tmp, "mps", os.path.join(tmp, f"{name}.sock"), "--pool", "1", "--state-dir", state, *extra)
    s.wait_ready()
    return s


def rows(s: Serve) -> dict[str, dict]:
    return {p["name"]: p for p in s.client.programs()}


def test_programs_come_back_on_their_slots_after_a_restart(tmp):
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, name="a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat"), restart="always"))
        a.client.load(program_body(str(EXAMPLES / "spin")))  # slot 1: unloaded below, its slot left free
        a.client.load(program_body(str(EXAMPLES / "echo")))
        a.client.unload("spin")
        up = a.client.upgrade("echo", program_body(str(EXAMPLES / "echo")))["program"]
        before = {n: (p["slot"], p["hash"], p["restart"]) for n, p in rows(a).items()}
        assert before["echo"][0] == 2 and before["heartbeat"] == (0, before["heartbeat"][1], "always")
        assert a.stop() == 0, a.log()[-4000:]
    finally:
        a.kill()
    b = serve(tmp, state, name="b")
    try:
        st = b.client.status()["state"]
        assert st["dir"] == state and st["restore"] == {"adopted": [], "restored": ["heartbeat", "echo"], "declared": [],
                                                  "halted": [], "skipped": {}, "left": {}}
        got = rows(b)
        assert {n: (p["slot"], p["hash"], p["restart"]) for n, p in got.items()} == before
        assert got["echo"]["hash"] == up["hash"] and all(p["state"] == "running" for p in got.values())
        assert b.client.call("echo", "after the restart")["data"] == "after the restart"
        b.client.unload("echo")
        assert b.stop() == 0, b.log()[-4000:]
    finally:
        b.kill()
    c = serve(tmp, state, name="c")
    try:
        assert list(rows(c)) == ["heartbeat"] and c.client.status()["state"]["restore"]["restored"] == ["heartbeat"]
        assert c.stop() == 0, c.log()[-4000:]
    finally:
        c.kill()


def test_a_program_that_no_longer_loads_is_skipped_and_reported(tmp):
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, name="a")
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        a.client.load(program_body(str(EXAMPLES / "echo")))
        assert a.stop() == 0, a.log()[-4000:]
    finally:
        a.kill()
    # echo's PTX damaged on disk (its sha256 no longer matches): it is skipped, heartbeat restored.
    with Store(state, lock=False) as st:
        key = st.programs()["echo"].ptx_key
    paths = glob.glob(os.path.join(state, "ptx", f"{key}*"))
    assert paths, os.listdir(os.path.join(state, "ptx"))
    with open(paths[0], "ab") as f:
        f.write(b"// damaged\n")
    b = serve(tmp, state, name="b")
    try:
        r = b.client.status()["state"]["restore"]
        assert r["restored"] == ["heartbeat"] and set(r["skipped"]) == {"echo"}, r
        assert list(rows(b)) == ["heartbeat"]
        assert b.stop() == 0, b.log()[-4000:]
    finally:
        b.kill()
    # Declared in the config file, echo comes back from its declaration instead of its damaged record.
    conf = os.path.join(tmp, "meshd-mps.toml")
    with open(conf, "w") as f:
        f.write(f'[program.echo]\ndir = "{EXAMPLES / "echo"}"\n')
    c = serve(tmp, state, "--config", conf, name="c")
    try:
        r = c.client.status()["state"]["restore"]
        assert r["restored"] == ["heartbeat"] and r["declared"] == ["echo"] and r["skipped"] == {}, r
        assert c.client.call("echo", "from its declaration")["data"] == "from its declaration"
        assert c.stop() == 0, c.log()[-4000:]
    finally:
        c.kill()


def test_programs_declared_in_the_config_file_are_loaded(tmp):
    state = os.path.join(tmp, "state")
    conf = os.path.join(tmp, "meshd-mps.toml")
    with open(conf, "w") as f:
        f.write(f'[program.heartbeat]\ndir = "{EXAMPLES / "heartbeat"}"\nrestart = "never"\n\n'
                f'[program.echo]\ndir = "{EXAMPLES / "echo"}"\n')
    a = serve(tmp, state, "--config", conf, name="a")
    try:
        assert a.client.status()["state"]["restore"] == {"adopted": [], "restored": [], "declared": ["heartbeat", "echo"],
                                                     "halted": [], "skipped": {}, "left": {}}
        got = rows(a)
        assert got["heartbeat"]["restart"] == "never" and got["echo"]["restart"] == "on-failure"
        a.client.upgrade("heartbeat", program_body(str(EXAMPLES / "heartbeat"), restart="always"))
        assert a.stop() == 0, a.log()[-4000:]
    finally:
        a.kill()
    b = serve(tmp, state, "--config", conf, name="b")
    try:
        # The records win: the upgrade's policy, not the declaration's; nothing loaded twice.
        r = b.client.status()["state"]["restore"]
        assert sorted(r["restored"]) == ["echo", "heartbeat"] and r["declared"] == [], r
        assert rows(b)["heartbeat"]["restart"] == "always"
        assert b.stop() == 0, b.log()[-4000:]
    finally:
        b.kill()


def test_a_state_dir_others_may_write_is_refused(tmp):
    state = os.path.join(tmp, "state")
    os.mkdir(state, 0o700)
    os.chmod(state, 0o777)
    r = cli("serve", "--gpu", "sim", "--socket", os.path.join(tmp, "s.sock"), "--state-dir", state)
    assert r.returncode != 0 and state in r.stderr and "Traceback" not in r.stderr, r.stderr
