"""A program's data through ``meshd-mps serve`` on the simulated GPU: loaded from the CLI (``--data``,
the manifest's ``data``) and over HTTP, written from both, shown by ps, status and the metrics;
kept across a restart of the daemon (from the state dir, its writes too) and a live restore (the
worker keeps it); a restore whose data is gone fails that program alone, said in status; and the
daemon's RSS while a large file streams in stays near its idle RSS."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading

import pytest

from meshd_mps.bench.measure import vmrss_mib
from meshd_mps.serving.client import ClientError, program_body

from ..cases.live_restore import nothing_left
from ..rigs.serve import EXAMPLES, Serve, cli, parse_metrics

pytestmark = pytest.mark.timeout(120)

HEAD = struct.Struct("<QII")


def peek(s: Serve, name: str, offset: int, n: int) -> tuple[int, int, int, bytes]:
    got = bytes.fromhex(s.client.call(name, struct.pack("<QI", offset, n))["hex"])
    size, seq, total = HEAD.unpack_from(got)
    return size, seq, total, got[HEAD.size :]


def start(tmp: str, state: str, *extra: str, name: str) -> Serve:
    s = Serve(tmp, "blink", os.path.join(tmp, f"{name}.sock"), "--state-dir", state, *extra)
    s.wait_ready()
    return s


def test_cli_and_http_load_write_and_a_restart_restores_the_data_with_its_writes(tmp):
    state = os.path.join(tmp, "state")
    table = os.path.join(tmp, "table.bin")
    with open(table, "wb") as f:
        f.write(bytes(range(256)) * 16)  # 4 KiB
    d = os.path.join(tmp, "peek2")  # the manifest's own data file, beside it
    shutil.copytree(EXAMPLES / "peek", d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"name": "peek2", "backend": "cuda", "warps": 1, "abi": 1, "data": "t.bin"}, f)
    with open(os.path.join(d, "t.bin"), "wb") as f:
        f.write(b"beside the manifest")
    a = start(tmp, state, name="a")
    sock = ["--socket", a.sock]
    try:
        r = cli("load", str(EXAMPLES / "peek"), "--data", table, *sock)
        assert r.returncode == 0, r.stderr
        r = cli("load", d, *sock)
        assert r.returncode == 0, r.stderr
        assert peek(a, "peek2", 0, 19)[0::3] == (19, b"beside the manifest")
        assert peek(a, "peek", 10, 4) == (4096, 0, 10 + 11 + 12 + 13, bytes([10, 11, 12, 13]))
        # The CLI's write, then the HTTP API's, each seen with its DATA_SEQ.
        with open(os.path.join(tmp, "w.bin"), "wb") as f:
            f.write(b"ABCD")
        r = cli("write", "peek", "10", os.path.join(tmp, "w.bin"), *sock)
        assert r.returncode == 0 and "4 bytes written at 10 (DATA_SEQ 1)" in r.stdout, r.stderr
        st, _h, body = a.client.raw("POST", "/v1/programs/peek/write?offset=4094", b"yz",
                                    {"Content-Type": "application/octet-stream"})
        assert st == 200 and json.loads(body)["seq"] == 2
        assert peek(a, "peek", 8, 8)[1::2] == (2, bytes([8, 9]) + b"ABCD" + bytes([14, 15]))
        # Refusals, each by its type: past the end (400, both sizes), a key it lacks (404), not a key (400).
        with pytest.raises(ClientError) as e:
            a.client.write("peek", 4095, b"xy")
        assert e.value.status == 400 and e.value.body and (e.value.body["size"], e.value.body["bytes"]) == (4096, 2)
        body_ = program_body(str(EXAMPLES / "peek"))
        with pytest.raises(ClientError) as e:
            a.client.load({**body_, "manifest": {**body_["manifest"], "name": "p3"}, "data": "a" * 64})
        assert e.value.status == 404 and "POST /v1/data" in str(e.value)
        with pytest.raises(ClientError) as e:
            a.client.load({**body_, "data": "not a key"})
        assert e.value.status == 400 and e.value.body and e.value.body["field"] == "data"
        # Over HTTP: the file streamed in, then loaded by its key.
        key = a.client.upload(table)
        ans = a.client.load({**body_, "manifest": {**body_["manifest"], "name": "peek3"}, "data": key})
        assert ans["program"]["data_bytes"] == 4096 and ans["program"]["data"] == key
        rows = {p["name"]: p for p in a.client.programs()}
        assert rows["peek"]["data_bytes"] == 4096 and rows["peek"]["data_writes"] == 2
        m = parse_metrics(a.client.metrics())
        assert m['meshd_mps_program_data_bytes{program="peek"}'] == 4096
        r = cli("ps", *sock)
        assert "DATA" in r.stdout and "4.0 KiB" in r.stdout, r.stdout
        assert a.stop() == 0, a.log()[-3000:]
    finally:
        a.kill()
    # Restarted (no live restore): every program back with its data, and peek with its writes.
    b = start(tmp, state, name="b")
    try:
        assert peek(b, "peek", 8, 8)[3] == bytes([8, 9]) + b"ABCD" + bytes([14, 15])
        assert peek(b, "peek", 4094, 2)[3] == b"yz"
        assert peek(b, "peek3", 10, 2)[3] == bytes([10, 11])
        assert b.stop() == 0, b.log()[-3000:]
    finally:
        b.kill()
    # peek's data gone from the state dir: it alone fails to come back, said in status.  And a program
    # the config file declares comes with the data file its manifest names.
    shutil.rmtree(os.path.join(state, "data", "programs"))
    conf = os.path.join(tmp, "meshd.toml")
    with open(conf, "w") as f:
        f.write(f'[program.peek2x]\ndir = "{d}"\n')
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"name": "peek2x", "backend": "cuda", "warps": 1, "abi": 1, "data": "t.bin"}, f)
    c = start(tmp, state, "--config", conf, name="c")
    try:
        st = c.client.status()["state"]
        skipped = st["restore"]["skipped"]
        assert list(skipped) == ["peek"] and "is gone" in skipped["peek"], skipped
        assert st["restore"]["declared"] == ["peek2x"] and peek(c, "peek2x", 0, 6)[3] == b"beside"
        assert {p["name"] for p in c.client.programs()} == {"peek2", "peek3", "peek2x"}
        assert c.stop() == 0
    finally:
        c.kill()


def test_a_live_restore_keeps_the_data_in_the_worker(tmp):
    state = os.path.join(tmp, "state")
    a = start(tmp, state, "--live-restore", name="a")
    try:
        a.client.load({**program_body(str(EXAMPLES / "peek")), "data": a.client.upload(str(EXAMPLES / "peek" / "peek.cu"))})
        a.client.write("peek", 0, b"LIVE")
        pid = a.client.program("peek")["pid"]
        assert a.stop() == 0
    finally:
        a.kill()
    b = start(tmp, state, "--live-restore", name="b")
    try:
        assert b.client.status()["state"]["restore"]["adopted"] == ["peek"]
        got = peek(b, "peek", 0, 4)
        assert got[1:] == (1, sum(b"LIVE"), b"LIVE") and b.client.program("peek")["pid"] == pid  # not placed again
        b.client.write("peek", 4, b"!")
        assert peek(b, "peek", 0, 5)[1::2] == (2, b"LIVE!")
        b.client.unload("peek")
        assert b.stop() == 0  # nothing runs: a full stop
    finally:
        b.kill()
    nothing_left(state)  # the first daemon's worker, ours (a subreaper) to reap


def test_the_daemon_does_not_hold_a_large_data_file_in_memory(tmp):
    s = start(tmp, os.path.join(tmp, "state"), name="a")
    big = os.path.join(tmp, "big.bin")
    with open(big, "wb") as f:
        f.truncate(256 << 20)  # sparse: cheap to send, as large as any to hold
    try:
        idle = vmrss_mib(s.proc.pid)
        peak = [idle]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], vmrss_mib(s.proc.pid))

        t = threading.Thread(target=watch)
        t.start()
        try:
            key = s.client.upload(big)
        finally:
            done.set()
            t.join()
        assert peak[0] - idle < 64, (idle, peak[0])  # MiB
        assert os.path.getsize(os.path.join(tmp, "state", "data", key)) == 256 << 20
        assert s.stop() == 0
    finally:
        s.kill()
