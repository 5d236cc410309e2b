"""The fleet's call to one node daemon (meshd_mps/fleet/nodecalls.py ``NodeCalls``): the bytes back
as a ``NodeAnswer`` (no hex dict between the agent and the caller), one connection kept between
calls, and each failure said as the caller retries on it: refused (the daemon's status,
not lost), nothing there (status 0, not lost), lost (sent, no answer), an answer of a shape it
does not read (refused, never guessed at; lost, for it may have reached the program).

The daemon is a real ``meshd-mps serve --gpu sim``; the servers that misbehave are the test's
own, explicit stand-ins on a Unix socket of their own."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from meshd_mps.base.errors import PayloadTooLarge
from meshd_mps.fleet import nodecalls
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.serving.client import program_body
from meshd_mps.serving.status import status_of

from ..rigs.serve import EXAMPLES
from ..rigs.waits import until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def echo_daemon(serve):
    s = serve("blink")
    s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "echo")))
    return s


async def test_a_call_answers_its_bytes_and_the_connection_is_kept(echo_daemon):
    nc = NodeCalls(echo_daemon.sock, 30)
    try:
        sent = [bytes(range(256))[:100], b"\x00\xff\xfe not utf-8", b"", b"x" * 16]
        got = [await nc.call("echo", x) for x in sent]
        assert got == [NodeAnswer(True, x) for x in sent]
        assert len(nc.idle) == 1  # one connection, kept between the calls
        first = nc.idle[0].writer
        assert (await nc.call("echo", b"again", timeout=5)).data == b"again"
        assert [c.writer for c in nc.idle] == [first]
    finally:
        await nc.close()
    assert nc.idle == []


async def test_refusals_say_the_daemons_status_and_are_not_lost(echo_daemon):
    nc = NodeCalls(echo_daemon.sock, 30)
    try:
        missing = await nc.call("no-such-program", b"x")
        assert (missing.ok, missing.status, missing.lost) == (False, 404, False) and "no-such-program" in missing.error
        assert (await nc.call("echo", b"y" * 5000)).data == b"y" * 5000  # through echo's payload region
        big = await nc.call("echo", b"x" * (1 << 17))  # over the 64 KiB echo's manifest declares
        assert (big.ok, big.status, big.lost) == (False, status_of(PayloadTooLarge("", size=0, limit=0, program="echo")), False)
        assert f"request of {1 << 17} bytes is over its most, 65536 bytes" in big.error
        bad = await nc.call("echo", b"x", timeout=-1)
        assert (bad.ok, bad.status, bad.lost) == (False, 400, False)
        assert (await nc.call("echo", b"still")).data == b"still"  # the connection is still good
    finally:
        await nc.close()


async def test_no_daemon_is_not_delivered(tmp):
    nc = NodeCalls(os.path.join(tmp, "nobody.sock"), 30)
    out = await nc.call("echo", b"x")
    assert (out.ok, out.status, out.lost) == (False, 0, False) and "no daemon on" in out.error


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def stand_in(tmp: str, handle: Handler) -> AsyncIterator[str]:
    """A server of the test's own on a Unix socket (its path), each connection passed to ``handle`` and
    then closed; at the end, every connection's handler is waited for (nothing left open)."""
    path = os.path.join(tmp, "stand-in.sock")
    live = [0]

    async def run(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        live[0] += 1
        try:
            await handle(r, w)
        except asyncio.IncompleteReadError:
            pass  # the client hung up
        finally:
            w.close()
            live[0] -= 1

    server = await asyncio.start_unix_server(run, path)
    async with server:
        yield path
        await until(lambda: live[0] == 0, 10, "every stand-in connection closed")


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    n = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    return head + await r.readexactly(n)


def answer(body: bytes, *fields: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + "".join(f + "\r\n" for f in fields).encode() + \
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body


async def test_a_call_sent_and_never_answered_is_lost(tmp):
    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    async with stand_in(tmp, hang_up) as path:
        nc = NodeCalls(path, 30)
        out = await nc.call("echo", b"x")
        assert (out.ok, out.status, out.lost) == (False, 0, True) and "no answer" in out.error
        assert nc.idle == []
        await nc.close()


async def test_an_answer_it_does_not_read_is_refused_not_guessed(tmp):
    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        await w.drain()
        await r.read()  # until the client hangs up

    async with stand_in(tmp, chunked) as path:
        nc = NodeCalls(path, 30)
        out = await nc.call("echo", b"x")
        assert (out.ok, out.status, out.lost) == (False, 0, True) and "Content-Length" in out.error
        assert nc.idle == []  # its connection is not used again
        await nc.close()


async def test_a_connection_the_daemon_closed_is_not_used_again(tmp):
    conns = []

    async def once(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        await read_request(r)
        w.write(answer(b'{"ok": true, "hex": "6869"}'))  # kept alive, as it says, and then closed
        await w.drain()

    async with stand_in(tmp, once) as path:
        nc = NodeCalls(path, 30)
        assert await nc.call("echo", b"hi") == NodeAnswer(True, b"hi")
        await until(lambda: all(c.reader.at_eof() for c in nc.idle), 10, "the client seeing the close")
        assert await nc.call("echo", b"hi") == NodeAnswer(True, b"hi")  # a new connection, not a lost call
        assert len(conns) == 2
        await nc.close()


async def test_connection_close_is_honoured(tmp):
    conns = []

    async def closing(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        while True:
            await read_request(r)
            w.write(answer(b'{"ok": true, "hex": ""}', "Connection: close"))
            await w.drain()

    async with stand_in(tmp, closing) as path:
        nc = NodeCalls(path, 30)
        for _ in range(2):
            assert await nc.call("echo", b"") == NodeAnswer(True, b"")
            assert nc.idle == []
        assert len(conns) == 2
        await nc.close()


async def test_a_call_with_no_answer_by_its_deadline_is_lost(tmp):
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # never answers; until the client hangs up

    async with stand_in(tmp, silent) as path:
        nc = NodeCalls(path, 0.3)
        out = await nc.call("echo", b"x")
        assert (out.ok, out.status, out.lost) == (False, 0, True) and "no answer in 0.3s" in out.error
        assert nc.idle == []
        await nc.close()


async def test_connections_to_a_daemon_are_bounded_and_a_call_waiting_for_one_is_not_sent(tmp, monkeypatch):
    monkeypatch.setattr(nodecalls, "CONNECTIONS", 2)
    conns, go = [], asyncio.Event()

    async def held(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        while True:
            await read_request(r)
            await go.wait()
            w.write(answer(b'{"ok": true, "hex": "6f6b"}'))
            await w.drain()

    async with stand_in(tmp, held) as path:
        nc = NodeCalls(path, 30)
        calls = [asyncio.create_task(nc.call("echo", b"ok")) for _ in range(3)]
        await until(lambda: len(conns) == 2, 10, "two connections")
        short = NodeCalls(path, 0.2)
        short.slots = nc.slots  # the same daemon's bound, none free: not sent, another replica may take it
        out = await short.call("echo", b"x")
        assert (out.ok, out.status, out.lost) == (False, 0, False) and "no connection free" in out.error
        go.set()
        assert await asyncio.gather(*calls) == [NodeAnswer(True, b"ok")] * 3
        assert len(conns) == 2 and len(nc.idle) == 2  # the third call waited for one of the two
        await nc.close()
