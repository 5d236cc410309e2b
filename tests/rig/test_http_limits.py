"""The control API's input limits as a raw client meets them: a request head is
at most 64 KiB as a whole (not per line), and a client that hangs up in the middle of its body is
counted as gone (``code="499"``), not as an internal error.  And its answers' words (item 4):
every verb on a program answers its row under ``"program"``, the old keys kept beside it.

On the daemon's own serving path (server.Daemon: its socket, its connection handler, its metrics)
in this process, with the simulated GPU; every read under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
from structlog.testing import capture_logs

from meshd_mps.serving import cli, server
from meshd_mps.serving.client import Client, program_body
from meshd_mps.serving.heads import MAX_HEAD

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

WAIT_S = 10.0  # every answer of the daemon, at most


@contextlib.asynccontextmanager
async def serving(tmp: str) -> AsyncIterator[server.Daemon]:
    """A daemon serving on ``tmp``/s.sock (simulated GPU, blink, no pool) until the block ends."""
    d = server.Daemon(server.Config(gpu="sim", socket=os.path.join(tmp, "s.sock"),
                                    state_dir=os.path.join(tmp, "state")))
    sock = d._bind()
    try:
        await d._open()
        async with anyio.create_task_group() as tg:
            tg.start_soon(d._serve, sock, tg)
            try:
                yield d
            finally:
                d._stop.set()
    finally:
        sock.close()
        await d._close_backend()
        d._remove_socket()


async def exchange(path: str, data: bytes, *, close_after: bool = False) -> bytes:
    """``data`` sent on a new connection; what the daemon answers, to the end (the request says
    Connection: close).  ``close_after``: hang up at once instead, reading nothing."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(data)
        await writer.drain()
        if close_after:
            return b""
        with anyio.fail_after(WAIT_S):
            return await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def head_of(lines: int, size: int) -> bytes:
    """A GET /v1/status head of ``lines`` header lines and ``size`` bytes in all (the blank line
    included)."""
    start = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    fill = size - len(start) - 2
    per, extra = divmod(fill, lines)
    out = [start]
    for i in range(lines):
        name = f"X-Fill-{i:03d}: ".encode()
        n = per + (extra if i == 0 else 0) - len(name) - 2
        assert n > 0
        out.append(name + b"a" * n + b"\r\n")
    head = b"".join(out) + b"\r\n"
    assert len(head) == size
    return head


def status_line(got: bytes) -> bytes:
    return got.split(b"\r\n", 1)[0]


async def http_codes(path: str) -> dict[str, float]:
    got = await exchange(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_line(got) == b"HTTP/1.1 200 OK", got[:200]
    text = got.partition(b"\r\n\r\n")[2].decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^meshd_mps_http_requests_total\{code="(\d+)"\} (\S+)$', text, re.M)}


async def test_a_head_over_64_kib_in_fewer_than_100_lines_is_a_431(tmp):
    """A 72 KB head of 90 lines (each line far under the 64 KiB a line may have): refused as a
    whole, 431 in JSON, and logged; a head just under 64 KiB is served."""
    async with serving(tmp) as d:
        path = d.socket_path
        with capture_logs() as logs:
            got = await exchange(path, head_of(90, 72_000))
        assert status_line(got) == b"HTTP/1.1 431 Request Header Fields Too Large", got[:200]
        ans = json.loads(got.partition(b"\r\n\r\n")[2])
        assert ans["ok"] is False and "64 KiB" in ans["error"] and "72" in ans["error"], ans
        said = [e for e in logs if e["event"].startswith("GET /v1/status: request head of")]
        assert len(said) == 1 and said[0]["log_level"] == "warning", logs

        got = await exchange(path, head_of(90, MAX_HEAD - 200))
        assert status_line(got) == b"HTTP/1.1 200 OK", got[:200]
        assert json.loads(got.partition(b"\r\n\r\n")[2])["ok"] is True
        assert (await http_codes(path)).get("431") == 1


async def test_a_client_gone_mid_body_is_a_499_not_a_500(tmp):
    """A body of 10 bytes where the head said 1000, then the client hangs up: counted as
    code="499" (a client gone, as nginx and aiohttp's logs call it), logged once with its route,
    and no 500 anywhere."""
    async with serving(tmp) as d:
        path = d.socket_path
        assert d.metrics is not None
        before = (await http_codes(path)).get("499", 0)
        counted = asyncio.Event()
        count = d.metrics.answered

        def answered(status: int) -> None:
            count(status)
            if status == 499:
                counted.set()

        d.metrics.answered = answered  # type: ignore[method-assign]
        with capture_logs() as logs:
            await exchange(path, b"POST /v1/programs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000\r\n\r\n{\"manifest\"", close_after=True)
            with anyio.fail_after(WAIT_S):
                await counted.wait()
        codes = await http_codes(path)
        assert "500" not in codes, codes
        assert codes.get("499", 0) == before + 1, codes
        gone = [e for e in logs if "went away" in e["event"]]
        assert len(gone) == 1 and gone[0]["log_level"] in ("info", "warning"), logs
        assert not [e for e in logs if e["log_level"] == "error"], logs


async def test_every_program_verb_answers_its_row_under_program(tmp, capsys):
    """POST, PUT and DELETE answer the program's row under "program", and nothing else of it (the
    older keys, "loaded", "upgraded", "unloaded", "slot" and a row's "worker_pid", are gone); the CLI
    reads "program"."""
    async with serving(tmp) as d:
        c = Client(d.socket_path)
        body = await anyio.to_thread.run_sync(program_body, str(EXAMPLES / "echo"))
        ans = await anyio.to_thread.run_sync(c.load, body)
        row = ans["program"]
        assert row["name"] == "echo" and row["state"] == "running" and set(ans) == {"ok", "program"}
        assert row["pid"] > 0 and "worker_pid" not in row
        ans = await anyio.to_thread.run_sync(c.upgrade, "echo", body)
        assert ans["program"]["name"] == "echo" and ans["program"]["upgrades"] == 1 and "upgraded" not in ans
        ans = await anyio.to_thread.run_sync(c.unload, "echo")
        assert ans["program"]["name"] == "echo" and ans["program"]["slot"] == row["slot"]
        assert "unloaded" not in ans and "slot" not in ans

        await anyio.to_thread.run_sync(c.load, body)
        capsys.readouterr()
        rc = await anyio.to_thread.run_sync(cli.main, ["unload", "echo", "--socket", d.socket_path])
        # The daemon runs in this process: a log line of its may share stdout with the CLI's answer.
        assert rc == 0 and f"echo unloaded from slot {row['slot']}" in capsys.readouterr().out.splitlines()
