"""Calls to one node daemon's programs, async and over kept-alive connections: the fleet's call path.

``serving/client.Client`` is blocking and opens a connection per request (the CLI's one request);
run in a thread for each fleet call it took twice the time of this (aiohttp's client over the Unix
socket, its connections kept between calls).  The same checks as the CLI's client: the socket is
the caller's own (``check_socket_owner``) before the first connection, and the process that
answers runs as the caller's uid (``check_peer``) on each connection once.

An answer is a dict, as the node agent hands it back to the caller through Ray: ``{"ok": True,
"hex": ...}``, or ``{"ok": False, "status": S, "error": ..., "lost": L}`` where ``status`` is the
daemon's HTTP status (0: no daemon took the connection: the call reached nothing), and ``lost`` says
that the call was sent and its answer never came (it may have reached the program).
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
import weakref
from typing import Any

import aiohttp

from meshd_mps.serving.client import ClientError, check_peer, check_socket_owner
from meshd_mps.strictjson import parse_json


class NodeCalls:
    def __init__(self, path: str, within: float):
        self.path = path
        self.within = within  # the answer's deadline beyond the call's own timeout
        self.session: aiohttp.ClientSession | None = None
        self.checked: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()  # connections whose peer was checked

    async def call(self, name: str, data: bytes, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        body: dict[str, Any] = {"hex": data.hex()}
        if timeout is not None:
            if not 0 < timeout < math.inf:
                return {"ok": False, "status": 400, "error": f"timeout {timeout:g}: seconds, a finite number more than 0",
                        "lost": False}
            body["timeout"] = timeout
        wait = self.within if timeout is None else max(self.within, timeout + 10)
        url = f"http://meshd-mps/v1/programs/{urllib.parse.quote(name, safe='')}/call"
        try:
            if self.session is None:
                check_socket_owner(self.path)
                self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.path, limit=64))
            async with asyncio.timeout(wait), self.session.post(url, json=body) as r:
                self._check(r)
                raw = await r.read()
                status = r.status
        except ClientError as e:
            return {"ok": False, "status": 0, "error": str(e), "lost": False}
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as e:
            return {"ok": False, "status": 0, "error": f"no daemon on {self.path} ({e})", "lost": False}
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return {"ok": False, "status": 0, "error": f"{self.path}: no answer: {type(e).__name__}: {e}", "lost": True}
        try:
            ans = parse_json(raw, strict=False)
        except ValueError as e:
            return {"ok": False, "status": status, "error": f"HTTP {status}: not JSON ({e})", "lost": False}
        if status >= 400 or not isinstance(ans, dict) or not ans.get("ok"):
            err = ans.get("error") if isinstance(ans, dict) else None
            return {"ok": False, "status": status, "error": str(err or f"HTTP {status}"), "lost": False}
        return {"ok": True, "hex": ans["hex"]}

    def _check(self, r: aiohttp.ClientResponse) -> None:
        """The peer of a connection used for the first time: ClientError if it is another uid's."""
        transport = r.connection.transport if r.connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if transport is None or sock is None or transport in self.checked:
            return
        check_peer(sock, self.path)
        self.checked.add(transport)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
