"""The control API's inputs, its socket and what the CLI sends: strict JSON (depth, NaN, duplicate
keys, UTF-8, huge numbers), odd HTTP heads, typed errors' status codes, the listen backlog under a
burst of clients, PTX only (the daemon never compiles CUDA C: the CLI does, as its user), the
socket's directory and owner, and the stall columns.  Most tests share one ``--gpu sim`` daemon
(blink mode) with ``echo`` loaded, and check after each refused request that nothing changed."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from meshd_mps.base.errors import CapacityError, ClientLimit, ImageRefused, LimitError, NotStarted, WorkerError
from meshd_mps.serving import client as client_mod, server, unix_socket
from meshd_mps.serving.cli import ps_table, status_table
from meshd_mps.serving.client import (
    MAX_JSON_DEPTH,
    Client,
    ClientError,
    UnixHTTPConnection,
    default_socket,
    json_deeper_than,
    oldest_arch,
    parse_json,
    program_body,
)
from meshd_mps.serving.status import status_of

from ..rigs.serve import EXAMPLES, NOBODY, Serve, cli, manifest, parse_metrics, ptx_of

pytestmark = pytest.mark.timeout(120)


# ---- the shared daemon ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="mai-")
    s = Serve(d, "blink", os.path.join(d, "s.sock"))
    try:
        s.wait_ready()
        s.client.load(program_body(str(EXAMPLES / "echo")))
        yield s
    finally:
        s.kill()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def spin_ptx() -> str:
    return ptx_of("spin")


def snapshot(c: Client):
    """What a refused request must leave as it was: every program, and the load count."""
    progs = [(p["name"], p["slot"], p["pid"], p["hash"], p["state"], p["upgrades"]) for p in c.programs()]
    return progs, c.status()["loads"]


def answer(c: Client, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    st, _h, data = c.raw(method, path, body)
    return st, json.loads(data)


def internal_errors(s: Serve) -> int:
    return s.log().count("internal error")


# ---- 1. JSON nesting, and JSON's other oddities -----------------------------------------------


@pytest.mark.parametrize("text, limit, deeper", [
    ("{}", 0, True), ("1", 0, False), ("[[]]", 2, False), ("[[]]", 1, True),
    ("[" * 32 + "]" * 32, 32, False), ("[" * 33 + "]" * 33, 32, True),
    ('{"a": {"b": {"c": []}}}', 4, False), ('{"a": {"b": {"c": []}}}', 3, True),
    ("[[[[", 3, True), ("[[[", 3, False),  # unclosed levels count (json.loads would recurse into them)
    ('["[[[[[[", "]]]]", "{{{{"]', 1, False),  # brackets in strings are text
    (r'["\"[[[[", []]', 2, False),  # an escaped quote does not end the string
    (r'["\\", [[[]]]]', 3, True),  # an escaped backslash does not escape the quote after it
    (r'["\\\"[[[[[", []]', 2, False),
    ("[]" * 1000 + "[[]]", 2, False),  # flat runs are not depth
])
def test_json_depth_scan(text, limit, deeper):
    assert json_deeper_than(text, limit) is deeper


@pytest.mark.timeout(60)  # a scan that went quadratic would not end; its speed is no unit test's to time
def test_json_depth_scan_never_recurses():
    deep = "[" * 1_000_000 + "]" * 1_000_000  # json.loads: RecursionError at ~1000
    flat = json.dumps({"ptx": "\tld.global.u32 %r1, [%rd2+4];\n" * 200_000})  # 6 MB, brackets in a string
    assert json_deeper_than(deep, MAX_JSON_DEPTH) and not json_deeper_than(flat, MAX_JSON_DEPTH)
    with pytest.raises(ValueError, match="nested deeper than the limit of 32 levels"):
        parse_json(deep)
    assert parse_json(flat)["ptx"].startswith("\tld.global")


@pytest.mark.parametrize("data, words", [
    (b'{"a": NaN}', "NaN is not a JSON number"), (b'[Infinity]', "Infinity is not a JSON number"),
    (b'[-Infinity]', "-Infinity is not a JSON number"), (b'[1e309]', "the number 1e309 is out of range"),
    (b"[" + b"9" * 65 + b"]", "an integer of 65 digits (at most 64)"),
    (b'{"a": 1, "b": {"c": 1, "c": 2}}', "the key 'c' appears twice"),
    (b'["\xff"]', "not UTF-8 (byte 2"), ('["x"]'.encode("utf-16"), "not UTF-8"),
    (b'["\\ud800"]', "lone surrogate"), (b'{"\\udfff": 1}', "lone surrogate"),
])
def test_parse_json_strict(data, words):
    with pytest.raises(ValueError) as ei:
        parse_json(data)
    assert words in str(ei.value)


def test_parse_json_refuses_too_many_values_before_parsing():
    """A body of 30 million numbers held the event loop ~12 s in the parse; it is refused from a
    count of its commas outside strings, and commas inside strings (PTX has many) count for nothing."""
    many = ('{"data": "x", "z": [' + ",".join(["0"] * 3_000_000) + "]}").encode()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="more than 100000 values in its arrays and objects"):
        parse_json(many)
    assert time.perf_counter() - t0 < 5.0
    ptx = json.dumps({"ptx": "add.s32 %r1, %r2, %r3;\n" * 200_000, "q": "\\\",,"})  # 600k commas, all in strings
    assert parse_json(ptx)["ptx"].count(",") == 400_000
    assert len(parse_json("[" + ",".join(["1"] * 100_001) + "]")) == 100_001  # 100000 commas: at the limit
    with pytest.raises(ValueError, match="more than 100000 values"):
        parse_json("[" + ",".join(["1"] * 100_002) + "]")


def test_parse_json_takes_what_json_is():
    assert parse_json(b'{"a": [1, -2.5e3, "\\ud83d\\ude00", null, true], "b": "' + b"9" * 64 + b'"}') == \
        {"a": [1, -2500.0, "\U0001F600", None, True], "b": "9" * 64}
    assert parse_json("[" + "9" * 64 + "]") == [int("9" * 64)]
    assert parse_json(b'{"a": NaN, "a": 1}', strict=False) == {"a": 1}  # answers: only depth and UTF-8
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json("[" * 33 + "]" * 33, strict=False)


def _deep(n: int, leaf: str = "1") -> str:
    return "[" * n + leaf + "]" * n


@pytest.mark.parametrize("path, body, status, words", [
    # nesting: refused before json.loads, naming the limit (it was a RecursionError and a 500)
    ("/v1/programs", '{"manifest": ' + _deep(33) + "}", 400, "nested deeper than the limit of 32 levels"),
    ("/v1/programs", "[" * 100_000, 400, "nested deeper than the limit of 32 levels"),
    ("/v1/programs/echo/call", '{"data": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", 400, "nested deeper than the limit of 32"),
    ("/v1/programs", json.dumps({"manifest": _deep(40), "ptx": "x"}), 400,
     "field 'manifest': not JSON: nested deeper than the limit of 32"),
    ("/v1/programs", '{"x": ' + _deep(31) + "}", 400, "unknown field 'x'"),  # 32 levels: parsed
    # numbers JSON does not have, numbers out of range
    ("/v1/programs/echo/call", '{"data": "x", "timeout": NaN}', 400, "NaN is not a JSON number"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": Infinity}', 400, "Infinity is not a JSON number"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": -Infinity}', 400, "-Infinity is not a JSON number"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": 1e309}', 400, "the number 1e309 is out of range"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": 1e308}', 400, "field 'timeout' 1e+308: seconds"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": ' + "9" * 40 + "}", 400, "field 'timeout' 9999"),
    ("/v1/programs/echo/call", '{"data": "x", "timeout": ' + "9" * 5000 + "}", 400,
     "an integer of 5000 digits (at most 64)"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "device": 10 ** 30}), 400, f"field 'device' {10 ** 30}: this daemon serves GPU 0"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "device": 2 ** 64}), 400, f"field 'device' {2 ** 64}: this daemon serves GPU 0"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "nodes": True}), 400, "field 'nodes': an integer expected, got boolean"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "nodes": 1.5}), 400, "field 'nodes': an integer expected, got number"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "restart": "sometimes"}), 400,
     "field 'restart': restart policy 'sometimes': one of on-failure, always, never"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "restart": 1}), 400, "field 'restart': restart policy 1: one of on-failure"),
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 2 ** 64, "abi": 1}, "ptx": "x"}),
     400, f"field 'warps' {2 ** 64} is out of range 1..32"),
    # hex: pairs of digits, nothing else (bytes.fromhex took "00 ff" and spoke Python)
    ("/v1/programs/echo/call", json.dumps({"hex": "0"}), 400, "field 'hex' '0': pairs of hex digits"),
    ("/v1/programs/echo/call", json.dumps({"hex": "00 ff"}), 400, "field 'hex' '00 ff': pairs of hex digits"),
    ("/v1/programs/echo/call", json.dumps({"hex": "zz"}), 400, "no blanks"),
    # duplicate keys: which one counts is the parser's guess, so neither does
    ("/v1/programs/echo/call", '{"data": "x", "data": "y"}', 400, "the key 'data' appears twice in one object"),
    ("/v1/programs", '{"manifest": {"name": "z", "name": "echo", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x"}',
     400, "the key 'name' appears twice"),
    ("/v1/programs", json.dumps({"manifest": '{"name": "z", "name": "y"}', "ptx": "x"}), 400,
     "field 'manifest': not JSON: the key 'name' appears twice"),
    # text that is not UTF-8 or not Unicode (a lone surrogate made .encode() raise: a 500)
    ("/v1/programs/echo/call", b'{"data": "\xff\xfe"}', 400, "not UTF-8 (byte 10"),
    ("/v1/programs/echo/call", json.dumps({"data": "x"}).encode("utf-16"), 400, "not UTF-8"),
    ("/v1/programs/echo/call", b'\xef\xbb\xbf{"data": "x"}', 400, "not JSON"),
    ("/v1/programs/echo/call", b'{"data": "\\ud800"}', 400, "lone surrogate"),
    ("/v1/programs", b'{"manifest": {}, "ptx": "\\udc00"}', 400, "lone surrogate"),
    # huge values are quoted cut short
    ("/v1/programs", json.dumps({"manifest": {"name": "z", "backend": "cuda", "warps": 1, "abi": 1}, "ptx": "x",
                                 "hash": list(range(10_000))}), 400, "16 hex digits expected"),
    ("/v1/programs/echo/call", json.dumps({"data": "x", "q" * 10_000: 1}), 400, "unknown field 'qqq"),
])
def test_bad_input_is_a_400_and_changes_nothing(daemon, path, body, status, words):
    c = daemon.client
    before, errors = snapshot(c), internal_errors(daemon)
    st, ans = answer(c, "POST", path, body.encode() if isinstance(body, str) else body)
    assert (st, ans["ok"]) == (status, False), (st, ans)
    assert words in ans["error"], ans["error"]
    assert len(ans["error"]) < 600, ans["error"]  # nothing huge quoted back
    assert snapshot(c) == before
    assert internal_errors(daemon) == errors


def test_good_input_still_goes_through(daemon):
    c = daemon.client
    assert c.call("echo", "\U0001F600 ok")["data"] == "\U0001F600 ok"
    st, ans = answer(c, "POST", "/v1/programs/echo/call", b'{"data": "\\ud83d\\ude00", "timeout": 5}')
    assert st == 200 and ans["data"] == "\U0001F600"


def test_cli_refuses_a_deep_manifest_without_a_traceback(daemon, tmp, spin_ptx):
    d = Path(tmp)
    (d / "manifest.json").write_text('{"name": "deep", "x": ' + _deep(5000) + "}")
    (d / "deep.ptx").write_text(spin_ptx)
    before = snapshot(daemon.client)
    r = cli("load", str(d), "--socket", daemon.sock)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == f"meshd-mps: {d / 'manifest.json'}: not JSON: nested deeper than the limit of 32 levels of" \
                       " arrays and objects\n"
    (d / "manifest.json").write_text('{"name": "deep", "name": "other"}')
    r = cli("load", str(d), "--socket", daemon.sock)
    assert r.returncode == 1 and "the key 'name' appears twice" in r.stderr and "Traceback" not in r.stderr
    assert snapshot(daemon.client) == before


def test_the_cli_refuses_what_it_cannot_send_without_a_traceback(tmp):
    """Checked before any connection: a manifest that is a device or a FIFO (read without end, or
    a wait for a writer), a timeout no socket takes, a name that is not text."""
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    for argv, said in ((["load", "--manifest", "/dev/zero", "--ptx", "/dev/null"], "/dev/zero: not a regular file"),
                       (["load", "--manifest", fifo, "--ptx", "/dev/null"], f"{fifo}: not a regular file"),
                       (["call", "echo", "hi", "--timeout", "inf"], "timeout inf: seconds, a finite number more than 0"),
                       (["call", "echo", "hi", "--timeout", "nan"], "timeout nan: seconds, a finite number more than 0"),
                       (["unload", "a\udcff"], "program name 'a\\udcff': not UTF-8 text")):
        r = cli(*argv, "--socket", os.path.join(tmp, "none.sock"), timeout=30)
        assert r.returncode == 1 and r.stderr.strip() == f"meshd-mps: {said}", (argv, r.stderr)


def test_client_refuses_a_deep_answer(tmp):
    """A daemon (or whatever answers on the socket) that sends JSON 100000 deep: ClientError, not a
    RecursionError out of the CLI."""
    path = os.path.join(tmp, "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    body = b"[" * 100_000

    def serve_one() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)

    t = threading.Thread(target=serve_one)
    t.start()
    try:
        with pytest.raises(ClientError) as ei:
            Client(path, timeout=10).status()
        assert "not JSON (nested deeper than the limit of 32 levels" in str(ei.value)
    finally:
        t.join(10)
        srv.close()


# ---- calls of any size: the binary form, and what is over the most ---------------------------------
#: What echo's manifest declares for its requests and responses (examples/echo/manifest.json).
ECHO_MOST = 65536


def test_a_binary_call_carries_any_size_the_program_declares_and_so_does_the_json_form(daemon):
    c = daemon.client
    for n in (0, 188, 189, 5000, ECHO_MOST):
        x = os.urandom(n)
        assert c.call_bytes("echo", x, timeout=5) == x, n
    st, headers, data = c.raw("POST", "/v1/programs/echo/call?timeout=2.5", b"\x00\xff" * 300,
                              {"Content-Type": "application/octet-stream"})
    assert (st, headers["content-type"], data) == (200, "application/octet-stream", b"\x00\xff" * 300)
    assert headers["server-timing"].startswith("call;dur=")
    big = os.urandom(3000)
    st, ans = answer(c, "POST", "/v1/programs/echo/call", json.dumps({"hex": big.hex(), "timeout": 5}).encode())
    assert (st, bytes.fromhex(ans["hex"]), ans["bytes"]) == (200, big, 3000)
    assert c.program("echo")["max_request"] == c.program("echo")["max_response"] == ECHO_MOST


def test_a_payload_over_the_most_is_a_413_before_its_body_is_read(daemon):
    c = daemon.client
    before, errors = snapshot(c), internal_errors(daemon)
    # The head alone: the refusal comes before any of the body, which never comes (the answer read by
    # its length: the daemon still takes an unread body for a while before it closes).
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(daemon.sock)
        raw.sendall((f"POST /v1/programs/echo/call HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     f"Content-Length: {ECHO_MOST + 1}\r\n\r\n").encode())
        got = b""
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"Content-Length: (\d+)", got, re.I)[1]):
            got += raw.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    ans = json.loads(body)
    assert (ans["size"], ans["limit"], ans["program"]) == (ECHO_MOST + 1, ECHO_MOST, "echo")
    assert f"request of {ECHO_MOST + 1} bytes is over its most, {ECHO_MOST} bytes" in ans["error"]
    st, ans = answer(c, "POST", "/v1/programs/echo/call", json.dumps({"hex": bytes(ECHO_MOST + 1).hex()}).encode())
    assert (st, ans["size"], ans["limit"]) == (413, ECHO_MOST + 1, ECHO_MOST)
    with pytest.raises(ClientError) as e:
        c.call_bytes("echo", bytes(ECHO_MOST + 1))
    assert e.value.status == 413 and e.value.body["program"] == "echo"
    for query, field in (("?timeout=soon", "timeout"), ("?timeout=nan", "timeout"), ("?timeout=0", "timeout"),
                         ("?retries=2", "retries")):
        st, _h, data = c.raw("POST", f"/v1/programs/echo/call{query}", b"x", {"Content-Type": "application/octet-stream"})
        assert (st, json.loads(data)["field"]) == (400, field), (query, data)
    st, _h, data = c.raw("POST", "/v1/programs/nobody/call", b"x", {"Content-Type": "application/octet-stream"})
    assert st == 404
    assert snapshot(c) == before and internal_errors(daemon) == errors


def test_the_cli_sends_a_file_and_writes_the_response_to_one(daemon, tmp):
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    x = os.urandom(40_000)
    with open(src, "wb") as f:
        f.write(x)
    r = cli("call", "--socket", daemon.sock, "echo", "--in", src, "--out", dst)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r.stderr
    with open(dst, "rb") as f:
        assert f.read() == x
    r = cli("call", "--socket", daemon.sock, "echo", "a text, its answer into a file", "--out", dst, "--timeout", "5")
    assert r.returncode == 0, r.stderr
    with open(dst, "rb") as f:
        assert f.read() == b"a text, its answer into a file"
    with open(src, "wb") as f:
        f.write(bytes(ECHO_MOST + 1))
    for args, words in ((("--in", src), f"request of {ECHO_MOST + 1} bytes is over its most, {ECHO_MOST} bytes"),
                        (("hello", "--in", src), "give the request as DATA or as --in FILE"),
                        (("--in", os.path.join(tmp, "none")), "--in " + os.path.join(tmp, "none") + ": No such file"),
                        (("--in", src, "--json"), "--json prints the JSON form's answer")):
        r = cli("call", "--socket", daemon.sock, "echo", *args)
        assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- odd HTTP heads --------------------------------------------------------------------------


def raw_http(sock: str, data: bytes) -> tuple[int, dict]:
    """One request as bytes; its answer's status and JSON, read by its Content-Length (the
    connection may stay open: keep-alive)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got and (chunk := s.recv(65536)):
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        m = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
        while m and len(body) < int(m[1]) and (chunk := s.recv(65536)):
            body += chunk
    # Answered, not a dropped connection (a head aiohttp cannot parse is answered as HTTP/1.0).
    assert re.match(rb"HTTP/1\.[01] ", got), got[:200]
    return int(head.split(b" ")[1]), json.loads(body)


H = "Host: x\r\n"  # HTTP/1.1 requires it (RFC 9112 3.2: a 400 without it, as aiohttp answers)


@pytest.mark.parametrize("data, status, words", [
    # Heads the parser (aiohttp's, llhttp) refuses: a 400 in its words, after "request head: ".
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: \u00b2\r\n\r\nxx", 400, "Content-Length"),
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: \u0661\r\n\r\nx", 400, "Content-Length"),
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: -1\r\n\r\n", 400, "Content-Length"),
    # beyond 2**64: the parser's overflow (400); within, but over 64 MiB: 413 (below)
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: " + "9" * 5000 + "\r\n\r\n", 400, "Content-Length"),
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: 1\r\nContent-Length: 2\r\n\r\n", 400,
     "Duplicate"),
    (f"GET http://[/v1/status HTTP/1.1\r\n{H}\r\n", 400, "request head: http://[/v1/status"),
    (f"GET /v1/status HTTP/1.1\r\n{H} continued: header\r\n\r\n", 400, " continued: header"),
    ("GET /v1/status HTTP/1.1\r\n\r\n", 400, "Missing 'Host' header"),
    (f"GET /v1/status HTTP/1.1\r\n{H}X: " + "a" * (65 << 10) + "\r\n\r\n", 431, "request head: "),
    (f"GET /v1/status HTTP/1.1\r\n{H}" + "".join(f"X{i}: 1\r\n" for i in range(101)) + "\r\n", 400,
     "Too many headers"),
    # Heads the parser takes, refused by the daemon.
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Length: 67108865\r\n\r\n", 413,
     "is over the limit of 67108864 bytes"),
    # An expectation HTTP/1.1 does not define: 417 through the table (aiohttp's was text/plain).
    (f"GET /v1/status HTTP/1.1\r\n{H}Expect: foo\r\n\r\n", 417, "Expect 'foo': only 100-continue is understood"),
    # A compressed body (it was a 500: aiohttp's decoder failed inside the read), valid or not.
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Encoding: gzip\r\nContent-Length: 13\r\n\r\n"
     '{"data":"hi"}', 415, "Content-Encoding 'gzip' is not supported"),
    (f"POST /v1/programs/echo/call HTTP/1.1\r\n{H}Content-Encoding: deflate\r\nContent-Length: 0\r\n\r\n", 415,
     "Content-Encoding 'deflate' is not supported"),
    (f"GET http://x/v1/status HTTP/1.1\r\n{H}\r\n", 200, ""),
    (f"GET /v1/programs/%ff HTTP/1.1\r\n{H}\r\n", 400, "not UTF-8"),
])
def test_odd_heads_are_answered(daemon, data, status, words):
    before, errors = snapshot(daemon.client), internal_errors(daemon)
    st, ans = raw_http(daemon.sock, data.encode("utf-8" if "\u0661" in data else "latin-1"))
    assert st == status, ans
    assert words in ans.get("error", ""), ans
    if status == 400 and words != "not UTF-8":
        assert ans["error"].startswith("request head: ") and len(ans["error"]) < 400, ans
    assert snapshot(daemon.client) == before
    assert internal_errors(daemon) == errors and "connection failed" not in daemon.log()
    assert "Traceback" not in daemon.log()


def test_expect_100_continue_is_answered_before_the_body(daemon):
    """The one expectation HTTP/1.1 defines: the interim 100, then the body, then the answer."""
    body = b'{"data": "hi"}'
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(f"POST /v1/programs/nosuch/call HTTP/1.1\r\n{H}Expect: 100-continue\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got and (chunk := s.recv(65536)):
            got += chunk
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), got
        s.sendall(body)
        while chunk := s.recv(65536):
            got += chunk
    head, _, answer_body = got[len(b"HTTP/1.1 100 Continue\r\n\r\n"):].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and "nosuch" in json.loads(answer_body)["error"], got


class AnswerCount:
    """What the API's connections need of Metrics: the count of answers by status."""

    def __init__(self):
        self.http_codes: dict[int, int] = {}

    def answered(self, status: int) -> None:
        self.http_codes[status] = self.http_codes.get(status, 0) + 1


async def test_no_request_in_time_is_a_408(tmp):
    """No head within Deadlines.http_head (nothing sent, or half a head), or no body within
    http_body: a 408 naming the deadline, and the connection closed.  On the API's own connection
    handler in this process (no daemon), with deadlines of 0.3 s."""
    from aiohttp import web

    from meshd_mps.base.deadlines import Deadlines
    from meshd_mps.serving.api import Api

    count = AnswerCount()
    api = Api(None, None, count, socket_path="", versions={}, started=datetime.now(UTC), t0=0.0,  # type: ignore[arg-type]
              deadlines=Deadlines(http_head=0.3, http_body=0.3))
    runner = web.AppRunner(api.app())
    await runner.setup()
    path = os.path.join(tmp, "s.sock")
    listener = await asyncio.get_running_loop().create_unix_server(api.protocols(runner.server), path=path)

    async def ask(data: bytes) -> tuple[bytes, dict]:
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(data)
            with anyio.fail_after(5):
                got = await reader.read()  # to the end: the daemon closes
        finally:
            writer.close()
        head, _, body = got.partition(b"\r\n\r\n")
        return head.split(b"\r\n")[0], json.loads(body)

    try:
        t0 = time.monotonic()
        assert await ask(b"") == (b"HTTP/1.1 408 Request Timeout", {"ok": False, "error": "no request in 0.3s", "within": 0.3})
        assert 0.25 < time.monotonic() - t0 < 3
        assert (await ask(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n"))[0] == b"HTTP/1.1 408 Request Timeout"
        line, ans = await ask(b"POST /v1/programs HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        assert (line, ans) == (b"HTTP/1.1 408 Request Timeout", {"ok": False, "error": "body not received in 0.3s",
                                                                 "within": 0.3})
        assert count.http_codes == {408: 3}
    finally:
        listener.close()
        await runner.cleanup()


# ---- 3. typed errors ---------------------------------------------------------------------------


def test_typed_errors_by_type():
    cap = CapacityError("x: nodes 9 cannot be resident at once", limit="resident blocks", have=8, asked=9)
    assert status_of(cap) == 409
    assert status_of(CapacityError("any words", limit="hardware queues", have=32, asked=33)) == 409
    assert status_of(NotStarted("x never started", program="x", within=5.0, likely="?")) == 409
    assert status_of(ImageRefused("worker 1: no mesh_main", driver="e")) == 400
    assert status_of(WorkerError("worker 1 died")) == 500  # unchanged: a worker's failure
    assert status_of(LimitError("x: 2048 threads per block")) == 400
    assert status_of(ClientLimit("mps: 48 clients already", have=48, asked=49, device=0)) == 409


@pytest.mark.parametrize("error, status, fields", [
    (CapacityError("p: the blink context runs 32 programs, one per hardware work queue", limit="hardware queues",
                   have=32, asked=33), 409, {"limit": "hardware queues", "have": 32, "asked": 33}),
    (NotStarted("p: did not write STATE = RUNNING within 5s; rolled back", program="p", within=5.0,
                likely="its queue is taken"), 409, {"program": "p", "within": 5.0, "likely": "its queue is taken"}),
    (ImageRefused("load: worker 7: cuModuleGetFunction(mesh_main): CUDA_ERROR_NOT_FOUND", driver="e"), 400, {"driver": "e"}),
])
async def test_typed_errors_through_the_middleware(error, status, fields):
    """What a route raises is answered by the API's middleware: a MeshError with status_of(e) and
    its fields, anything else with a 500 that says only where the traceback is (the log)."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from structlog.testing import capture_logs

    from meshd_mps.base.deadlines import DEFAULT
    from meshd_mps.serving.api import Api

    api = Api(None, None, None, socket_path="/nonexistent/meshd-mps.sock", versions={},  # type: ignore[arg-type]
              started=datetime.now(UTC), t0=0.0, deadlines=DEFAULT)

    async def handler(request):
        raise error

    async def bug(request):
        raise RuntimeError("a bug")

    app = web.Application(middlewares=[api.checked])
    app.router.add_post("/v1/programs", handler)
    app.router.add_post("/v1/bug", bug)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/programs")
        assert resp.status == status
        assert json.loads(await resp.read()) == {"ok": False, "error": str(error), **fields}
        with capture_logs() as logs:
            resp = await client.post("/v1/bug")
            assert resp.status == 500
            assert json.loads(await resp.read()) == {"ok": False, "error": "internal error (the daemon's log has the traceback)"}
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [e["event"] for e in errors] == ["POST /v1/bug: internal error"] and "RuntimeError: a bug" in errors[0]["traceback"]
    assert api.busy == set()


def check_image_refused(c: Client) -> None:
    """PTX without mesh_main: the driver (here the simulation, in its words) refuses the image: 400,
    nothing loaded, and the next load goes through."""
    from meshd_mps.gpu.compiler import cuda_to_ptx

    ptx = cuda_to_ptx(b'extern "C" __global__ void other(int *p) { *p = 1; }', "spin").decode()
    before = snapshot(c)
    st, ans = answer(c, "POST", "/v1/programs", json.dumps({"manifest": manifest("spin"), "ptx": ptx}).encode())
    assert st == 400 and "mesh_main" in ans["error"] and "CUDA_ERROR_NOT_FOUND" in ans["error"], (st, ans)
    assert snapshot(c) == before
    assert c.call("echo", "still here")["data"] == "still here"


def test_image_refused_is_a_400(daemon):
    check_image_refused(daemon.client)


def test_image_refused_is_a_400_in_mps_mode(tmp):
    """The same in MPS mode, where the image goes to a pooled worker (needs mps.py to raise the
    worker's ImageRefused as it is, not as a plain WorkerError: that was a 500)."""
    s = Serve(tmp, "mps", os.path.join(tmp, "s.sock"), "--pool", "1")
    try:
        s.wait_ready()
        s.client.load(program_body(str(EXAMPLES / "echo")))
        check_image_refused(s.client)
    finally:
        s.kill()


@pytest.mark.parametrize("nodes, words", [
    (4294967296, "over the grid limit of 2147483647 blocks"),
    (2 ** 64, "over the grid limit of 2147483647 blocks"),
    (1000000000, "cannot be resident at once"),
])
def test_nodes_beyond_the_gpu_is_a_409_naming_the_limit(daemon, spin_ptx, nodes, words):
    """Needs Programs' CapacityError for nodes (meshd_mps/limits.py): over the grid, or more blocks than
    the GPU holds at once.  Never a 500 (4294967296 was a struct.error in the LAUNCH frame)."""
    c = daemon.client
    before = snapshot(c)
    name = f"nodes-{nodes % 1000}"
    try:
        st, ans = answer(c, "POST", "/v1/programs",
                         json.dumps({"manifest": manifest("spin", name=name), "ptx": spin_ptx, "nodes": nodes}).encode())
        assert st == 409, (st, ans)
        assert words in ans["error"] and f"nodes {nodes}" in ans["error"], ans
        assert ans["asked"] == nodes and str(ans["have"]) in ans["error"], ans
        assert snapshot(c) == before
    finally:
        if name in {p["name"] for p in c.programs()}:
            c.unload(name)


# ---- 2. the listen backlog ------------------------------------------------------------------


def test_a_burst_of_200_clients_is_served(daemon):
    """200 clients connect at once, each with a connect timeout as a real client has (its socket is
    then non-blocking, so a full backlog is EAGAIN at once, not a wait), while the daemon is stopped
    (SIGSTOP: the worst case of a busy loop, none accepted): the backlog holds them all, and each
    gets its 200 once the daemon goes on.  asyncio's default backlog of 100 failed about half."""
    n = 200
    results: list[object] = [None] * n
    connected = threading.Semaphore(0)
    go = threading.Barrier(n)

    def one(i: int) -> None:
        conn = UnixHTTPConnection(daemon.sock, timeout=60)
        try:
            go.wait(30)
            conn.connect()
        except Exception as e:
            results[i] = f"connect: {e!r}"
            conn.close()
            return
        finally:
            connected.release()
        try:
            conn.request("GET", "/v1/status", headers={"Host": "x", "Connection": "close"})
            r = conn.getresponse()
            results[i] = r.status if json.loads(r.read())["ok"] else "not ok"
        except Exception as e:
            results[i] = repr(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        for _ in range(n):
            assert connected.acquire(timeout=60), "a client's connect neither succeeded nor failed"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(90)
    failed = [r for r in results if r != 200]
    assert not failed, f"{len(failed)} of {n} failed, e.g. {failed[:3]}"
    assert daemon.client.status()["ok"]


# ---- 4. PTX only: CUDA C is the CLI's --------------------------------------------------------


def test_the_daemon_refuses_cuda_c_and_reads_no_file(daemon, tmp):
    """A body with "cuda" gets a 400 saying the daemon takes PTX only, whatever the source
    #includes: a FIFO (a daemon that opened it would hang: the request would time out, and a writer
    could open the FIFO) and a file whose contents must not come back."""
    c = daemon.client
    fifo, secret = os.path.join(tmp, "fifo"), os.path.join(tmp, "secret.h")
    os.mkfifo(fifo)
    Path(secret).write_text("the-secret-line-7f3a\n")
    src = f'#include "{fifo}"\n#include "{secret}"\n#include "/etc/passwd"\n'
    before = snapshot(c)
    quick = Client(daemon.sock, timeout=10)
    for method, path, name in (("POST", "/v1/programs", "spin"), ("PUT", "/v1/programs/echo", "echo")):
        st, _h, data = quick.raw(method, path, json.dumps({"manifest": manifest(name), "cuda": src}).encode())
        ans = json.loads(data)
        assert st == 400 and ans["error"].startswith("field 'cuda': this daemon takes PTX only"), (st, ans)
        assert "The CLI compiles CUDA C itself" in ans["error"] and "meshd-mps load DIR" in ans["error"]
        assert "--cuda FILE" in ans["error"]
        assert "7f3a" not in data.decode() and "root:" not in data.decode()
    with pytest.raises(OSError) as ei:  # nobody has the FIFO open for reading
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert ei.value.errno == errno.ENXIO
    assert snapshot(c) == before
    assert "7f3a" not in daemon.log()


class Recorder:
    """A socket in front of the daemon's: records each request (method, target, body) and relays it."""

    def __init__(self, upstream: str, path: str):
        self.upstream, self.path = upstream, path
        self.requests: list[tuple[str, str, bytes]] = []
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(16)
        self.srv.settimeout(0.1)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(60)
                self._relay(conn)

    def _relay(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        while m and len(body) < int(m[1]):
            body += conn.recv(1 << 20)
        method, target = head.split(b" ")[:2]
        self.requests.append((method.decode(), target.decode(), body))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
            up.settimeout(60)
            up.connect(self.upstream)
            up.sendall(head + b"\r\n\r\n" + body)
            while chunk := up.recv(65536):
                conn.sendall(chunk)

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.srv.close()


@pytest.fixture
def recorder(daemon, tmp):
    r = Recorder(daemon.sock, os.path.join(tmp, "rec.sock"))
    yield r
    r.close()


def test_the_cli_compiles_cuda_c_and_sends_ptx(daemon, recorder):
    r = cli("load", str(EXAMPLES / "heartbeat"), "--socket", recorder.path)
    try:
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("heartbeat loaded on slot "), r.stdout
        # It asked whether the name is loaded (before compiling), the daemon's status (the
        # oldest GPU's compute capability), then sent PTX for it.
        assert [(m, t) for m, t, _b in recorder.requests] == [("GET", "/v1/programs/heartbeat"), ("GET", "/v1/status"),
                                                              ("POST", "/v1/programs")]
        body = json.loads(recorder.requests[2][2])
        assert set(body) == {"manifest", "ptx"} and body["manifest"]["name"] == "heartbeat"
        assert ".target sm_90" in body["ptx"] and ".entry mesh_main" in body["ptx"]
        assert body["ptx"] == ptx_of("heartbeat")
        assert daemon.client.program("heartbeat")["state"] == "running"
    finally:
        if "heartbeat" in {p["name"] for p in daemon.client.programs()}:
            daemon.client.unload("heartbeat")


def test_the_cli_compiles_as_its_user_and_prints_errors_plainly(daemon, recorder, tmp):
    """#include "/etc/passwd" through the CLI: NVRTC reads it in the CLI's own process, with the
    user's rights (here it may: the user's own access), and its errors come out as one clean
    message with exit status 1; the daemon gets no body at all, so never reads the file."""
    d = Path(tmp) / "prog"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(manifest("spin", name="peek")))
    (d / "peek.cu").write_text('#include "/etc/passwd"\n')
    before = snapshot(daemon.client)
    r = cli("load", str(d), "--socket", recorder.path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("meshd-mps: nvrtc: peek: ") and "/etc/passwd" in r.stderr, r.stderr
    assert [(m, t) for m, t, _b in recorder.requests] == [("GET", "/v1/programs/peek"), ("GET", "/v1/status")]  # no load
    (d / "peek.cu").write_text("this is not C\n")
    r = cli("load", str(d), "--socket", recorder.path)
    assert r.returncode == 1 and r.stderr.startswith("meshd-mps: nvrtc: peek: ") and "Traceback" not in r.stderr
    assert [m for m, _t, _b in recorder.requests] == ["GET"] * 4
    assert snapshot(daemon.client) == before


def test_the_arch_is_the_oldest_gpus():
    caps = lambda major, minor: {"cc_major": major, "cc_minor": minor}  # noqa: E731
    assert oldest_arch({"caps": caps(9, 0), "devices": [{"caps": caps(9, 0)}, {"caps": caps(8, 6)}]}) == "compute_86"
    assert oldest_arch({"caps": caps(10, 0), "devices": [{"caps": caps(12, 0)}, {"caps": caps(10, 0)}]}) == "compute_100"
    assert oldest_arch({"caps": caps(8, 0)}) == "compute_80"  # a daemon without "devices"
    with pytest.raises(ClientError, match="names no compute capability"):
        oldest_arch({"caps": None, "devices": []})


# ---- 5. the socket: its default directory, its owner -----------------------------------------


def test_the_default_socket(monkeypatch):
    for k in ("MESHD_MPS_SOCKET", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_socket() == "/run/meshd-mps/meshd-mps.sock"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert default_socket() == "/tmp/meshd-mps-1000/meshd-mps.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket() == "/run/user/1000/meshd-mps.sock"
    monkeypatch.setenv("MESHD_MPS_SOCKET", "/srv/m.sock")
    assert default_socket() == "/srv/m.sock"


def refused_dir(d: str, *words: str) -> None:
    with pytest.raises(unix_socket.StartError) as ei:
        unix_socket.check_socket_dir(d)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_the_socket_directory_rules(monkeypatch, tmp):
    me = os.geteuid()
    # The default directory is made 0700, and taken only as a real directory of the daemon's uid.
    monkeypatch.setattr(client_mod, "RUN_DIR", os.path.join(tmp, "run"))
    monkeypatch.setattr(client_mod, "TMP_ROOT", tmp)
    own = client_mod.private_dirs()[0]
    unix_socket.check_socket_dir(own)
    st = os.lstat(own)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == me
    os.rmdir(own)
    target = os.path.join(tmp, "elsewhere")
    os.mkdir(target, 0o700)
    os.symlink(target, own)
    refused_dir(own, f"socket directory {own} is a symlink; refusing it")
    os.unlink(own)
    named = os.path.join(tmp, "named")
    os.symlink(target, named)
    unix_socket.check_socket_dir(named)  # a named one may be a symlink of ours, to a directory of ours
    os.mkdir(own, 0o700)
    os.chmod(own, 0o770)
    refused_dir(own, "is writable by its group (mode 0770)")
    os.chmod(own, 0o777)
    refused_dir(own, "is writable by its group and other users (mode 0777)", "--socket")
    os.chmod(own, 0o1777)  # sticky makes no exception
    refused_dir(own, "writable by its group and other users (mode 1777)")
    os.chmod(own, 0o755)
    unix_socket.check_socket_dir(own)  # no write bit for others: fine
    if me == 0:
        os.chown(own, NOBODY, NOBODY)
        refused_dir(own, f"socket directory {own} is owned by uid {NOBODY}, not by this daemon's uid 0")
        os.chown(target, NOBODY, NOBODY)
        refused_dir(named, f"owned by uid {NOBODY}")
    Path(os.path.join(tmp, "file")).write_text("")
    refused_dir(os.path.join(tmp, "file"), "is not a directory")
    # For another uid: a named directory of root's is fine, its own default one must be its own.
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    root_owned = os.path.join(tmp, "rootdir")
    os.mkdir(root_owned, 0o755)
    if me == 0:
        unix_socket.check_socket_dir(root_owned)
        own2 = client_mod.private_dirs()[0]
        assert own2 == os.path.join(tmp, "meshd-mps-4242")
        refused_dir(own2, "is owned by uid 0, not by this daemon's uid 4242")  # made by root, here


def test_the_daemon_binds_in_its_default_directory(monkeypatch, tmp):
    """Daemon._bind without --socket or the environment: root's default, /run/meshd-mps (here
    moved under tmp), made 0700, the socket 0600 in it; and refused once the directory is not its own."""
    for k in ("MESHD_MPS_SOCKET", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(client_mod, "RUN_DIR", os.path.join(tmp, "run"))
    monkeypatch.setattr(client_mod, "TMP_ROOT", tmp)
    d = server.Daemon(server.Config())
    assert d.socket_path == os.path.join(client_mod.private_dirs()[0], "meshd-mps.sock")
    s = d._bind()
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(d.socket_path)).st_mode) == 0o700
        assert stat.S_ISSOCK(os.lstat(d.socket_path).st_mode) and stat.S_IMODE(os.lstat(d.socket_path).st_mode) == 0o600
    finally:
        s.close()
        d._remove_socket()
    assert not os.path.exists(d.socket_path)
    os.chmod(os.path.dirname(d.socket_path), 0o733)
    with pytest.raises(unix_socket.StartError, match="writable by its group and other users"):
        server.Daemon(server.Config())._bind()
    assert not os.path.exists(d.socket_path)


@pytest.mark.parametrize("how", ["mode", "owner"])
def test_serve_refuses_a_socket_directory_others_can_write(tmp, how):
    d = os.path.join(tmp, "shared")
    os.mkdir(d)
    if how == "mode":
        os.chmod(d, 0o777)
        words = f"socket directory {d} is writable by its group and other users (mode 0777); refusing it"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another uid")
        os.chown(d, NOBODY, NOBODY)
        words = f"socket directory {d} is owned by uid {NOBODY}, not by this daemon's uid 0; refusing it"
    sock = os.path.join(d, "s.sock")
    r = cli("serve", "--gpu", "sim", "--socket", sock, "--state-dir", os.path.join(tmp, "state"), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"meshd-mps: {words}" in r.stderr, r.stderr
    assert not os.path.exists(sock)


def requests_seen(c: Client) -> float:
    return sum(v for k, v in parse_metrics(c.metrics()).items() if k.startswith("meshd_mps_http_requests_total"))


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")


@needs_root
def test_the_client_refuses_a_socket_of_another_user(daemon, tmp):
    c = daemon.client
    link = os.path.join(tmp, "link.sock")
    os.symlink(daemon.sock, link)
    assert Client(link).status()["ok"]  # our link to our socket
    before = snapshot(c)
    n0 = requests_seen(c)
    os.chown(daemon.sock, NOBODY, -1)
    try:
        with pytest.raises(ClientError) as ei:
            Client(daemon.sock).status()
        assert str(ei.value) == (f"{daemon.sock}: owned by uid {NOBODY}, not by you (uid 0); refusing to talk to it"
                                 " (run the client as the daemon's user)")
        with pytest.raises(ClientError, match=rf"^{re.escape(link)}: a symlink to {re.escape(daemon.sock)}, owned by uid"
                                              rf" {NOBODY}, not by you"):
            Client(link).status()
        r = cli("ps", "--socket", daemon.sock)
        assert r.returncode == 1 and r.stderr == f"meshd-mps: {ei.value}\n", r.stderr
    finally:
        os.chown(daemon.sock, 0, -1)
    os.lchown(link, NOBODY, -1)
    with pytest.raises(ClientError, match=rf"^{re.escape(link)}: owned by uid {NOBODY}"):
        Client(link).status()
    n1 = requests_seen(c)
    assert n1 - n0 == 1  # only the metrics request that counted n0: none of the refused ones reached the daemon
    assert snapshot(c) == before


@needs_root
def test_the_client_refuses_a_server_of_another_user(tmp):
    """A socket file of ours, served by a process of another uid (it was chowned after the bind):
    SO_PEERCRED names the real server, and the client hangs up before it sends anything."""
    d = os.path.join(tmp, "other")
    os.mkdir(d, 0o700)
    os.chown(d, NOBODY, NOBODY)
    os.chmod(tmp, 0o711)
    path = os.path.join(d, "s.sock")
    ready_r, ready_w = os.pipe()
    quit_r, quit_w = os.pipe()
    with warnings.catch_warnings():  # the child makes syscalls only and _exits: fork is fine
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(quit_w)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(4)
            os.write(ready_w, b"ready")
            got = b""
            s.settimeout(30)
            try:
                conn, _ = s.accept()
                conn.settimeout(5)
                got = conn.recv(100)  # b"": the client closed without a byte
            except OSError:
                got = b"no connection"
            os.write(ready_w, b"|" + (got or b"nothing"))
            os.read(quit_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(quit_r)
    try:
        assert os.read(ready_r, 5) == b"ready"
        os.chown(path, 0, 0)
        with pytest.raises(ClientError) as ei:
            Client(path, timeout=10).status()
        assert re.fullmatch(rf"{re.escape(path)}: served by pid {pid} as uid {NOBODY}, not by you \(uid 0\); refusing"
                            r" to talk to it \(run the client as the daemon's user\)", str(ei.value)), str(ei.value)
        assert os.read(ready_r, 100) == b"|nothing"
    finally:
        os.close(quit_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# ---- 6. stalls ---------------------------------------------------------------------------------


def test_ps_shows_the_beat_age_and_stalled():
    base = {"pid": 10, "device": 0, "heartbeat": 7, "uptime_s": 75.0, "upgrades": 0, "hash": "0123456789abcdef"}
    rows = [
        {**base, "name": "hb", "slot": 0, "state": "running", "beat_age_s": 0.04},
        {**base, "name": "quiet", "slot": 1, "state": "stalled", "beat_age_s": 65.2},
        {**base, "name": "never", "slot": 2, "state": "running", "beat_age_s": None},
        {**base, "name": "old", "slot": 3, "state": "running"},  # a daemon without the fields
        {**base, "name": "loop", "slot": 4, "state": "crash-loop", "restarts": 4, "restart": "always"},
    ]
    lines = ps_table(rows).splitlines()
    assert lines[0].split() == ["NAME", "SLOT", "STATE", "PID", "GPU", "HEARTBEAT", "BEAT-AGE", "UPTIME", "UPGRADES",
                                "RESTARTS", "HASH", "DATA"]
    got = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert [got[n][2] for n in ("hb", "quiet", "never", "old", "loop")] == ["running", "stalled", "running", "running",
                                                                          "crash-loop"]
    assert [got[n][6] for n in ("hb", "quiet", "never", "old")] == ["0.0s", "1m05s", "-", "-"]
    assert got["hb"][7] == "1m15s"
    assert got["hb"][9] == "0" and got["loop"][9:11] == ["4", "(always)"]


def rows_of(text: str) -> dict[str, str]:
    return {(parts := re.split(r"\s{2,}", ln.strip(), maxsplit=1))[0]: parts[1] if len(parts) > 1 else ""
            for ln in text.splitlines()}


def test_status_shows_the_stalled_count():
    table = rows_of(status_table({"isolation": "blink", "programs": 3, "stalled": 2}))
    assert table["programs"] == "3" and table["stalled"] == "2"
    assert rows_of(status_table({"isolation": "blink", "programs": 1}))["stalled"] == "0"  # a daemon without it


def test_stall_figures_in_status_and_metrics(daemon):
    c = daemon.client
    st = c.status()
    assert isinstance(st["stalled"], int) and not isinstance(st["stalled"], bool)
    assert st["stalled"] == sum(1 for p in c.programs() if p["state"] == "stalled")
    text = c.metrics()
    m = parse_metrics(text)
    assert 'meshd_mps_programs{state="stalled"}' in m and 'meshd_mps_programs{state="running"}' in m
    assert "# TYPE meshd_mps_program_beat_age_seconds gauge\n" in text
    ages = {k: v for k, v in m.items() if k.startswith("meshd_mps_program_beat_age_seconds")}
    beat = {p["name"]: p.get("beat_age_s") for p in c.programs()}
    assert set(ages) == {f'meshd_mps_program_beat_age_seconds{{program="{n}"}}' for n, a in beat.items() if a is not None}
    r = cli("status", "--socket", daemon.sock)
    assert r.returncode == 0 and re.search(r"^stalled +\d+$", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e10"])
def test_serve_refuses_a_bad_stall_after(tmp, value):
    r = cli("serve", "--gpu", "sim", "--socket", os.path.join(tmp, "s.sock"), "--stall-after", value,
            "--state-dir", os.path.join(tmp, "state"))
    said = f"meshd-mps: --stall-after {float(value):g}: seconds, more than 0 and at most 2592000 (30 days)\n"
    assert r.returncode == 2 and r.stderr == said, r.stderr
    assert not os.path.exists(os.path.join(tmp, "s.sock"))


async def test_stall_after_reaches_programs(monkeypatch, tmp):
    """--stall-after S is Programs(backend, stall_after=S); without it, Programs' own default."""
    seen: list[dict] = []
    real = server.Programs

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, backend, **kw):
            seen.append(kw)
            super().__init__(backend)

    monkeypatch.setattr(server, "Programs", Spy)
    for cfg, kw in ((server.Config(gpu="sim", stall_after=2.5), {"stall_after": 2.5}), (server.Config(gpu="sim"), {})):
        cfg.socket = os.path.join(tmp, "s.sock")
        cfg.state_dir = os.path.join(tmp, "state")  # never root's default (/var/lib/meshd-mps-sim)
        d = server.Daemon(cfg)
        try:
            await d._open()
            data = seen[-1].pop("data")  # the programs' data files: the state dir's data/
            assert seen[-1] == kw and data.dir == os.path.join(cfg.state_dir, "data")
        finally:
            await d._close_backend()
    assert len(seen) == 2
