"""Calls to one node daemon's programs, async and over kept-alive connections: the fleet's call path.

``serving/client.Client`` is blocking and opens a connection per request (the CLI's one request);
run in a thread for each fleet call it took twice the time of aiohttp's client, and aiohttp's
client (its request and response objects, connector, cookie jar, timers) took 0.58 ms a call
where this module's takes 0.34 ms, the daemon and the ring included (the 2-core CPU machine;
docs/runs/fleet.md, (l3) the call path).  So a call is written here: one HTTP/1.1
request of a fixed shape, on a connection kept from the last call, and its answer read by its
Content-Length, which the daemon's answers always carry (aiohttp's ``web.Response`` with a body).
An answer of any other shape (chunked, no length, not HTTP/1.x) is refused and its connection
closed, never guessed at.  The same checks as the CLI's client: the socket is the caller's own
(``check_socket_owner``) before each new connection, and the process that answers runs as the
caller's uid (``check_peer``) on each new connection.

At most CONNECTIONS calls are in flight to one daemon at once; a call that finds none free by
its deadline is not sent.

The same client reaches another node's daemon through that node's call port (fleet/callport.py):
``CallPort`` names its TCP address and the token its agent asks for; the request is the same, with
the token in its ``Authorization`` header, and the port relays it to its daemon as it is.  A
connection to a call port is made within ``Deadlines.fleet_connect`` (a dead host drops it: the
caller then goes through Ray).

A call is sent in the daemon's binary form (the body is the payload, ``?timeout=S``; the answer is
the response's bytes, or a JSON refusal), so that a payload of any size the program declares travels
as it is, never as hex in JSON.

An answer is a ``NodeAnswer`` (the node agent hands back its bytes alone when it is ``ok``):
``ok`` and the response's bytes, or the daemon's HTTP ``status`` (0: the call reached no daemon,
or no answer came), its ``error``, ``lost``: the call was sent and its answer never came (it
may have reached the program), and ``unreachable``: no connection could be made (nothing sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import urllib.parse
from typing import NamedTuple

from meshd_mps.base.strictjson import parse_json
from meshd_mps.fleet.spec import CallPort
from meshd_mps.serving.client import BINARY, MAX_BODY, ClientError, check_peer, check_socket_owner

#: A connection idle longer than this is closed, not used again: the daemon closes an idle one
#: after its ``Deadlines.http_head`` (30 s), and a request written as it closes would be lost.
IDLE_S = 5.0
#: The most bytes an answer's head may have (the reader's buffer), and its body: a response's bytes,
#: at most the daemon's largest body (a payload's most), or a refusal in JSON.
MAX_HEAD = 1 << 20
MAX_ANSWER = MAX_BODY
#: The most connections to one daemon at once (aiohttp's connector had the same limit): calls past
#: it wait for one, within their deadline.
CONNECTIONS = 64


class NodeAnswer(NamedTuple):
    ok: bool
    data: bytes = b""
    status: int = 200
    error: str = ""
    lost: bool = False
    unreachable: bool = False


class _Conn(NamedTuple):
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used: float  # monotonic, when it was last put back


class _BadAnswer(Exception):
    """The daemon answered in a shape this client does not read (its connection is closed)."""


class NodeCalls:
    """Calls to one daemon: on its Unix socket ``path``, or, with ``port``, through another node's
    call port."""

    def __init__(self, path: str, within: float, *, port: CallPort | None = None, connect: float = 1.0):
        self.path = str(port) if port is not None else path  # what the messages name
        self.socket = path
        self.port = port
        self.within = within  # the answer's deadline beyond the call's own timeout
        self.connect = connect  # a call port's TCP connect (Deadlines.fleet_connect)
        self.auth = f"Authorization: Bearer {port.token}\r\n" if port is not None else ""
        self.idle: list[_Conn] = []  # connections between two calls, the last used last
        self.closed = False  # closed (a port no route names any more): a call still on its way closes its own
        self.slots = asyncio.Semaphore(CONNECTIONS)

    async def call(self, name: str, data: bytes, timeout: float | None = None) -> NodeAnswer:  # noqa: ASYNC109
        query = ""
        if timeout is not None:
            if not 0 < timeout < math.inf:
                return NodeAnswer(False, status=400, error=f"timeout {timeout:g}: seconds, a finite number more than 0")
            query = f"timeout={timeout!r}"
        got = await self.relay(name, data, timeout, binary=True, query=query)
        return got if isinstance(got, NodeAnswer) else _parsed(*got)

    async def relay(self, name: str, body: bytes, timeout: float | None = None, *, binary: bool = False,  # noqa: ASYNC109
                    query: str = "") -> tuple[int, str, bytes] | NodeAnswer:
        """``body`` (a call's, as the daemon reads it: its payload with ``binary``, else its JSON) to
        program ``name``, ``query`` its query string: the daemon's status, answer's content type and
        answer as they are, or the ``NodeAnswer`` that says why none came."""
        wait = self.within if timeout is None else max(self.within, timeout + 10)
        target = f"/v1/programs/{urllib.parse.quote(name, safe='')}/call" + (f"?{query}" if query else "")
        kind = BINARY if binary else "application/json"
        req = (f"POST {target} HTTP/1.1\r\nHost: meshd-mps\r\n"
               f"{self.auth}Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        deadline = asyncio.get_running_loop().time() + wait
        try:
            async with asyncio.timeout_at(deadline):
                await self.slots.acquire()
        except TimeoutError:  # not sent: another replica may take it
            return NodeAnswer(False, status=0, error=f"{self.path}: no connection free in {wait:g}s ({CONNECTIONS}"
                                                     " calls in flight)")
        try:
            async with asyncio.timeout_at(deadline):
                return await self._exchange(req)
        except TimeoutError as e:
            return NodeAnswer(False, status=0, error=f"{self.path}: no answer in {wait:g}s: {e}", lost=True)
        finally:
            self.slots.release()

    async def _exchange(self, req: bytes) -> tuple[int, str, bytes] | NodeAnswer:
        conn: _Conn | None = None
        try:
            try:
                conn = await self._connection()
            except ClientError as e:
                return NodeAnswer(False, status=0, error=str(e), unreachable=True)
            except (OSError, TimeoutError) as e:  # no socket, nobody listening, a host that drops it
                what = "no call port" if self.port is not None else "no daemon"
                return NodeAnswer(False, status=0, error=f"{what} on {self.path} ({type(e).__name__}: {e})",
                                  unreachable=True)
            conn.writer.write(req)
            status, kind, answer, keep = await _read_answer(conn.reader)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self._drop(conn)
            return NodeAnswer(False, status=0, error=f"{self.path}: no answer: {type(e).__name__}: {e}", lost=True)
        except _BadAnswer as e:
            self._drop(conn)
            return NodeAnswer(False, status=0, error=f"{self.path}: {e}", lost=True)
        except BaseException:  # cancelled (the deadline) mid-answer: the connection holds the rest of it
            self._drop(conn)
            raise
        if keep and not self.closed:
            self.idle.append(_Conn(conn.reader, conn.writer, time.monotonic()))
        else:
            self._drop(conn)
        return status, kind, answer

    async def _connection(self) -> _Conn:
        """The connection used last, if it is still open and not idle too long; else a new one:
        to a call port within ``connect`` seconds, or on the Unix socket, its owner and its peer
        checked (ClientError)."""
        now = time.monotonic()
        while self.idle:
            c = self.idle.pop()
            if now - c.used < IDLE_S and not c.reader.at_eof() and not c.writer.is_closing():
                return c
            c.writer.close()
        if self.port is not None:
            async with asyncio.timeout(self.connect):
                reader, writer = await asyncio.open_connection(self.port.host, self.port.port, limit=MAX_HEAD)
            return _Conn(reader, writer, now)
        check_socket_owner(self.socket)
        reader, writer = await asyncio.open_unix_connection(self.socket, limit=MAX_HEAD)
        try:
            check_peer(writer.get_extra_info("socket"), self.socket)
        except BaseException:
            writer.close()
            raise
        return _Conn(reader, writer, now)

    @staticmethod
    def _drop(conn: _Conn | None) -> None:
        if conn is not None:
            conn.writer.close()

    async def close(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for c in idle:
            c.writer.close()
        for c in idle:
            with contextlib.suppress(OSError):
                await c.writer.wait_closed()


def _parsed(status: int, kind: str, answer: bytes) -> NodeAnswer:
    """A daemon's answer to a call (the response's bytes, ``kind`` BINARY; or JSON), or a call
    port's own refusal (its ``lost`` field: the port reached no daemon, ``CallPortRelay``; its
    status is then 0, as a daemon not reached here)."""
    if status == 200 and kind == BINARY:
        return NodeAnswer(True, answer)
    try:
        ans = parse_json(answer, strict=False)
    except ValueError as e:
        return NodeAnswer(False, status=status, error=f"HTTP {status}: not JSON ({e})")
    if status >= 400 or not isinstance(ans, dict) or not ans.get("ok"):
        err = str((ans.get("error") if isinstance(ans, dict) else None) or f"HTTP {status}")
        if isinstance(ans, dict) and isinstance(ans.get("lost"), bool):
            return NodeAnswer(False, status=0, error=err, lost=ans["lost"])
        return NodeAnswer(False, status=status, error=err)
    try:
        return NodeAnswer(True, bytes.fromhex(ans["hex"]))
    except (KeyError, TypeError, ValueError):
        return NodeAnswer(False, status=status, error=f"HTTP {status}: an answer without its bytes ('hex')")


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
    """One answer: its status, its content type, its body, and whether its connection may carry the
    next request."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
        raise _BadAnswer(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
    size = fields.get("content-length", "")
    if "transfer-encoding" in fields or not size.isdigit() or int(size) > MAX_ANSWER:
        raise _BadAnswer(f"HTTP {code}: an answer without a Content-Length of at most {MAX_ANSWER} bytes")
    body = await reader.readexactly(int(size))
    keep = version == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
    return int(code), fields.get("content-type", "").split(";")[0].strip(), body, keep
