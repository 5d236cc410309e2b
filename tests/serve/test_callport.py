"""A node agent's call port (meshd_mps/fleet/callport.py): a fleet call over TCP, relayed to the
node's daemon with no Ray hop.  The port relays only the fleet's replicas' calls,
only with its agent's token, and answers every refusal through the one status table; a caller
(``NodeCalls`` with a ``CallPort``) reads the daemon's answers through it as it reads them on the
socket, and tells a port it cannot reach (nothing sent: the caller goes through Ray) from a call
that was sent and lost.

The daemon is a real ``meshd-mps serve --gpu sim``; the port runs on this test's event loop, as it
runs on the agent's (tests/cluster/test_fleet.py calls through it on a real Ray cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

from meshd_mps.base import errors as E
from meshd_mps.base.strictjson import parse_json
from meshd_mps.fleet import callport
from meshd_mps.fleet.callport import CallPortServer
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.fleet.spec import CallPort
from meshd_mps.serving.client import MAX_BODY, program_body
from meshd_mps.serving.status import status_of

from ..rigs.serve import EXAMPLES, Serve

pytestmark = pytest.mark.timeout(120)

REPLICA = "echo.fleet-0"


@pytest.fixture(scope="module")
def replica_daemon() -> Iterator[Serve]:
    """A daemon with a fleet replica (``echo.fleet-0``) and a program of its own (``echo``): one
    for the module (its tests only call it)."""
    d = tempfile.mkdtemp(prefix="cp-")
    s = Serve(d, "blink", os.path.join(d, "s.sock"))
    try:
        s.wait_ready()
        body = program_body(str(EXAMPLES / "echo"))
        s.client.load({**body, "manifest": {**body["manifest"], "name": REPLICA}})
        s.client.load(body)
        yield s
    finally:
        s.kill()
        shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def port_on(sock: str) -> AsyncIterator[CallPort]:
    """A call port in front of the daemon on ``sock``, on 127.0.0.1 (stopped at the end)."""
    calls = NodeCalls(sock, 30)
    server = CallPortServer(calls)
    try:
        yield await server.open("127.0.0.1", 0)
    finally:
        await server.close()
        await calls.close()


async def exchange(port: CallPort, request: bytes) -> tuple[int, dict]:
    """One raw request on a fresh connection: the answer's status and JSON body."""
    reader, writer = await asyncio.open_connection(port.host, port.port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        size = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        return int(head.split()[1]), parse_json(await reader.readexactly(size), strict=False)
    finally:
        writer.close()


def post(path: str, body: bytes, *headers: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers) +
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def test_a_call_on_its_way_when_its_calls_are_closed_closes_its_own_connection(replica_daemon):
    """A ``Fleet`` closes the calls of a port its routes no longer name (fleet/client.py
    _forget_ports) while a call may still be on its way there: that call ends as it would, and its
    connection is closed, not kept by calls nobody uses (seen once as an unclosed StreamWriter)."""
    nc = NodeCalls(replica_daemon.sock, 30)
    call = asyncio.ensure_future(nc.call(REPLICA, b"on its way"))
    await asyncio.sleep(0)  # the call took its connection
    await nc.close()
    assert (await call).data == b"on its way"
    assert nc.idle == [], "its connection was not kept"


async def test_a_call_through_the_port_answers_as_on_the_socket_on_one_kept_connection(replica_daemon):
    async with port_on(replica_daemon.sock) as port:
        nc = NodeCalls("", 30, port=port)
        try:
            sent = [bytes(range(256))[:100], b"\x00\xff not utf-8", b"", b"x" * 16]
            assert [await nc.call(REPLICA, x) for x in sent] == [NodeAnswer(True, x) for x in sent]
            assert len(nc.idle) == 1, "one connection, kept between the calls"
            assert (await nc.call(REPLICA, b"again", timeout=5)).data == b"again"
            # The daemon's own refusals come back as it said them: a replica not there, a bad timeout.
            missing = await nc.call("gone.fleet-3", b"x")
            assert (missing.ok, missing.status, missing.lost) == (False, 404, False) and "gone.fleet-3" in missing.error
            bad = await nc.call(REPLICA, b"x", timeout=-1)
            assert (bad.ok, bad.status, bad.lost) == (False, 400, False)
        finally:
            await nc.close()


async def test_without_the_agents_token_nothing_is_relayed(replica_daemon):
    async with port_on(replica_daemon.sock) as port:
        body = b'{"hex": "6869"}'
        path = f"/v1/programs/{REPLICA}/call"
        for auth in ((), ("Authorization: Bearer wrong",), (f"Authorization: Basic {port.token}",)):
            status, ans = await exchange(port, post(path, body, *auth))
            assert status == 401 == status_of(E.CallPortToken("")) and ans["ok"] is False and "token" in ans["error"]
        # Checked before anything else: a program that is not there is still a 401, not the daemon's 404.
        status, _ = await exchange(port, post("/v1/programs/gone.fleet-1/call", body, "Authorization: Bearer no"))
        assert status == 401
        other = NodeCalls("", 30, port=port._replace(token="not-the-token"))
        out = await other.call(REPLICA, b"x")
        assert (out.ok, out.status, out.lost, out.unreachable) == (False, 401, False, False)
        await other.close()


async def test_only_the_fleets_replicas_and_only_their_call_route(replica_daemon):
    async with port_on(replica_daemon.sock) as port:
        auth = f"Authorization: Bearer {port.token}"
        status, ans = await exchange(port, post("/v1/programs/echo/call", b'{"hex": "00"}', auth))
        assert (status, ans["program"]) == (404, "echo") and "fleet's replicas" in ans["error"], \
            "the daemon's own program 'echo' runs, and is not the port's to call"
        status, ans = await exchange(port, post(f"/v1/programs/{REPLICA}/unload", b"{}", auth))
        assert status == 404 and "no route" in ans["error"]
        status, ans = await exchange(port, post("/v1/programs", b"{}", auth))
        assert status == 404
        status, ans = await exchange(port, f"GET /v1/programs/{REPLICA}/call HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n".encode())
        assert (status, ans["allowed"]) == (405, ["POST"])
        chunked = (f"POST /v1/programs/{REPLICA}/call HTTP/1.1\r\nHost: x\r\n{auth}\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode()
        status, ans = await exchange(port, chunked)
        assert status == 411
        big = f"POST /v1/programs/{REPLICA}/call HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
        status, ans = await exchange(port, big.encode())
        assert (status, ans["size"], ans["limit"]) == (413, MAX_BODY + 1, MAX_BODY)  # the daemon's own limit
        status, ans = await exchange(port, post(f"/v1/programs/{REPLICA}/call", b"not json", auth))
        assert status == 400, "the daemon's own refusal of a bad body, relayed"
        # Still serving, the replica untouched.
        nc = NodeCalls("", 30, port=port)
        assert (await nc.call(REPLICA, b"still")).data == b"still"
        await nc.close()


async def test_a_port_whose_daemon_is_gone_says_not_lost_and_a_closed_port_is_unreachable(tmp):
    async with port_on(os.path.join(tmp, "nobody.sock")) as port:
        nc = NodeCalls("", 30, port=port)
        out = await nc.call(REPLICA, b"x")
        assert (out.ok, out.status, out.lost, out.unreachable) == (False, 0, False, False), out
        assert "no daemon on" in out.error
        await nc.close()
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        closed = CallPort("127.0.0.1", s.getsockname()[1], "t")
        nc = NodeCalls("", 30, port=closed, connect=5)
        out = await nc.call(REPLICA, b"x")
    assert (out.ok, out.status, out.lost, out.unreachable) == (False, 0, False, True), out
    assert "no call port on 127.0.0.1:" in out.error


def test_the_port_setting():
    assert callport.configured("") == 0 and callport.configured("0") == 0 and callport.configured(" 41000 ") == 41000
    assert callport.configured("off") is None and callport.configured("OFF") is None
    for bad in ("x", "-1", "65536", "1.5"):
        with pytest.raises(E.ConfigError, match="MESHD_MPS_FLEET_CALL_PORT"):
            callport.configured(bad)
