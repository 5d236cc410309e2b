"""A node agent's call port: the fleet's calls to this node's replicas, over TCP, with no Ray hop.

Through Ray a call from another node is an actor call to the replica's agent and then the agent's
call to its daemon; the actor call alone costs as much as a bare Ray echo, so such a call cost
2.0-3.5x the echo (docs/runs/fleet.md, (l3) the call path).  The agent therefore also
listens on a TCP port of its node's address and relays each call it takes there to its daemon
(``NodeCalls.relay``: the body as the caller wrote it, the daemon's status and answer as they are),
and a caller that knows the port (``CallPort`` in the controller's routes) calls it directly.  Ray
still places the replicas and restarts the agent; the port changes the transport of a call, not
who routes it (``Fleet.call`` picks the replica from the controller's routes, as before).

The port is as open as Ray's own ports (a Ray cluster runs on a trusted network), and it serves
less: one route, ``POST /v1/programs/REPLICA/call``, for the fleet's replicas only
(``NAME.fleet-N``, ``NotAReplica``), and only with the token the agent made at its start (``CallPortToken``, 401),
which reaches callers through the controller's routes (a Ray call) alone.  A caller that cannot
reach the port (a firewall, a host gone) goes through Ray (fleet/client.py).  Every refusal is a
typed error answered through the one status table (``serving/status.py``).

``$MESHD_MPS_FLEET_CALL_PORT`` on the node: the port number (default 0: any free one), or ``off``
(calls to this node go through Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import secrets
import urllib.parse
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from meshd_mps.base import errors as E
from meshd_mps.base.strictjson import parse_json
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.fleet.spec import CallPort, parse_replica_name
from meshd_mps.serving import schemas
from meshd_mps.serving.answers import answer, refused
from meshd_mps.serving.client import MAX_BODY
from meshd_mps.serving.status import BodyTooLarge, LengthRequired, MethodNotAllowed, NoRoute

ENV = "MESHD_MPS_FLEET_CALL_PORT"
PREFIX, SUFFIX = "/v1/programs/", "/call"


def configured(value: str | None = None) -> int | None:
    """The port ``value`` (default: ``$MESHD_MPS_FLEET_CALL_PORT``) names: a number from 0 (any free
    port) to 65535, or None for ``off``; ConfigError for anything else."""
    if value is None:
        value = os.environ.get(ENV)
    v = (value or "0").strip().lower()
    if v == "off":
        return None
    if not v.isdigit() or int(v) > 65535:
        raise E.ConfigError(f"${ENV}={value!r}: a port number (0: any free port) or 'off'")
    return int(v)


class CallPortServer:
    """The port's listener on the agent's event loop; ``open`` starts it, ``close`` stops it."""

    def __init__(self, calls: NodeCalls):
        self.calls = calls
        self.token = secrets.token_urlsafe(32)
        self.auth = f"Bearer {self.token}".encode()
        self.server: Any = None  # asyncio.Server
        self.port: CallPort | None = None

    async def open(self, host: str, port: int) -> CallPort:
        """Listen on ``host``:``port`` (OSError if it is taken); the address and token to call it."""
        loop = asyncio.get_running_loop()

        def request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            # a body up to the daemon's own limit (a payload's most): aiohttp's default is 1 MiB
            return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=MAX_BODY)

        handler = web.Server(self._handle, request_factory=request)
        self.server = await loop.create_server(handler, host, port, reuse_address=True)
        bound = self.server.sockets[0].getsockname()[1]
        self.port = CallPort(host, int(bound), self.token)
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError):
                await self.server.wait_closed()
            self.server = None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            name, body = await self._read(request)
            binary = schemas.binary(request)
            got = await self.calls.relay(name, body, _timeout(body, request.query, binary), binary=binary,
                                         query=request.query_string)
            if isinstance(got, NodeAnswer):  # no daemon answered: said with ``lost`` (nodecalls._parsed)
                raise E.CallPortRelay(f"call port {self.port}: {got.error}", lost=got.lost)
        except E.MeshError as e:
            return answer(*refused(e))
        status, kind, raw = got
        return web.Response(status=status, body=raw, content_type=kind or "application/json")

    async def _read(self, request: web.BaseRequest) -> tuple[str, bytes]:
        """The replica a call names and its body, or the typed refusal (nothing relayed)."""
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), self.auth):
            raise E.CallPortToken("a call port takes only the fleet's calls: no token, or not this agent's"
                                  " (the agent restarted: ask the fleet's controller for its routes again)")
        path = request.raw_path.partition("?")[0]
        if not (path.startswith(PREFIX) and path.endswith(SUFFIX)) or len(path) <= len(PREFIX) + len(SUFFIX):
            raise NoRoute(f"no route {path!r} on a call port (only POST {PREFIX}NAME{SUFFIX})")
        if request.method != "POST":
            raise MethodNotAllowed(f"{request.method} {path}: a call port takes POST", allowed=("POST",))
        name = urllib.parse.unquote(path[len(PREFIX):-len(SUFFIX)])
        if parse_replica_name(name) is None:
            raise E.NotAReplica(f"{name!r}: a call port calls the fleet's replicas (NAME.fleet-N) only", program=name)
        size = request.content_length
        if size is None:
            raise LengthRequired("a call's body needs a Content-Length")
        if size > MAX_BODY:
            raise BodyTooLarge(f"a call's body of {size} bytes: at most {MAX_BODY}", size=size, limit=MAX_BODY)
        return name, await request.read()


def _timeout(body: bytes, query: Mapping[str, str], binary: bool) -> float | None:
    """The call's own ``timeout`` (the relay waits as long), if its query or its JSON body says one;
    the daemon checks them itself and answers for them."""
    t: Any = query.get("timeout")
    try:
        t = float(t) if t is not None else None if binary else parse_json(body, strict=False).get("timeout")
    except (ValueError, AttributeError):
        return None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e6 else None

