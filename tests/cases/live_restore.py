"""Live restore's cases, run on the simulated GPU by tests/serve/test_live_restore.py and on the
H200 by tests/gpu/test_live_restore_real.py: a ``serve --live-restore`` stops or dies and the next
one adopts, halts and loads; ``gpu`` is serve's ``--gpu``."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import textwrap

from meshd_mps.backend import live_paths
from meshd_mps.mps.control import Owner
from meshd_mps.protocol import abi, payloads
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.serving.client import program_body
from meshd_mps.state.store import Store
from meshd_mps.supervision import procfs

from ..rigs.serve import EXAMPLES, Serve, leftovers
from ..rigs.waits import poll


def serve(tmp: str, state: str, isolation: str = "mps", *extra: str, name: str = "s", live: bool = True,
          gpu: str = "sim") -> Serve:
    pool = ["--pool", "1"] if isolation == "mps" else []
    s = Serve(tmp, isolation, os.path.join(tmp, f"{name}.sock"), *pool, "--state-dir", state,
              *(["--live-restore"] if live else []), *extra, gpu=gpu)
    s.wait_ready()
    return s


def rows(s: Serve) -> dict[str, dict]:
    return {p["name"]: p for p in s.client.programs()}


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # this test process is a subreaper (conftest): orphans are ours to reap
    return procfs.starttime(pid) is not None


def reap_orphans() -> None:
    """What the dead daemons left and has exited since (re-parented to us), reaped as init would."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def pooled(s: Serve) -> list[int]:
    """A worker idle in the pool (a load takes the pooled one; an unload gives its worker back)."""
    s.client.load(program_body(str(EXAMPLES / "spin")))
    s.client.unload("spin")
    pool = s.client.status()["pool"]["idle"]
    assert len(pool) == 1, pool
    return pool


def nothing_left(state: str) -> None:
    def clean() -> bool:
        reap_orphans()
        return not leftovers([state])

    poll(clean, 20.0, f"no process of the state dir left: {leftovers([state])}")
    assert not os.path.exists(live_paths(state).mailbox), "the mailbox left in shared memory"
    assert regions(state) == [], "a payload region left in shared memory"


def regions(state: str) -> list[str]:
    """The payload regions in shared memory beside the state dir's live mailbox."""
    return glob.glob(glob.escape(payloads.live_prefix(live_paths(state).mailbox)) + "*")


def wait_beats(mb: Mailbox, slot: int, more_than: int) -> int:
    return poll(lambda: (hb := mb.heartbeat(slot)) > more_than and hb, 20.0, f"slot {slot} beating past {more_than}")


def adopt_case(tmp: str, isolation: str, how: int, gpu: str = "sim") -> None:
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, isolation, name="a", gpu=gpu)
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        a.client.load(program_body(str(EXAMPLES / "echo")))
        pool = pooled(a) if isolation == "mps" else []
        # Blink: the next context's worker stands by (no context); a stop retires it, a SIGKILL leaves it
        # for the next daemon, which adopts it and retires it (it holds no module).
        standby = poll(lambda: a.client.status()["standby_pid"], 20.0, "the standby") if isolation == "blink" else None
        before = rows(a)
        mb = Mailbox.open(live_paths(state).mailbox)  # the file the kernels beat in: it outlives the daemon
        try:
            used = {p["slot"] for p in before.values()}
            assert [s for s in range(abi.SLOTS) if s not in used and mb.u32(s, abi.STATE) != abi.IDLE] == [], \
                "an unloaded program's slot keeps a word of its kernel"
            slot = before["heartbeat"]["slot"]
            if how == signal.SIGKILL:
                a.proc.kill()
                a.proc.wait(10)
            else:
                assert a.stop() == 0, a.log()[-4000:]
            last = mb.heartbeat(slot)
            assert len(regions(state)) == 1, "echo's payload region outlives its daemon, as the mailbox does"
            pids = {p["pid"] for p in before.values()} | set(pool)
            assert all(alive(p) for p in pids), "the workers run on with no daemon"
            if how == signal.SIGKILL and standby is not None:
                pids.add(standby)
            last = wait_beats(mb, slot, last + 2)  # and the kernel beats meanwhile
            b = serve(tmp, state, isolation, name="b", gpu=gpu)
            try:
                after = rows(b)
                same = ("pid", "slot", "hash", "device", "nodes", "restart")
                assert {n: [p[k] for k in same] for n, p in after.items()} == {
                    n: [p[k] for k in same] for n, p in before.items()}
                assert all(p["state"] == "running" for p in after.values()), after
                assert after["heartbeat"]["heartbeat"] >= last, "the heartbeat counted on, never reset"
                st = b.client.status()
                assert not st["faults"], st["faults"]
                assert st["state"]["restore"]["adopted"] == ["heartbeat", "echo"], st["state"]
                assert not st["state"]["restore"]["restored"] and not st["state"]["restore"]["halted"]
                assert set(st["state"]["adoption"]["adopted"]) == pids
                assert "halted the kernels on slots" not in b.log(), "a slot no kernel runs taken for a running one"
                if isolation == "mps":
                    assert st["pool"]["idle"] == pool, "the pooled worker adopted into the pool"
                assert b.client.call("echo", "adopted")["data"] == "adopted"
                big = os.urandom(20_000)  # through its payload region, found again by the new daemon
                assert b.client.call_bytes("echo", big) == big
                up = b.client.upgrade("echo", program_body(str(EXAMPLES / "echo")))["program"]
                assert up["state"] == "running" and b.client.call("echo", "upgraded")["data"] == "upgraded"
                assert b.client.call_bytes("echo", big[::-1]) == big[::-1]
                for n in ("echo", "heartbeat"):
                    b.client.unload(n)
                assert b.stop() == 0  # nothing runs: a full stop, which leaves nothing behind
            finally:
                b.kill()
        finally:
            mb.close()
    finally:
        a.kill()
    nothing_left(state)
    assert Owner.read(live_paths(state).mps) is None, "the MPS daemon quit"


def orphan_case(tmp: str, gpu: str = "sim") -> None:
    """The orphan timeout; then a start without live restore ends what is left and reloads."""
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, "mps", "--orphan-timeout", "1", name="a", gpu=gpu)
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        a.client.load(program_body(str(EXAMPLES / "echo")))  # its payload region in shared memory, left too
        pids = a.client.status()["workers"]
        a.proc.kill()
        a.proc.wait(10)
    finally:
        a.kill()
    poll(lambda: not any(alive(p) for p in pids), 30.0, f"workers {pids} exited after their orphan timeout")
    mb = Mailbox.open(live_paths(state).mailbox)
    try:
        assert mb.u32(0, abi.STATE) == abi.EXITED, "the kernel was halted before its worker exited"
    finally:
        mb.close()
    assert Owner.read(live_paths(state).mps) is not None, "the MPS daemon outlives the workers"
    b = serve(tmp, state, "mps", name="b", live=False, gpu=gpu)
    try:
        assert Owner.read(live_paths(state).mps) is None, "the daemon left in the state dir was quit"
        assert not os.path.exists(live_paths(state).mailbox) and regions(state) == []
        st = b.client.status()["state"]
        assert st["restore"]["restored"] == ["heartbeat", "echo"] and not st["restore"]["adopted"], st
        big = os.urandom(30_000)
        assert b.client.call_bytes("echo", big) == big
        assert b.stop() == 0, b.log()[-4000:]
    finally:
        b.kill()
    nothing_left(state)


FAKE_WORKER = textwrap.dedent("""
    import mmap, os, socket, struct, sys, threading, time
    dir, mailbox, slot, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    f = open(mailbox, "r+b")
    mm = mmap.mmap(f.fileno(), 1 << 20)
    base = slot * 4096
    struct.pack_into("<I", mm, base + 4, 1)  # STATE = RUNNING: a kernel of an older worker on that slot

    def kernel():
        while struct.unpack_from("<I", mm, base)[0] != 1:  # until CONTROL = HALT
            time.sleep(0.005)
        struct.pack_into("<I", mm, base + 4, 2)  # STATE = EXITED

    threading.Thread(target=kernel, daemon=True).start()
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(dir, f"{os.getpid()}.sock"))
    s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept()
    body = struct.pack("<II", 99, os.getpid()) + b"a layout of the future"
    c.sendall(struct.pack("<I", 1 + len(body)) + bytes([10]) + body)  # HELLO, version 99
    frame = c.recv(5)
    state = struct.unpack_from("<I", mm, base + 4)[0]
    with open(out, "w") as o:
        o.write(f"{frame[4] if len(frame) == 5 else -1} {state}")  # the op it got, and its slot's STATE then
    os.unlink(os.path.join(dir, f"{os.getpid()}.sock"))
""")


def reconcile_case(tmp: str, gpu: str = "sim") -> None:
    state = os.path.join(tmp, "state")
    paths = live_paths(state)
    heartbeat2 = os.path.join(tmp, "heartbeat2")  # a second heartbeat program, under another name
    os.mkdir(heartbeat2)
    with open(EXAMPLES / "heartbeat" / "manifest.json") as f:
        manifest = f.read().replace('"heartbeat"', '"heartbeat2"')
    with open(os.path.join(heartbeat2, "manifest.json"), "w") as f:
        f.write(manifest)
    with open(EXAMPLES / "heartbeat" / "heartbeat.cu") as f, open(os.path.join(heartbeat2, "heartbeat.cu"), "w") as g:
        g.write(f.read())
    a = serve(tmp, state, "mps", name="a", gpu=gpu)
    try:
        for d in (str(EXAMPLES / "heartbeat"), str(EXAMPLES / "echo"), str(EXAMPLES / "spin"), heartbeat2):
            a.client.load(program_body(d))
        with Store(state, lock=False) as st:
            echo_v1 = st.programs()["echo"]
            echo_v1_ptx = st.ptx(echo_v1)
        # echo v2, another image, runs when the daemon stops: spin's (the simulated GPU runs only the
        # shipped examples, known by their image; a comment added to echo's PTX would be none of them).
        v2 = program_body(str(EXAMPLES / "spin"))
        v2["manifest"]["name"] = "echo"
        a.client.upgrade("echo", v2)
        before = rows(a)
        assert a.stop() == 0, a.log()[-4000:]
    finally:
        a.kill()
    # Meanwhile: as if echo's upgrade and spin's load had never been answered (the record is written
    # before the answer), and heartbeat2's kernel ended with no daemon connected.
    with Store(state, lock=False) as st:
        st.record(echo_v1, echo_v1_ptx)
        st.forget("spin")
    mb = Mailbox.open(paths.mailbox)
    try:
        mb.halt(before["heartbeat2"]["slot"])
        poll(lambda: mb.u32(before["heartbeat2"]["slot"], abi.STATE) == abi.EXITED, 20.0, "heartbeat2 halted")
        # And an older meshd-mps's worker, of protocol version 99, runs a kernel on slot 9.
        out = os.path.join(tmp, "fake.out")
        fake = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, paths.workers, paths.mailbox, "9", out],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert fake.stdout is not None and fake.stdout.readline().strip() == "listening"
            b = serve(tmp, state, "mps", name="b", gpu=gpu)
            try:
                assert fake.wait(30) == 0
                with open(out) as f:
                    assert f.read() == "8 2", "told to QUIT (op 8) once its kernel was halted (STATE EXITED)"
                r = b.client.status()["state"]["restore"]
                assert r["adopted"] == ["heartbeat"], r
                assert sorted(r["restored"]) == ["echo", "heartbeat2"], r
                halted = {h["program"]: h for h in r["halted"]}
                assert set(halted) == {"spin", "echo", "heartbeat2"}, r["halted"]
                assert halted["spin"]["pid"] == before["spin"]["pid"] and "no record" in halted["spin"]["why"]
                assert halted["echo"]["pid"] == before["echo"]["pid"] and "upgrade" in halted["echo"]["why"]
                assert "not running" in halted["heartbeat2"]["why"]
                assert fake.pid in b.client.status()["state"]["adoption"]["dismissed"]
                got = rows(b)
                assert set(got) == {"heartbeat", "echo", "heartbeat2"}
                assert got["heartbeat"]["pid"] == before["heartbeat"]["pid"], "adopted: the same worker"
                assert got["echo"]["hash"] == echo_v1.hash and got["echo"]["slot"] == before["echo"]["slot"]
                assert all(p["state"] == "running" for p in got.values()), got
                assert b.client.call("echo", "v1 again")["data"] == "v1 again"
                # The halted workers went back to the pool or were retired; none runs a kernel.
                assert not alive(before["spin"]["pid"]) or before["spin"]["pid"] in b.client.status()["pool"]["idle"]
                for n in got:
                    b.client.unload(n)
                assert b.stop() == 0, b.log()[-4000:]
            finally:
                b.kill()
        finally:
            if fake.poll() is None:
                fake.kill()
            fake.wait()
            assert fake.stdout is not None
            fake.stdout.close()
    finally:
        mb.close()
    nothing_left(state)


def blink_discard_case(tmp: str, gpu: str = "sim") -> None:
    state = os.path.join(tmp, "state")
    a = serve(tmp, state, "blink", name="a", gpu=gpu)
    try:
        a.client.load(program_body(str(EXAMPLES / "heartbeat")))
        a.client.load(program_body(str(EXAMPLES / "spin")))
        before = rows(a)
        assert a.stop() == 0, a.log()[-4000:]
    finally:
        a.kill()
    with Store(state, lock=False) as st:
        st.forget("spin")
    b = serve(tmp, state, "blink", name="b", gpu=gpu)
    try:
        r = b.client.status()["state"]["restore"]
        assert r["adopted"] == ["heartbeat"] and [h["program"] for h in r["halted"]] == ["spin"], r
        got = rows(b)
        assert list(got) == ["heartbeat"] and got["heartbeat"]["pid"] == before["heartbeat"]["pid"]
        assert got["heartbeat"]["state"] == "running" and b.client.status()["blinks"] == 1
        b.client.unload("heartbeat")
        assert b.stop() == 0, b.log()[-4000:]
    finally:
        b.kill()
    nothing_left(state)
